"""The quantized-weight matmul kernels against plain torch: the stored integers are unpacked here with shifts and
masks written from the layout's definition (value j of a word at bits [b*j, b*(j+1))), not with the package's
unpacking; FP8 against torch's own float8 conversion."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import reference
from pagellm.kernels.activation import silu_and_mul, silu_and_mul_to_fp8
from pagellm.kernels.quant_matmul import (
    Tiles,
    dequantize,
    fp8_quantize_rows,
    rms_norm_weight_only_gemv,
    silu_and_mul_weight_only_gemv,
    weight_only_matmul,
)
from pagellm.kernels.rmsnorm import rms_norm, rms_norm_to_fp8
from pagellm.quantization.packing import pack_int32, unpack_int32
from tests.kernels.test_triton_kernels import DEVICE, DTYPES, rel_err, rms_norm_inputs

# fp32 tensor-core dots run in TF32 on a GPU; the interpreter multiplies in fp32.
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 2e-3, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def grouped_weight(n, k, bits, group, dtype, gen):
    """Random stored integers with group scales and offsets, and the fp32 weight they stand for."""
    q = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
    offsets = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype)
    per_word = 32 // bits
    words = torch.zeros(n, k // per_word, dtype=torch.int64)
    for j in range(per_word):
        words |= q[:, j::per_word].to(torch.int64) << (bits * j)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    dense = q.float() * scales.float().repeat_interleave(group, 1) + offsets.float().repeat_interleave(group, 1)
    return words, scales, offsets, dense


def test_packing_round_trips_and_matches_the_layout():
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        values = torch.randint(0, 2**bits, (3, 64), generator=gen, dtype=torch.int32)
        words = pack_int32(values, bits)
        assert words.dtype == torch.int32 and words.shape == (3, 64 * bits // 32)
        assert torch.equal(unpack_int32(words, bits), values)
        low = values[:, 0] | (values[:, 1] << bits)
        assert torch.equal(words[:, 0] & ((1 << 2 * bits) - 1), low)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 64), (4, 32), (8, 16), (8, 64)])
def test_weight_only_matmul_grouped_integers(dtype, m, bits, group):
    gen = torch.Generator().manual_seed(m * 10 + bits + group)
    n, k = 72, 384  # neither a multiple of the kernel's row tile nor of its column tile
    words, scales, offsets, dense = grouped_weight(n, k, bits, group, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    expected = x.float() @ dense.T + bias.float()
    to = dict(device=DEVICE)
    out = weight_only_matmul(x.to(**to), words.to(**to), scales.to(**to), offsets.to(**to), bits, group, bias.to(**to))
    assert out.dtype == dtype and out.shape == (m, n)
    twin = reference.weight_only_matmul(x, words, scales, offsets, bits, group, bias)
    assert rel_err(twin, expected) < TOL[dtype]
    if m == 1 and bits == 4:
        check_x16_activations(out, x, words, scales, offsets, group, bias, expected)
    else:
        assert rel_err(out.cpu(), expected) < TOL[dtype]


# One INT4 row takes x per 32 columns as 16-bit integers (two int8 parts): ~1e-5 from the exact product.
X16_TOL = 1e-4


def check_x16_activations(out, x, words, scales, offsets, group, bias, expected) -> None:
    """The one-row INT4 kernel against its twin (the same integers: as close as the output dtype allows) and
    the exact product."""
    twin = reference.int4_x16_matmul(x, words, scales, offsets, group, bias)
    assert rel_err(out.cpu(), twin.float()) < TOL[x.dtype]
    assert rel_err(twin, expected) < max(TOL[x.dtype], X16_TOL)
    assert rel_err(out.cpu(), expected) < max(TOL[x.dtype], X16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128])
def test_one_int4_row_is_exact_on_int8_grid_activations(dtype, group):
    """x whose 32-column groups are integers in [-127, 127] with 127 present is its own int8 part (the other part
    zero), so the integer kernel and its twin give the exact product (up to the output's rounding)."""
    gen = torch.Generator().manual_seed(group)
    n, k = 40, 512
    words, scales, offsets, dense = grouped_weight(n, k, 4, group, dtype, gen)
    x = torch.randint(-127, 128, (1, k), generator=gen).float()
    x[0, ::32] = 127.0
    x = (x * 2.0**-7).to(dtype)  # a power of two keeps every group on its grid
    expected = x.float() @ dense.T
    out = weight_only_matmul(x.to(DEVICE), words.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), 4, group)
    assert rel_err(out.cpu(), expected) < TOL[dtype]
    twin = reference.int4_x16_matmul(x, words, scales, offsets, group)
    assert rel_err(twin.float(), expected) < TOL[dtype]


# Each code path of the two kernels: the one-row GEMV with tiles inside one group, spanning several and ending
# past K; the dot kernel with tiles inside one group (INT4: on BASE + q, in either operand order) or spanning
# several, in either operand order, or inside one group but with the weights dequantized before the dot (INT4:
# scaled in x's dtype, or through fp32); one activation row through the dot kernel; columns split between programs
# (a last split shorter than the others, and more splits asked for than K has tiles). 19 rows take two token tiles.
TILE_VARIANTS = [
    Tiles(1, 16, 64, 4, 2),
    Tiles(1, 8, 256, 4, 3),
    Tiles(16, 16, 64, 4, 2),
    Tiles(16, 32, 32, 4, 2),
    Tiles(16, 32, 128, 4, 2, swap_ab=True),
    Tiles(16, 64, 64, 4, 2, swap_ab=True),
    Tiles(32, 64, 256, 4, 2),
    Tiles(16, 16, 64, 4, 2, split_k=3),
    Tiles(16, 64, 128, 4, 2, swap_ab=True, split_k=2),
    Tiles(16, 32, 256, 4, 2, split_k=8),
    Tiles(16, 32, 128, 4, 2, swap_ab=True, int4_dot="scaled"),
    Tiles(16, 64, 64, 4, 2, int4_dot="scaled"),
    Tiles(16, 32, 128, 4, 2, swap_ab=True, int4_dot="fp32"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", TILE_VARIANTS, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 16)])
def test_every_tile_variant(dtype, tiles, bits, group):
    gen = torch.Generator().manual_seed(tiles.block_n + bits + group)
    m = 1 if tiles.block_m == 1 or tiles.block_k == 32 else 19
    n, k = 72, 640  # 640: a partial last tile for 256-column tiles
    words, scales, offsets, dense = grouped_weight(n, k, bits, group, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)  # added once, however many programs share a row's columns
    expected = x.float() @ dense.T + bias.float()
    out = weight_only_matmul(
        x.to(DEVICE), words.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), bits, group, bias.to(DEVICE), tiles
    )
    if tiles.block_m == 1 and bits == 4:
        check_x16_activations(out, x, words, scales, offsets, group, bias, expected)
    else:
        assert rel_err(out.cpu(), expected) < TOL[dtype]
    fp8 = (torch.randn(n, k, generator=gen) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    out = weight_only_matmul(x.to(DEVICE), fp8.to(DEVICE), scale.to(DEVICE), None, 8, 0, bias.to(DEVICE), tiles)
    assert rel_err(out.cpu(), x.float() @ (fp8.float() * scale[:, None]).T + bias.float()) < TOL[dtype]


def test_tiles_refuse_what_they_cannot_run():
    x = torch.randn(2, 64)
    words = torch.zeros(8, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m 1"):
        weight_only_matmul(x, words, torch.ones(8, 1), torch.zeros(8, 1), 4, 64, tiles=Tiles(1, 8, 64, 4, 2))
    for int4_dot, block_k in [("scaled", 32), ("bf16", 64)]:  # pair planes need 64 columns; an unknown way
        with pytest.raises(ValueError, match="int4_dot"):
            weight_only_matmul(
                x,
                words,
                torch.ones(8, 1),
                torch.zeros(8, 1),
                4,
                64,
                tiles=Tiles(16, 8, block_k, 4, 2, int4_dot=int4_dot),
            )


# Each one-row kernel: INT4 in integers (groups of 32 and more), the dequantizing GEMV (8-bit integers, INT4 in
# groups of 16, FP8).
ONE_ROW_FORMATS = [(4, 128), (4, 32), (8, 64), (4, 16), ("fp8", 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", ONE_ROW_FORMATS)
@pytest.mark.parametrize("prologue", ["rms_norm", "rms_norm_residual", "silu_and_mul"])
def test_one_row_prologues(dtype, bits, group, prologue):
    """The op before the product, fused into the one-row kernels' loads of x, against the reference op followed
    by the unfused kernel, and against the exact product; the new residual equals the reference's."""
    gen = torch.Generator().manual_seed(len(prologue) + group)
    n, k = 72, 384
    if bits == "fp8":
        words = (torch.randn(n, k, generator=gen) * 3).to(torch.float8_e4m3fn)
        scales, offsets, bits = torch.rand(n, generator=gen) * 0.01 + 1e-3, None, 8
        dense = words.float() * scales[:, None]
    else:
        words, scales, offsets, dense = grouped_weight(n, k, bits, group, dtype, gen)
    stored = [t if t is None else t.to(DEVICE) for t in (words, scales, offsets)]
    bias = torch.randn(n, generator=gen).to(dtype)
    if prologue == "silu_and_mul":
        x = (2 * torch.randn(1, 2 * k, generator=gen)).to(dtype)
        inputs = reference.silu_and_mul(x)
        out = silu_and_mul_weight_only_gemv(x.to(DEVICE), *stored, bits, group, bias.to(DEVICE))
    else:
        x = (3 * torch.randn(1, k, generator=gen)).to(dtype)
        residual = torch.randn(1, k, generator=gen).to(dtype) if prologue == "rms_norm_residual" else None
        norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
        inputs, ref_residual = reference.rms_norm(x, norm_weight, 1e-5, residual)
        device_residual = None if residual is None else residual.to(DEVICE)
        out, new_residual = rms_norm_weight_only_gemv(
            x.to(DEVICE), device_residual, norm_weight.to(DEVICE), 1e-5, *stored, bits, group, bias.to(DEVICE)
        )
        assert torch.equal(new_residual.cpu(), ref_residual)
    assert out.shape == (1, n) and out.dtype == dtype
    unfused = weight_only_matmul(inputs.to(DEVICE), *stored, bits, group, bias.to(DEVICE))
    assert rel_err(out.cpu(), unfused.cpu()) < TOL[dtype]
    expected = inputs.float() @ dense.T + bias.float()
    assert rel_err(out.cpu(), expected) < max(TOL[dtype], X16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16])
def test_weight_only_matmul_fp8(dtype, m):
    gen = torch.Generator().manual_seed(m)
    n, k = 40, 200
    weight = (torch.randn(n, k, generator=gen) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen).to(dtype)
    expected = x.float() @ (weight.float() * scale[:, None]).T
    out = weight_only_matmul(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), None, 8, 0)
    assert rel_err(out.cpu(), expected) < TOL[dtype]
    assert rel_err(reference.weight_only_matmul(x, weight, scale, None, 8, 0), expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, 16)])
def test_dequantize(dtype, bits, group):
    gen = torch.Generator().manual_seed(bits + group)
    n, k = 48, 256
    words, scales, offsets, dense = grouped_weight(n, k, bits, group, dtype, gen)
    out = dequantize(words.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), bits, group, dtype)
    assert out.dtype == dtype
    assert rel_err(out.cpu(), dense) < TOL[dtype]
    assert rel_err(reference.dequantize_grouped(words, scales, offsets, bits, group), dense) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_quantize_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 300, generator=gen) * torch.logspace(-2, 2, 6)[:, None]).to(dtype)
    q, scale = fp8_quantize_rows(x.to(DEVICE))
    expected_scale = x.float().abs().amax(dim=1, keepdim=True) / 448.0
    torch.testing.assert_close(scale.cpu(), expected_scale, rtol=1e-6, atol=0)
    assert q.dtype == torch.float8_e4m3fn
    ref_q, ref_scale = reference.fp8_quantize_rows(x)
    assert torch.equal(ref_scale, expected_scale)
    assert torch.equal(ref_q.float(), (x.float() / expected_scale).to(torch.float8_e4m3fn).float())
    if DEVICE == "cuda":  # the interpreter's fp32 -> e4m3 conversion truncates (124.3 -> 64), the GPU's rounds
        # Each value is the nearest e4m3 value of x / scale (torch's conversion rounds to nearest even).
        assert torch.equal(q.cpu().float(), ref_q.float())


def assert_same_fp8_rows(fused: tuple[torch.Tensor, torch.Tensor], op_output: torch.Tensor, reference_output):
    """The fused kernel's FP8 rows are bit for bit what quantizing the unfused op's output gives, and their scales
    those of the torch twin's output (to its rounding); on a GPU, the values are torch's conversion of the op's
    output (the interpreter's own conversion is wrong: see test_fp8_quantize_rows)."""
    q, scale = fused
    unfused_q, unfused_scale = fp8_quantize_rows(op_output)
    assert q.dtype == torch.float8_e4m3fn and q.shape == op_output.shape and scale.shape == (q.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), unfused_q.view(torch.uint8))
    assert torch.equal(scale, unfused_scale)
    torch.testing.assert_close(scale.cpu(), reference.fp8_quantize_rows(reference_output.cpu())[1], rtol=2e-3, atol=0)
    if DEVICE == "cuda":
        expected = (op_output.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_to_fp8(dtype, hidden, with_residual):
    x, residual, weight = rms_norm_inputs(hidden, dtype, with_residual, torch.logspace(-2, 2, 13)[:, None])
    normed, summed = rms_norm(x, weight, 1e-5, residual)
    q, scale, fused_summed = rms_norm_to_fp8(x, weight, 1e-5, residual)
    assert_same_fp8_rows((q, scale), normed, reference.rms_norm(x, weight, 1e-5, residual)[0])
    assert torch.equal(fused_summed, summed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 64), (7, 1000), (3, 3072)])
def test_silu_and_mul_to_fp8(dtype, tokens, intermediate):
    gen = torch.Generator().manual_seed(intermediate)
    x = (2 * torch.randn(tokens, 2 * intermediate, generator=gen)).to(DEVICE, dtype)
    assert_same_fp8_rows(silu_and_mul_to_fp8(x), silu_and_mul(x), reference.silu_and_mul(x))
