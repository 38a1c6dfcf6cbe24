"""Triton helpers shared by the attention kernels: loading one tile of K and V through the block table, the
tile's scores, and folding the tile into the running output."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq, kv_head, offs, n_mask,
                 d, d_mask, stride_bt, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, block_size,
                 dtype: tl.constexpr, KV_INT8: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] of the context tokens `offs` of one sequence and KV head, and their per-token
    scales (ones for unquantized caches). INT8 K/V are converted (exactly) to `dtype`, the query's; their scales
    are left to the caller to fold into the scores and probabilities. Masked-out tokens load as zeros."""
    block = tl.load(block_tables_ptr + seq * stride_bt + offs // block_size, mask=n_mask, other=0)
    slot = offs % block_size
    kv_off = block[:, None] * stride_cb + slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0)
    if KV_INT8:
        scale_off = block * stride_sb + slot * stride_ss + kv_head
        k_scale = tl.load(k_scale_ptr + scale_off, mask=n_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_off, mask=n_mask, other=0.0)
        k = k.to(dtype)
        v = v.to(dtype)
    else:
        k_scale = tl.full(offs.shape, 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def tile_scores(q, k, k_scale, KV_INT8: tl.constexpr, IEEE: tl.constexpr):
    """q @ k^T [rows, BLOCK_N] in fp32, with INT8 keys' scales folded in (IEEE: exact fp32 products)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if KV_INT8:
        s = s * k_scale[None, :]
    return s


@triton.jit
def accumulate(acc, alpha, p, v, v_scale, KV_INT8: tl.constexpr, IEEE: tl.constexpr):
    """acc * alpha + p @ v: the online-softmax update, with INT8 values' scales folded into p."""
    if KV_INT8:
        p = p * v_scale[None, :]
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
