"""Triton: a layer's rotary embedding and KV-cache write in one launch. Each program takes one token: it rotates
the token's query heads in place (neox style, after a per-head RMSNorm for Qwen3's q_norm/k_norm) and stores its
rotated key heads and its value heads at the token's cache slot, quantizing them to INT8 on the way when the cache
is int8 (one absmax scale per token per KV head; round half up, like `reference.quantize_int8`).

The frequencies (plain, 'linear' or 'llama3'-scaled) live in `cos_sin_cache` [max_pos, D] (cos | sin halves), so
one kernel serves every variant. The twin is `reference.rms_norm` / `reference.apply_rope` / `reference.write_kv`.
The decode attention kernel uses the same helpers to do this work itself in pure-decode steps (`decode_attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.paged_kv import kv_strides
from pagellm.kernels.pdl import launch_early, wait_for_inputs


@triton.jit
def rotated_heads(
    ptr, stride_h, num_heads, cos, sin, norm_weight_ptr, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """The heads at `ptr` (a token's row) rotated, as their two halves [BLOCK_H, BLOCK_HALF] in fp32 holding
    values rounded to the input's dtype (the values q keeps and the cache stores or quantizes), and where they
    live."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    base = ptr + h * stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:  # as reference.rms_norm: normalize in fp32, cast, then multiply by the weight
        rstd = 1.0 / tl.sqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(norm_weight_ptr + d, mask=d < HALF, other=0.0)
        w2 = tl.load(norm_weight_ptr + HALF + d, mask=d < HALF, other=0.0)
        x1f = (w1 * (x1f * rstd[:, None]).to(x1.dtype)).to(tl.float32)
        x2f = (w2 * (x2f * rstd[:, None]).to(x2.dtype)).to(tl.float32)
    r1 = (x1f * cos - x2f * sin).to(x1.dtype).to(tl.float32)
    r2 = (x2f * cos + x1f * sin).to(x1.dtype).to(tl.float32)
    return r1, r2, base, mask


@triton.jit
def _int8_scales(x1, x2):
    """Each head's INT8 scale from its two halves [BLOCK_H, BLOCK_HALF]: absmax / 127, as reference.quantize_int8."""
    return tl.maximum(tl.maximum(tl.max(tl.abs(x1), axis=1), tl.max(tl.abs(x2), axis=1)), 1e-8) / 127.0


@triton.jit
def _int8_rows(x, scale):
    """x / scale rounded half up into [-127, 127], as reference.quantize_int8."""
    return tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x, scale) + 0.5), -127.0), 127.0).to(tl.int8)


@triton.jit
def store_kv_heads(
    k1, k2, v_ptr, stride_vh, head0, num_heads, slot, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, stride_vd, stride_sb, stride_ss, stride_sh,
    block_size, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    """Store a token's rotated key heads (halves k1, k2 [BLOCK_H, BLOCK_HALF]) and its value heads (read at v_ptr,
    `stride_vh` apart) as the cache's heads head0..head0 + num_heads - 1 at `slot`; slot -1 (a padding token of a
    CUDA-graph batch) stores nothing."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    v1 = tl.load(v_ptr + h * stride_vh + d, mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(v_ptr + h * stride_vh + HALF + d, mask=mask, other=0.0).to(tl.float32)
    keep = mask & (slot >= 0)
    block = slot // block_size
    offset = slot % block_size
    k_dst = key_cache_ptr + block * stride_kb + offset * stride_ks + (head0 + h) * stride_kch + d
    v_dst = value_cache_ptr + block * stride_vb + offset * stride_vs + (head0 + h) * stride_vch + d * stride_vd
    if QUANT:
        k_scale = _int8_scales(k1, k2)
        v_scale = _int8_scales(v1, v2)
        tl.store(k_dst, _int8_rows(k1, k_scale[:, None]), mask=keep)
        tl.store(k_dst + HALF, _int8_rows(k2, k_scale[:, None]), mask=keep)
        tl.store(v_dst, _int8_rows(v1, v_scale[:, None]), mask=keep)
        tl.store(v_dst + HALF * stride_vd, _int8_rows(v2, v_scale[:, None]), mask=keep)
        heads = tl.arange(0, BLOCK_H)
        scale_dst = block * stride_sb + offset * stride_ss + (head0 + heads) * stride_sh
        head_keep = (heads < num_heads) & (slot >= 0)
        tl.store(key_scale_ptr + scale_dst, k_scale, mask=head_keep)
        tl.store(value_scale_ptr + scale_dst, v_scale, mask=head_keep)
    else:
        tl.store(k_dst, k1.to(key_cache_ptr.dtype.element_ty), mask=keep)
        tl.store(k_dst + HALF, k2.to(key_cache_ptr.dtype.element_ty), mask=keep)
        tl.store(v_dst, v1.to(value_cache_ptr.dtype.element_ty), mask=keep)
        tl.store(v_dst + HALF * stride_vd, v2.to(value_cache_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, key_cache_ptr, value_cache_ptr,
    key_scale_ptr, value_scale_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, stride_vd, stride_sb, stride_ss, stride_sh,
    num_q_heads, num_kv_heads, block_size, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    NORM: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + d, mask=d < HALF, other=0.0)
    q1, q2, q_base, q_mask = rotated_heads(
        q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin, q_norm_ptr, eps, HALF, BLOCK_HQ, BLOCK_HALF, NORM
    )
    tl.store(q_base, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_base + HALF, q2.to(q_ptr.dtype.element_ty), mask=q_mask)
    k1, k2, _, _ = rotated_heads(
        k_ptr + token * stride_kt, stride_kh, num_kv_heads, cos, sin, k_norm_ptr, eps, HALF, BLOCK_HK, BLOCK_HALF, NORM
    )
    slot = tl.load(slot_ptr + token)
    store_kv_heads(
        k1, k2, v_ptr + token * stride_vt, stride_vh, 0, num_kv_heads, slot, key_cache_ptr, value_cache_ptr,
        key_scale_ptr, value_scale_ptr, stride_kb, stride_ks, stride_kch, stride_vb, stride_vs, stride_vch, stride_vd,
        stride_sb, stride_ss, stride_sh, block_size, HALF, BLOCK_HK, BLOCK_HALF, QUANT,
    )  # fmt: skip


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Rotate q [T, H, D] in place and store the rotated k and v [T, Hkv, D] (views with a contiguous last dim)
    at `slot_mapping` of the caches [num_blocks, block_size, Hkv, D] (key rows contiguous; values in any layout;
    int8 caches take scales [num_blocks, block_size, Hkv]); k itself is left as it was. With the per-head norm
    weights q_norm and k_norm [D], each head is RMS-normalized before it is rotated."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    norm = q_norm is not None
    quant = key_cache.dtype == torch.int8
    pdl = launch_early(q, num_tokens)
    _rope_write_kv_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        q_norm if norm else q,  # unused pointers without the norms, or when not quantizing
        k_norm if norm else k,
        key_cache,
        value_cache,
        key_scale if quant else key_cache,
        value_scale if quant else value_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        *kv_strides(key_cache, value_cache, key_scale if quant else None),
        num_q_heads,
        k.shape[1],
        key_cache.shape[1],
        eps,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        NORM=norm,
        QUANT=quant,
        PDL=pdl,
        launch_pdl=pdl,
    )
