"""Paged attention: flat batch metadata, the per-layer KV cache, and the backends behind one interface.

The model calls `backend.forward(q, k, v, rotation, kv_cache, metadata, scale)`: it applies the layer's rotary
embedding to q and k, writes the new K/V into the paged cache (quantizing to INT8 when the cache is int8) and
attends over everything cached for each sequence. Rotation and write are one kernel on the GPU.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import NamedTuple, Protocol

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
    max_seq_len: int  # host-side bound for kernel grids (max_model_len under CUDA-graph capture)
    num_decodes: int = 0  # the first num_decodes sequences have one query token each

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    plan: reference.AttentionPlan | None = None  # the batch's key slots and mask, shared by every layer


@dataclass
class LayerKVCache:
    key: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value: torch.Tensor  # same shape; slot-minor in memory when int8
    key_scale: torch.Tensor | None = None  # [num_blocks, block_size, Hkv] fp32 (head-major), INT8 caches only
    value_scale: torch.Tensor | None = None


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[LayerKVCache]:
    """Every cache is indexed [block, slot, head, dim], scales [block, slot, head]. An INT8 value cache is stored
    slot-minor ([block, head, dim, slot] in memory, viewed in that order): the attention kernels' probabilities @
    values product then reads values contiguous along tokens, which int8 needs to reach the tensor cores quickly.
    Scales are stored head-major ([block, head, slot]), so that a tile's scales of one head are a few contiguous
    runs, not one 4-byte read per token from a different 32-byte sector."""
    # Zeros, not empty: masked-out garbage could hold NaN, and 0 * NaN poisons the softmax-weighted sum.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for _ in range(num_layers):
        key = _zeros(shape, dtype, device)
        if dtype == torch.int8:
            value = _zeros((num_blocks, num_kv_heads, head_dim, block_size), dtype, device).permute(0, 3, 1, 2)
            scales = tuple(
                _zeros((num_blocks, num_kv_heads, block_size), torch.float32, device).permute(0, 2, 1) for _ in range(2)
            )
        else:
            value, scales = _zeros(shape, dtype, device), (None, None)
        caches.append(LayerKVCache(key, value, *scales))
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in an anonymous memory mapping, whose pages the OS zeroes as they are first touched. A
    cache of gigabytes then costs nothing until used, and the process holds only what serving wrote: writing the
    zeros took 2-3 s of the embedded model's start-up on the 2-core machine (2.1 GB of float32 cache)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


class Rotation(NamedTuple):
    """A layer's rotary embedding, which the backend applies to q and k as it stores k and v: positions [T],
    `cos_sin_cache` [max_pos, D] (cos | sin halves) and, for Qwen3, per-head RMSNorm weights [D] applied first."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """This backend's metadata of a step: the common fields plus its per-step work shared by all layers
        (called once before the forward pass)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: Rotation,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of the step's tokens: q [T, H, D] and k [T, Hkv, D] rotated (q in place or not), the rotated
        k and v stored at the metadata's slots, then each query attends over its sequence's cache."""


class TorchAttentionBackend:
    """Reference backend: runs everywhere, used on CPU and as the test oracle."""

    name = "torch"

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def build_metadata(self, metadata: AttentionMetadata) -> TorchAttentionMetadata:
        plan = reference.plan_attention(
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            self.block_size,
            metadata.max_query_len,
            metadata.max_seq_len,
        )
        return TorchAttentionMetadata(**vars(metadata), plan=plan)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: Rotation,
        cache: LayerKVCache,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if rotation.q_norm is not None:  # Qwen3 normalizes each head before rotating it
            q, _ = reference.rms_norm(q, rotation.q_norm, rotation.eps)
            k, _ = reference.rms_norm(k, rotation.k_norm, rotation.eps)
        q, k = reference.apply_rope(q, k, rotation.positions, rotation.cos_sin_cache)
        reference.write_kv(k, v, cache.key, cache.value, metadata.slot_mapping, cache.key_scale, cache.value_scale)
        return reference.paged_attention(
            q,
            cache.key,
            cache.value,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            metadata.max_query_len,
            metadata.max_seq_len,
            cache.key_scale,
            cache.value_scale,
            plan=metadata.plan,
        )


class TritonAttentionBackend:
    """GPU backend: Triton RoPE with the KV write (with INT8 quantization) in one kernel, split-KV decode for the
    leading one-token sequences, and paged prefill attention for the rest of the batch. Pure-decode steps of a few
    sequences leave the RoPE and the KV write to the decode kernel."""

    name = "triton"

    def __init__(self, max_model_len: int) -> None:
        from pagellm.kernels import decode_attention, kv_write, prefill_attention  # Triton: CUDA only

        self.max_model_len = max_model_len
        self._decode, self._kv_write, self._prefill = decode_attention, kv_write, prefill_attention

    def build_metadata(self, metadata: AttentionMetadata) -> AttentionMetadata:
        return metadata  # the kernels read the common metadata tensors directly

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotation: Rotation,
        cache: LayerKVCache,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        n = metadata.num_decodes
        new_tokens = None
        if n == metadata.seq_lens.numel() and self._decode.rotates_new_tokens(q.shape[-1], n):
            # A pure-decode step: the decode kernel rotates and stores the new tokens itself, one launch fewer.
            new_tokens = self._decode.NewTokens(
                k, v, rotation.positions, metadata.slot_mapping, rotation.cos_sin_cache,
                rotation.q_norm, rotation.k_norm, rotation.eps,
            )  # fmt: skip
        else:
            self._kv_write.rope_and_write_kv(
                q, k, v, rotation.positions, rotation.cos_sin_cache, cache.key, cache.value, metadata.slot_mapping,
                cache.key_scale, cache.value_scale, rotation.q_norm, rotation.k_norm, rotation.eps,
            )  # fmt: skip
        out = torch.empty_like(q)
        scales = (cache.key_scale, cache.value_scale)
        if n:
            # The grid is sized for max_model_len, as in the captured graphs: sized for this step's longest
            # sequence, its split count (a specialized argument) would recompile the kernels mid-serving.
            kv_int8 = cache.key.dtype == torch.int8
            split = self._decode.split_size_for(self.max_model_len, n, kv_int8, cache.key.shape[1])
            self._decode.paged_decode_attention(
                q[:n],
                cache.key,
                cache.value,
                metadata.block_tables[:n],
                metadata.seq_lens[:n],
                scale,
                self.max_model_len,
                split,
                *scales,
                out=out[:n],
                new_tokens=new_tokens,
            )
        if n < metadata.seq_lens.numel():
            self._prefill.paged_prefill_attention(
                q,
                cache.key,
                cache.value,
                metadata.block_tables[n:],
                metadata.query_start_loc[n:],
                metadata.seq_lens[n:],
                scale,
                metadata.max_query_len,
                *scales,
                out=out,
            )
        return out


def get_backend(name: str, block_size: int, max_model_len: int) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(block_size)
    if name == "triton":
        return TritonAttentionBackend(max_model_len)
    raise ValueError(f"attention backend={name!r} is invalid: must be 'torch' or 'triton'")
