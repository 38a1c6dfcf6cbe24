"""Triton: matmuls over quantized weights, dequantizing in the loop (the weight crosses HBM in its stored bytes).

Two stored formats, both in nn.Linear's [N, K] orientation (rows are output features):

- **grouped integers** (AWQ, GPTQ, GGUF): `qweight` int32 [N, K * BITS / 32] packs 32 / BITS unsigned values per word,
  the lowest bits first; `scales` and `offsets` [N, K / GROUP] give w = q * scale + offset per group of GROUP
  input columns (AWQ/GPTQ's (q - zero) * scale with offset = -zero * scale, folded at load).
- **FP8** (e4m3): `weight` [N, K] with one fp32 scale per output row.

`weight_only_matmul` serves the rows of decode steps: one program reads BLOCK_N weight rows once for BLOCK_M
activation rows (a multiply-add reduction for one row, tensor-core dots for more). One row of INT4 has a kernel of
its own that never reorders a weight tile: each word meets its eight x values where it was loaded, two at a time
in bf16x2 arithmetic on the GPU (1.5x the general GEMV at Llama-3.1-8B's shapes on the H200). Many rows (prefill)
go through `dequantize` plus cuBLAS for the integers, and FP8 x FP8 `torch._scaled_mm` with per-token activation
scales for FP8 (`fp8_quantize_rows`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagellm.kernels.paged_kv import asm_conversions

# The products of one int32 word of eight INT4 values (value i at bits [4i, 4i+4)) and its eight bf16 x values,
# summed in fp32; $1 is the word, $2..$5 the bf16 pairs (x[i], x[i+4]) for i = 0..3. One lop3 puts values i and
# i+4 into the mantissas of a bf16 pair reading 128 + q (exact); an fma subtracts 128 (exact), a multiply and three
# fmas sum the four pairs' products in bf16x2 (two values an instruction: the unpacking, not HBM, bounds this
# kernel), and the pair's two halves are added in fp32.
_BF16X2_DOT8 = tl.constexpr(
    """{
    .reg .b32 t, s, a, one, bias, lo, hi;
    mov.b32 one, 0x3F803F80;
    mov.b32 bias, 0xC300C300;
    lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 t, t, one, bias;
    mul.rn.bf16x2 a, t, $2;
    shr.u32 s, $1, 4;
    lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 t, t, one, bias;
    fma.rn.bf16x2 a, t, $3, a;
    shr.u32 s, $1, 8;
    lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 t, t, one, bias;
    fma.rn.bf16x2 a, t, $4, a;
    shr.u32 s, $1, 12;
    lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
    fma.rn.bf16x2 t, t, one, bias;
    fma.rn.bf16x2 a, t, $5, a;
    shl.b32 lo, a, 16;
    and.b32 hi, a, 0xFFFF0000;
    add.f32 $0, lo, hi;
    }"""
)


@triton.jit
def _load_weight_tile(
    w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, stride_w, stride_s,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Weight rows `rows`, columns k0 .. k0 + BLOCK_K, as fp32 [BLOCK_N, BLOCK_K]; FP8 tiles are unscaled (their
    per-row scale is applied to the finished sums). Columns past K read as zero."""
    r_mask = rows < N
    cols = k0 + tl.arange(0, BLOCK_K)
    # One return at the end: the JIT compiles every statement after a return inside a constexpr branch.
    if FP8:
        mask = r_mask[:, None] & (cols < K)[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        WORDS: tl.constexpr = BLOCK_K * BITS // 32
        word_cols = k0 * BITS // 32 + tl.arange(0, WORDS)
        w_mask = r_mask[:, None] & (word_cols < K * BITS // 32)[None, :]
        words = tl.load(w_ptr + rows[:, None] * stride_w + word_cols[None, :], mask=w_mask, other=0)
        q = _unpack(words, BITS)
        if BLOCK_K <= GROUP:  # the tile lies in one group: one scale per row
            g = k0 // GROUP
            s_mask = r_mask & (k0 < K)
            scale = tl.load(scale_ptr + rows * stride_s + g, mask=s_mask, other=0.0).to(tl.float32)
            offset = tl.load(offset_ptr + rows * stride_s + g, mask=s_mask, other=0.0).to(tl.float32)
            w = q * scale[:, None] + offset[:, None]
        else:  # GROUPS whole groups: their scales broadcast over a [rows, groups, group] view (a free reshape)
            GROUPS: tl.constexpr = BLOCK_K // GROUP
            groups = k0 // GROUP + tl.arange(0, GROUPS)
            g_mask = r_mask[:, None] & (groups < K // GROUP)[None, :]
            g_offs = rows[:, None] * stride_s + groups[None, :]
            scale = tl.load(scale_ptr + g_offs, mask=g_mask, other=0.0).to(tl.float32)
            offset = tl.load(offset_ptr + g_offs, mask=g_mask, other=0.0).to(tl.float32)
            q = tl.reshape(q, (BLOCK_N, GROUPS, GROUP))
            w = tl.reshape(q * scale[:, :, None] + offset[:, :, None], (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _int_to_float(q):
    """Unsigned integers below 2**23 to fp32 exactly, on the full-rate ALUs: placed in the mantissa of 2**23 and
    subtracted (I2F runs at a quarter of the rate, and the unpacking, not HBM, bounds INT4 GEMVs)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _unpack(words, BITS: tl.constexpr):
    """[rows, words] int32 -> [rows, words * 32 / BITS] fp32 columns in order (value j of a word at bits
    [BITS*j, BITS*(j+1))). tl.join adds its new axis inside each thread, so a word's values stay in the thread
    that loaded it and the reshape moves no data; nested as below, the joins' axes flatten into column order."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        v0, v1, v2, v3 = words & MASK, (words >> 4) & MASK, (words >> 8) & MASK, (words >> 12) & MASK
        v4, v5, v6, v7 = (words >> 16) & MASK, (words >> 20) & MASK, (words >> 24) & MASK, (words >> 28) & MASK
        q = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    else:
        v0, v1, v2, v3 = words & MASK, (words >> 8) & MASK, (words >> 16) & MASK, (words >> 24) & MASK
        q = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    return _int_to_float(tl.reshape(q, (words.shape[0], words.shape[1] * (32 // BITS))))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, N, K, stride_w, stride_s,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One activation row: multiply-adds into a [BLOCK_N, BLOCK_K] accumulator reduced once at the end, as the
    bf16 GEMV does, on weight tiles dequantized in registers."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _load_weight_tile(
            w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, stride_w, stride_s, FP8, BITS, GROUP, BLOCK_N, BLOCK_K
        )
        # x loaded per row of the tile (the same addresses, L1 hits): [BLOCK_N, BLOCK_K] takes the weight tile's
        # register layout, where a [BLOCK_K] load would take its own and convert the tile through shared memory.
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + (rows * 0)[:, None] + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        acc += w * x.to(tl.float32)
    out = tl.sum(acc, axis=1)
    if FP8:
        out *= tl.load(scale_ptr + rows, mask=r_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _columns4(t):
    """[W, 4] -> its four columns [W] (splits keep each value in the thread that holds it)."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))  # columns 0, 2 and 1, 3
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _int4_pair_products(words, SHIFT: tl.constexpr, x_lo, x_hi):
    """fp32 products of values SHIFT/4 and SHIFT/4 + 4 of each word with their x columns [W] (broadcast over rows)."""
    q_lo = _int_to_float((words >> SHIFT) & 15)
    q_hi = _int_to_float((words >> (SHIFT + 16)) & 15)
    return q_lo * x_lo[None, :] + q_hi * x_hi[None, :]


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, N, K, stride_w, stride_s,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
):  # fmt: skip
    """One activation row over INT4 words: word w of a row holds columns 8w .. 8w + 7, and its values meet
    x[8w + i] without being reordered into columns. Per word, sum(q * x) is scaled by its group's scale, and the
    group's offset meets sum(x) (w = q * scale + offset). PACKED_BF16 (bf16 x, inline PTX allowed) multiplies in
    bf16x2, else in fp32."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for k0 in range(0, K, 8 * WORDS):
        word_cols = k0 // 8 + tl.arange(0, WORDS)
        c_mask = word_cols < K // 8
        mask = r_mask[:, None] & c_mask[None, :]
        words = tl.load(w_ptr + rows[:, None] * stride_w + word_cols[None, :], mask=mask, other=0)
        x_offs = 8 * word_cols[:, None] + tl.arange(0, 4)[None, :]
        x_lo = tl.load(x_ptr + x_offs, mask=c_mask[:, None], other=0.0)  # [WORDS, 4]: x[8w + i]
        x_hi = tl.load(x_ptr + x_offs + 4, mask=c_mask[:, None], other=0.0)  # x[8w + 4 + i]
        x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        if PACKED_BF16:
            lo = x_lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            pairs = lo | (x_hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
            p0, p1, p2, p3 = _columns4(pairs)
            p0 = tl.broadcast_to(p0[None, :], (BLOCK_N, WORDS))
            p1 = tl.broadcast_to(p1[None, :], (BLOCK_N, WORDS))
            p2 = tl.broadcast_to(p2[None, :], (BLOCK_N, WORDS))
            p3 = tl.broadcast_to(p3[None, :], (BLOCK_N, WORDS))
            part = tl.inline_asm_elementwise(
                _BF16X2_DOT8, "=r,r,r,r,r,r", [words, p0, p1, p2, p3], dtype=tl.int32, is_pure=True, pack=1
            )
            part = part.to(tl.float32, bitcast=True)
        else:
            l0, l1, l2, l3 = _columns4(x_lo.to(tl.float32))
            h0, h1, h2, h3 = _columns4(x_hi.to(tl.float32))
            part = _int4_pair_products(words, 0, l0, h0) + _int4_pair_products(words, 4, l1, h1)
            part += _int4_pair_products(words, 8, l2, h2) + _int4_pair_products(words, 12, l3, h3)
        groups = rows[:, None] * stride_s + (word_cols // (GROUP // 8))[None, :]
        scale = tl.load(scale_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        offset = tl.load(offset_ptr + groups, mask=mask, other=0.0).to(tl.float32)
        acc += part * scale + offset * x_sum[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _tile_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_s, stride_out,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """Several activation rows: tensor-core dots on weight tiles dequantized in registers. SWAP_AB computes
    out^T = W x^T, so the weight tile is the dot's first operand (Hopper's wgmma takes that one from registers,
    the second only from shared memory) and BLOCK_N, not the few tokens, is its 64-row side."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask, t_mask = rows < N, tokens < M
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _load_weight_tile(
            w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, stride_w, stride_s, FP8, BITS, GROUP, BLOCK_N, BLOCK_K
        )
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=t_mask[:, None] & (cols < K)[None, :], other=0.0
        )
        if SWAP_AB:
            acc += tl.dot(w.to(x.dtype), tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = tl.trans(acc) if SWAP_AB else acc  # [BLOCK_M, BLOCK_N]
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


class Tiles(NamedTuple):
    """One launch configuration of `weight_only_matmul`; block_m 1 is the one-row GEMV kernel (which ignores
    swap_ab)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False


def matmul_tiles(m: int, fp8: bool) -> Tiles:
    """The best single configuration over Llama-3.1-8B's four linear shapes in an H200 sweep
    (benchmarks/results/quant-kernels-2026-12-03; one row of INT4: -2026-12-04): narrow row tiles, so even
    N = 4,096 spreads over every SM."""
    if m == 1:  # INT4's block_k: 8 x the words of a row per iteration of its own kernel
        return Tiles(1, 8, 1024, 4, 2) if fp8 else Tiles(1, 4, 4096, 4, 2)
    if fp8:  # up to FP8_WEIGHT_ONLY_ROWS rows
        return Tiles(16, 32, 256, 4, 3, swap_ab=True)
    return Tiles(min(64, max(16, triton.next_power_of_2(m))), 32, 256, 4, 3)


def weight_only_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized tile by tile. FP8 weights (`offsets` None) take one
    fp32 scale per row; integer weights take `bits`-wide values with group scales and offsets. `tiles` overrides
    the launch configuration (benchmarks/quant_kernels.py sweeps them)."""
    fp8 = offsets is None
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    t = tiles or matmul_tiles(m, fp8)
    common = dict(
        FP8=fp8,
        BITS=bits,
        GROUP=max(group_size, 1),  # unused by FP8
        HAS_BIAS=bias is not None,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    offsets = scales if fp8 else offsets
    bias = bias if bias is not None else scales
    if t.block_m == 1:
        if m != 1:
            raise ValueError(f"one-row tiles (block_m 1) given {m} rows")
        grid = (triton.cdiv(n, t.block_n),)
        if bits == 4 and group_size % 8 == 0:  # whole words in each group
            _int4_gemv_kernel[grid](
                x,
                weight,
                scales,
                offsets,
                bias,
                out,
                n,
                k,
                weight.stride(0),
                scales.stride(0),
                GROUP=group_size,
                HAS_BIAS=common["HAS_BIAS"],
                PACKED_BF16=x.dtype == torch.bfloat16 and asm_conversions(x),
                BLOCK_N=t.block_n,
                WORDS=max(t.block_k // 8, 1),
                num_warps=t.num_warps,
                num_stages=t.num_stages,
            )
            return out
        _gemv_kernel[grid](x, weight, scales, offsets, bias, out, n, k, weight.stride(0), scales.stride(0), **common)
        return out
    _tile_matmul_kernel[(triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m))](
        x,
        weight,
        scales,
        offsets,
        bias,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_M=t.block_m,
        SWAP_AB=t.swap_ab,
        **common,
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
