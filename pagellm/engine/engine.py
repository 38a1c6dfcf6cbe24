"""Engine: requests in, RequestOutputs out. One `step()` schedules, runs the model, applies sampled tokens,
detokenizes, checks stop conditions and frees finished requests' blocks."""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass

from pagellm.config import EngineConfig, ModelConfig
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request, RequestStatus
from pagellm.engine.scheduler import Scheduler, SchedulerOutput
from pagellm.errors import InvalidParameter
from pagellm.model.loader import load_config_dict, resolve_model_dir
from pagellm.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from pagellm.runner.model_runner import LaunchedStep, ModelRunner, RunnerOutput
from pagellm.runner.sampler import TokenScore
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    generation_tokens_total: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model_dir(config.model, quiet=config.quiet)
        self.model_config = ModelConfig.from_dict(load_config_dict(self.model_dir))
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        max_model_len = self._max_model_len_wanted()
        # Seconds spent in each start-up phase, logged and kept for benchmarks.
        self.startup_seconds: dict[str, float] = {}
        start = time.perf_counter()
        self.runner = ModelRunner(self.model_config, config, self.model_dir, max_model_len)
        self.startup_seconds["load_model"] = time.perf_counter() - start
        start = time.perf_counter()
        self.runner.compile_kernels()  # started before the weights loaded: this is what their loading did not hide
        self.startup_seconds["compile_kernels"] = time.perf_counter() - start
        start = time.perf_counter()
        num_blocks = self.runner.determine_num_blocks(max_model_len)
        self.startup_seconds["profile_memory"] = time.perf_counter() - start
        capacity = num_blocks * config.block_size
        if max_model_len > capacity:
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len={config.max_model_len} is invalid: the KV cache holds only "
                                 f"{capacity} tokens ({num_blocks} blocks of {config.block_size})")
            max_model_len = capacity
        self.max_model_len = max_model_len
        start = time.perf_counter()
        self.runner.allocate_kv_cache(num_blocks)
        self.startup_seconds["kv_cache_and_cuda_graphs"] = time.perf_counter() - start
        if not config.quiet:
            logger.info("KV cache: %d blocks of %d tokens; start-up %s", num_blocks, config.block_size,
                        ", ".join(f"{name} {secs:.1f} s" for name, secs in self.startup_seconds.items()))
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, config.token_budget)
        self.eos_token_ids = self._eos_token_ids()
        self._groups: dict[str, list[Request]] = {}  # request id -> its n samples
        self._ids = itertools.count()
        self._generation_tokens_total = 0
        self._in_flight: _InFlight | None = None  # the launched step whose tokens have not come back yet

    def _max_model_len_wanted(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:  # full attention equals windowed attention up to the window
            limit = min(limit, self.model_config.sliding_window)
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} is invalid: the model supports at most {limit} tokens")
        return wanted

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_config = self.model_dir / "generation_config.json"
        if gen_config.exists():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests in ----------------------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, validated: non-empty, ids in the vocabulary, shorter than max_model_len."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "prompt: this model has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidParameter("prompt", "prompt: must not be empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidParameter("prompt", f"prompt: token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidParameter("prompt", f"prompt: {len(ids)} tokens is too long: max_model_len="
                                             f"{self.max_model_len} must leave room for at least one output token")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request (n samples of it when params.n > 1). Raises InvalidParameter (a
        ValueError), queueing nothing, on bad input."""
        children = self.make_requests(prompt, params, request_id)
        self.enqueue(children)
        return children[0].parent_id

    def make_requests(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None) -> list[Request]:
        """The validated Request of each of the n samples; changes no engine state (safe from other threads)."""
        params = params or SamplingParams()
        request_id = request_id or self.new_request_id()
        if request_id in self._groups:
            raise InvalidParameter("request_id", f"request_id={request_id!r} is already in use")
        ids = self.tokenize(prompt)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if not params.ignore_eos:
            params.all_stop_token_ids = set(self.eos_token_ids)
        text = prompt if isinstance(prompt, str) else None
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.for_child(i)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            request = Request(child_id, ids, child_params, max_tokens, prompt=text, parent_id=request_id, index=i)
            if self.tokenizer is not None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, child_params.skip_special_tokens)
            if child_params.prompt_logprobs is not None:
                request.prompt_logprobs = [None]
            children.append(request)
        return children

    def enqueue(self, children: list[Request]) -> None:
        self._groups[children[0].parent_id] = children
        for request in children:
            self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks. Unknown or finished ids are ignored."""
        children = self._groups.pop(request_id, None)
        if children is None:
            return None
        for request in children:
            if not request.status.finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self._output(children)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- one step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for every request that got a new token or finished
        (only finished ones for requests with output_kind FINAL_ONLY).

        With async_scheduling, a pure-decode step's successor is launched before this step's tokens come back
        (its input tokens stay on the device), so the host's bookkeeping overlaps the GPU's work instead of
        leaving it idle. A request that turns out to have stopped wastes its row of the successor."""
        if self._in_flight is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            self._in_flight = self._launch(sched)
        current = self._in_flight
        self._in_flight = self._launch_next_decodes(current) if self.config.async_scheduling else None
        return self._process(current, self.runner.collect(current.launched))

    def _launch(self, sched: SchedulerOutput, previous: _InFlight | None = None) -> _InFlight:
        launched = self.runner.launch(sched, previous.launched if previous is not None else None)
        now = time.time()
        for request in sched.requests:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            request.num_computed_tokens += sched.num_scheduled_tokens[request.request_id]
        for request in launched.batch.sampling_requests:
            request.num_pending_tokens += 1
        return _InFlight(sched, launched)

    def _launch_next_decodes(self, current: _InFlight) -> _InFlight | None:
        """Launch the decode step after `current` before its tokens are known, when that step is certain: every
        running request is decoding in `current` and needs none of its tokens on the host to sample the next
        (no penalties or min_tokens), and no waiting request could be admitted instead."""
        sampling = current.launched.batch.sampling_requests
        running = self.scheduler.running
        if (len(sampling) != len(current.sched.requests) or len(running) != len(sampling)
                or not current.launched.batch.is_decode_only
                or (self.scheduler.waiting and len(running) < self.config.max_num_seqs)):
            return None
        in_current = {id(r) for r in sampling}
        if any(id(r) not in in_current or _needs_host_tokens(r) for r in running):
            return None
        # Requests that reach max_tokens with the token in flight stop there.
        continuing = [r for r in running if len(r.output_token_ids) + r.num_pending_tokens < r.max_tokens]
        sched = self.scheduler.schedule_next_decodes(continuing) if continuing else None
        return self._launch(sched, previous=current) if sched is not None else None

    def _process(self, step: _InFlight, result: RunnerOutput) -> list[RequestOutput]:
        touched: dict[str, None] = {}
        for request in step.sched.requests:
            sampled = result.sampled.get(request.request_id)
            if sampled is not None:
                request.num_pending_tokens -= 1
            if request.status.finished:  # stopped (or aborted) while this step was in flight
                continue
            self.kv_cache.cache_full_blocks(request)
            if request.request_id in result.prompt_logprobs:
                self._add_prompt_logprobs(request, *result.prompt_logprobs[request.request_id])
            if sampled is not None:
                self._append_token(request, *sampled)
                if request.status.finished or request.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                    touched[request.parent_id] = None
        outputs = []
        for parent_id in touched:
            children = self._groups[parent_id]
            finished = all(r.status.finished for r in children)
            if finished or children[0].sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(children))
            if finished:
                del self._groups[parent_id]
        return outputs

    def _append_token(self, request: Request, token: int, score: TokenScore | None) -> None:
        now = time.time()
        request.metrics.first_token_time = request.metrics.first_token_time or now
        request.metrics.last_token_time = now
        request.output_token_ids.append(token)
        self._generation_tokens_total += 1
        if score is not None:
            request.logprobs.append(self._position_logprobs(token, score))
            request.cumulative_logprob += score[0]
        params = request.sampling_params
        past_min = len(request.output_token_ids) >= params.min_tokens
        if past_min and (token in params.all_stop_token_ids or token in params.stop_token_ids):
            request.stop_reason = None if token in params.all_stop_token_ids else token
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            return
        if request.detokenizer is not None:
            piece = request.detokenizer.step(token)
            request.output_text = request.detokenizer.text
            if past_min and params.stop and self._truncate_at_stop_string(request, len(piece)):
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                return
        if len(request.output_token_ids) >= request.max_tokens:
            self._finish(request, RequestStatus.FINISHED_LENGTH)

    @staticmethod
    def _truncate_at_stop_string(request: Request, new_chars: int) -> bool:
        text = request.output_text
        params = request.sampling_params
        for stop in params.stop:
            # Only a stop string overlapping the newly added text can be new.
            idx = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                request.output_text = text[:end]
                request.stop_reason = stop
                return True
        return False

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.metrics.finished_time = time.time()
        self.scheduler.finish(request, status)

    def _add_prompt_logprobs(self, request: Request, first_position: int, scores: list[TokenScore]) -> None:
        targets = request.prompt_token_ids
        for position, score in enumerate(scores, start=first_position):
            if position == len(request.prompt_logprobs):  # recomputation after preemption repeats positions
                request.prompt_logprobs.append(self._position_logprobs(targets[position], score))

    def _position_logprobs(self, token: int, score: TokenScore) -> PositionLogprobs:
        logprob, rank, top = score
        entries = {tid: Logprob(lp, i + 1, self._decode_one(tid)) for i, (tid, lp) in enumerate(top)}
        entries.setdefault(token, Logprob(logprob, rank, self._decode_one(token)))
        return entries

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    # ---- outputs --------------------------------------------------------------------------------------------

    def _output(self, children: list[Request]) -> RequestOutput:
        first = children[0]
        return RequestOutput(
            request_id=first.parent_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(r) for r in children],
            finished=all(r.status.finished for r in children),
            metrics=first.metrics,
            prompt_logprobs=first.prompt_logprobs,
            num_cached_tokens=first.num_cached_tokens,
        )

    @staticmethod
    def _completion(request: Request) -> CompletionOutput:
        text = request.output_text
        if not request.status.finished and request.sampling_params.stop:
            text = text[:len(text) - _stop_prefix_len(text, request.sampling_params.stop)]
        return CompletionOutput(
            index=request.index,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            logprobs=request.logprobs,
            stop_reason=request.stop_reason,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_free_blocks=self.kv_cache.num_free_blocks,
            num_preemptions=self.scheduler.stats.num_preemptions,
            prefix_cache_queries=self.kv_cache.stats.queries,
            prefix_cache_hits=self.kv_cache.stats.hits,
            generation_tokens_total=self._generation_tokens_total,
        )


@dataclass
class _InFlight:
    sched: SchedulerOutput
    launched: LaunchedStep


def _needs_host_tokens(request: Request) -> bool:
    """Whether sampling this request's next token needs its previous one on the host."""
    p = request.sampling_params
    return p.has_penalties or len(request.output_token_ids) + request.num_pending_tokens < p.min_tokens


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
