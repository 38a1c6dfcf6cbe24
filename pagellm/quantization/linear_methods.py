"""How a quantized linear layer holds, loads and applies its weight.

A method turns the checkpoint's tensors (AWQ's, GPTQ's, GGUF's or FP8's layouts; full-precision weights for FP8
at load) into the stored layout of `kernels/quant_matmul.py` as they load (`convert`, then `load`), finishes the
layer once all of its tensors are in (`finalize`: zero points folded into offsets, GPTQ's act-order permutation
applied), and computes through `ops` (`apply`). On the CPU `finalize` dequantizes once into an ordinary weight:
no CPU kernel beats oneDNN's fp32 matmul on the dequantized weight there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pagellm.kernels import reference
from pagellm.kernels.ops import QuantizedWeight
from pagellm.quantization.config import QuantizationConfig, check_tensor_parallel_quantization
from pagellm.quantization.packing import pack_int32, unpack_int32

if TYPE_CHECKING:
    from pagellm.model.layers import Linear, RMSNorm

# AutoAWQ packs the 8 nibbles of a word in the column order 0, 2, 4, 6, 1, 3, 5, 7; this puts them back.
AWQ_UNPACK_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


class LinearMethod(Protocol):
    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None: ...

    def convert(self, component: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...

    def load(self, layer: Linear, name: str, shard: int | None, tensor: torch.Tensor) -> None: ...

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None: ...

    def finalize(self, layer: Linear) -> None: ...

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def apply_after_norm(
        self, layer: Linear, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`apply` to norm(x + residual), and x + residual (one launch for a decode row on the GPU)."""
        ...

    def apply_after_silu_and_mul(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`apply` to silu(gate) * up of x = gate | up, fused likewise."""
        ...


def linear_method(config: QuantizationConfig, tp_size: int) -> LinearMethod:
    check_tensor_parallel_quantization(config, tp_size)
    if config.method == "fp8":
        return Fp8LinearMethod(config)
    return GroupedIntLinearMethod(config)


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _load_rows(layer: Linear, name: str, shard: int | None, tensor: torch.Tensor) -> None:
    """Copy a converted tensor into this shard's output rows of `layer.<name>`."""
    target = getattr(layer, name).data[layer.shard_rows(shard)]
    if tensor.shape != target.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def _become_full_precision(layer: Linear, weight: torch.Tensor) -> None:
    """Drop the quantized tensors for one ordinary weight (the CPU path)."""
    for name in list(layer._parameters):
        if name != "bias":
            delattr(layer, name)
    layer.weight = _param(weight)
    layer.method = None


class Fp8LinearMethod:
    """e4m3 weights with one fp32 scale per output row; activations get per-token scales as they come. A
    full-precision checkpoint is quantized row by row as each tensor loads (no full-precision copy is held)."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.prequantized = config.prequantized

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        layer.compute_dtype = torch.get_default_dtype()  # the model's dtype, for the CPU's dequantized weight
        layer.weight = _param(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        layer.weight_scale = _param(torch.empty(out_features, dtype=torch.float32))

    def convert(self, component: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if component == "weight" and not self.prequantized:
            weight, scale = quantize_fp8_rows(tensor)
            return [("weight", weight), ("weight_scale", scale)]
        if component == "weight":
            return [("weight", tensor)]
        if component == "weight_scale":  # [1] per tensor, [N] or [N, 1] per channel
            return [("weight_scale", tensor.float().reshape(-1))]
        if component == "input_scale":  # static activation scales: per-token scales are used instead
            return []
        raise ValueError(f"checkpoint tensor {component!r} is not part of an FP8 linear layer")

    def load(self, layer: Linear, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        if name == "weight_scale" and tensor.numel() == 1:  # per tensor: the one scale of each of its rows
            layer.weight_scale.data[layer.shard_rows(shard)].fill_(tensor.item())
            return
        _load_rows(layer, name, shard, tensor)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        weight = torch.empty(layer.weight.shape, device=layer.weight.device).normal_(0.0, 0.02, generator=gen)
        layer.weight.data, layer.weight_scale.data = quantize_fp8_rows(weight)

    def finalize(self, layer: Linear) -> None:
        if layer.weight.device.type == "cpu":
            weight = layer.weight.float() * layer.weight_scale[:, None]
            _become_full_precision(layer, weight.to(layer.compute_dtype))

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.ops.fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def apply_after_norm(self, layer, norm, x, residual, bias):
        return layer.ops.quantized_rms_norm_linear(x, residual, norm.weight, norm.eps, self._stored(layer), bias)

    def apply_after_silu_and_mul(self, layer, x, bias):
        return layer.ops.quantized_silu_and_mul_linear(x, self._stored(layer), bias)

    @staticmethod
    def _stored(layer: Linear) -> QuantizedWeight:
        return QuantizedWeight(layer.weight, layer.weight_scale, None, 8, 0)


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row: w ~= q * scale with scale = absmax / 448 (fp32 [N])."""
    q, scale = reference.fp8_quantize_rows(weight)
    return q, scale[:, 0]


class GroupedIntLinearMethod:
    """AWQ and GPTQ: `bits`-wide integers, a scale and a zero point per group of input columns, stored as
    (qweight, scales, offsets) with w = q * scale + offset; GPTQ's act-order reorders the input columns so every
    group is contiguous, and the layer permutes its input the same way."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config
        self.bits = config.bits

    def create_weights(self, layer: Linear, in_features: int, out_features: int) -> None:
        group = in_features if self.config.group_size == -1 else self.config.group_size
        if in_features % group or in_features % (32 // self.bits):
            raise ValueError(
                f"a linear layer with {in_features} inputs does not split into quantization groups of {group}"
            )
        if group != in_features and group & (group - 1):  # the kernels' tiles hold whole groups or lie in one
            raise ValueError(f"quantization group_size must be a power of two or -1 (whole rows); got {group}")
        layer.group_size = group
        layer.compute_dtype = torch.get_default_dtype()
        layer.qweight = _param(torch.empty(out_features, in_features * self.bits // 32, dtype=torch.int32))
        # fp16, the checkpoints' own precision, unless the model computes in fp32 (bf16 would round them).
        dtype = torch.float32 if torch.get_default_dtype() == torch.float32 else torch.float16
        layer.scales = _param(torch.empty(out_features, in_features // group, dtype=dtype))
        layer.offsets = _param(torch.empty(out_features, in_features // group, dtype=dtype))  # zero points, first
        if self.config.desc_act:
            layer.g_idx = _param(torch.full((in_features,), -1, dtype=torch.int32))
        layer.register_buffer("input_perm", None, persistent=False)

    def convert(self, component: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        awq = self.config.checkpoint_format == "awq"
        if self.config.checkpoint_format == "gguf":  # read in the stored layout already (gguf_blocks.py)
            return [(component, tensor)]
        if component == "qweight":
            if awq:  # [K, N / 8], packed along N
                return [("qweight", pack_int32(self._unpack_awq(tensor).T.contiguous(), self.bits))]
            return [("qweight", tensor.T.contiguous())]  # GPTQ's [K * bits / 32, N] packs K as the engine does
        if component == "qzeros":  # [K / G, N * bits / 32], packed along N
            zeros = self._unpack_awq(tensor) if awq else unpack_int32(tensor, self.bits)
            if self.config.checkpoint_format == "gptq":
                zeros = zeros + 1  # GPTQ v1 stores zero - 1
            return [("offsets", zeros.T.float())]
        if component == "scales":
            return [("scales", tensor.T)]
        if component == "g_idx":
            if self.config.desc_act:
                return [("g_idx", tensor.to(torch.int32))]
            sequential = torch.arange(tensor.numel(), device=tensor.device) // self.config.group_size
            if self.config.group_size != -1 and not torch.equal(tensor.long(), sequential):
                raise ValueError("checkpoint g_idx is not sequential but quantization_config.desc_act is false")
            return []
        raise ValueError(f"checkpoint tensor {component!r} is not part of an AWQ/GPTQ linear layer")

    def _unpack_awq(self, tensor: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(tensor, 4)
        return values.reshape(*tensor.shape, 8)[..., AWQ_UNPACK_ORDER.to(tensor.device)].reshape(values.shape)

    def load(self, layer: Linear, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        if name != "g_idx":
            _load_rows(layer, name, shard, tensor)
            return
        # q/k/v (gate/up) see the same input, so GPTQ gives them the same act-order; one copy serves all.
        tensor = tensor.to(layer.g_idx.device)
        if layer.g_idx[0] >= 0 and not torch.equal(layer.g_idx.data, tensor):
            raise ValueError("checkpoint g_idx differs between the projections of one merged layer")
        layer.g_idx.data.copy_(tensor)

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        layer.qweight.data.random_(generator=gen)
        layer.scales.data.uniform_(0.001, 0.004, generator=gen)
        layer.offsets.data.fill_(2 ** (self.bits - 1))
        if self.config.desc_act:
            layer.g_idx.data.copy_(torch.arange(layer.g_idx.numel()) // layer.group_size)

    def finalize(self, layer: Linear) -> None:
        scales = layer.scales.data
        if self.config.checkpoint_format != "gguf":  # AWQ/GPTQ load zero points: w = (q - zero) * scale
            layer.offsets.data = (-layer.offsets.data.float() * scales.float()).to(scales.dtype)
        if self.config.desc_act:
            self._apply_act_order(layer)
        if layer.qweight.device.type == "cpu":
            weight = reference.dequantize_grouped(layer.qweight, scales, layer.offsets, self.bits, layer.group_size)
            if layer.input_perm is not None:
                weight = torch.empty_like(weight).index_copy_(1, layer.input_perm, weight)
            _become_full_precision(layer, weight.to(layer.compute_dtype))

    def _apply_act_order(self, layer: Linear) -> None:
        """Sort the input columns by group: column j of the stored weight is input column perm[j]."""
        g_idx = layer.g_idx.data.long()
        del layer.g_idx
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(g_idx.numel(), device=g_idx.device) // layer.group_size):
            raise ValueError(f"checkpoint g_idx does not hold groups of exactly {layer.group_size} columns")
        if torch.equal(perm, torch.arange(perm.numel(), device=perm.device)):
            return
        values = unpack_int32(layer.qweight.data, self.bits)[:, perm]
        layer.qweight.data = pack_int32(values, self.bits)
        layer.input_perm = perm

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.input_perm is not None:
            x = x[:, layer.input_perm]
        return layer.ops.grouped_linear(
            x, layer.qweight, layer.scales, layer.offsets, self.bits, layer.group_size, bias
        )

    def apply_after_norm(self, layer, norm, x, residual, bias):
        if layer.input_perm is not None:  # act-order permutes the normalized input first
            hidden, residual = norm(x, residual)
            return self.apply(layer, hidden, bias), residual
        return layer.ops.quantized_rms_norm_linear(x, residual, norm.weight, norm.eps, self._stored(layer), bias)

    def apply_after_silu_and_mul(self, layer, x, bias):
        if layer.input_perm is not None:
            return self.apply(layer, layer.ops.silu_and_mul(x), bias)
        return layer.ops.quantized_silu_and_mul_linear(x, self._stored(layer), bias)

    def _stored(self, layer: Linear) -> QuantizedWeight:
        return QuantizedWeight(layer.qweight, layer.scales, layer.offsets, self.bits, layer.group_size)
