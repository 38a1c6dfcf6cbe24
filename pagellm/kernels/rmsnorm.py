"""Triton: fused residual-add + RMSNorm, one program per row. Normalizes in fp32, casts back to the input dtype,
then multiplies by the weight (HF Llama's order), so bf16 results track HF's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, weight * normed, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.rms_norm`: returns (norm(x + residual) * weight, x + residual). Any leading
    shape; the last dim is normalized and must be contiguous."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    if residual is None:
        res2, res_out = x2, x
    else:
        res2 = residual.reshape(-1, shape[-1])
        res_out = torch.empty_like(x2)
    rows, n_cols = x2.shape
    if rows:
        pdl = launch_early(x, rows)
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out if residual is not None else out,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            (res_out if residual is not None else out).stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_N=triton.next_power_of_2(n_cols),
            PDL=pdl,
            launch_pdl=pdl,
        )
    return out.view(shape), res_out.view(shape) if residual is not None else x
