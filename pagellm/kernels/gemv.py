"""Triton: y = x @ W^T for the few rows of a decode step, W [N, K] in nn.Linear's row-major layout.

Decode steps stream every weight once per step, so their matmuls are bandwidth-bound. cuBLAS, given one row or a
few, falls well short of HBM bandwidth, most on small projections (benchmarks/results/kernels-2026-12-02 and
matmul-sweep-2026-12-04). Both kernels here spread the weight over many small programs, each reading BLOCK_N whole
rows of W in BLOCK_K-wide tiles (contiguous, pipelined loads), so the whole GPU keeps loads in flight:

- `gemv`, one row: multiply-adds into a [BLOCK_N, BLOCK_K] fp32 accumulator reduced once at the end;
- `few_rows_matmul`, up to FEW_ROWS rows: tensor-core dots of the rows (padded to 16) against each weight tile.

The one-row kernel can also take the op before the product into its loads of x, so that a batch-1 decode step
launches fewer small elementwise kernels (each a launch and a few microseconds): `rms_norm_gemv` (the residual add
and RMSNorm that open an attention or MLP block, before q|k|v or gate|up) and `silu_and_mul_gemv` (SwiGLU before
down_proj).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs

FEW_ROWS = 16  # the most rows `few_rows_matmul` serves faster than cuBLAS (H200 sweep of 2026-12-04)
SMALL_WEIGHT = 8 << 20  # elements of a weight the one-row GEMV reads in whole rows (`gemv_tiles`)
WHOLE_ROWS_TILE = 8192  # elements of each of its programs' one tile


# What a kernel computes from its input before the product (`input_tile`): nothing; RMSNorm of x + residual;
# SwiGLU's silu(gate) * up of x = gate | up.
PLAIN = tl.constexpr(0)
RMS_NORM = tl.constexpr(1)
SILU_MUL = tl.constexpr(2)


@triton.jit
def _block_input(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """x + residual, rounded to x's dtype (the residual stream's next value), or x."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + cols, mask=mask, other=0.0)
    return x


@triton.jit
def input_tile(x_ptr, res_ptr, norm_ptr, cols, mask, K, rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The product's input at `cols`, rounded as the separate kernels round it (rmsnorm.py, activation.py), so the
    fused product is theirs: x; rms_norm(x + residual), given the row's 1/rms `rstd`; silu(gate) * up of
    x = gate | up."""
    if PROLOGUE == SILU_MUL:
        gate = tl.load(x_ptr + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + cols + K, mask=mask, other=0.0)
        gate_f = gate.to(tl.float32)
        tile = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype) * up
    else:
        tile = _block_input(x_ptr, res_ptr, cols, mask, HAS_RESIDUAL)
        if PROLOGUE == RMS_NORM:
            normed = (tile.to(tl.float32) * rstd).to(tile.dtype)
            tile = tl.load(norm_ptr + cols, mask=mask, other=0.0) * normed
    return tile


@triton.jit
def prologue_rstd(
    x_ptr, res_ptr, res_out_ptr, K, eps,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_ROW: tl.constexpr,
):  # fmt: skip
    """RMS_NORM: the whole row's 1/rms in a first pass over it (a few KB, from L2; program 0 also stores x +
    residual, the residual stream's next value). 1.0 for the other prologues."""
    rstd = 1.0
    if PROLOGUE == RMS_NORM:
        row = tl.arange(0, BLOCK_ROW)
        row_mask = row < K
        whole = _block_input(x_ptr, res_ptr, row, row_mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + row, whole, mask=row_mask & (tl.program_id(0) == 0))
        whole_f = whole.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(whole_f * whole_f, axis=0) / K + eps)
    return rstd


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, res_out_ptr, norm_ptr, N, K, stride_w, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N
    # The first weight tile is loaded before waiting: no kernel writes weights, so under PDL these loads overlap
    # the kernel before this one.
    cols = tl.arange(0, BLOCK_K)
    c_mask = cols < K
    w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
    wait_for_inputs(PDL)
    rstd = prologue_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, PROLOGUE, HAS_RESIDUAL, BLOCK_ROW)
    x = input_tile(x_ptr, res_ptr, norm_ptr, cols, c_mask, K, rstd, PROLOGUE, HAS_RESIDUAL)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]  # reduced once at the end, not per tile
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_mask = cols < K
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        x = input_tile(x_ptr, res_ptr, norm_ptr, cols, c_mask, K, rstd, PROLOGUE, HAS_RESIDUAL)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=r_mask)


# M only masks loads and stores: one compiled variant serves every row count (Triton would otherwise compile apart
# the counts divisible by 16), so start-up compiles fewer kernels.
@triton.jit(do_not_specialize=["M"])
def _few_rows_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """SWAP_AB computes out^T = W x^T, making the weight tile the dot's first operand."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    r_mask, t_mask = rows < N, tokens < M
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_mask = cols < K
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=r_mask[:, None] & c_mask[None, :], other=0.0)
        x_mask = t_mask[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=x_mask, other=0.0)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(x), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = tl.trans(acc) if SWAP_AB else acc  # [BLOCK_M, BLOCK_N]
    mask = t_mask[:, None] & r_mask[None, :]
    tl.store(out_ptr + tokens[:, None] * stride_out + rows[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


class Tiles(NamedTuple):
    """One launch configuration: rows of W per program, tile width, warps, pipelining depth (and, for
    `few_rows_matmul`, whether the weight is the dot's first operand)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False


def gemv_tiles(n: int, k: int) -> Tiles:
    """Small weights (up to SMALL_WEIGHT elements: Qwen3-0.6B's are 2-6M) are read in whole rows, one tile of
    WHOLE_ROWS_TILE elements per program: a program's loads are all in flight at once, and under PDL
    (`_gemv_kernel` loads its first tile before waiting) the programs placed while the kernel before runs have
    read their whole share of the weight by the time it ends. Batch-1 decode of Qwen3-0.6B on an H100, same run:
    1.14x the streamed tiles (results/ab-gemv-whole-rows-h100-2026-12-07); halving the tile, 8 warps or narrower
    streamed tiles gave less (results/gemv-rules-h100-2026-12-07).
    Larger weights stream in 512-wide tiles, 8 rows per program (an H200 sweep over Llama-3.1-8B shapes; narrower
    tiles were 2-10% slower for its batch-1 decode), and the widest (an LM head, Llama-3.1-8B's gate|up) in
    256-wide ones, 16 rows per program."""
    if n > 16384:
        return Tiles(16, 256, 4, 3)
    row = triton.next_power_of_2(k)
    if n * k <= SMALL_WEIGHT and row <= WHOLE_ROWS_TILE:
        return Tiles(min(8, WHOLE_ROWS_TILE // row), row, 4, 1)  # one tile per program: nothing to pipeline
    return Tiles(8, 512, 8 if k > 8192 else 4, 4)


def few_rows_tiles(n: int) -> Tiles:
    """By the weight's rows, the best (or within 3% of it) of benchmarks/matmul_sweep.py on the H200 for each of
    Llama-3.1-8B's and Qwen3-0.6B's shapes at 16 rows: narrow row tiles where few rows would leave SMs idle."""
    if n <= 2048:
        return Tiles(16, 512, 4, 3)
    if n <= 4096:
        return Tiles(32, 256, 4, 4, swap_ab=True)
    if n < 16384:
        return Tiles(64, 256, 4, 4, swap_ab=True)
    return Tiles(64, 128, 4, 4, swap_ab=True)


def gemv(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T -> [1, N], in x's dtype."""
    return _gemv(x, weight, tiles, PLAIN)[0]


def rms_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm(x, norm_weight, eps, residual)`'s output @ weight^T, and x + residual, for one row
    (x [1, K]) in one launch: each program first takes the whole row's 1/rms, then normalizes as it loads."""
    return _gemv(x, weight, None, RMS_NORM, residual, norm_weight, eps)


def silu_and_mul_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul(x)` @ weight^T for one row (x [1, 2K]: gate | up) in one launch."""
    return _gemv(x, weight, None, SILU_MUL)[0]


def _gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    tiles: Tiles | None,
    prologue: tl.constexpr,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product, and the new residual (x + residual; x itself without one). x and residual contiguous."""
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    residual_out = x if residual is None else torch.empty_like(x)
    t = tiles or gemv_tiles(n, k)
    pdl = launch_early(x, 1)
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x,
        weight,
        out,
        x if residual is None else residual,  # unread without a residual
        residual_out,
        x if norm_weight is None else norm_weight,  # unread without a norm
        n,
        k,
        weight.stride(0),
        eps,
        BLOCK_N=t.block_n,
        BLOCK_K=min(t.block_k, triton.next_power_of_2(k)),
        PROLOGUE=prologue.value,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROW=triton.next_power_of_2(k) if prologue == RMS_NORM else 1,
        PDL=pdl,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        launch_pdl=pdl,
    )
    return out, residual_out


def few_rows_matmul(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype, for 1 <= M <= FEW_ROWS; `tiles` overrides the launch
    configuration (benchmarks/matmul_sweep.py sweeps them)."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= FEW_ROWS:
        raise ValueError(f"few_rows_matmul takes 1 to {FEW_ROWS} rows, got {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    t = tiles or few_rows_tiles(n)
    _few_rows_kernel[(triton.cdiv(n, t.block_n),)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=16,  # the tensor cores' smallest row count
        BLOCK_N=t.block_n,
        BLOCK_K=min(t.block_k, max(16, triton.next_power_of_2(k))),
        SWAP_AB=t.swap_ab,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 exact (no TF32 rounding); half ignores it
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return out
