"""One step's data as plain values: what the scheduler hands the model runner (`SchedulerOutput` of `StepRow`s)
and what comes back (`RunnerOutput`). Only ints, lists, strings, arrays and `SamplingParams`: something one process can
send to another (rank 0 to the other tensor-parallel ranks), and nothing the runner could change in the
scheduler's state. The lists a row holds (block ids, tokens so far) are the request's own, read when the step is
launched and never written by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.core.request import Request
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

# A scored token: (its logprob, its rank, the top-N [(token, logprob)] of its row).
TokenScore = tuple[float, int, list[tuple[int, float]]]


@dataclass
class SamplingRow:
    """How the token a row samples is drawn."""

    params: SamplingParams
    draw_index: int  # which output token of its request this is (keys a seeded request's noise)
    prompt_token_ids: list[int]  # the repetition penalty counts the prompt too
    output_token_ids: list[int]  # generated so far (penalties, min_tokens)


@dataclass
class PromptScoring:
    """Prompt tokens whose logprobs this row's positions give: position start + i predicts targets[i]."""

    top_n: int
    targets: list[int]


@dataclass
class StepRow:
    """One sequence's part of a step: `num_tokens` tokens fed from position `start`."""

    request_id: str
    start: int  # the request's num_computed_tokens before this step
    num_tokens: int
    # Ids of the tokens fed. A decode row whose input token is still being sampled by the step in flight
    # (asynchronous scheduling) has none: the runner takes that token from the device.
    token_ids: list[int]
    block_ids: list[int]
    sampling: SamplingRow | None = None  # set when the logits of the row's last token are sampled this step
    prompt_scoring: PromptScoring | None = None
    request_serial: int = -1  # the `Request.serial` of the request it was made for (none: -1, warm-up rows)

    @property
    def input_pending(self) -> bool:
        return len(self.token_ids) < self.num_tokens


@dataclass
class SchedulerOutput:
    rows: list[StepRow] = field(default_factory=list)  # in scheduling order

    @property
    def total_tokens(self) -> int:
        return sum(row.num_tokens for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @property
    def is_decode_only(self) -> bool:
        return all(row.num_tokens == 1 for row in self.rows)


@dataclass
class GrammarBitmask:
    """The tokens the constrained rows of a step may sample (structured outputs): row i belongs to
    request_ids[i]; bit t % 32 of its int32 word t // 32 is set when token t is allowed."""

    request_ids: list[str]
    bitmask: torch.Tensor  # [len(request_ids), ceil(vocab / 32)] int32, on the host (pinned for a GPU)


@dataclass
class RunnerOutput:
    sampled: dict[str, tuple[int, TokenScore | None]] = field(default_factory=dict)  # request id -> token, score
    # request id -> (position of the first scored prompt token, one score per position from there)
    prompt_logprobs: dict[str, tuple[int, list[TokenScore]]] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one step changed for one request, for the output side: a new token, prompt logprobs, a finish."""

    request_id: str
    new_token_id: int | None = None
    score: TokenScore | None = None
    prompt_scores: tuple[int, list[TokenScore]] | None = None  # (first position, scores)
    finish_reason: str | None = None  # "stop" (a stop token) or "length"
    stop_reason: int | None = None  # the stop_token_ids entry that stopped it (None for EOS)
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


def make_row(request: Request, num_tokens: int) -> StepRow:
    """The row of `request` feeding `num_tokens` tokens from its num_computed_tokens (before they advance)."""
    start = request.num_computed_tokens
    end = start + num_tokens
    if num_tokens == 1:  # the common case, kept cheap: a decode step has hundreds of these
        token_ids = [request.token_at(start)] if start < request.num_tokens else []
    else:
        token_ids = request.token_slice(start, end)
    row = StepRow(request.request_id, start, num_tokens, token_ids, request.block_ids, request_serial=request.serial)
    if end == request.num_tokens + request.num_pending_tokens:  # caught up: the last position's logits sample
        row.sampling = SamplingRow(
            request.sampling_params,
            len(request.output_token_ids) + request.num_pending_tokens,
            request.prompt_token_ids,
            request.output_token_ids,
        )
    num_prompt = request.num_prompt_tokens
    if request.wants_prompt_logprobs and start < num_prompt - 1:
        last = min(end, num_prompt - 1)  # positions start..last-1 predict prompt tokens start+1..last
        row.prompt_scoring = PromptScoring(
            request.sampling_params.prompt_logprobs, request.prompt_token_ids[start + 1 : last + 1]
        )
    return row
