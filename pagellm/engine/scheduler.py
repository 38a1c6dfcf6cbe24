"""Scheduler: one token budget for prefill and decode (vLLM v1's rule).

Each step every running request asks for `num_tokens - num_computed_tokens` tokens, capped by what is left of
the step's budget. Decode is "1 token left"; chunked prefill is "more than the budget left". Running requests go
first, then waiting ones. When the KV cache runs out of blocks, the newest running request is preempted: its
blocks are freed and it waits to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)  # in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request_id -> tokens this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class SchedulerStats:
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(out, budget)
        budget -= out.total_tokens
        if not preempted:  # no room was short this step: admit waiting requests
            self._schedule_waiting(out, budget)
        return out

    def schedule_next_decodes(self, requests: list[Request]) -> SchedulerOutput | None:
        """A decode step for `requests` whose current token is still being sampled (asynchronous scheduling):
        one more token each. None, with nothing preempted, when the pool is short (the regular schedule decides
        then) or the step would exceed the token budget."""
        if len(requests) > self.max_num_batched_tokens:
            return None
        out = SchedulerOutput()
        for request in requests:
            if not self.kv_cache.allocate_slots(request, 1):
                return None
            out.requests.append(request)
            out.num_scheduled_tokens[request.request_id] = 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                out.requests.append(request)
                out.num_scheduled_tokens[request.request_id] = num_new
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
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.metrics.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.requests.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and free its blocks (finished or aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)
