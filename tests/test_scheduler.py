"""The scheduler alone (no model): the token budget, chunked prefill, preemption order, the asynchronous look-ahead
step, aborts while a step is in flight, and the prefix-cache statistics. Steps are answered with made-up tokens."""

from __future__ import annotations

import pytest

from pagellm.core.request import Request, RequestStatus
from pagellm.core.step import RunnerOutput, SchedulerOutput
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32, prefix_caching: bool = True
) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK, prefix_caching), max_num_seqs, budget)


def add(
    sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8, first_token: int | None = None, **params
) -> Request:
    """A request whose prompt counts up from `first_token` (by default one of its own: no prefix hits)."""
    first = 1000 * len(sched.requests) + 1000 if first_token is None else first_token
    request = Request(rid, list(range(first, first + prompt_len)), SamplingParams(**params), max_tokens)
    sched.add_request(request)
    return request


def answer(step: SchedulerOutput, token: int = 7) -> RunnerOutput:
    """What the runner returns: one token for every row that samples."""
    return RunnerOutput(sampled={row.request_id: (token, None) for row in step.rows if row.sampling is not None})


def run_step(sched: Scheduler, token: int = 7):
    step = sched.schedule()
    return step, sched.update_from_output(step, answer(step, token))


def scheduled(step: SchedulerOutput) -> dict[str, int]:
    return {row.request_id: row.num_tokens for row in step.rows}


def test_budget_split_running_first_then_waiting_chunked():
    sched = make_scheduler(budget=32)
    add(sched, "a", 20)
    step, updates = run_step(sched)
    assert scheduled(step) == {"a": 20} and [u.request_id for u in updates] == ["a"]
    add(sched, "b", 50)
    add(sched, "c", 5)
    step, _ = run_step(sched)
    # a decodes (1 token), b takes the rest of the budget as a chunk, c waits for the next step.
    assert scheduled(step) == {"a": 1, "b": 31}
    row_b = step.rows[1]
    assert (row_b.start, row_b.sampling) == (0, None)  # a mid-prompt chunk samples nothing
    step, updates = run_step(sched)
    assert scheduled(step) == {"a": 1, "b": 19, "c": 5}
    assert step.rows[1].start == 31 and step.rows[1].sampling is not None  # b's last chunk samples
    assert {u.request_id for u in updates} == {"a", "b", "c"}


def test_num_computed_tokens_advance_when_scheduled():
    sched = make_scheduler()
    request = add(sched, "a", 10)
    step = sched.schedule()
    assert request.num_computed_tokens == 10 and request.num_pending_tokens == 1
    assert request.output_token_ids == []  # the token comes with the step's output
    sched.update_from_output(step, answer(step, token=42))
    assert request.output_token_ids == [42] and request.num_pending_tokens == 0
    step = sched.schedule()
    assert step.rows[0].token_ids == [42] and step.rows[0].start == 10


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        add(sched, rid, 3)
    step, _ = run_step(sched)
    assert scheduled(step) == {"a": 3, "b": 3}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preemption_takes_the_newest_and_recomputes_it():
    sched = make_scheduler(num_blocks=4, budget=64, prefix_caching=False)  # 16 token slots
    a = add(sched, "a", 7, max_tokens=20)
    b = add(sched, "b", 7, max_tokens=20)
    run_step(sched)  # a and b take 2 blocks each: the pool is full
    assert sched.kv_cache.num_free_blocks == 0
    step, _ = run_step(sched)  # a's 8th token still fits its second block; b's too
    assert scheduled(step) == {"a": 1, "b": 1}
    step, _ = run_step(sched)  # a needs a third block: b, the newest, is preempted
    assert scheduled(step) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert sched.num_preemptions == 1 and list(sched.waiting) == [b]
    assert len(b.output_token_ids) == 2  # kept: recomputed with its prompt later
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    step, _ = run_step(sched)
    assert scheduled(step) == {"b": 9} and b.status == RequestStatus.RUNNING  # prompt and outputs again
    assert a.block_ids == [] and sched.stats().num_free_blocks == 4 - 3


def test_stop_token_min_tokens_and_length_free_blocks():
    sched = make_scheduler()
    add(sched, "eos", 3, max_tokens=10, min_tokens=2).sampling_params.all_stop_token_ids = {7}
    add(sched, "len", 3, max_tokens=2)
    _, updates = run_step(sched)  # token 7 is EOS, but before min_tokens it is an ordinary token
    assert [u.finish_reason for u in updates] == [None, None]
    _, updates = run_step(sched)
    assert [(u.request_id, u.finish_reason) for u in updates] == [("eos", "stop"), ("len", "length")]
    assert not sched.has_unfinished() and sched.stats().num_free_blocks == 64


def test_schedule_ahead_only_when_certain():
    sched = make_scheduler()
    a = add(sched, "a", 5, max_tokens=3)
    b = add(sched, "b", 5, max_tokens=10)
    first = sched.schedule()
    assert sched.schedule_ahead(first) is None  # prefill rows: not decode-only
    sched.update_from_output(first, answer(first))
    decode = sched.schedule()
    ahead = sched.schedule_ahead(decode)
    assert scheduled(ahead) == {"a": 1, "b": 1}
    assert all(row.input_pending for row in ahead.rows)  # their input tokens are still being sampled
    assert [row.sampling.draw_index for row in ahead.rows] == [2, 2]
    assert a.num_pending_tokens == 2 and a.num_computed_tokens == 7
    # a reaches max_tokens=3 with the token in flight: no row for it in the next look-ahead.
    sched.update_from_output(decode, answer(decode))
    assert scheduled(sched.schedule_ahead(ahead)) == {"b": 1}
    add(sched, "c", 3)  # a waiting request that could be admitted: the regular schedule decides
    assert sched.schedule_ahead(ahead) is None
    assert b.status == RequestStatus.RUNNING


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2), dict(min_tokens=5)], ids=str)
def test_schedule_ahead_waits_for_host_tokens(params):
    sched = make_scheduler()
    add(sched, "a", 5, max_tokens=10, **params)
    step, _ = run_step(sched)
    assert sched.schedule_ahead(sched.schedule()) is None


def test_abort_mid_flight_drops_the_rows_and_frees_blocks():
    sched = make_scheduler()
    add(sched, "a", 5)
    keep = add(sched, "b", 5)
    step = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # while the step is in flight
    assert [u.request_id for u in sched.update_from_output(step, answer(step))] == ["b"]
    assert keep.output_token_ids == [7]
    sched.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and sched.stats().num_free_blocks == 64


def test_a_reused_id_gets_nothing_of_the_aborted_requests_step_in_flight():
    sched = make_scheduler()
    add(sched, "a", 5)
    step = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # while the step is in flight
    again = add(sched, "a", 3)
    assert sched.update_from_output(step, answer(step)) == []
    assert (again.output_token_ids, again.num_pending_tokens, again.status) == ([], 0, RequestStatus.WAITING)
    step, updates = run_step(sched, token=9)
    assert scheduled(step) == {"a": 3} and again.output_token_ids == [9]


def test_prefix_hits_counted_once_per_request():
    sched = make_scheduler(num_blocks=6, budget=64)
    add(sched, "a", 12, first_token=0)
    run_step(sched)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12, 0)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    big = add(sched, "big", 20, first_token=100)  # takes 5 of 6 blocks (evicting a's), holds them
    run_step(sched)
    add(sched, "b", 12, first_token=0)  # a's prompt again, but its blocks are gone and the pool is short: b waits
    for _ in range(3):
        step, _ = run_step(sched)
        assert "b" not in scheduled(step)
    assert sched.stats().prefix_cache_queries == 12 + 20  # b's failed admissions are not queries
    sched.finish_requests([big.request_id], RequestStatus.FINISHED_ABORTED)
    run_step(sched)
    assert sched.stats().prefix_cache_queries == 12 + 20 + 12


def test_prompt_logprob_rows_score_the_prompt():
    sched = make_scheduler(budget=6)
    add(sched, "a", 10, first_token=0, prompt_logprobs=2)
    step = sched.schedule()
    row = step.rows[0]
    # Positions 0..5 predict prompt tokens 1..6.
    assert row.prompt_scoring.top_n == 2 and row.prompt_scoring.targets == [1, 2, 3, 4, 5, 6]
    sched.update_from_output(step, RunnerOutput(prompt_logprobs={"a": (1, [(-1.0, 1, [])] * 6)}))
    step = sched.schedule()
    assert step.rows[0].prompt_scoring.targets == [7, 8, 9]  # the last position predicts the first output
