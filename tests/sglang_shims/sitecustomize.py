"""TEST-ONLY startup hook, used only to run real SGLang on CPU in CI; never on a GPU machine.

Python imports `sitecustomize` at startup when this directory is on PYTHONPATH. SGLang 0.5.23's
`release_memory_occupation` calls `torch.get_device_module().synchronize()`, which on a CUDA
build of torch without a GPU resolves to `torch.cuda` and fails. When SGLANG_USE_CPU_ENGINE=1
and no CUDA device exists, `torch.get_device_module(None)` returns `torch.cpu` instead (the
variable is only set for SGLang's CPU processes, which import torch anyway). With a GPU present,
or the variable unset, nothing is changed.
"""

from __future__ import annotations

import os


def _patch_torch_get_device_module() -> None:
    import torch

    original = torch.get_device_module
    if getattr(original, "_verl_agent_cpu_shim", False) or torch.cuda.is_available():
        return

    def get_device_module(device=None):  # type: ignore[no-untyped-def]
        return torch.cpu if device is None else original(device)

    get_device_module._verl_agent_cpu_shim = True  # type: ignore[attr-defined]
    torch.get_device_module = get_device_module


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    _patch_torch_get_device_module()
