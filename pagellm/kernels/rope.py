"""Triton: neox-style rotary embedding applied in place to q [T, H, D] and k [T, Hkv, D], optionally after a
per-head RMSNorm of each (Qwen3's q_norm/k_norm), so a layer spends one launch on both.

The frequencies (plain, 'linear' or 'llama3'-scaled) live in `cos_sin_cache` [max_pos, D] (cos | sin halves), so
one kernel serves every variant. One program per token rotates all its query and key heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs


@triton.jit
def _rotate_heads(
    ptr,
    stride_t,
    stride_h,
    token,
    num_heads,
    cos,
    sin,
    norm_weight_ptr,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < HALF)
    base = ptr + token * stride_t + h * stride_h + d
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:  # as reference.rms_norm: normalize in fp32, cast, then multiply by the weight
        rstd = 1.0 / tl.sqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(norm_weight_ptr + d, mask=d < HALF, other=0.0)
        w2 = tl.load(norm_weight_ptr + HALF + d, mask=d < HALF, other=0.0)
        x1f = (w1 * (x1f * rstd[:, None]).to(x1.dtype)).to(tl.float32)
        x2f = (w2 * (x2f * rstd[:, None]).to(x2.dtype)).to(tl.float32)
    tl.store(base, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    num_q_heads,
    num_k_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_c + d, mask=d < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + d, mask=d < HALF, other=0.0)
    _rotate_heads(
        q_ptr, stride_qt, stride_qh, token, num_q_heads, cos, sin, q_norm_ptr, eps, HALF, BLOCK_HQ, BLOCK_HALF, NORM
    )
    _rotate_heads(
        k_ptr, stride_kt, stride_kh, token, num_k_heads, cos, sin, k_norm_ptr, eps, HALF, BLOCK_HK, BLOCK_HALF, NORM
    )


def apply_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (views with a contiguous last dim are fine); returns them. With the per-head norm
    weights q_norm and k_norm [D], each head is RMS-normalized first (reference.rms_norm, then apply_rope)."""
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    norm = q_norm is not None
    if num_tokens:
        pdl = launch_early(q, num_tokens)
        _rope_kernel[(num_tokens,)](
            q,
            k,
            positions,
            cos_sin_cache,
            q_norm if norm else q,
            k_norm if norm else k,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos_sin_cache.stride(0),
            num_q_heads,
            k.shape[1],
            eps,
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            NORM=norm,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return q, k
