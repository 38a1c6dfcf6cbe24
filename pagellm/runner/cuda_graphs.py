"""CUDA graphs for decode steps and for short prefill steps, captured largest first into one shared memory pool.

Decode graphs: one per batch size of a ladder. A step is padded to the next captured size (padding rows write to
slot -1, which the KV-write kernel skips, and see a one-token context) and the logits are sliced back.

Prefill graphs: one per token count of a ladder up to 512, for steps of prefill chunks only (no decodes, no
prompt logprobs) of at most PREFILL_GRAPH_SEQS sequences. An eager step of a short prompt spends ten times its
GPU time launching some 300 kernels; replayed, it is one launch. The prefill kernel's grid covers
PREFILL_GRAPH_SEQS sequences of the graph's token count; the sequences a step lacks own no tokens (their query
range is empty), so their programs return at once, and padding tokens belong to no sequence.

Mixed steps (decodes beside prefill chunks, as nearly every step is when requests keep arriving) replay two
graphs, a decode graph for the decodes and a prefill graph for the chunks (`split_mixed`), where both fit: the
weights are read twice, which costs less than the eager step's launches for models of a few billion parameters.

The graphs read their inputs from one device buffer laid out [input_ids | positions | slot_mapping | seq_lens |
query_start_loc | logits_indices | block_tables]; a pinned host buffer of the same layout is filled each step and
sent in one copy (the fixed-size head plus the block-table rows in use), instead of one small copy per tensor.
Input ids sampled by a step still in flight are copied in on the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.config import cdiv
from pagellm.model.attention import AttentionMetadata, LayerKVCache
from pagellm.model.llama import LlamaForCausalLM
from pagellm.runner.heap import freeze_start_up_heap
from pagellm.runner.input_batch import HostBatch, split_mixed

PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)
PREFILL_GRAPH_SEQS = 4


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The decode graphs' batch sizes."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def prefill_capture_sizes(token_budget: int) -> list[int]:
    """The prefill graphs' token counts: those of the ladder that a step may schedule."""
    return [t for t in PREFILL_GRAPH_TOKENS if t <= token_budget]


@dataclass(frozen=True)
class GraphShape:
    num_tokens: int
    num_seqs: int
    decode: bool  # every sequence has one token (and samples it, in order)


def graph_shape(batch: HostBatch, decode_sizes: list[int], prefill_sizes: list[int]) -> GraphShape | None:
    """The captured graph a step replays, or None when it runs eagerly (or as two graphs: `split_shapes`)."""
    n = batch.num_tokens
    if batch.is_decode_only:
        bs = next((s for s in decode_sizes if s >= n), None)
        return GraphShape(bs, bs, True) if bs is not None else None
    if batch.num_decodes or batch.prompt_logprob_rows or len(batch.seq_lens) > PREFILL_GRAPH_SEQS:
        return None
    t = next((t for t in prefill_sizes if t >= n), None)
    return GraphShape(t, PREFILL_GRAPH_SEQS, False) if t is not None else None


def split_shapes(
    batch: HostBatch, decode_sizes: list[int], prefill_sizes: list[int]
) -> tuple[GraphShape, GraphShape] | None:
    """The decode and prefill graphs a mixed step replays one after the other, or None."""
    d = batch.num_decodes
    if batch.is_decode_only or not d or batch.prompt_logprob_rows or len(batch.seq_lens) - d > PREFILL_GRAPH_SEQS:
        return None
    bs = next((s for s in decode_sizes if s >= d), None)
    t = next((t for t in prefill_sizes if t >= batch.num_tokens - d), None)
    if bs is None or t is None:
        return None
    return GraphShape(bs, bs, True), GraphShape(t, PREFILL_GRAPH_SEQS, False)


class StepGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKVCache],
        max_num_seqs: int,
        token_budget: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.decode_sizes = capture_sizes(max_num_seqs)
        self.prefill_sizes = prefill_capture_sizes(token_budget)
        shapes = [GraphShape(bs, bs, True) for bs in self.decode_sizes]
        shapes += [GraphShape(t, PREFILL_GRAPH_SEQS, False) for t in self.prefill_sizes]
        self.shapes = sorted(shapes, key=lambda s: (-s.num_tokens, -s.num_seqs))
        tokens = max(s.num_tokens for s in shapes)
        self.max_seqs = seqs = max(s.num_seqs for s in shapes)
        self.width = cdiv(max_model_len, block_size)
        # (dtype, entries) per section; each starts 16-byte aligned: Triton specializes kernels on pointer alignment.
        self._layout = [
            (torch.int64, tokens),  # input_ids
            (torch.int64, tokens),  # positions
            (torch.int64, tokens),  # slot_mapping
            (torch.int32, seqs),  # seq_lens
            (torch.int32, seqs + 1),  # query_start_loc (prefill graphs)
            (torch.int64, seqs),  # logits_indices (prefill graphs)
        ]
        self._tables_offset = sum(_aligned(n * dtype.itemsize) for dtype, n in self._layout)
        # Two pinned host buffers, used in turn: with asynchronous scheduling the next step fills one while the
        # copy out of the other may still be queued behind the step in flight.
        # A mixed step uses a second pair, for its chunks.
        self._host = [
            torch.zeros(self._tables_offset + seqs * self.width * 4, dtype=torch.uint8, pin_memory=True)
            for _ in range(4)
        ]
        self._host_views = [[t.numpy() for t in self._views(host)] for host in self._host]
        self._copied = [torch.cuda.Event() for _ in range(4)]
        self._turn = 0
        self._device = torch.zeros_like(self._host[0], device=device)
        (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.seq_lens,
            self.query_start_loc,
            self.logits_indices,
            self.block_tables,
        ) = self._views(self._device)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.decode_query_start_loc = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphShape, torch.Tensor] = {}

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The layout's sections and then the block tables, inside one byte buffer."""
        views, offset = [], 0
        for dtype, n in self._layout:
            views.append(buffer[offset : offset + n * dtype.itemsize].view(dtype))
            offset += _aligned(n * dtype.itemsize)
        views.append(buffer[offset:].view(torch.int32).view(self.max_seqs, self.width))
        return views

    @property
    def max_batch(self) -> int:
        return self.decode_sizes[-1]

    def _metadata(self, shape: GraphShape) -> AttentionMetadata:
        # max_seq_len = max_model_len: the decode grid covers any context, so one graph serves every step. The
        # prefill kernel's grid covers shape.num_tokens query tokens in each sequence.
        t, s = shape.num_tokens, shape.num_seqs
        query_start_loc = self.decode_query_start_loc if shape.decode else self.query_start_loc
        return AttentionMetadata(
            self.slot_mapping[:t],
            self.block_tables[:s],
            query_start_loc[: s + 1],
            self.seq_lens[:s],
            max_query_len=1 if shape.decode else t,
            max_seq_len=self.max_model_len,
            num_decodes=s if shape.decode else 0,
        )

    def _forward(self, shape: GraphShape) -> torch.Tensor:
        t = shape.num_tokens
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._metadata(shape), self.kv_caches)
        if not shape.decode:
            hidden = hidden[self.logits_indices[: shape.num_seqs]]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        # No Python GC pauses (or frees) over the start-up heap while graphs record; it stays frozen, so the engine's
        # own freeze when start-up ends collects only what was made since.
        freeze_start_up_heap()
        pool = None
        for shape in self.shapes:
            self._forward(shape)  # warm-up: lazy initializations (and any kernel not yet compiled) outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[shape] = self._forward(shape)
            pool = graph.pool()
            self.graphs[shape] = graph

    def can_run(self, batch: HostBatch) -> bool:
        return (
            graph_shape(batch, self.decode_sizes, self.prefill_sizes) is not None
            or split_shapes(batch, self.decode_sizes, self.prefill_sizes) is not None
        )

    def run(self, batch: HostBatch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the batch's logits rows (every row of a decode step, in order); `input_ids` (on the device)
        replace the batch's leading ones."""
        turn, self._turn = self._turn, 1 - self._turn
        shape = graph_shape(batch, self.decode_sizes, self.prefill_sizes)
        if shape is not None:
            return self._replay(batch, shape, turn, input_ids)
        decode_shape, chunk_shape = split_shapes(batch, self.decode_sizes, self.prefill_sizes)
        decodes, chunks = split_mixed(batch)
        # A copy: the chunks' replay reuses the pool's memory, the decode graph's logits included. The decode
        # graph's rows are the decodes in order, and those that sample lead (a one-token chunk that does not
        # sample is the step's last row).
        decode_logits = self._replay(decodes, decode_shape, turn, input_ids)[: len(decodes.logits_indices)].clone()
        return torch.cat([decode_logits, self._replay(chunks, chunk_shape, 2 + turn, None)])

    def _replay(self, batch: HostBatch, shape: GraphShape, buffer: int, input_ids: torch.Tensor | None) -> torch.Tensor:
        """Fill host buffer `buffer` with the batch, copy it to the device and replay the shape's graph."""
        n, t, s, b = batch.num_tokens, shape.num_tokens, shape.num_seqs, len(batch.seq_lens)
        self._copied[buffer].synchronize()  # long done: the step that last used this buffer has been collected
        host_ids, host_positions, host_slots, host_seq_lens, host_starts, host_rows, host_tables = self._host_views[
            buffer
        ]
        host_ids[:n] = batch.input_ids
        host_positions[:n] = batch.positions
        host_slots[:n] = batch.slot_mapping
        host_slots[n:t] = -1
        host_seq_lens[:b] = batch.seq_lens
        host_seq_lens[b:s] = 1
        host_tables[:b, : batch.block_tables.shape[1]] = batch.block_tables
        rows = n
        if not shape.decode:
            host_starts[: b + 1] = batch.query_start_loc
            host_starts[b + 1 : s + 1] = n  # absent sequences own no tokens
            rows = len(batch.logits_indices)
            host_rows[:rows] = batch.logits_indices
            host_rows[rows:s] = 0
        used = self._tables_offset + s * self.width * 4
        self._device[:used].copy_(self._host[buffer][:used], non_blocking=True)
        self._copied[buffer].record()
        if input_ids is not None:
            self.input_ids[: input_ids.shape[0]].copy_(input_ids)
        self.graphs[shape].replay()
        return self.logits[shape][:rows]
