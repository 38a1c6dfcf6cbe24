"""Building blocks of the Llama family: linear layers with shard-aware loading, RMSNorm, rotary embedding, MLP,
the vocabulary-parallel embedding.

Every layer computes through `ops` (kernels/ops.py: Triton on CUDA, the torch twins elsewhere), chosen once when
the model is built. Merged linears (q|k|v, gate|up) load each HF weight into its slice through `load_shard`; under
tensor parallelism each rank's layers are built at its share's size (`distributed/parallel.py`) and read only that
share of each checkpoint tensor (`read_slice`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.config import RopeConfig, cdiv
from pagellm.distributed.parallel import TensorParallel, vocab_shard
from pagellm.kernels.ops import Ops
from pagellm.model.attention import Rotation
from pagellm.quantization.linear_methods import LinearMethod


class CheckpointTensor(Protocol):
    """A checkpoint tensor not read yet (safetensors' slice handle): shape first, then the slice wanted."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


def read_slice(source: CheckpointTensor, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Read all of a checkpoint tensor, or (dim, start, size) of it: only those bytes are read from the file."""
    if part is None:
        return source[tuple(slice(None) for _ in source.get_shape())]
    dim, start, size = part
    index = tuple(slice(start, start + size) if d == dim else slice(None) for d in range(len(source.get_shape())))
    return source[index]


class Linear(nn.Module):
    """y = x W^T + b; with a quantization `method` the method holds W in its stored format and applies it."""

    def __init__(
        self, in_features: int, out_features: int, ops: Ops, bias: bool = False, method: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.method = method
        if method is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        else:
            method.create_weights(self, in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return self.method.apply(self, x, self.bias)
        return self.ops.linear(x, self.weight, self.bias)

    def after_norm(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """self(norm(x + residual)) and x + residual: one fused op (a decode row on the GPU runs one kernel)."""
        if self.method is None:
            return self.ops.rms_norm_linear(x, residual, norm.weight, norm.eps, self.weight, self.bias)
        return self.method.apply_after_norm(self, norm, x, residual, self.bias)

    def after_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) of x = gate | up, fused likewise."""
        if self.method is None:
            return self.ops.silu_and_mul_linear(x, self.weight, self.bias)
        return self.method.apply_after_silu_and_mul(self, x, self.bias)

    def shard_rows(self, shard: int | None) -> slice:
        """The output rows that checkpoint shard `shard` of a merged layer fills (all of them for a plain one)."""
        return slice(None)

    def pack_for_cpu(self) -> None:
        """Store the weight in oneDNN's layout (after loading), which `Ops.linear` then multiplies with oneDNN."""
        weight = self.weight.data
        del self.weight
        self.register_buffer("weight", weight.to_mkldnn())


def can_pack_for_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class MergedLinear(Linear):
    """Several output projections stored as one matrix, so one matmul computes them all."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        ops: Ops,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), ops, bias, method)
        self.output_sizes = output_sizes
        self.row_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def shard_rows(self, shard: int | None) -> slice:
        if shard is None:
            return slice(None)
        return slice(self.row_offsets[shard], self.row_offsets[shard] + self.output_sizes[shard])

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        getattr(self, param_name).data[self.shard_rows(shard)].copy_(tensor)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies as HF computes them, including 'linear' and 'llama3' scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated smoothly.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def rotation(
        self, positions: torch.Tensor, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
    ) -> Rotation:
        """The rotation of the tokens at `positions`, after RMS-normalizing each head when given per-head norms
        (Qwen3): the attention backend applies it as it writes the KV cache (one kernel on the GPU)."""
        if q_norm is None:
            return Rotation(positions, self.cos_sin_cache)
        return Rotation(positions, self.cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps)


class MLP(nn.Module):
    """`intermediate_size` is the rank's share under tensor parallelism; down_proj sums the ranks' parts."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        ops: Ops,
        tp: TensorParallel,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], ops, method=quant_method)
        self.down_proj = Linear(intermediate_size, hidden_size, ops, method=quant_method)
        self.ops = ops
        self.tp = tp

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output for the input norm(x + residual), and x + residual."""
        gate_up, residual = self.gate_up_proj.after_norm(norm, x, residual)
        return self.tp.all_reduce(self.down_proj.after_silu_and_mul(gate_up)), residual


class VocabParallelEmbedding(nn.Module):
    """The token embedding, its vocabulary rows split over the tensor-parallel ranks: a rank looks up the ids it
    holds, zeros the others, and the ranks' lookups are summed. Every rank holds cdiv(vocab, ranks) rows (the last
    padded with zeros), so the tied LM head's logits gather evenly."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.first_row = vocab_shard(vocab_size, tp)[0]
        self.num_rows = cdiv(vocab_size, tp.size)
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(hidden)
