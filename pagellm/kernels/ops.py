"""The model's and the sampler's elementwise and row ops behind one facade, picked once when the runner is built:
`TritonOps` on CUDA, `TorchOps` (the plain-torch twins of `reference.py`, and numpy's bit unpacking for the
structured-output mask) everywhere else. Layers call
`self.ops.<op>` and never ask which device they are on."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.kernels import reference

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Integer weights: rows up to which dequantizing in the matmul beats dequantize + cuBLAS (INT4 in groups of 64 or
# more runs on pair-plane dots: 1.4-2.5x dequantize + cuBLAS at 64 rows, quant-kernels-int4-h100-2026-12-06).
# Past 64 rows only the widest INT4 weights (gate|up) still gain on the H200: 0.098 against 0.173 ms at 128 rows,
# 0.180 against 0.194 at 256 (lost at 512); the others lose from 128 or 256 rows on
# (quant-kernels-int4-many-rows-2026-12-06). Other integer weights: dequantize + cuBLAS was the faster at 64 rows
# on three of Llama-3.1-8B's four shapes (H200 sweep of 2026-12-03).
GROUPED_FUSED_ROWS = 16
INT4_FUSED_ROWS = 64
WIDE_INT4_FUSED_ROWS = 256
FP8_WEIGHT_ONLY_ROWS = 16  # FP8 weights: rows up to which the weight-only matmul beats FP8 x FP8 tensor cores


class QuantizedWeight(NamedTuple):
    """A quantized linear layer's stored tensors in kernels/quant_matmul.py's formats: `bits`-wide integers with
    group scales and offsets, or FP8 (offsets None) with one scale per output row."""

    weight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    group_size: int


class Ops(Protocol):
    name: str

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(rms_norm(x + residual)), x + residual): a pre-norm block's norm and first projection."""
        ...

    def silu_and_mul_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def grouped_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bits: int,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def fp8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def quantized_rms_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rms_norm_linear` over a quantized weight."""
        ...

    def quantized_silu_and_mul_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def sample_rows(
        self,
        logits: torch.Tensor,
        inv_temperature: torch.Tensor,
        greedy: torch.Tensor,
        top_p: torch.Tensor,
        seeds: torch.Tensor,
    ) -> torch.Tensor: ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None: ...


class _Composed:
    """The fused ops as their parts, one op after the other: TorchOps' twins, and TritonOps' way where no fused
    kernel serves."""

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        normed, residual = self.rms_norm(x, norm_weight, eps, residual)
        return self.linear(normed, weight, bias), residual

    def silu_and_mul_linear(self, x, weight, bias=None):
        return self.linear(self.silu_and_mul(x), weight, bias)

    def quantized_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        normed, residual = self.rms_norm(x, norm_weight, eps, residual)
        return self.quantized_linear(normed, weight, bias), residual

    def quantized_silu_and_mul_linear(self, x, weight, bias=None):
        return self.quantized_linear(self.silu_and_mul(x), weight, bias)

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        if weight.offsets is None:
            return self.fp8_linear(x, weight.weight, weight.scales, bias)
        return self.grouped_linear(x, *weight, bias)


class TorchOps(_Composed):
    """The reference twins (the CPU path and the oracle of the Triton kernels), but for the structured-output mask,
    which numpy unpacks faster than the twin."""

    name = "torch"

    def rms_norm(self, x, weight, eps, residual=None):
        return reference.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        return reference.silu_and_mul(x)

    def linear(self, x, weight, bias=None):
        if weight.is_mkldnn:  # dense in, dense out; the op torch.compile uses for frozen CPU linears
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def grouped_linear(self, x, qweight, scales, offsets, bits, group_size, bias=None):
        return reference.weight_only_matmul(x, qweight, scales, offsets, bits, group_size, bias)

    def fp8_linear(self, x, weight, weight_scale, bias=None):
        return reference.weight_only_matmul(x, weight, weight_scale, None, 8, 0, bias)

    def sample_rows(self, logits, inv_temperature, greedy, top_p, seeds):
        return reference.sample_rows(logits, inv_temperature, greedy, top_p, seeds)

    def argmax_rows(self, logits):
        return logits.argmax(dim=-1)

    def apply_token_bitmask(self, logits, bitmask, rows):
        """The bits unpacked to one bool per token by numpy's byte table, then one masked fill: xgrammar's C++
        kernel took 18 ms for 64 rows of SmolLM2's vocabulary (the torch twin's per-token shifts, 56 ms for 16).
        Bit t % 32 of word t // 32 is byte (t % 32) // 8 of the word on a little-endian host."""
        vocab = logits.shape[1]
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
        blocked = torch.from_numpy(allowed.view(np.bool_)).logical_not_()
        rows = rows.long()
        if torch.equal(rows, torch.arange(logits.shape[0])):  # every row constrained: no gather and scatter
            logits.masked_fill_(blocked, float("-inf"))
        else:
            logits[rows] = logits[rows].masked_fill_(blocked, float("-inf"))


class TritonOps(_Composed):
    """The Triton kernels of this package (CUDA); imported here, so the CPU path never imports Triton."""

    name = "triton"

    def __init__(self) -> None:
        from pagellm.kernels import activation, bitmask, gemv, quant_matmul, rmsnorm, sampling

        self._activation, self._bitmask, self._gemv, self._rmsnorm, self._sampling = (
            activation,
            bitmask,
            gemv,
            rmsnorm,
            sampling,
        )
        self._quant = quant_matmul
        # FP8 x FP8 tensor-core matmuls with per-row scales (torch._scaled_mm) need sm89 or newer.
        self._fp8_tensor_cores = torch.cuda.get_device_capability() >= (8, 9)

    def rms_norm(self, x, weight, eps, residual=None):
        return self._rmsnorm.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x):
        return self._activation.silu_and_mul(x)

    def linear(self, x, weight, bias=None):
        """The half-precision rows of decode steps (up to FEW_ROWS) go through the GEMV kernels, which stream the
        weight faster than cuBLAS does for a few rows."""
        if self._decode_rows(x, bias):
            if x.shape[0] == 1:
                return self._gemv.gemv(x.contiguous(), weight)
            return self._gemv.few_rows_matmul(x.contiguous(), weight)
        return F.linear(x, weight, bias)

    def rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        """One decode row normalizes inside the GEMV's loads (one launch instead of two). Not 2-16 rows: fused
        likewise into `few_rows_matmul`, the H100 decoded batch 16 at half the speed (ab-fused-gemv-2026-12-06)."""
        if self._decode_rows(x, bias) and x.shape[0] == 1:
            residual = None if residual is None else residual.contiguous()
            return self._gemv.rms_norm_gemv(x.contiguous(), residual, norm_weight, eps, weight)
        return super().rms_norm_linear(x, residual, norm_weight, eps, weight, bias)

    def silu_and_mul_linear(self, x, weight, bias=None):
        """One decode row applies SwiGLU inside the GEMV's loads (one launch instead of two)."""
        if self._decode_rows(x, bias) and x.shape[0] == 1:
            return self._gemv.silu_and_mul_gemv(x.contiguous(), weight)
        return super().silu_and_mul_linear(x, weight, bias)

    def _decode_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> bool:
        return x.dim() == 2 and 0 < x.shape[0] <= self._gemv.FEW_ROWS and bias is None and x.dtype in HALF_DTYPES

    def grouped_linear(self, x, qweight, scales, offsets, bits, group_size, bias=None):
        """Up to GROUPED_FUSED_ROWS rows (INT4_FUSED_ROWS for INT4 in groups of 64 or more, WIDE_INT4_FUSED_ROWS
        for the widest of those weights) dequantize in the matmul's loop; more rows dequantize once and use cuBLAS
        (the sweeps behind each bound: the comment above them)."""
        int4_dots = bits == 4 and group_size % 64 == 0
        if not int4_dots:
            fused_rows = GROUPED_FUSED_ROWS
        elif qweight.shape[0] > self._quant.WIDE_WEIGHT_ROWS:
            fused_rows = WIDE_INT4_FUSED_ROWS
        else:
            fused_rows = INT4_FUSED_ROWS
        if x.shape[0] <= fused_rows:
            return self._quant.weight_only_matmul(x.contiguous(), qweight, scales, offsets, bits, group_size, bias)
        return F.linear(x, self._quant.dequantize(qweight, scales, offsets, bits, group_size, x.dtype), bias)

    def fp8_linear(self, x, weight, weight_scale, bias=None):
        """Decode-sized batches read the FP8 weight once in a weight-only matmul; larger ones quantize the
        activations per token and run FP8 x FP8 on the tensor cores."""
        if not self._fp8_tensor_core_rows(x, weight):
            return self._quant.weight_only_matmul(x.contiguous(), weight, weight_scale, None, 8, 0, bias)
        return self._fp8_matmul(*self._quant.fp8_quantize_rows(x.contiguous()), weight, weight_scale, bias, x.dtype)

    def _fp8_tensor_core_rows(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x's rows times an FP8 weight run FP8 x FP8 on the tensor cores: more of them than
        FP8_WEIGHT_ONLY_ROWS, where torch._scaled_mm serves (per-row scales with bf16 output only, dimensions in
        multiples of 16)."""
        n, k = weight.shape
        tensor_cores = self._fp8_tensor_cores and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
        return tensor_cores and x.dim() == 2 and x.shape[0] > FP8_WEIGHT_ONLY_ROWS

    def _fp8_matmul(self, x_fp8, x_scale, weight, weight_scale, bias, dtype):
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :], out_dtype=dtype)
        return out if bias is None else out + bias

    def quantized_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        """One decode row normalizes inside the weight-only GEMV's loads, as `rms_norm_linear` does; rows bound
        for FP8 tensor cores leave the norm's kernel quantized."""
        if x.dim() == 2 and x.shape[0] == 1:
            return self._quant.rms_norm_weight_only_gemv(x, residual, norm_weight, eps, *weight, bias)
        if weight.offsets is None and self._fp8_tensor_core_rows(x, weight.weight):
            x_fp8, x_scale, residual = self._rmsnorm.rms_norm_to_fp8(x.contiguous(), norm_weight, eps, residual)
            return self._fp8_matmul(x_fp8, x_scale, weight.weight, weight.scales, bias, x.dtype), residual
        return super().quantized_rms_norm_linear(x, residual, norm_weight, eps, weight, bias)

    def quantized_silu_and_mul_linear(self, x, weight, bias=None):
        """One decode row applies SwiGLU inside the weight-only GEMV's loads; rows bound for FP8 tensor cores
        leave SwiGLU's kernel quantized."""
        if x.dim() == 2 and x.shape[0] == 1:
            return self._quant.silu_and_mul_weight_only_gemv(x, *weight, bias)
        if weight.offsets is None and self._fp8_tensor_core_rows(x, weight.weight):
            x_fp8, x_scale = self._activation.silu_and_mul_to_fp8(x.contiguous())
            return self._fp8_matmul(x_fp8, x_scale, weight.weight, weight.scales, bias, x.dtype)
        return super().quantized_silu_and_mul_linear(x, weight, bias)

    def sample_rows(self, logits, inv_temperature, greedy, top_p, seeds):
        return self._sampling.sample_rows(logits, inv_temperature, greedy, top_p, seeds)

    def argmax_rows(self, logits):
        return self._sampling.argmax_rows(logits)

    def apply_token_bitmask(self, logits, bitmask, rows):
        self._bitmask.apply_token_bitmask(logits, bitmask, rows)


def ops_for(device: torch.device) -> Ops:
    return TritonOps() if device.type == "cuda" else TorchOps()
