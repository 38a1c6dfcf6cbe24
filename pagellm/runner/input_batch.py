"""Turn a SchedulerOutput into the flat inputs of one forward pass: first as host arrays (`HostBatch`), then as
device tensors (`ModelInput`). CUDA-graph decode steps skip the second form: they copy the host arrays into their
own buffers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.engine.request import Request
from pagellm.engine.scheduler import SchedulerOutput
from pagellm.model.attention import AttentionMetadata
from pagellm.runner.transfers import to_device_async


@dataclass
class PromptLogprobRows:
    """Rows of the logits that score prompt tokens of one request: row i predicts `targets[i]`,
    the prompt token at position `first_position + 1 + i`."""

    request: Request
    rows: list[int]
    targets: list[int]
    first_position: int


@dataclass
class HostBatch:
    """One step's inputs on the host. B sequences (one-token decodes first), T tokens."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32
    logits_indices: np.ndarray  # rows that need logits: sampling rows first, then prompt-logprob rows
    num_decodes: int
    max_query_len: int
    sampling_requests: list[Request]  # the requests that sample a token this step, in logits row order
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


def build_host_batch(sched: SchedulerOutput, block_size: int) -> HostBatch:
    # One-token (decode) sequences first: the attention backend runs its decode kernel on that prefix.
    num_new = sched.num_scheduled_tokens
    requests = sorted(sched.requests, key=lambda r: num_new[r.request_id] != 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc, seq_lens = [0], []
    sample_rows: list[int] = []
    sampling_requests: list[Request] = []
    prompt_rows: list[tuple[Request, list[int], int, int]] = []
    num_decodes = 0
    for request in requests:
        n = num_new[request.request_id]
        start = request.num_computed_tokens
        end = start + n
        offset = query_start_loc[-1]
        if n == 1:  # the common case, kept free of numpy calls: a decode step has hundreds of these
            num_decodes += 1
            # A token still being sampled by the step in flight gets a placeholder; the runner fills it in.
            input_ids.append(request.token_at(start) if start < request.num_tokens else 0)
            positions.append(start)
            slots.append(request.block_ids[start // block_size] * block_size + start % block_size)
        else:
            input_ids += request.token_slice(start, end)
            pos = np.arange(start, end)
            positions += pos.tolist()
            table = np.asarray(request.block_ids, dtype=np.int64)
            slots += (table[pos // block_size] * block_size + pos % block_size).tolist()
        query_start_loc.append(offset + n)
        seq_lens.append(end)
        if end == request.num_tokens + request.num_pending_tokens:  # caught up: the last row's logits sample
            sample_rows.append(offset + n - 1)
            sampling_requests.append(request)
        if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
            last = min(end, request.num_prompt_tokens - 1)  # positions start..last-1 predict prompt tokens
            prompt_rows.append((request, list(range(offset, offset + last - start)), start, last))
    logits_indices = sample_rows
    prompt_logprob_rows = []
    for request, rows, start, last in prompt_rows:
        first_row = len(logits_indices)
        logits_indices += rows
        prompt_logprob_rows.append(PromptLogprobRows(
            request, list(range(first_row, first_row + len(rows))),
            request.prompt_token_ids[start + 1:last + 1], start))
    return HostBatch(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        query_start_loc=np.array(query_start_loc, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=_block_tables([r.block_ids for r in requests]),
        logits_indices=np.array(logits_indices, dtype=np.int64),
        num_decodes=num_decodes,
        max_query_len=max(num_new.values()),
        sampling_requests=sampling_requests,
        prompt_logprob_rows=prompt_logprob_rows,
    )


def _block_tables(block_ids: list[list[int]]) -> np.ndarray:
    """Rows padded with zeros, filled in one vectorized assignment (row by row costs microseconds per row)."""
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int32, count=int(lens.sum()))
    tables = np.zeros((len(block_ids), int(lens.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = flat
    return tables


def to_device(batch: HostBatch, device: torch.device) -> ModelInput:
    metadata = AttentionMetadata(
        slot_mapping=_to(batch.slot_mapping, device),
        block_tables=_to(batch.block_tables, device),
        query_start_loc=_to(batch.query_start_loc, device),
        seq_lens=_to(batch.seq_lens, device),
        max_query_len=batch.max_query_len,
        max_seq_len=int(batch.seq_lens.max()),
        num_decodes=batch.num_decodes,
    )
    return ModelInput(_to(batch.input_ids, device), _to(batch.positions, device), metadata,
                      _to(batch.logits_indices, device))


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device_async(torch.from_numpy(array), device)
