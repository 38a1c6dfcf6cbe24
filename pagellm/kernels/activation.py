"""Triton: SwiGLU's silu(gate) * up over the merged gate|up projection [T, 2I], one launch instead of two.
`silu_and_mul_to_fp8` quantizes each row of the result to FP8 before storing it, for an FP8 x FP8 matmul after it:
the same bits as `silu_and_mul` followed by `quant_matmul.fp8_quantize_rows`, one program holding a whole row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs
from pagellm.kernels.quant_matmul import store_fp8_row

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    stride_x,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    FP8_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    # Rounded to the input dtype before the product, as torch's silu(gate) * up does.
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    out = silu * up
    if FP8_OUT:  # the program holds the whole row (BLOCK >= n_cols), so its scale is known here
        store_fp8_row(out_ptr, scale_ptr, row, row * stride_o + cols, out, mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference.silu_and_mul`: x [T, 2I] (gate | up) -> [T, I]."""
    rows, width = x.shape
    n_cols = width // 2
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows:
        pdl = launch_early(x, rows)
        _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, BLOCK))](
            x, out, out, x.stride(0), out.stride(0), n_cols, BLOCK=BLOCK, FP8_OUT=False, PDL=pdl, launch_pdl=pdl
        )
    return out


def silu_and_mul_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2I]: `silu_and_mul`'s output quantized per row, as `fp8_quantize_rows` returns it (e4m3 values
    [T, I], fp32 scales [T, 1])."""
    rows, width = x.shape
    n_cols = width // 2
    out = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        pdl = launch_early(x, rows)
        block = triton.next_power_of_2(n_cols)
        _silu_and_mul_kernel[(rows, 1)](
            x,
            out,
            scale,
            x.stride(0),
            out.stride(0),
            n_cols,
            BLOCK=block,
            FP8_OUT=True,
            PDL=pdl,
            num_warps=min(16, max(4, block // 1024)),  # 32 values of gate and of up a thread at Llama-3.1-8B's 14,336
            launch_pdl=pdl,
        )
    return out, scale
