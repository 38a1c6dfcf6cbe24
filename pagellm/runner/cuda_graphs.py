"""CUDA graphs for pure-decode steps: one graph per batch size of a ladder, captured largest first into one
shared memory pool. A step is padded to the next captured size (padding rows write to slot -1, which the KV-write
kernel skips, and see a one-token context) and the logits are sliced back."""

from __future__ import annotations

import gc

import torch

from pagellm.config import cdiv
from pagellm.model.attention import AttentionMetadata, LayerKVCache
from pagellm.model.llama import LlamaForCausalLM
from pagellm.runner.input_batch import ModelInput


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[LayerKVCache], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, cdiv(max_model_len, block_size), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        # max_seq_len = max_model_len: the decode grid covers any context, so one graph serves every step.
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.query_start_loc[:bs + 1],
                                 self.seq_lens[:bs], max_query_len=1, max_seq_len=self.max_model_len,
                                 num_decodes=bs)

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
                self._forward(bs)  # warm-up: Triton compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[bs] = self._forward(bs)
                pool = graph.pool()
                self.graphs[bs] = graph
        finally:
            gc.unfreeze()

    def can_run(self, inputs: ModelInput) -> bool:
        return inputs.metadata.is_decode_only and inputs.input_ids.numel() <= self.max_batch

    def run(self, inputs: ModelInput) -> torch.Tensor:
        """Logits [n, V] of a pure-decode step of n sequences."""
        n = inputs.input_ids.numel()
        bs = next(s for s in self.sizes if s >= n)
        md = inputs.metadata
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.block_tables[:n, :md.block_tables.shape[1]].copy_(md.block_tables)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
