"""The test-only CPU shims that let real SGLang run here (tests/sglang_cpu.py says where and how)."""

from __future__ import annotations

import pytest
from sglang_cpu import SHIMS


def _shim():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sgl_kernel_shim", SHIMS / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shim_assign_req_to_token_pool_writes_rows_in_order():
    import torch

    table = torch.zeros(3, 8, dtype=torch.int32)
    _shim().assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([4, 2]), torch.tensor([10, 11, 12, 20, 21]), 8
    )
    assert table[2].tolist() == [0, 10, 11, 12, 0, 0, 0, 0]
    assert table[0].tolist() == [20, 21, 0, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="bad span"):
        _shim().assign_req_to_token_pool_cpu(torch.tensor([0]), table, torch.tensor([5]), torch.tensor([9]),
                                             torch.arange(4), 8)  # fmt: skip


def test_shim_copy_kv_slots_moves_every_layer_and_unknown_ops_fail_clearly():
    import torch

    layers = [torch.arange(12, dtype=torch.float32).reshape(6, 2) + 100 * i for i in range(3)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers])
    _shim().copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([0, 5]), torch.tensor([3, 1]))
    for i, t in enumerate(layers):
        assert t[0].tolist() == [6 + 100 * i, 7 + 100 * i] and t[5].tolist() == [2 + 100 * i, 3 + 100 * i]
    from_shim = _shim().some_cuda_only_op  # importable, as SGLang imports unused ops at module level
    with pytest.raises(NotImplementedError, match="not provided by the verl-agent CPU test shim"):
        from_shim()
