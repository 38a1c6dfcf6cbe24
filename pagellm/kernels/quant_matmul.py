"""Triton: matmuls over quantized weights, dequantizing in the loop (the weight crosses HBM in its stored bytes).

Two stored formats, both in nn.Linear's [N, K] orientation (rows are output features):

- **grouped integers** (AWQ, GPTQ, GGUF): `qweight` int32 [N, K * BITS / 32] packs 32 / BITS unsigned values per word,
  the lowest bits first; `scales` and `offsets` [N, K / GROUP] give w = q * scale + offset per group of GROUP
  input columns (AWQ/GPTQ's (q - zero) * scale with offset = -zero * scale, folded at load).
- **FP8** (e4m3): `weight` [N, K] with one fp32 scale per output row.

`weight_only_matmul` serves the rows of decode steps: one program reads BLOCK_N weight rows once for BLOCK_M
activation rows (a multiply-add reduction for one row, tensor-core dots for more). Many rows (prefill) go through
`dequantize` plus cuBLAS for the integers, and FP8 x FP8 `torch._scaled_mm` with per-token activation scales for
FP8 (`fp8_quantize_rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_weight_tile(
    w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, stride_w, stride_s,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Weight rows `rows`, columns k0 .. k0 + BLOCK_K, as fp32 [BLOCK_N, BLOCK_K]; FP8 tiles are unscaled (their
    per-row scale is applied to the finished sums). Columns past K read as zero."""
    r_mask = rows < N
    if FP8:
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = r_mask[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        PACK: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // PACK
        word_cols = k0 // PACK + tl.arange(0, WORDS)
        w_mask = r_mask[:, None] & (word_cols < K // PACK)[None, :]
        words = tl.load(w_ptr + rows[:, None] * stride_w + word_cols[None, :], mask=w_mask, other=0)
        shifts = tl.arange(0, PACK) * BITS
        q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
        q = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(tl.float32)
        if BLOCK_K <= GROUP:  # the tile lies in one group: one scale per row
            g = k0 // GROUP
            s_mask = r_mask & (k0 < K)
            scale = tl.load(scale_ptr + rows * stride_s + g, mask=s_mask, other=0.0).to(tl.float32)
            offset = tl.load(offset_ptr + rows * stride_s + g, mask=s_mask, other=0.0).to(tl.float32)
            w = q * scale[:, None] + offset[:, None]
        else:
            GROUPS: tl.constexpr = BLOCK_K // GROUP
            groups = k0 // GROUP + tl.arange(0, GROUPS)
            g_mask = r_mask[:, None] & (groups < K // GROUP)[None, :]
            g_offs = rows[:, None] * stride_s + groups[None, :]
            scale = tl.load(scale_ptr + g_offs, mask=g_mask, other=0.0).to(tl.float32)
            offset = tl.load(offset_ptr + g_offs, mask=g_mask, other=0.0).to(tl.float32)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, GROUPS, GROUP)), (BLOCK_N, BLOCK_K))
            offset = tl.reshape(tl.broadcast_to(offset[:, :, None], (BLOCK_N, GROUPS, GROUP)), (BLOCK_N, BLOCK_K))
            w = q * scale + offset
    return w


@triton.jit
def _weight_only_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s, stride_out,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask, t_mask = rows < N, tokens < M
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced once at the end, not per tile
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _load_weight_tile(
            w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, stride_w, stride_s, FP8, BITS, GROUP, BLOCK_N, BLOCK_K
        )
        cols = k0 + tl.arange(0, BLOCK_K)
        x_mask = t_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=x_mask, other=0.0)
        if BLOCK_M == 1:
            acc += w * x.to(tl.float32)  # x is [1, BLOCK_K]
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if BLOCK_M == 1:
        out = tl.reshape(tl.sum(acc, axis=1), (1, BLOCK_N))
    else:
        out = acc
    if FP8:
        out *= tl.load(scale_ptr + rows, mask=r_mask, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = t_mask[:, None] & r_mask[None, :]
    tl.store(out_ptr + tokens[:, None] * stride_out + rows[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize_kernel(
    w_ptr, scale_ptr, offset_ptr, out_ptr, N, K, stride_w, stride_s, stride_out,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _load_weight_tile(
        w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, stride_w, stride_s, False, BITS, GROUP, BLOCK_N, BLOCK_K
    )
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0  # 448: the largest finite e4m3 value
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(scale_ptr + row, scale)


def _matmul_config(m: int, fp8: bool, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). One row reduces with multiply-adds over wide tiles, as the bf16
    GEMV does; more rows use tensor-core dots on 16..64-row tiles. Not tuned yet: on the H200 these gave INT4
    batch-1 Llama-3.1-8B 20% of its bandwidth limit (benchmarks/quant_kernels.py sweeps the alternatives)."""
    if m == 1:
        return 1, 8, 512 if fp8 else 256, 4
    return min(64, max(16, triton.next_power_of_2(m))), 64, 64 if fp8 else min(128, max(32, group)), 4


def weight_only_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized tile by tile. FP8 weights (`offsets` None) take one
    fp32 scale per row; integer weights take `bits`-wide values with group scales and offsets. `config`
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the tiles (benchmarks/quant_kernels.py sweeps)."""
    fp8 = offsets is None
    n = weight.shape[0]
    k = x.shape[1]
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = config or (*_matmul_config(m, fp8, group_size), 3)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _weight_only_matmul_kernel[grid](
        x,
        weight,
        scales,
        scales if fp8 else offsets,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scales.stride(0),
        out.stride(0),
        FP8=fp8,
        BITS=bits,
        GROUP=max(group_size, 1),  # unused by FP8
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def dequantize(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The whole [N, K] weight in `dtype` (for prefill's many rows, then one cuBLAS matmul)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 32 // bits
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = 32, min(128, max(32, group_size))
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight,
        scales,
        offsets,
        out,
        n,
        k,
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        BITS=bits,
        GROUP=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) dynamic FP8: x ~= q * scale[:, None], scale = absmax / 448."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _fp8_quantize_rows_kernel[(m,)](
        x, q, scale, k, x.stride(0), q.stride(0), BLOCK_K=min(1024, triton.next_power_of_2(k))
    )
    return q, scale
