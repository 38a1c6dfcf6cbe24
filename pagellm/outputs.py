"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM-compatible)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    logprobs: list[PositionLogprobs] | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merged(self, later: CompletionOutput) -> CompletionOutput:
        """This delta followed by a later one of the same sample, as one (new lists: neither is changed)."""
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        text, token_ids = self.text + later.text, self.token_ids + later.token_ids
        return replace(later, text=text, token_ids=token_ids, logprobs=logprobs)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This output of a DELTA request followed by a later one, as one: everything so far when this one is the
        request's first (which carries the prompt's fields). Neither is changed."""
        outputs = [mine.merged(theirs) for mine, theirs in zip(self.outputs, later.outputs, strict=True)]
        return replace(
            later,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            prompt_logprobs=self.prompt_logprobs,
        )
