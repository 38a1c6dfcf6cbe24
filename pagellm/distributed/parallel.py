"""Tensor parallelism (Megatron layout) over torch.distributed: a rank's group and collectives, and which slice of
each checkpoint tensor the rank holds.

Column-parallel: q/k/v and gate/up split their output rows (KV heads split when there are at least as many as
ranks, else each rank holds the one its query heads use); row-parallel: o_proj and down_proj split their input
columns and all-reduce their outputs; vocab-parallel: the embedding and the LM head split the vocabulary rows (the
embedding all-reduces its lookups, the LM head all-gathers its logits). Norms are replicated. Rank 0 samples and
broadcasts the tokens. With one rank everything here is the identity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagellm.config import ModelConfig, cdiv


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # the device collectives (NCCL on CUDA, gloo on the CPU)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, in place, on every rank."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along its last dimension (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """The model must split evenly over `size` ranks: a clear error naming both numbers otherwise."""
    for what, count in (
        ("attention heads", config.num_heads),
        ("intermediate size", config.intermediate_size),
    ):
        if count % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {what} ({count})")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's {kv} KV heads: one must divide the other")


def shard_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The rank's share of the model: its heads, KV heads and MLP width (the vocabulary split is the embedding's
    own, `vocab_shard`)."""
    if tp.size == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp.size,
        num_kv_heads=max(1, config.num_kv_heads // tp.size),
        intermediate_size=config.intermediate_size // tp.size,
    )


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of the vocabulary this rank holds; the last shard may be short."""
    per_rank = cdiv(vocab_size, tp.size)
    start = min(per_rank * tp.rank, vocab_size)
    return start, min(per_rank, vocab_size - start)


def kv_head_shard(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first head, heads) of K and V this rank holds: its own slice, or the one head its query heads share."""
    if num_kv_heads >= tp.size:
        per_rank = num_kv_heads // tp.size
        return tp.rank * per_rank, per_rank
    return tp.rank * num_kv_heads // tp.size, 1


# The tensors of a row-parallel layer split along their input columns: its weight, or a quantized weight's stored
# integers and group scales (kernels/quant_matmul.py); per-row tensors (FP8 scales, biases) are whole on each rank.
ROW_PARALLEL_TENSORS = ("weight", "qweight", "scales", "offsets")


def checkpoint_slice(
    name: str, shape: list[int], config: ModelConfig, tp: TensorParallel
) -> tuple[int, int, int] | None:
    """The (dim, start, size) of checkpoint tensor `name` (HF naming, shape `shape`) that this rank reads, or None
    when it reads all of it (replicated, or one rank)."""
    if tp.size == 1:
        return None
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    head_dim = config.head_dim
    if module == "q_proj":
        per_rank = config.num_heads // tp.size * head_dim
        return 0, tp.rank * per_rank, per_rank
    if module in ("k_proj", "v_proj"):
        first, heads = kv_head_shard(config.num_kv_heads, tp)
        return 0, first * head_dim, heads * head_dim
    if module in ("gate_proj", "up_proj"):
        per_rank = config.intermediate_size // tp.size
        return 0, tp.rank * per_rank, per_rank
    if module in ("o_proj", "down_proj") and parts[-1] in ROW_PARALLEL_TENSORS:
        per_rank = shape[1] // tp.size
        return 1, tp.rank * per_rank, per_rank
    if module in ("embed_tokens", "lm_head"):
        start, size = vocab_shard(config.vocab_size, tp)
        return 0, start, size
    return None
