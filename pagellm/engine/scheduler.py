"""Scheduler: one token budget for prefill and decode (vLLM v1's rule), and the owner of every request's state.

Each step every running request asks for `num_tokens - num_computed_tokens` tokens, capped by what is left of
the step's budget. Decode is "1 token left"; chunked prefill is "more than the budget left". Running requests go
first, then waiting ones. When the KV cache runs out of blocks, the newest running request is preempted: its
blocks are freed and it waits to be recomputed.

The scheduler advances `num_computed_tokens` when it schedules, and `update_from_output` applies what the step
sampled: it appends tokens, stops requests on stop tokens and length, registers full blocks in the prefix cache
and frees finished requests' blocks. Nothing else changes a `Request` or calls the KV cache manager.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.core.request import Request, RequestStatus
from pagellm.core.step import RequestUpdate, RunnerOutput, SchedulerOutput, make_row
from pagellm.engine.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Stop requests (stop strings, aborts) and free their blocks; ids no longer unfinished are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    # ---- scheduling -----------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(out, budget)
        if not preempted:  # no room was short this step: admit waiting requests
            self._schedule_waiting(out, budget - out.total_tokens)
        self._update_after_schedule(out)
        return out

    def schedule_ahead(self, current: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after `current`, scheduled before `current`'s tokens are back (asynchronous scheduling),
        when it is certain: every running request decodes and samples in `current`, none needs its previous token
        on the host to sample the next (`Request.needs_host_tokens`), and no waiting request could be admitted
        instead. Requests that reach max_tokens with the token in flight stop there. None when that is not so,
        or when the pool is short or the budget too small (the regular schedule decides then, nothing preempted)."""
        rows = current.rows
        if (
            not current.is_decode_only
            or len(rows) != len(self.running)
            or any(r.sampling is None for r in rows)
            or (self.waiting and len(self.running) < self.max_num_seqs)
        ):
            return None
        in_current = {row.request_id for row in rows}
        if any(r.request_id not in in_current or r.needs_host_tokens for r in self.running):
            return None
        continuing = [r for r in self.running if len(r.output_token_ids) + r.num_pending_tokens < r.max_tokens]
        if not continuing or len(continuing) > self.max_num_batched_tokens:
            return None
        out = SchedulerOutput()
        for request in continuing:
            if not self.kv_cache.allocate_slots(request, 1):
                return None
            out.rows.append(make_row(request, 1))
        self._update_after_schedule(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running[-1]  # the newest; never one scheduled already this step (they come first)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                out.rows.append(make_row(request, num_new))
                budget -= num_new
                i += 1
        return preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed = self.kv_cache.get_computed_blocks(request) if request.num_computed_tokens == 0 else []
            num_cached = len(computed) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(request, num_new, computed):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_cached
            if request.status == RequestStatus.WAITING:  # a first admission: retries and recomputation don't count
                request.num_cached_tokens = num_cached
                self.kv_cache.record_prefix_query(request, num_cached)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.rows.append(make_row(request, num_new))
            budget -= num_new

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """The scheduled tokens count as computed from now on; a row that samples has one more token pending."""
        now = time.time()
        requests = self.requests
        for row in out.rows:
            request = requests[row.request_id]
            request.num_computed_tokens += row.num_tokens
            if row.sampling is not None:
                request.num_pending_tokens += 1
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ---- results --------------------------------------------------------------------------------------------

    def update_from_output(self, step: SchedulerOutput, result: RunnerOutput) -> list[RequestUpdate]:
        """Apply a finished step: append each sampled token, stop requests on a stop token (after min_tokens) or
        at max_tokens, cache the full blocks, free the finished. One update per request that got a token or
        prompt logprobs; rows of requests finished while the step was in flight are dropped (also when a new
        request took the id meanwhile)."""
        updates = []
        for row in step.rows:
            request = self.requests.get(row.request_id)
            if request is None or request.serial != row.request_serial:  # finished while this step was in flight
                continue
            sampled = result.sampled.get(row.request_id)
            if sampled is not None:
                request.num_pending_tokens -= 1
            self.kv_cache.cache_full_blocks(request)
            prompt_scores = result.prompt_logprobs.get(row.request_id)
            if sampled is None and prompt_scores is None:
                continue
            update = RequestUpdate(
                row.request_id,
                prompt_scores=prompt_scores,
                num_cached_tokens=request.num_cached_tokens,
                first_scheduled_time=request.first_scheduled_time,
            )
            if sampled is not None:
                update.new_token_id, update.score = sampled
                self._append_token(request, update)
            updates.append(update)
        return updates

    def _append_token(self, request: Request, update: RequestUpdate) -> None:
        token = update.new_token_id
        request.output_token_ids.append(token)
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens and (
            token in params.all_stop_token_ids or token in params.stop_token_ids
        ):
            update.finish_reason = RequestStatus.FINISHED_STOPPED.value
            update.stop_reason = None if token in params.all_stop_token_ids else token
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        elif len(request.output_token_ids) >= request.max_tokens:
            update.finish_reason = RequestStatus.FINISHED_LENGTH.value
            self._finish(request, RequestStatus.FINISHED_LENGTH)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        del self.requests[request.request_id]
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            len(self.running),
            len(self.waiting),
            kv.usage,
            kv.num_free_blocks,
            kv.num_blocks,
            self.num_preemptions,
            kv.stats.queries,
            kv.stats.hits,
        )
