"""Turn a step's rows into the flat inputs of one forward pass: first as host arrays (`HostBatch`), then as device
tensors (`ModelInput`). CUDA-graph decode steps skip the second form: they copy the host arrays into their own
buffers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.core.step import SamplingRow, SchedulerOutput
from pagellm.model.attention import AttentionMetadata
from pagellm.runner.transfers import to_device_async


@dataclass
class PromptLogprobRows:
    """Rows of the logits that score prompt tokens of one request: row i predicts `targets[i]`,
    the prompt token at position `first_position + 1 + i`."""

    request_id: str
    rows: list[int]
    targets: list[int]
    first_position: int
    top_n: int


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
    sampling_ids: list[str]  # the requests that sample a token this step, in logits row order
    sampling_rows: list[SamplingRow]  # and how (empty on tensor-parallel ranks other than 0, which do not sample)
    constrained: bool = False  # some sampling row has structured outputs: sampling waits for their bitmask
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)
    # Requests of the leading rows whose input token the step in flight is sampling (placeholders in input_ids).
    pending_ids: list[str] = field(default_factory=list)

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


def build_host_batch(step: SchedulerOutput, block_size: int) -> HostBatch:
    # One-token (decode) sequences first: the attention backend runs its decode kernel on that prefix.
    rows = sorted(step.rows, key=lambda r: r.num_tokens != 1)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc, seq_lens = [0], []
    sample_rows: list[int] = []
    sampling_ids: list[str] = []
    sampling_rows: list[SamplingRow] = []
    pending_ids: list[str] = []
    prompt_rows: list[tuple[str, int, int, list[int], int]] = []
    num_decodes = 0
    for row in rows:
        n, start = row.num_tokens, row.start
        offset = query_start_loc[-1]
        if n == 1:  # the common case, kept free of numpy calls: a decode step has hundreds of these
            num_decodes += 1
            if row.token_ids:
                input_ids.append(row.token_ids[0])
            else:  # being sampled by the step in flight: a placeholder the runner fills in on the device
                if len(pending_ids) != num_decodes - 1:
                    raise ValueError("rows whose input token is pending must lead the step")
                pending_ids.append(row.request_id)
                input_ids.append(0)
            positions.append(start)
            slots.append(row.block_ids[start // block_size] * block_size + start % block_size)
        else:
            input_ids += row.token_ids
            pos = np.arange(start, start + n)
            positions += pos.tolist()
            table = np.asarray(row.block_ids, dtype=np.int64)
            slots += (table[pos // block_size] * block_size + pos % block_size).tolist()
        query_start_loc.append(offset + n)
        seq_lens.append(start + n)
        if row.sampling is not None:  # the last position's logits sample
            sample_rows.append(offset + n - 1)
            sampling_ids.append(row.request_id)
            sampling_rows.append(row.sampling)
        if row.prompt_scoring is not None:
            prompt_rows.append((row.request_id, offset, start, row.prompt_scoring.targets, row.prompt_scoring.top_n))
    logits_indices = sample_rows
    prompt_logprob_rows = []
    for request_id, offset, start, targets, top_n in prompt_rows:
        first_row = len(logits_indices)
        logits_indices += range(offset, offset + len(targets))
        prompt_logprob_rows.append(
            PromptLogprobRows(request_id, list(range(first_row, first_row + len(targets))), targets, start, top_n)
        )
    return HostBatch(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        query_start_loc=np.array(query_start_loc, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=_block_tables([r.block_ids for r in rows]),
        logits_indices=np.array(logits_indices, dtype=np.int64),
        num_decodes=num_decodes,
        max_query_len=max(r.num_tokens for r in rows),
        sampling_ids=sampling_ids,
        sampling_rows=sampling_rows,
        constrained=any(row.params.structured_outputs is not None for row in sampling_rows),
        prompt_logprob_rows=prompt_logprob_rows,
        pending_ids=pending_ids,
    )


def split_mixed(batch: HostBatch) -> tuple[HostBatch, HostBatch]:
    """A step of decodes and prefill chunks as two steps, its decodes and its chunks, each a graph can replay
    (their sequences are distinct, so one after the other computes what the step does). Logits rows: the
    decodes' sampling rows, then the chunks'. No prompt-logprob rows (scored steps run eagerly)."""
    if batch.prompt_logprob_rows or not 0 < batch.num_decodes < len(batch.seq_lens):
        raise ValueError("split_mixed takes a step of decodes and prefill chunks, no prompt-logprob rows")
    d = batch.num_decodes  # decode sequence i owns token i
    rows = batch.logits_indices
    decode_rows, chunk_rows = rows[rows < d], rows[rows >= d] - d
    k = len(decode_rows)
    decodes = HostBatch(
        input_ids=batch.input_ids[:d],
        positions=batch.positions[:d],
        slot_mapping=batch.slot_mapping[:d],
        query_start_loc=batch.query_start_loc[: d + 1],
        seq_lens=batch.seq_lens[:d],
        block_tables=batch.block_tables[:d],
        logits_indices=decode_rows,
        num_decodes=d,
        max_query_len=1,
        sampling_ids=batch.sampling_ids[:k],
        sampling_rows=batch.sampling_rows[:k],
        pending_ids=batch.pending_ids,
    )
    chunks = HostBatch(
        input_ids=batch.input_ids[d:],
        positions=batch.positions[d:],
        slot_mapping=batch.slot_mapping[d:],
        query_start_loc=batch.query_start_loc[d:] - d,
        seq_lens=batch.seq_lens[d:],
        block_tables=batch.block_tables[d:],
        logits_indices=chunk_rows,
        num_decodes=0,
        max_query_len=batch.max_query_len,
        sampling_ids=batch.sampling_ids[k:],
        sampling_rows=batch.sampling_rows[k:],
    )
    return decodes, chunks


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
    return ModelInput(
        _to(batch.input_ids, device), _to(batch.positions, device), metadata, _to(batch.logits_indices, device)
    )


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device_async(torch.from_numpy(array), device)
