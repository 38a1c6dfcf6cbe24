"""Host <-> device copies that never make the host wait for the GPU, so asynchronous scheduling stays
asynchronous. Both go through pinned memory: a copy from pageable memory may wait for the stream (and
`torch.tensor(..., device=cuda)` always does), and `.tolist()` on a device tensor waits for everything queued.
Sampled tokens and logprob scores travel this way: copied behind the step, read once its event has passed."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pagellm.core.step import TokenScore

if TYPE_CHECKING:
    from pagellm.runner.sampler import SampledTokens, ScoreTensors  # which sends its row values through here


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, the copy enqueued on the current stream."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host_async(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, complete once the stream passes this point (record an event)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def scores_to_host_async(scores: ScoreTensors) -> ScoreTensors:
    return replace(
        scores,
        chosen=to_host_async(scores.chosen),
        ranks=to_host_async(scores.ranks),
        top_values=to_host_async(scores.top_values),
        top_ids=to_host_async(scores.top_ids),
    )


def sampled_to_host_async(sampled: SampledTokens) -> SampledTokens:
    scores = None if sampled.scores is None else scores_to_host_async(sampled.scores)
    return replace(sampled, token_ids=to_host_async(sampled.token_ids), scores=scores)


def score_values(scores: ScoreTensors, top_ns: list[int]) -> list[TokenScore]:
    """Host ScoreTensors as Python values: one (logprob, rank, top-N) per row."""
    chosen, ranks = scores.chosen.tolist(), scores.ranks.tolist()
    top_values, top_ids = scores.top_values.tolist(), scores.top_ids.tolist()
    return [(chosen[r], ranks[r], list(zip(top_ids[r][:n], top_values[r][:n]))) for r, n in enumerate(top_ns)]


def sampled_values(sampled: SampledTokens) -> tuple[list[int], list[TokenScore | None]]:
    """Host SampledTokens as Python values: the token ids, and each row's score where it asked for logprobs."""
    want = sampled.want_logprobs
    token_ids = sampled.token_ids.tolist()
    if sampled.scores is None:
        return token_ids, [None] * len(want)
    scores = score_values(sampled.scores, [n or 0 for n in want])
    return token_ids, [None if n is None else score for n, score in zip(want, scores)]
