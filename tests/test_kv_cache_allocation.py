"""The CPU KV cache (memory the OS maps in as it is first touched) starts as zeros, in the layouts the kernels
index, each tensor its own memory."""

from __future__ import annotations

import pytest
import torch

from pagellm.model.attention import allocate_kv_caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cpu_kv_caches_start_as_zeros_in_their_layouts(dtype):
    blocks, block_size, heads, dim = 5, 16, 3, 8
    caches = allocate_kv_caches(2, blocks, block_size, heads, dim, dtype, torch.device("cpu"))
    int8 = dtype == torch.int8
    for cache in caches:
        tensors = [cache.key, cache.value] + ([cache.key_scale, cache.value_scale] if int8 else [])
        assert all(t.device.type == "cpu" and not t.any() for t in tensors)  # masked slots must never be NaN
        assert cache.key.dtype == cache.value.dtype == dtype
        assert cache.key.shape == cache.value.shape == (blocks, block_size, heads, dim) and cache.key.is_contiguous()
        if int8:  # values slot-minor in memory, scales head-major
            assert cache.value.stride() == torch.empty(blocks, heads, dim, block_size).permute(0, 3, 1, 2).stride()
            for scale in (cache.key_scale, cache.value_scale):
                assert scale.dtype == torch.float32 and scale.shape == (blocks, block_size, heads)
                assert scale.stride() == torch.empty(blocks, heads, block_size).permute(0, 2, 1).stride()
        else:
            assert cache.value.is_contiguous() and cache.key_scale is None and cache.value_scale is None
    caches[0].key[1, 2] = 1
    caches[0].value[3] = 2
    assert caches[0].key.count_nonzero() == heads * dim and caches[0].value.count_nonzero() == block_size * heads * dim
    assert not caches[1].key.any() and not caches[1].value.any()  # no memory shared between tensors
