"""Triton: store new K/V rows into the paged cache at `slot_mapping`, quantizing to INT8 on the way when the cache
is int8 (one absmax scale per token per KV head; round half up, like `reference.quantize_int8`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.paged_kv import kv_strides
from pagellm.kernels.pdl import launch_early, wait_for_inputs


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kb,
    stride_ks,
    stride_kch,
    stride_vb,
    stride_vs,
    stride_vch,
    stride_vd,
    stride_sb,
    stride_ss,
    stride_sh,
    block_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)  # before the padding tokens' return too: every program waits
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding token (CUDA-graph batches)
        return
    block = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask, other=0.0).to(tl.float32)
    k_dst = block * stride_kb + offset * stride_ks + head * stride_kch + d
    v_dst = block * stride_vb + offset * stride_vs + head * stride_vch + d * stride_vd
    if QUANT:
        k_scale = tl.maximum(tl.max(tl.abs(k), axis=0), 1e-8) / 127.0
        v_scale = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-8) / 127.0
        kq = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(k, k_scale) + 0.5), -127.0), 127.0)
        vq = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(v, v_scale) + 0.5), -127.0), 127.0)
        tl.store(key_cache_ptr + k_dst, kq.to(tl.int8), mask=mask)
        tl.store(value_cache_ptr + v_dst, vq.to(tl.int8), mask=mask)
        scale_dst = block * stride_sb + offset * stride_ss + head * stride_sh
        tl.store(key_scale_ptr + scale_dst, k_scale)
        tl.store(value_scale_ptr + scale_dst, v_scale)
    else:
        tl.store(key_cache_ptr + k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(value_cache_ptr + v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as `reference.write_kv`: key/value [T, Hkv, D] (last dim contiguous), caches
    [num_blocks, block_size, Hkv, D] (key rows contiguous; values in any layout), scales
    [num_blocks, block_size, Hkv] for int8."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = key_cache.dtype == torch.int8
    scale_k = key_scale if quant else key_cache  # unused pointers when not quantizing
    scale_v = value_scale if quant else value_cache
    pdl = launch_early(key, num_tokens)
    _write_kv_kernel[(num_tokens, num_heads)](
        key,
        value,
        key_cache,
        value_cache,
        scale_k,
        scale_v,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv_strides(key_cache, value_cache, key_scale if quant else None),
        key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant,
        PDL=pdl,
        launch_pdl=pdl,
    )
