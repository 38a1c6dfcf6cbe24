"""Request: the scheduler's state of one sequence (its tokens, blocks and progress). The output side (text,
logprobs, metrics) lives in `engine/output_processor.py`; nothing else keeps per-request state."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pagellm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: sampling_params.max_tokens or what fits in max_model_len
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # advanced by the scheduler when it schedules, not when the step returns
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    block_ids: list[int] = field(default_factory=list)
    # Hash of each full block of this request's tokens, in order (filled as blocks fill up).
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading full blocks already offered to the prefix cache
    num_pending_tokens: int = 0  # sampled by a step still in flight, not yet in output_token_ids
    first_scheduled_time: float | None = None
    # Unique to this object: tells its step rows from those of an earlier request of the same id (aborted, its
    # step still in flight, the id reused).
    serial: int = field(default_factory=itertools.count().__next__, init=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        prompt_len = len(self.prompt_token_ids)
        if position < prompt_len:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - prompt_len]

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end], without concatenating the whole sequence."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None

    @property
    def needs_host_tokens(self) -> bool:
        """Whether sampling this request's next token needs its previous one on the host (penalties count the
        tokens so far, a bad word of several tokens checks the last ones; min_tokens masks stop tokens until enough
        are out)."""
        params = self.sampling_params
        return params.needs_output_history or len(self.output_token_ids) + self.num_pending_tokens < params.min_tokens
