"""TEST-ONLY stand-in for SGLang's `sgl_kernel` package, used only to run real SGLang on CPU in CI.

It exists because SGLang 0.5.23's plain-torch CPU path (SGLANG_USE_CPU_ENGINE=1) imports
`assign_req_to_token_pool_cpu` and `copy_all_layer_kv_cache_cpu` from `sgl_kernel` at module
level, while the published
`sgl_kernel` wheels are CUDA-only and fail to load without libcuda. Here both ops are written in
plain torch / ctypes. Never put this directory on PYTHONPATH on a GPU machine: there the real
`sgl_kernel` must be used. Any other op imports but raises NotImplementedError when called.
Remove when SGLang ships a CPU build of `sgl_kernel` on PyPI.
"""

from __future__ import annotations

import ctypes

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


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Move KV slots ``src_loc[j] -> tgt_loc[j]`` in every layer buffer.

    ``data_ptrs[i]`` is the base address of buffer i (one per layer, K and V) and ``strides[i]``
    the byte size of one slot in it, as SGLang's KV pool passes them; the caller bounds-checks
    the locations. SGLang calls this once at start-up (a slot-0-to-slot-0 warm-up) and when it
    relocates cache rows.
    """
    pairs = [(t, s) for t, s in zip(tgt_loc.tolist(), src_loc.tolist()) if t != s]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str) -> object:
    """Any other op: importable (SGLang imports CPU ops of features we never use at module
    level, e.g. speculative decoding), but calling it raises a clear error."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the verl-agent CPU test shim (tests/sglang_shims); it only "
            "implements assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu. On a GPU machine install "
            "the real sgl-kernel and do not put tests/sglang_shims on PYTHONPATH."
        )

    missing.__name__ = name
    return missing
