"""Output processing: sampled tokens to text and `RequestOutput`s. It detokenizes incrementally, applies stop
strings, builds logprobs and gathers a request's n samples; it tells the engine which requests a stop string
ended (a verdict, not a call back into the scheduler)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagellm.core.step import RequestUpdate, TokenScore
from pagellm.engine.input_processor import ProcessedRequest, SampleRequest
from pagellm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(eq=False)
class _Sample:
    """What the output side keeps of one sample."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What DELTA outputs have reported so far.
    sent_tokens: int = 0
    sent_chars: int = 0


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    kind: RequestOutputKind
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    reported: bool = False  # whether an output went out (a DELTA request's prompt fields go with the first only)

    @property
    def final_only(self) -> bool:
        return self.kind == RequestOutputKind.FINAL_ONLY

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}  # request id -> its state, until it finishes
        self._samples: dict[str, tuple[_Request, _Sample]] = {}  # sample id -> its request and itself
        self.generation_tokens_total = 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, processed: ProcessedRequest) -> None:
        first = processed.samples[0].params
        state = _Request(
            processed.request_id,
            processed.prompt,
            processed.prompt_token_ids,
            [self._new_sample(processed, s) for s in processed.samples],
            RequestMetrics(arrival_time=processed.arrival_time),
            kind=first.output_kind,
            prompt_logprobs=None if first.prompt_logprobs is None else [None],
        )
        self._requests[state.request_id] = state
        for sample in state.samples:
            self._samples[sample.request_id] = (state, sample)

    def _new_sample(self, processed: ProcessedRequest, sample: SampleRequest) -> _Sample:
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, processed.prompt_token_ids, sample.params.skip_special_tokens
            )
        return _Sample(
            sample.request_id,
            sample.index,
            sample.params,
            detokenizer,
            logprobs=None if sample.params.logprobs is None else [],
        )

    def abort(self, request_id: str) -> tuple[list[str], RequestOutput | None]:
        """Forget a request: the ids of its samples still running (for the scheduler to stop), and its final
        output. Unknown or finished ids give ([], None)."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return [], None
        running = []
        for sample in state.samples:
            del self._samples[sample.request_id]
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
                running.append(sample.request_id)
        return running, self._output(state)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's updates. Returns an output for every request that got a new token or finished (only
        finished ones for FINAL_ONLY requests), and the ids of the samples a stop string ended."""
        touched: dict[str, _Request] = {}
        stopped: list[str] = []
        for update in updates:
            state, sample = self._samples[update.request_id]
            if sample.index == 0:
                state.metrics.first_scheduled_time = update.first_scheduled_time
                state.metrics.num_cached_tokens = state.num_cached_tokens = update.num_cached_tokens
                if update.prompt_scores is not None and state.prompt_logprobs is not None:
                    self._add_prompt_logprobs(state, *update.prompt_scores)
            if update.new_token_id is None:
                continue
            if self._append_token(state, sample, update):
                stopped.append(sample.request_id)
            if sample.finish_reason is not None or not state.final_only:
                touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            finished = state.finished
            if finished or not state.final_only:
                outputs.append(self._output(state))
            if finished:
                del self._requests[state.request_id]
                for sample in state.samples:
                    del self._samples[sample.request_id]
        return outputs, stopped

    def _append_token(self, state: _Request, sample: _Sample, update: RequestUpdate) -> bool:
        """Add a sampled token; True when a stop string ends the sample here."""
        token = update.new_token_id
        now = time.time()
        metrics = state.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        sample.token_ids.append(token)
        self.generation_tokens_total += 1
        if update.score is not None and sample.logprobs is not None:
            sample.logprobs.append(self._position_logprobs(token, update.score))
            sample.cumulative_logprob += update.score[0]
        stopped_by_string = False
        if update.finish_reason == "stop":  # a stop token: not part of the text
            self._finish(state, sample, "stop", update.stop_reason)
        elif sample.detokenizer is not None:
            piece = sample.detokenizer.step(token)
            sample.text = sample.detokenizer.text
            params = sample.params
            if params.stop and len(sample.token_ids) >= params.min_tokens:
                stop = _truncate_at_stop_string(sample, len(piece))
                if stop is not None:
                    self._finish(state, sample, "stop", stop)
                    stopped_by_string = True
        if update.finish_reason == "length" and sample.finish_reason is None:
            self._finish(state, sample, "length", None)
        return stopped_by_string

    @staticmethod
    def _finish(state: _Request, sample: _Sample, reason: str, stop_reason: int | str | None) -> None:
        sample.finish_reason, sample.stop_reason = reason, stop_reason
        if state.finished:
            state.metrics.finished_time = time.time()

    def _add_prompt_logprobs(self, state: _Request, first_position: int, scores: list[TokenScore]) -> None:
        targets = state.prompt_token_ids
        for position, score in enumerate(scores, start=first_position):
            if position == len(state.prompt_logprobs):  # recomputation after preemption repeats positions
                state.prompt_logprobs.append(self._position_logprobs(targets[position], score))

    def _position_logprobs(self, token: int, score: TokenScore) -> PositionLogprobs:
        logprob, rank, top = score
        entries = {tid: Logprob(lp, i + 1, self._decode_one(tid)) for i, (tid, lp) in enumerate(top)}
        entries.setdefault(token, Logprob(logprob, rank, self._decode_one(token)))
        return entries

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    @staticmethod
    def _output(state: _Request) -> RequestOutput:
        delta = state.kind == RequestOutputKind.DELTA
        with_prompt = not (delta and state.reported)
        state.reported = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt if with_prompt else None,
            prompt_token_ids=state.prompt_token_ids if with_prompt else [],
            outputs=[_delta(s) if delta else _completion(s) for s in state.samples],
            finished=state.finished,
            metrics=state.metrics,
            prompt_logprobs=state.prompt_logprobs if with_prompt else None,
            num_cached_tokens=state.num_cached_tokens,
        )


def _completion(sample: _Sample) -> CompletionOutput:
    return CompletionOutput(
        index=sample.index,
        text=_visible_text(sample),
        token_ids=list(sample.token_ids),
        finish_reason=sample.finish_reason,
        # Copies: the engine thread goes on appending to its lists while a consumer reads this output.
        logprobs=None if sample.logprobs is None else list(sample.logprobs),
        stop_reason=sample.stop_reason,
        cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
    )


def _delta(sample: _Sample) -> CompletionOutput:
    """What is new in a sample since its last output. Its text only grows: the visible text holds back any tail
    that could begin a stop string, so a stop string found later cuts only text not yet sent."""
    text, sent_tokens = _visible_text(sample), sample.sent_tokens
    output = CompletionOutput(
        index=sample.index,
        text=text[sample.sent_chars :],
        token_ids=sample.token_ids[sent_tokens:],
        finish_reason=sample.finish_reason,
        logprobs=None if sample.logprobs is None else sample.logprobs[sent_tokens:],
        stop_reason=sample.stop_reason,
        cumulative_logprob=sample.cumulative_logprob if sample.logprobs is not None else None,
    )
    sample.sent_tokens, sample.sent_chars = len(sample.token_ids), len(text)
    return output


def _visible_text(sample: _Sample) -> str:
    """The text so far, less a tail that may yet grow into a stop string while the sample runs."""
    text = sample.text
    if sample.finish_reason is None and sample.params.stop:
        text = text[: len(text) - _stop_prefix_len(text, sample.params.stop)]
    return text


def _truncate_at_stop_string(sample: _Sample, new_chars: int) -> str | None:
    """The stop string that the newly added text completes, if any; the text is cut there."""
    text = sample.text
    params = sample.params
    for stop in params.stop:
        # Only a stop string overlapping the newly added text can be new.
        idx = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if idx != -1:
            sample.text = text[: idx + len(stop) if params.include_stop_str_in_output else idx]
            return stop
    return None


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string: streamed text holds it
    back, so a stop string is never shown in part."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
