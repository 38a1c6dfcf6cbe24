"""Triton helpers shared by the attention kernels: the query in the dtype the products run in, loading one tile
of K and V through the block table, the tile's scores, and folding the tile into the running output.

INT8 caches run their products in fp16, which holds every int8 value exactly; the query is scaled by the softmax
scale before its cast, so its range is the scores' range. Decode instead runs q @ k^T on int8 tensor cores over the
keys as stored, the query split into two int8 halves (`split_query_int8`). Keys are read row by row (head_dim
contiguous: the q @ k^T operand). Values have their own strides: an INT8 value cache is stored slot-minor (see
`model.attention.allocate_kv_caches`) and read as whole cache blocks, which makes a tile contiguous along tokens,
the p @ v operand's inner dimension, so that it reaches the tensor cores with wide loads instead of byte by byte
(results/kernels-2026-12-03)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def kv_strides(key_cache: torch.Tensor, value_cache: torch.Tensor, key_scale: torch.Tensor | None) -> tuple[int, ...]:
    """The kernels' cache strides: key (block, slot, head), value (block, slot, head, dim), scales (block, slot,
    head; zeros for unquantized caches). Caches are [num_blocks, block_size, Hkv, D] views, key rows contiguous;
    scales are [num_blocks, block_size, Hkv] views."""
    scale_strides = key_scale.stride() if key_scale is not None else (0, 0, 0)
    return (*key_cache.stride()[:3], *value_cache.stride(), *scale_strides)


def asm_conversions(q: torch.Tensor) -> bool:
    """Whether kernels on q may run inline PTX (INT8 conversions, packed INT4 products): on CUDA, not under the
    Triton interpreter."""
    return q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def int8x4_to_fp16(x):
    """int8 -> fp16 four at a time (exact): bias each byte to unsigned, place it under the exponent of 1024 and
    subtract 1152. About one instruction per value where a plain cast takes two slow conversions."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 u, hi, bias;
        xor.b32 u, $2, 0x80808080;
        mov.b32 hi, 0x64646464;
        mov.b32 bias, 0x64806480;
        prmt.b32 $0, u, hi, 0x4140;
        prmt.b32 $1, u, hi, 0x4342;
        sub.f16x2 $0, $0, bias;
        sub.f16x2 $1, $1, bias;
        }""",
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def from_int8(x, dtype: tl.constexpr, ASM_CVT: tl.constexpr):
    """int8 values as `dtype`, exactly (inline PTX for fp16 where allowed: the interpreter cannot run it)."""
    if ASM_CVT and dtype == tl.float16:
        return int8x4_to_fp16(x)
    return x.to(dtype)


@triton.jit
def query_operand(q, sm_scale, KV_INT8: tl.constexpr):
    """The query as the score product's operand. With INT8 K/V it is fp16 (fp32 for fp32 queries: exact tests)
    and carries the softmax scale, which keeps it in fp16's range."""
    if KV_INT8:
        if q.dtype == tl.float32:
            q = q * sm_scale
        else:
            q = (q.to(tl.float32) * sm_scale).to(tl.float16)
    return q


@triton.jit
def split_query_int8(q, sm_scale):
    """The query times the softmax scale as two int8 operands and a per-row scale, q ~ (hi * 256 + lo) * scale: 16-bit
    fixed point per row, so that q @ k^T runs on int8 tensor cores over the int8 keys as stored, with no conversion
    of K (a sixth of the INT8 decode loop's instructions), at about fp16's precision."""
    q = q.to(tl.float32) * sm_scale
    amax = tl.max(tl.abs(q), axis=1)
    scale = tl.where(amax > 0, amax / 127.0, 1.0)
    q = q / scale[:, None]
    hi = tl.floor(q + 0.5)
    lo = tl.minimum(tl.floor((q - hi) * 256.0 + 0.5), 127.0)
    return hi.to(tl.int8), lo.to(tl.int8), scale / 256.0


@triton.jit
def int8_tile_scores(q_hi, q_lo, q_scale, k, k_scale):
    """Scaled q @ k^T [rows, BLOCK_N] in fp32 from `split_query_int8` and int8 keys, both scales folded in. Exact
    in int32 up to head_dim 256: |hi * 256 + lo| <= 32640, times 127 per key entry."""
    s = tl.dot(q_hi, tl.trans(k), out_dtype=tl.int32) * 256 + tl.dot(q_lo, tl.trans(k), out_dtype=tl.int32)
    return s.to(tl.float32) * (q_scale[:, None] * k_scale[None, :])


@triton.jit
def load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq,
    kv_head,
    n0,
    end,
    d,
    d_mask,
    stride_bt,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_sb,
    stride_ss,
    stride_sh,
    dtype: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,
    ASM_CVT: tl.constexpr,
    CONVERT_K: tl.constexpr = True,
):
    """K and V [BLOCK_N, BLOCK_D] of context tokens n0 .. n0 + BLOCK_N (n0 a multiple of BLOCK_SIZE) of one
    sequence and KV head, and their per-token scales (ones for unquantized caches). INT8 K/V are converted exactly
    to `dtype` (INT8 keys stay int8 without CONVERT_K); their scales are left to the caller to fold into the scores
    and probabilities. Tokens at or past `end` load as zeros."""
    offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs < end
    block = tl.load(block_tables_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=n_mask, other=0)
    slot = offs % BLOCK_SIZE
    k = tl.load(
        k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0,
    )
    if KV_INT8:
        # Slot-minor values, read as [blocks, slots, dims] so that the compiler sees runs of BLOCK_SIZE tokens.
        NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
        tile_blocks = n0 // BLOCK_SIZE + tl.arange(0, NB)
        blocks = tl.load(block_tables_ptr + seq * stride_bt + tile_blocks, mask=tile_blocks * BLOCK_SIZE < end, other=0)
        s = tl.arange(0, BLOCK_SIZE)
        # Masked by whole blocks, so that runs stay vectorizable: values past `end` in the last block are read
        # too (finite int8s; their scales load as 0, which zeroes their weight).
        v = tl.load(
            v_cache_ptr
            + blocks[:, None, None] * stride_vb
            + s[None, :, None] * stride_vs
            + kv_head * stride_vh
            + d[None, None, :] * stride_vd,
            mask=(tile_blocks * BLOCK_SIZE < end)[:, None, None] & d_mask[None, None, :],
            other=0,
        )
        v = tl.reshape(v, (BLOCK_N, d.shape[0]))
    else:
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + d[None, :] * stride_vd,
            mask=n_mask[:, None] & d_mask[None, :],
            other=0,
        )
    if KV_INT8:
        scale_off = block * stride_sb + slot * stride_ss + kv_head * stride_sh
        k_scale = tl.load(k_scale_ptr + scale_off, mask=n_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + scale_off, mask=n_mask, other=0.0)
        if CONVERT_K:
            k = from_int8(k, dtype, ASM_CVT)
        v = from_int8(v, dtype, ASM_CVT)
    else:
        k_scale = tl.full(offs.shape, 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def tile_scores(q, k, k_scale, sm_scale, KV_INT8: tl.constexpr, IEEE: tl.constexpr):
    """Scaled q @ k^T [rows, BLOCK_N] in fp32 (q from `query_operand`), INT8 keys' scales folded in (IEEE: exact
    fp32 products)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if KV_INT8:
        s = s * k_scale[None, :]
    else:
        s = s * sm_scale
    return s


@triton.jit
def accumulate(acc, alpha, p, v, v_scale, KV_INT8: tl.constexpr, IEEE: tl.constexpr):
    """acc * alpha + p @ v: the online-softmax update, with INT8 values' scales folded into p."""
    if KV_INT8:
        p = p * v_scale[None, :]
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
