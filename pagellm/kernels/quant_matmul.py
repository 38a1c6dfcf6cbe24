"""Triton: matmuls over quantized weights, dequantizing in the loop (the weight crosses HBM in its stored bytes).

Two stored formats, both in nn.Linear's [N, K] orientation (rows are output features):

- **grouped integers** (AWQ, GPTQ, GGUF): `qweight` int32 [N, K * BITS / 32] packs 32 / BITS unsigned values per word,
  the lowest bits first; `scales` and `offsets` [N, K / GROUP] give w = q * scale + offset per group of GROUP
  input columns (AWQ/GPTQ's (q - zero) * scale with offset = -zero * scale, folded at load).
- **FP8** (e4m3): `weight` [N, K] with one fp32 scale per output row.

`weight_only_matmul` serves the rows of decode steps: one program reads BLOCK_N weight rows once for BLOCK_M
activation rows (a multiply-add reduction for one row, tensor-core dots for more). One row of INT4 has a kernel of
its own, in integers: x as two int8 parts per 32 columns, multiplied with each word's eight values where the word
was loaded by dp4a (four products and their sum an instruction). On Llama-3.1-8B's shapes on the H200 that is
1.8-2.1x the bf16 GEMV (benchmarks/results/quant-kernels-x16-2026-12-04). Many rows (prefill) go through
`dequantize` plus cuBLAS for the integers, and FP8 x FP8 `torch._scaled_mm` with per-token activation scales for
FP8 (`fp8_quantize_rows`, or in the RMSNorm or SwiGLU kernel before the matmul: `store_fp8_row`).
The one-row kernels also take in the op before the product, as the bf16 GEMV does
(`rms_norm_weight_only_gemv`, `silu_and_mul_weight_only_gemv`), so that a decode row launches fewer kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagellm.kernels.gemv import PLAIN, RMS_NORM, SILU_MUL, input_tile, prologue_rstd
from pagellm.kernels.paged_kv import asm_conversions
from pagellm.kernels.pdl import launch_early, wait_for_inputs


@triton.jit
def _load_words(w_ptr, rows, k0, N, k_words, stride_w, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The int32 words packing weight rows `rows`, columns k0 .. k0 + BLOCK_K (zero past N and K). `k_words`, the
    words of a row, comes as an argument: K * BITS // 32 computed in the kernel is known divisible by 2 only (K
    by 16), which splits the loads into 8-byte pieces."""
    word_cols = k0 // (32 // BITS) + tl.arange(0, BLOCK_K * BITS // 32)
    mask = (rows < N)[:, None] & (word_cols < k_words)[None, :]
    return tl.load(w_ptr + rows[:, None] * stride_w + word_cols[None, :], mask=mask, other=0)


@triton.jit
def _group_scales(scale_ptr, offset_ptr, rows, group, N, stride_s):
    """fp32 scale and offset of group `group` of each of weight rows `rows` (zero past N)."""
    offs = rows * stride_s + group
    scale = tl.load(scale_ptr + offs, mask=rows < N, other=0.0).to(tl.float32)
    return scale, tl.load(offset_ptr + offs, mask=rows < N, other=0.0).to(tl.float32)


@triton.jit
def _load_weight_tile(
    w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, k_words, stride_w, stride_s,
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
        q = _unpack(_load_words(w_ptr, rows, k0, N, k_words, stride_w, BITS, BLOCK_K), BITS)
        if BLOCK_K <= GROUP:  # the tile lies in one group: one scale per row
            scale, offset = _group_scales(scale_ptr, offset_ptr, rows, k0 // GROUP, N, stride_s)
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
    [BITS*j, BITS*(j+1)))."""
    return _int_to_float(_unpack_ints(words, BITS))


@triton.jit
def _unpack_ints(words, BITS: tl.constexpr):
    """[rows, words] int32 -> [rows, words * 32 / BITS] int32 columns in order. tl.join adds its new axis inside
    each thread, so a word's values stay in the thread that loaded it and the reshape moves no data; nested as
    below, the joins' axes flatten into column order."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        v0, v1, v2, v3 = words & MASK, (words >> 4) & MASK, (words >> 8) & MASK, (words >> 12) & MASK
        v4, v5, v6, v7 = (words >> 16) & MASK, (words >> 20) & MASK, (words >> 24) & MASK, (words >> 28) & MASK
        q = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    else:
        v0, v1, v2, v3 = words & MASK, (words >> 8) & MASK, (words >> 16) & MASK, (words >> 24) & MASK
        q = tl.join(tl.join(v0, v2), tl.join(v1, v3))
    return tl.reshape(q, (words.shape[0], words.shape[1] * (32 // BITS)))


@triton.jit
def _x_pair_planes(x, WORDS: tl.constexpr):
    """x [M, 8 * WORDS] -> four planes [M, 2 * WORDS]: plane q holds columns 8j + q and 8j + q + 4 at 2j and
    2j + 1, the columns that values q and q + 4 of a tile's INT4 word j multiply (splits keep each value in the
    thread that holds it)."""
    c0, c1 = tl.split(tl.reshape(x, (x.shape[0], WORDS, 2, 2, 2)))  # column = 8j + 4a + 2b + c
    p0, p2 = tl.split(c0)
    p1, p3 = tl.split(c1)
    shape: tl.constexpr = (x.shape[0], 2 * WORDS)
    return tl.reshape(p0, shape), tl.reshape(p1, shape), tl.reshape(p2, shape), tl.reshape(p3, shape)


@triton.jit
def _biased_int4_dot(
    w_ptr, rows, k0, N, k_words, stride_w, x, BASE: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """The dot of INT4 weight rows `rows` with x [M, BLOCK_K] over columns k0 .. k0 + BLOCK_K: [BLOCK_N, M]
    (SWAP_AB) or [M, BLOCK_N]. The weights enter as BASE + q in x's 16-bit float dtype, exactly: q placed in the
    mantissa of BASE (128 in bf16, 1024 in fp16: the powers of two whose spacing there is 1) by bit operations
    alone, where converting each integer to a float and scaling it runs on the slower conversion units.

    From 64 columns on it runs as four dots, one per pair of value positions (q, q + 4) of the words against x's
    matching columns (`_x_pair_planes`): each operand is then an element-wise function of the loaded words, so
    Triton moves the words (a quarter of the bf16 tile's bytes) into the dot's register layout, where the whole
    unpacked tile would go through shared memory; and the two values of a 32-bit register come from one word,
    (word >> 4q) & 0x000F000F | BASE_BITS x 0x10001 making both."""
    words = _load_words(w_ptr, rows, k0, N, k_words, stride_w, 4, BLOCK_K)
    if BLOCK_K >= 64:
        planes = _x_pair_planes(x, BLOCK_K // 8)
        part = tl.zeros([rows.shape[0], x.shape[0]] if SWAP_AB else [x.shape[0], rows.shape[0]], tl.float32)
        for q in tl.static_range(4):
            part = _weight_dot(_pair_tile(_biased_pairs(words, q, BASE), x.dtype, BLOCK_K), planes[q], part, SWAP_AB)
    else:
        BASE_BITS: tl.constexpr = 0x4300 if BASE == 128 else 0x6400
        w = (_unpack_ints(words, 4) | BASE_BITS).to(tl.int16).to(x.dtype, bitcast=True)
        part = _weight_dot(w, x, None, SWAP_AB)
    return part


@triton.jit
def _biased_pairs(words, q, BASE: tl.constexpr):
    """Values q and q + 4 of each INT4 word as BASE + value, two 16-bit floats in one int32 (low half: value q)."""
    BASE_BITS: tl.constexpr = 0x4300 if BASE == 128 else 0x6400
    return ((words >> (4 * q)) & 0x000F000F) | (BASE_BITS * 0x10001)


@triton.jit
def _pair_tile(pairs, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 [rows, BLOCK_K / 8] of two 16-bit floats each -> [rows, BLOCK_K / 4] of dtype, each word's halves
    side by side (a pair plane's columns 2j and 2j + 1)."""
    lo = pairs.to(tl.int16).to(dtype, bitcast=True)
    hi = (pairs >> 16).to(tl.int16).to(dtype, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (pairs.shape[0], BLOCK_K // 4))


@triton.jit
def _weight_dot(w, x, acc, SWAP_AB: tl.constexpr):
    """acc + w [BLOCK_N, K] . x [M, K]^T as [BLOCK_N, M] (SWAP_AB: w is the dot's first operand) or [M, BLOCK_N];
    acc None starts from zero."""
    return tl.dot(w, tl.trans(x), acc) if SWAP_AB else tl.dot(x, tl.trans(w), acc)


@triton.jit
def _pair_bits(value, BASE: tl.constexpr):
    """fp32 [rows] -> int32 [rows]: the value rounded to the 16-bit float of BASE (bf16 for 128, fp16 for 1024) in
    both halves of a word, as packed instructions take it."""
    dtype: tl.constexpr = tl.bfloat16 if BASE == 128 else tl.float16
    bits = value.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits | (bits << 16)


def _scaled_pair_asm(packed: str, one: int, minus_base: int) -> tl.constexpr:
    """PTX for `_scaled_pair` on one 32-bit register of two 16-bit floats: q = (BASE + q) * 1 - BASE exactly, then
    q * scale + offset."""
    return tl.constexpr(
        f"""{{
        .reg .b32 one, minus_base, q;
        mov.b32 one, {one:#x};
        mov.b32 minus_base, {minus_base:#x};
        fma.rn.{packed} q, $1, one, minus_base;
        fma.rn.{packed} $0, q, $2, $3;
        }}"""
    )


_BF16_SCALED_PAIR: tl.constexpr = _scaled_pair_asm("bf16x2", 0x3F803F80, 0xC300C300)  # 1.0 and -128 twice
_F16_SCALED_PAIR: tl.constexpr = _scaled_pair_asm("f16x2", 0x3C003C00, 0xE400E400)  # 1.0 and -1024 twice


@triton.jit
def _scaled_pair(pair, scale2, offset2, BASE: tl.constexpr, ASM: tl.constexpr):
    """Both halves of `pair` (16-bit floats BASE + q, as `_biased_int4_dot` makes them) to q * scale + offset, the
    scale and offset packed in both halves of scale2 / offset2 (`_pair_bits`): two packed instructions per two
    values, each value rounded once. The twin computes the same in fp32."""
    if ASM:
        out = tl.inline_asm_elementwise(
            _BF16_SCALED_PAIR if BASE == 128 else _F16_SCALED_PAIR,
            "=r,r,r,r",
            [pair, scale2, offset2],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        dtype: tl.constexpr = tl.bfloat16 if BASE == 128 else tl.float16
        scale = (scale2 & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
        offset = (offset2 & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)
        lo = ((pair & 15).to(tl.float32) * scale + offset).to(dtype).to(tl.int16, bitcast=True).to(tl.int32)
        hi = (((pair >> 16) & 15).to(tl.float32) * scale + offset).to(dtype).to(tl.int16, bitcast=True)
        out = (lo & 0xFFFF) | (hi.to(tl.int32) << 16)
    return out


@triton.jit
def _scaled_int4_dot(
    w_ptr, rows, k0, N, k_words, stride_w, x, scale, offset, acc,
    BASE: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """acc + the dot of INT4 weight rows `rows` (their group's fp32 scale and offset) with x [M, BLOCK_K], the
    weights dequantized to x's dtype before the dot, on the pair planes of `_biased_int4_dot` (BLOCK_K >= 64).
    For many rows: scaling each weight costs BLOCK_N * BLOCK_K multiply-adds a tile where scaling the sums of
    BASE + q costs BLOCK_N * BLOCK_M, and packed in pairs (`_scaled_pair`) a value takes about two instructions
    where dequantizing it through fp32 takes five."""
    words = _load_words(w_ptr, rows, k0, N, k_words, stride_w, 4, BLOCK_K)
    planes = _x_pair_planes(x, BLOCK_K // 8)
    scale2 = tl.broadcast_to(_pair_bits(scale, BASE)[:, None], words.shape)
    offset2 = tl.broadcast_to(_pair_bits(offset, BASE)[:, None], words.shape)
    for q in tl.static_range(4):
        pairs = _scaled_pair(_biased_pairs(words, q, BASE), scale2, offset2, BASE, ASM)
        acc = _weight_dot(_pair_tile(pairs, x.dtype, BLOCK_K), planes[q], acc, SWAP_AB)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, N, K, k_words,
    stride_w, stride_s, eps,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_ROW: tl.constexpr,
):  # fmt: skip
    """One activation row: multiply-adds into a [BLOCK_N, BLOCK_K] accumulator reduced once at the end, as the
    bf16 GEMV does, on weight tiles dequantized in registers. PROLOGUE: the op before the product, taken into the
    loads of x as in the bf16 GEMV (gemv.py)."""
    wait_for_inputs(PDL)
    rstd = prologue_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, PROLOGUE, HAS_RESIDUAL, BLOCK_ROW)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _load_weight_tile(
            w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, k_words, stride_w, stride_s, FP8, BITS, GROUP, BLOCK_N,
            BLOCK_K,
        )  # fmt: skip
        cols = k0 + tl.arange(0, BLOCK_K)
        if PROLOGUE == PLAIN:
            # x loaded per row of the tile (the same addresses, L1 hits): [BLOCK_N, BLOCK_K] takes the weight
            # tile's register layout, where a [BLOCK_K] load would take its own and convert through shared memory.
            x = tl.load(x_ptr + (rows * 0)[:, None] + cols[None, :], mask=(cols < K)[None, :], other=0.0)
        else:  # computed once, then converted: per row of the tile, the prologue's work (SwiGLU's exp) was 8x,
            # and batch-1 FP8 decode 1.7x slower (latency-none-fp8-awq-2026-12-06)
            x = input_tile(x_ptr, res_ptr, norm_ptr, cols, cols < K, K, rstd, PROLOGUE, HAS_RESIDUAL)[None, :]
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
def _pack_bytes(t):
    """[W, 4] int32 in [-128, 127] -> [W] int32 holding them as bytes, column j in byte j."""
    c0, c1, c2, c3 = _columns4(t)
    return (c0 & 255) | ((c1 & 255) << 8) | ((c2 & 255) << 16) | (c3 << 24)


@triton.jit
def _int4_int8_dot(words, x_even, x_odd):
    """Twin of the dp4a pair in `_int4_x16_dot`, a product at a time (byte j of x sign-extended by shifting it to
    the top and back)."""
    dot = tl.zeros(words.shape, tl.int32)
    for j in tl.static_range(4):
        dot += ((words >> (8 * j)) & 15) * ((x_even << (24 - 8 * j)) >> 24)
        dot += ((words >> (8 * j + 4)) & 15) * ((x_odd << (24 - 8 * j)) >> 24)
    return dot


@triton.jit
def _int4_x16_dot(words, hi_even, hi_odd, lo_even, lo_odd, ASM: tl.constexpr):
    """Per int32 word of eight INT4 values (value i at bits [4i, 4i + 4)), sum(q[i] * (254 * hi[i] + lo[i])) in
    int32, x's two int8 parts packed as bytes: *_even hold values 0, 2, 4, 6 of the word and *_odd the others.
    Masking the word with 0x0F0F0F0F leaves exactly its even values as bytes, so four dp4a (four products and a
    sum each) and a multiply-add do it all."""
    if ASM:
        dot = tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi, zero, d_hi, d_lo;
            mov.b32 zero, 0;
            and.b32 lo, $1, 0x0F0F0F0F;
            shr.u32 hi, $1, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            dp4a.u32.s32 d_hi, lo, $2, zero;
            dp4a.u32.s32 d_hi, hi, $3, d_hi;
            dp4a.u32.s32 d_lo, lo, $4, zero;
            dp4a.u32.s32 d_lo, hi, $5, d_lo;
            mad.lo.s32 $0, d_hi, 254, d_lo;
            }""",
            "=r,r,r,r,r,r",
            [words, hi_even, hi_odd, lo_even, lo_odd],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        dot = 254 * _int4_int8_dot(words, hi_even, hi_odd) + _int4_int8_dot(words, lo_even, lo_odd)
    return dot


@triton.jit
def _round_to_int(v):
    """fp32 -> nearest int32 (ties to even) for |v| < 2**22: adding 1.5 * 2**23 leaves the integer in the low
    mantissa bits."""
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _packed_x_bytes(xq, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """[WORDS * 8] int8 values (int32) in column order -> the [BLOCK_N, WORDS] even and odd byte packs of each
    word's eight (broadcast over the rows)."""
    even, odd = tl.split(tl.reshape(xq, (WORDS, 4, 2)))  # [WORDS, 4]: word w's xq[8w + 2i], xq[8w + 2i + 1]
    even = tl.broadcast_to(_pack_bytes(even)[None, :], (BLOCK_N, WORDS))
    odd = tl.broadcast_to(_pack_bytes(odd)[None, :], (BLOCK_N, WORDS))
    return even, odd


@triton.jit
def _int4_weight_tile(
    w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, k_words, stride_w, stride_s,
    GROUP: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """The words of weight rows `rows` from column k0 (8 * WORDS columns) and the fp32 scales and offsets of their
    32-column groups."""
    words = _load_words(w_ptr, rows, k0, N, k_words, stride_w, 4, 8 * WORDS)
    x_groups = k0 // 32 + tl.arange(0, WORDS // 4)
    g_mask = (rows < N)[:, None] & (x_groups < K // 32)[None, :]
    groups = rows[:, None] * stride_s + (x_groups // (GROUP // 32))[None, :]
    scale = tl.load(scale_ptr + groups, mask=g_mask, other=0.0).to(tl.float32)
    offset = tl.load(offset_ptr + groups, mask=g_mask, other=0.0).to(tl.float32)
    return words, scale, offset


@triton.jit
def _int4_x_tile(
    x_ptr, res_ptr, norm_ptr, k0, K, rstd,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, WORDS: tl.constexpr,
):  # fmt: skip
    """The product's input at columns k0 .. k0 + 8 * WORDS as fp32 [WORDS / 4, 32], one 32-column group a row
    (zero past K), after the prologue (`gemv.input_tile`)."""
    x_groups = k0 // 32 + tl.arange(0, WORDS // 4)
    x_offs = 32 * x_groups[:, None] + tl.arange(0, 32)[None, :]
    mask = (x_groups < K // 32)[:, None]
    return input_tile(x_ptr, res_ptr, norm_ptr, x_offs, mask, K, rstd, PROLOGUE, HAS_RESIDUAL).to(tl.float32)


@triton.jit
def _int4_tile_sums(words, scale, offset, x, ASM: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """Each row's products with x [WORDS / 4, 32] (`_int4_x_tile`) over the tile's 32-column groups
    [BLOCK_N, WORDS / 4] (see `_int4_gemv_kernel`)."""
    XG: tl.constexpr = WORDS // 4
    x_max = tl.max(tl.abs(x), axis=1)
    v = x * (127.0 / tl.where(x_max > 0, x_max, 1.0))[:, None]  # all-zero groups stay zero
    hi = _round_to_int(v)
    lo = _round_to_int((v - hi.to(tl.float32)) * 254.0)  # the rounding error, |v - hi| <= 1/2, to 1/254
    hi_even, hi_odd = _packed_x_bytes(hi, BLOCK_N, WORDS)
    lo_even, lo_odd = _packed_x_bytes(lo, BLOCK_N, WORDS)
    dot = _int4_x16_dot(words, hi_even, hi_odd, lo_even, lo_odd, ASM)
    dot = tl.sum(tl.reshape(dot, (BLOCK_N, XG, 4)), axis=2)  # below 2**24 in magnitude: exact in fp32
    x_scale = (x_max / (127.0 * 254.0))[None, :]
    return dot.to(tl.float32) * x_scale * scale + offset * tl.sum(x, axis=1)[None, :]


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, N, K, k_words,
    stride_w, stride_s, eps,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
    PDL: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_ROW: tl.constexpr,
):  # fmt: skip
    """One activation row over INT4 words, in integers. x is taken per 32 columns as 254 * hi + lo: hi its int8
    rounding (absmax to 127) and lo that rounding's error in 1/254ths, so x keeps ~15 bits against its group's
    absmax, finer than its own bf16 rounding. Each word's eight values meet both parts in four dp4a; four words'
    sums make a 32-column integer dot (exact), scaled by x's scale and the weight group's, and the offset term
    (w = q * scale + offset) meets the exact sum of x's 32 columns. Every program quantizes the x tile it reads
    (L2 hits, shared by BLOCK_N rows): on the H200 a variant with no x work at all was no faster. Each iteration
    loads the words and scales before x, so that their round trips overlap; the first tile's are loaded before
    waiting for the kernel before (weights are written by no kernel; under PDL they overlap it). Loading each next
    tile an iteration ahead was 2-10% slower per shape on the H100. PROLOGUE: the op before the product, taken into
    the loads of x as in the bf16 GEMV (gemv.py)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    words, scale, offset = _int4_weight_tile(
        w_ptr, scale_ptr, offset_ptr, rows, 0, N, K, k_words, stride_w, stride_s, GROUP, WORDS
    )
    wait_for_inputs(PDL)
    rstd = prologue_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, PROLOGUE, HAS_RESIDUAL, BLOCK_ROW)
    x = _int4_x_tile(x_ptr, res_ptr, norm_ptr, 0, K, rstd, PROLOGUE, HAS_RESIDUAL, WORDS)
    acc = _int4_tile_sums(words, scale, offset, x, ASM, BLOCK_N, WORDS)
    for k0 in range(8 * WORDS, K, 8 * WORDS):
        words, scale, offset = _int4_weight_tile(
            w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, k_words, stride_w, stride_s, GROUP, WORDS
        )
        x = _int4_x_tile(x_ptr, res_ptr, norm_ptr, k0, K, rstd, PROLOGUE, HAS_RESIDUAL, WORDS)
        acc += _int4_tile_sums(words, scale, offset, x, ASM, BLOCK_N, WORDS)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _tile_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, offset_ptr, bias_ptr, out_ptr, M, N, K, k_words, tiles_per_split, stride_x, stride_w,
    stride_s, stride_out,
    FP8: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BASE: tl.constexpr,
    SCALE_FIRST: tl.constexpr, ASM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """Several activation rows: tensor-core dots on weight tiles dequantized in registers. SWAP_AB computes
    out^T = W x^T, so the weight tile is the dot's first operand (Hopper's wgmma takes that one from registers,
    the second only from shared memory) and BLOCK_N, not the few tokens, is its 64-row side.

    Program (i, j, s) sums the columns of tiles [s * tiles_per_split, (s + 1) * tiles_per_split) only (counted in
    tiles, so that the compiler knows each split's start divisible by BLOCK_K and loads whole 16-byte vectors).
    With several splits (grid axis 2) out holds their fp32 partial sums [splits, M, N] (the bias in split 0's),
    which `_sum_splits_kernel` adds up: with few rows, a weight of 4,096 rows gives too few row tiles to keep every
    SM reading.

    BASE 128 or 1024 (INT4 with bf16 or fp16 activations, each tile inside one group; 0 otherwise): the dot
    runs on BASE + q as stored (`_biased_int4_dot`), and the group's scale s and offset o apply to its sums:
    sum((q * s + o) x) = s * dot(BASE + q, x) + (o - BASE * s) * sum(x). The sums are fp32, whose 24 bits leave
    the cancellation of BASE * sum(x) far below bf16's rounding. SCALE_FIRST (with BASE) scales the weights
    instead, before the dot (`_scaled_int4_dot`): fewer multiply-adds once the tokens outnumber the tile's
    columns."""
    # Token tiles on the grid's fastest axis: the programs that share a weight tile run together, so each weight
    # tile crosses HBM once (with the weight tiles outermost, a weight larger than L2 was read once per token tile).
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask, t_mask = rows < N, tokens < M
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    split = tl.program_id(2)
    k_start = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_start + tiles_per_split * BLOCK_K, K)
    if BASE:  # each iteration loads the next tile's group scales, used an iteration later, so that their round
        # trip overlaps a tile's work (Triton's pipeliner leaves loads that feed no dot waiting where they are used)
        scale, offset = _group_scales(scale_ptr, offset_ptr, rows, k_start // GROUP, N, stride_s)
    for k0 in range(k_start, k_end, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=t_mask[:, None] & (cols < K)[None, :], other=0.0
        )
        if BASE:
            last = k0 + BLOCK_K >= k_end  # no next tile in this split: its "rows" are all masked out (N as 0)
            next_scale, next_offset = _group_scales(
                scale_ptr, offset_ptr, rows, (k0 + BLOCK_K) // GROUP, tl.where(last, 0, N), stride_s
            )
            if SCALE_FIRST:
                acc = _scaled_int4_dot(
                    w_ptr, rows, k0, N, k_words, stride_w, x, scale, offset, acc, BASE, SWAP_AB, BLOCK_K, ASM
                )
            else:
                part = _biased_int4_dot(w_ptr, rows, k0, N, k_words, stride_w, x, BASE, SWAP_AB, BLOCK_K)
                shift = offset - BASE * scale
                x_sum = tl.sum(x.to(tl.float32), axis=1)
                if SWAP_AB:
                    acc += part * scale[:, None] + shift[:, None] * x_sum[None, :]
                else:
                    acc += part * scale[None, :] + x_sum[:, None] * shift[None, :]
            scale, offset = next_scale, next_offset
        else:
            w = _load_weight_tile(
                w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, k_words, stride_w, stride_s, FP8, BITS, GROUP, BLOCK_N,
                BLOCK_K,
            ).to(x.dtype)  # fmt: skip
            acc = _weight_dot(w, x, acc, SWAP_AB)
    out = tl.trans(acc) if SWAP_AB else acc  # [BLOCK_M, BLOCK_N]
    if FP8:
        out *= tl.load(scale_ptr + rows, mask=r_mask, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=r_mask & (split == 0), other=0.0).to(tl.float32)[None, :]
    out_mask = t_mask[:, None] & r_mask[None, :]
    out_ptr += split.to(tl.int64) * M * stride_out  # several splits: this one's partial sums
    tl.store(out_ptr + tokens[:, None] * stride_out + rows[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of SPLIT_K fp32 partials [SPLIT_K, numel], in split order (graphs and eager agree)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(
    w_ptr, scale_ptr, offset_ptr, out_ptr, N, K, k_words, stride_w, stride_s, stride_out,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _load_weight_tile(
        w_ptr, scale_ptr, offset_ptr, rows, k0, N, K, k_words, stride_w, stride_s, False, BITS, GROUP, BLOCK_N, BLOCK_K
    )
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_row_scale(amax):
    """The per-row FP8 scale of a row whose largest magnitude is `amax` (fp32)."""
    return tl.maximum(amax, 1e-12) / 448.0  # 448: the largest finite e4m3 value


@triton.jit
def fp8_values(x, scale):
    """fp32 values over their row's scale, in e4m3's range (the store converts them)."""
    return tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)  # IEEE division, as torch divides


@triton.jit
def store_fp8_row(out_ptr, scale_ptr, row, offsets, values, mask):
    """A whole row's values quantized to FP8 by their own scale: the values to out_ptr + offsets, the scale to
    scale_ptr + row."""
    values = values.to(tl.float32)
    scale = fp8_row_scale(tl.max(tl.abs(values), axis=0))
    tl.store(out_ptr + offsets, fp8_values(values, scale).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _fp8_quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_row_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * stride_q + cols, fp8_values(x, scale).to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(scale_ptr + row, scale)


INT4_DOTS = ("base", "scaled", "fp32")
# Weights with more output rows than this (Llama-3.1-8B's gate|up, 28,672) take INT4 tiles of their own.
WIDE_WEIGHT_ROWS = 16384


class Tiles(NamedTuple):
    """One launch configuration of `weight_only_matmul`; block_m 1 is the one-row GEMV kernel (which ignores
    swap_ab, split_k and int4_dot). split_k: how many programs share each tile's columns (see
    `_tile_matmul_kernel`). int4_dot, for INT4 tiles inside one group: "base" dots BASE + q and scales the sums,
    "scaled" scales the weights in x's dtype before the dot (block_k 64 or more), "fp32" dequantizes each value
    through fp32 (what tiles spanning several groups always do)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    split_k: int = 1
    int4_dot: str = "base"


def matmul_tiles(m: int, fp8: bool, bits: int = 4, group_size: int = 128, n: int = 0, k: int = 0) -> Tiles:
    """The best single configuration over Llama-3.1-8B's four linear shapes in a sweep (benchmarks/results: one row
    quant-kernels-2026-12-03 and -x16-2026-12-04 on the H200; FP8 2-16 rows quant-kernels-x16-h100-2026-12-06, INT4
    2-64 rows quant-kernels-int4-h100-2026-12-06): narrow row tiles or split columns, so even N = 4,096 spreads over
    every SM. One row of INT4 also by the weight's shape [n, k], as the best per shape on both the H200 and the H100
    (ab-int4-one-row-2026-12-06): narrower tiles for the widest weight (gate|up), 8 warps for the longest rows
    (down_proj). INT4 past 16 rows scales the weights before the dot, the best per shape on the H200
    (quant-kernels-int4-many-rows-2026-12-06: 12-18% faster than the scaled sums at 64 rows)."""
    if m == 1 and fp8:
        return Tiles(1, 8, 1024, 4, 2)
    if m == 1:  # INT4's block_k: 8 x the words of a row per iteration of its own kernel
        if n > 16384:
            return Tiles(1, 16, 1024, 4, 2)
        return Tiles(1, 8, 2048, 8 if k > 8192 else 4, 2)
    if fp8:  # up to FP8_WEIGHT_ONLY_ROWS rows
        return Tiles(16, 32, 256, 4, 4, split_k=2)
    if bits == 4 and group_size % 64 == 0:  # INT4 pair-plane dots need 64 columns inside one group
        block_k = 128 if group_size % 128 == 0 else 64
        if m <= 16:
            return Tiles(16, 128, block_k, 4, 3, True, 8)
        # gate|up: wide row tiles, no column splits (224 row tiles fill the SMs); 128 tokens spill 64 bytes on
        # sm_90 and still beat every other tile at 128 and 256 rows
        if n > WIDE_WEIGHT_ROWS:
            return Tiles(128 if m > 64 else 64, 128, block_k, 4, 3, True, 1, "scaled")
        return Tiles(64, 64, block_k, 4, 3, False, 4, "scaled")
    return Tiles(min(64, max(16, triton.next_power_of_2(m))), 32, 256, 4, 3)


def _int4_dot_base(dtype: torch.dtype) -> int:
    """The power of two under whose mantissa INT4 values become x's dtype exactly (0: no 16-bit float)."""
    return {torch.bfloat16: 128, torch.float16: 1024}.get(dtype, 0)


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
    """x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized tile by tile (one row of INT4: in integers, see
    `_int4_gemv_kernel`). FP8 weights (`offsets` None) take one fp32 scale per row; integer weights take
    `bits`-wide values with group scales and offsets. `tiles` overrides the launch configuration
    (benchmarks/quant_kernels.py sweeps them)."""
    fp8 = offsets is None
    m, k = x.shape
    n = weight.shape[0]
    t = tiles or matmul_tiles(m, fp8, bits, group_size, n, k)
    if t.int4_dot not in INT4_DOTS or (t.int4_dot == "scaled" and t.block_k < 64):
        raise ValueError(
            f"int4_dot {t.int4_dot!r} with block_k {t.block_k}: one of {INT4_DOTS} (scaled: block_k >= 64)"
        )
    if t.block_m == 1:
        if m != 1:
            raise ValueError(f"one-row tiles (block_m 1) given {m} rows")
        return _one_row(x, weight, scales, offsets, bits, group_size, bias, t, PLAIN)[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    offsets = scales if fp8 else offsets
    # Each split's columns start a tile (and so, with BASE, a group); fewer splits when K has too few tiles.
    tiles_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k)
    split_k = triton.cdiv(k, tiles_per_split * t.block_k)
    partials = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    base_dots = t.int4_dot != "fp32" and bits == 4 and not fp8 and group_size % t.block_k == 0
    _tile_matmul_kernel[(triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), split_k)](
        x,
        weight,
        scales,
        offsets,
        scales if bias is None else bias,  # unread without a bias
        partials,
        m,
        n,
        k,
        weight.shape[1],
        tiles_per_split,
        x.stride(0),
        weight.stride(0),
        scales.stride(0),
        n,
        FP8=fp8,
        BITS=bits,
        GROUP=max(group_size, 1),  # unused by FP8
        HAS_BIAS=bias is not None,
        BASE=_int4_dot_base(x.dtype) if base_dots else 0,
        SCALE_FIRST=base_dots and t.int4_dot == "scaled",
        ASM=asm_conversions(x),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        SWAP_AB=t.swap_ab,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partials, out, m * n, SPLIT_K=split_k, BLOCK=block)
    return out


def rms_norm_weight_only_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm(x, norm_weight, eps, residual)`'s output @ W^T, and x + residual, for one row (x [1, K])
    in one launch, as `gemv.rms_norm_gemv` for a plain weight."""
    return _one_row(x, weight, scales, offsets, bits, group_size, bias, None, RMS_NORM, residual, norm_weight, eps)


def silu_and_mul_weight_only_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.silu_and_mul(x)` @ W^T for one row (x [1, 2K]: gate | up) in one launch."""
    return _one_row(x, weight, scales, offsets, bits, group_size, bias, None, SILU_MUL)[0]


def _shape(weight: torch.Tensor, bits: int, fp8: bool) -> tuple[int, int]:
    """[N, K] of the weight a stored tensor holds."""
    return weight.shape[0], weight.shape[1] if fp8 else weight.shape[1] * 32 // bits


def _one_row(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
    t: Tiles | None,
    prologue: tl.constexpr,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-row product after `prologue` (gemv.py's PLAIN, RMS_NORM or SILU_MUL), and the new residual (x +
    residual; x itself without one). `t` None: the tiles `matmul_tiles` picks for the shape."""
    fp8 = offsets is None
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    n, k = _shape(weight, bits, fp8)  # x has 2K columns under SILU_MUL
    t = t or matmul_tiles(1, fp8, bits, group_size, n, k)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    residual_out = x if residual is None else torch.empty_like(x)
    pdl = launch_early(x, 1)
    launch_args = dict(
        PROLOGUE=prologue.value,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROW=triton.next_power_of_2(k) if prologue == RMS_NORM else 1,
        PDL=pdl,
        HAS_BIAS=bias is not None,
        BLOCK_N=t.block_n,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        launch_pdl=pdl,
    )
    pointers = (
        x,
        weight,
        scales,
        scales if fp8 else offsets,  # unread by FP8
        scales if bias is None else bias,  # unread without a bias
        out,
        x if residual is None else residual,  # unread without a residual
        residual_out,
        x if norm_weight is None else norm_weight,  # unread without a norm
    )
    grid = (triton.cdiv(n, t.block_n),)
    if bits == 4 and not fp8 and group_size % 32 == 0 and k % 32 == 0:  # whole 32-column x groups in each group
        _int4_gemv_kernel[grid](
            *pointers, n, k, weight.shape[1], weight.stride(0), scales.stride(0), eps,
            GROUP=group_size, ASM=asm_conversions(x), WORDS=max(t.block_k // 8, 1), **launch_args,
        )  # fmt: skip
    else:
        _gemv_kernel[grid](
            *pointers, n, k, weight.shape[1], weight.stride(0), scales.stride(0), eps,
            FP8=fp8, BITS=bits, GROUP=max(group_size, 1), BLOCK_K=t.block_k, **launch_args,
        )  # fmt: skip
    return out, residual_out


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
        qweight.shape[1],
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
