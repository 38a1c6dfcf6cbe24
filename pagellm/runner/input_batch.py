"""Turn a SchedulerOutput into the flat tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.engine.request import Request
from pagellm.engine.scheduler import SchedulerOutput
from pagellm.model.attention import AttentionMetadata


@dataclass
class PromptLogprobRows:
    """Rows of the logits that score prompt tokens of one request: row i predicts `targets[i]`,
    the prompt token at position `first_position + 1 + i`."""

    request: Request
    rows: list[int]
    targets: list[int]
    first_position: int


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # hidden rows that need logits: sampling rows first, then prompt-logprob rows
    sampling_requests: list[Request]  # the requests that sample a token this step, in logits row order
    prompt_logprob_rows: list[PromptLogprobRows] = field(default_factory=list)


def build_model_input(sched: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
    # One-token (decode) sequences first: the attention backend runs its decode kernel on that prefix.
    requests = sorted(sched.requests, key=lambda r: sched.num_scheduled_tokens[r.request_id] != 1)
    num_decodes = sum(1 for r in requests if sched.num_scheduled_tokens[r.request_id] == 1)
    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    query_start_loc, seq_lens = [0], []
    sample_rows: list[int] = []
    sampling_requests: list[Request] = []
    prompt_rows: list[tuple[Request, list[int], int, int]] = []
    for request in requests:
        num_new = sched.num_scheduled_tokens[request.request_id]
        start = request.num_computed_tokens
        end = start + num_new
        token_offset = query_start_loc[-1]
        input_ids += request.all_token_ids[start:end]
        pos = np.arange(start, end)
        positions.append(pos)
        table = np.asarray(request.block_ids, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(token_offset + num_new)
        seq_lens.append(end)
        if end == request.num_tokens:  # caught up with every known token: the last one's logits sample
            sample_rows.append(token_offset + num_new - 1)
            sampling_requests.append(request)
        if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
            last = min(end, request.num_prompt_tokens - 1)  # positions start..last-1 predict prompt tokens
            prompt_rows.append((request, list(range(token_offset, token_offset + last - start)), start, last))
    logits_indices = list(sample_rows)
    prompt_logprob_rows = []
    for request, rows, start, last in prompt_rows:
        first_row = len(logits_indices)
        logits_indices += rows
        prompt_logprob_rows.append(PromptLogprobRows(
            request, list(range(first_row, first_row + len(rows))),
            request.prompt_token_ids[start + 1:last + 1], start))
    max_blocks = max(len(r.block_ids) for r in requests)
    block_tables = np.zeros((len(requests), max_blocks), dtype=np.int32)
    for i, request in enumerate(requests):
        block_tables[i, :len(request.block_ids)] = request.block_ids
    query_lens = np.diff(query_start_loc)
    metadata = AttentionMetadata(
        slot_mapping=_to(np.concatenate(slots), torch.int64, device),
        block_tables=_to(block_tables, torch.int32, device),
        query_start_loc=_to(np.asarray(query_start_loc), torch.int32, device),
        seq_lens=_to(np.asarray(seq_lens), torch.int32, device),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
    )
    return ModelInput(
        input_ids=_to(np.asarray(input_ids), torch.int64, device),
        positions=_to(np.concatenate(positions), torch.int64, device),
        metadata=metadata,
        logits_indices=_to(np.asarray(logits_indices, dtype=np.int64), torch.int64, device),
        sampling_requests=sampling_requests,
        prompt_logprob_rows=prompt_logprob_rows,
    )


def _to(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return tensor.to(device, non_blocking=True) if device.type != "cpu" else tensor
