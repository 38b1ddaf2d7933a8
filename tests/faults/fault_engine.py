"""An engine whose requests sometimes raise: imported by the workers as actor_rollout_ref.model.external_lib.

The fault is injected into the real HFEngine: `generate` raises for the requests whose prompt
(which holds the earlier turns' sampled tokens, so it differs per sample) hashes to 0 mod 9,
before they reach the batcher; every other request runs normally on the same engine.
"""

from __future__ import annotations

import zlib

from verl_agent.engine.backends.hf_engine import HFEngine

_generate = HFEngine.generate


async def _faulty_generate(self, prompt_ids, sampling, **kwargs):
    if zlib.crc32(str(list(prompt_ids)).encode()) % 9 == 0:
        raise RuntimeError("injected engine fault")
    return await _generate(self, prompt_ids, sampling, **kwargs)


HFEngine.generate = _faulty_generate
