"""Triton: SwiGLU's silu(gate) * up over the merged gate|up projection [T, 2I], one launch instead of two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    # Rounded to the input dtype before the product, as torch's silu(gate) * up does.
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, silu * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as `reference.silu_and_mul`: x [T, 2I] (gate | up) -> [T, I]."""
    rows, width = x.shape
    n_cols = width // 2
    out = torch.empty(rows, n_cols, dtype=x.dtype, device=x.device)
    if rows:
        pdl = launch_early(x, rows)
        _silu_and_mul_kernel[(rows, triton.cdiv(n_cols, BLOCK))](
            x, out, x.stride(0), out.stride(0), n_cols, BLOCK=BLOCK, PDL=pdl, launch_pdl=pdl
        )
    return out
