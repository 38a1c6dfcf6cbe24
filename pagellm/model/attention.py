"""Paged attention: flat batch metadata, the per-layer KV cache, and the backends behind one interface.

The model calls `backend.forward(q, k, v, kv_cache, metadata)`: it writes the new K/V into the paged cache
(quantizing to INT8 when the cache is int8) and attends over everything cached for each sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagellm.kernels import reference


@dataclass
class AttentionMetadata:
    """Where every token of the flat batch goes and what it may see. B sequences, T tokens."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, -1 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b owns tokens query_start_loc[b]:[b+1]
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens after this step
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class LayerKVCache:
    key: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value: torch.Tensor
    key_scale: torch.Tensor | None = None  # [num_blocks, block_size, Hkv] fp32, INT8 caches only
    value_scale: torch.Tensor | None = None


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device) -> list[LayerKVCache]:
    # Zeros, not empty: masked-out garbage could hold NaN, and 0 * NaN poisons the softmax-weighted sum.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for _ in range(num_layers):
        scales = ((torch.zeros(shape[:3], dtype=torch.float32, device=device),
                   torch.zeros(shape[:3], dtype=torch.float32, device=device))
                  if dtype == torch.int8 else (None, None))
        caches.append(LayerKVCache(torch.zeros(shape, dtype=dtype, device=device),
                                   torch.zeros(shape, dtype=dtype, device=device), *scales))
    return caches


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor: ...


class TorchAttentionBackend:
    """Reference backend: runs everywhere, used on CPU and as the test oracle."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.write_kv(k, v, cache.key, cache.value, metadata.slot_mapping, cache.key_scale, cache.value_scale)
        return reference.paged_attention(q, cache.key, cache.value, metadata.block_tables, metadata.query_start_loc,
                                         metadata.seq_lens, scale, metadata.max_query_len, metadata.max_seq_len,
                                         cache.key_scale, cache.value_scale)


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"attention backend={name!r} is invalid: must be 'torch'")
