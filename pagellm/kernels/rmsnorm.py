"""Triton: fused residual-add + RMSNorm, one program per row. Normalizes in fp32, casts back to the input dtype,
then multiplies by the weight (HF Llama's order), so bf16 results track HF's. `rms_norm_to_fp8` quantizes that
result per row to FP8 before storing it, for an FP8 x FP8 matmul after it: the same bits as `rms_norm` followed by
`quant_matmul.fp8_quantize_rows`, without a launch, a store and a load of the row in between."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs
from pagellm.kernels.quant_matmul import store_fp8_row


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    scale_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
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
    out = weight * normed
    if FP8_OUT:
        store_fp8_row(out_ptr, scale_ptr, row, row * stride_o + cols, out, mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.rms_norm`: returns (norm(x + residual) * weight, x + residual). Any leading
    shape; the last dim is normalized and must be contiguous."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res_out = _launch(x2, weight, eps, residual, out, None)
    return out.view(shape), x if res_out is None else res_out.view(shape)


def rms_norm_to_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K]: `rms_norm`'s output quantized per row, as `fp8_quantize_rows` returns it (e4m3 values [T, K],
    fp32 scales [T, 1]), and x + residual."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    res_out = _launch(x, weight, eps, residual, out, scale)
    return out, scale, x if res_out is None else res_out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    scale: torch.Tensor | None,
) -> torch.Tensor | None:
    """Normalizes x [T, K] into out (FP8 with its row scales where `scale` is given); returns x + residual."""
    res2 = x if residual is None else residual.reshape(x.shape)
    res_out = None if residual is None else torch.empty_like(x)
    rows, n_cols = x.shape
    if rows:
        pdl = launch_early(x, rows)
        _rms_norm_kernel[(rows,)](
            x,
            res2,
            weight,
            out,
            out if res_out is None else res_out,
            out if scale is None else scale,
            x.stride(0),
            res2.stride(0),
            out.stride(0),
            (out if res_out is None else res_out).stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            FP8_OUT=scale is not None,
            BLOCK_N=triton.next_power_of_2(n_cols),
            PDL=pdl,
            launch_pdl=pdl,
        )
    return res_out
