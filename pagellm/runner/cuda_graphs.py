"""CUDA graphs for pure-decode steps: one graph per batch size of a ladder, captured largest first into one
shared memory pool. A step is padded to the next captured size (padding rows write to slot -1, which the KV-write
kernel skips, and see a one-token context) and the logits are sliced back.

The graphs read their inputs from one device buffer laid out [input_ids | positions | slot_mapping | seq_lens |
block_tables]; a pinned host buffer of the same layout is filled each step and sent in one copy (the fixed-size
head plus the block-table rows in use), instead of one small copy per tensor. Input ids sampled by a step still in
flight are copied in on the device."""

from __future__ import annotations

import gc

import torch

from pagellm.config import cdiv
from pagellm.model.attention import AttentionMetadata, LayerKVCache
from pagellm.model.llama import LlamaForCausalLM
from pagellm.runner.input_batch import HostBatch

_HEAD_DTYPES = (torch.int64, torch.int64, torch.int64, torch.int32)  # input_ids, positions, slot_mapping, seq_lens


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKVCache],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        self.width = cdiv(max_model_len, block_size)
        # Sections start 16-byte aligned: Triton specializes kernels on pointer alignment.
        self._tables_offset = sum(_aligned(max_bs * dtype.itemsize) for dtype in _HEAD_DTYPES)
        # Two pinned host buffers, used in turn: with asynchronous scheduling the next step fills one while the
        # copy out of the other may still be queued behind the step in flight.
        self._host = [
            torch.zeros(self._tables_offset + max_bs * self.width * 4, dtype=torch.uint8, pin_memory=True)
            for _ in range(2)
        ]
        self._host_views = [[t.numpy() for t in self._views(host)] for host in self._host]
        self._copied = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0
        self._device = torch.zeros_like(self._host[0], device=device)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables = self._views(self._device)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """input_ids, positions, slot_mapping, seq_lens and block_tables inside one byte buffer."""
        max_bs = self.sizes[-1]
        views, offset = [], 0
        for dtype in _HEAD_DTYPES:
            views.append(buffer[offset : offset + max_bs * dtype.itemsize].view(dtype))
            offset += _aligned(max_bs * dtype.itemsize)
        views.append(buffer[offset:].view(torch.int32).view(max_bs, self.width))
        return views

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        # max_seq_len = max_model_len: the decode grid covers any context, so one graph serves every step.
        return AttentionMetadata(
            self.slot_mapping[:bs],
            self.block_tables[:bs],
            self.query_start_loc[: bs + 1],
            self.seq_lens[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._metadata(bs), self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        gc.collect()
        gc.freeze()  # no Python GC pauses (or frees) while graphs record
        try:
            pool = None
            for bs in reversed(self.sizes):
                self._forward(bs)  # warm-up: lazy initializations (and any kernel not yet compiled) outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bs] = self._forward(bs)
                pool = graph.pool()
                self.graphs[bs] = graph
        finally:
            gc.unfreeze()

    def can_run(self, batch: HostBatch) -> bool:
        return batch.is_decode_only and batch.num_tokens <= self.max_batch

    def run(self, batch: HostBatch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, V] of a pure-decode step of n sequences; `input_ids` (on the device) replace the batch's."""
        n = batch.num_tokens
        bs = next(s for s in self.sizes if s >= n)
        turn, self._turn = self._turn, 1 - self._turn
        self._copied[turn].synchronize()  # long done: the step that last used this buffer has been collected
        host_ids, host_positions, host_slots, host_seq_lens, host_tables = self._host_views[turn]
        host_ids[:n] = batch.input_ids
        host_positions[:n] = batch.positions
        host_slots[:n] = batch.slot_mapping
        host_slots[n:bs] = -1
        host_seq_lens[:n] = batch.seq_lens
        host_seq_lens[n:bs] = 1
        host_tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
        used = self._tables_offset + bs * self.width * 4
        self._device[:used].copy_(self._host[turn][:used], non_blocking=True)
        self._copied[turn].record()
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
