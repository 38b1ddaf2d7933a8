"""TEST-ONLY stand-in for SGLang's `sgl_kernel` package, used only to run real SGLang on CPU in CI.

It exists because SGLang 0.5.23's plain-torch CPU path (SGLANG_USE_CPU_ENGINE=1) imports
`assign_req_to_token_pool_cpu` from `sgl_kernel` at module level, while the published
`sgl_kernel` wheels are CUDA-only and fail to load without libcuda. Here the op is written in
plain torch. Never put this directory on PYTHONPATH on a GPU machine: there the real
`sgl_kernel` must be used. Any other name raises ImportError saying so.
Remove when SGLang ships a CPU build of `sgl_kernel` on PyPI.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+verl-agent-cpu-test-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of the request->token table.

    Request i gets the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``
    (consumed in order) at columns ``start_offset[i]:end_offset[i]`` of row ``req_pool_indices[i]``.
    """
    pos = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: bad span [{start}, {end}) for pool_len {pool_len}")
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def __getattr__(name: str) -> object:
    raise ImportError(
        f"sgl_kernel.{name} is not provided by the verl-agent CPU test shim (tests/sglang_shims); "
        "it only implements assign_req_to_token_pool_cpu. On a GPU machine install the real sgl-kernel "
        "and do not put tests/sglang_shims on PYTHONPATH."
    )
