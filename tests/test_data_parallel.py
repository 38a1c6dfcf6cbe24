"""Data parallelism on the CPU: two engine replicas in their own processes, requests spread over both, every output
equal to one engine's (greedy, fp32), tensor-parallel replicas included; a replica that dies fails the call instead
of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagellm import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[i, i + 1, i + 2, (7 * i) % 500] for i in range(1, 25)]


def test_dp2_spreads_requests_and_equals_one_engine(tiny_llama_dir):
    one = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True, data_parallel_size=2)
    try:
        two = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        assert [o.request_id for o in two] != [] and all(o.finished for o in two)
        per_replica = [s.generation_tokens_total for s in llm.engine.replica_stats()]
        assert sum(per_replica) == 24 * 16 and min(per_replica) > 0  # both replicas served
        assert not llm.engine.has_unfinished()
    finally:
        llm.shutdown()
    assert all(not r.process.is_alive() for r in llm.engine.cores)


def test_generate_waits_for_outputs_still_on_their_way(tiny_llama_dir, monkeypatch):
    """A replica's reader thread takes a finished request off the table and queues its output for `step`: the
    caller's loop, asking in between whether anything is unfinished, must not stop short (it returned None for
    such a request). Each report is queued late here, so that the loop asks inside that window every time."""
    one = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True).generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True, data_parallel_size=2)
    try:
        reports = llm.engine._reports
        put = reports.put
        monkeypatch.setattr(reports, "put", lambda report: time.sleep(0.02) or put(report))
        two = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    finally:
        llm.shutdown()


def test_tensor_parallel_replicas_equal_one_engine(tiny_llama_dir):
    """Each replica process starts its own other rank (a replica is no daemon process, which could not)."""
    one = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True).generate(PROMPTS, GREEDY, use_tqdm=False)
    options = dict(device="cpu", dtype="float32", quiet=True, data_parallel_size=2, tensor_parallel_size=2)
    llm = LLM(str(tiny_llama_dir), **options)
    try:
        two_by_two = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in two_by_two] == [o.outputs[0].token_ids for o in one]
        assert min(s.generation_tokens_total for s in llm.engine.replica_stats()) > 0
    finally:
        llm.shutdown()
    assert all(not core.process.is_alive() for core in llm.engine.cores)


def test_a_dead_replica_fails_the_call(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True, data_parallel_size=2)
    try:
        os.kill(llm.engine.cores[1].process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="replica 1 died"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()


def test_shared_prefixes_are_routed_to_the_replica_that_has_them(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True, data_parallel_size=2, block_size=16)
    try:
        shared = list(range(100, 164))  # four full blocks
        llm.generate([shared + [1]], GREEDY, use_tqdm=False)  # its blocks are cached on one replica
        others = [[400 + i, 3, 4] for i in range(4)]
        llm.generate([shared + [i] for i in range(2, 6)] + others, GREEDY, use_tqdm=False)
        hits = sorted(s.prefix_cache_hits for s in llm.engine.replica_stats())
        assert hits == [0, 4 * 64]  # every later shared-prefix request hit, all on the first one's replica
    finally:
        llm.shutdown()
