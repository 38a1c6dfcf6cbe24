"""AsyncLLM's hand-over of outputs to asyncio consumers (the engine in a process of its own): a consumer that falls
behind the engine gets its request's newest output (a DELTA request's deltas merged), not a backlog of one per
step, and still reads exactly what the offline engine generates."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from pagellm import LLM, RequestOutputKind, SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.async_llm import AsyncLLM

PROMPT = [11, 12, 13, 14]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def async_tiny(tiny_llama_dir):
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True))
    yield llm
    llm.shutdown()


async def _wait_for_tokens(llm: AsyncLLM, total: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while llm.stats.engine.generation_tokens_total < total:
        assert time.time() < deadline, "the engine stopped generating"
        await asyncio.sleep(0.005)


def test_a_consumer_that_falls_behind_gets_the_newest_output(async_tiny, tiny_llama_dir):
    async def read_with_a_pause() -> list[list[int]]:
        seen: list[list[int]] = []
        async for out in async_tiny.generate(PROMPT, GREEDY):
            seen.append(out.outputs[0].token_ids)
            if len(seen) == 1:  # fall 10 steps behind: each of them handed over an output meanwhile
                await _wait_for_tokens(async_tiny, async_tiny.stats.engine.generation_tokens_total + 10)
        return seen

    seen = asyncio.run(read_with_a_pause())
    offline = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    expected = offline.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert seen[-1] == expected
    assert all(expected[: len(ids)] == ids for ids in seen)  # every output a prefix of the whole
    assert len(seen[1]) >= len(seen[0]) + 10  # the pause's outputs were replaced by the newest, not queued


def test_a_delta_consumer_that_falls_behind_gets_the_missed_deltas_merged(async_tiny, tiny_llama_dir):
    async def read_with_a_pause() -> list[list[int]]:
        seen: list[list[int]] = []
        params = replace(GREEDY, output_kind=RequestOutputKind.DELTA)
        async for out in async_tiny.generate(PROMPT, params):
            seen.append(out.outputs[0].token_ids)
            if len(seen) == 1:
                await _wait_for_tokens(async_tiny, async_tiny.stats.engine.generation_tokens_total + 10)
        return seen

    seen = asyncio.run(read_with_a_pause())
    offline = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    expected = offline.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for ids in seen for t in ids] == expected
    assert len(seen[1]) >= 10  # the pause's deltas came as one


def test_an_id_used_again_right_after_its_abort_gets_only_its_own_outputs(async_tiny, tiny_llama_dir):
    """The engine's process learns of an abort between its steps: what it sent of the aborted request meanwhile must
    not reach the new request of the same id."""
    other = [21, 22, 23]

    async def abort_then_reuse():
        first = async_tiny.stream(async_tiny.input_processor.process(PROMPT, replace(GREEDY, max_tokens=500), "again"))
        for _ in range(3):  # running: more of its outputs are on their way
            await anext(first)
        await first.aclose()  # aborts it
        return [out async for out in async_tiny.generate(other, GREEDY, request_id="again")]

    outs = asyncio.run(abort_then_reuse())
    offline = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    expected = offline.generate([other], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected
    assert all(out.request_id == "again" and out.prompt_token_ids == other for out in outs)


def test_an_output_that_ends_the_request_is_never_replaced(tiny_llama_dir):
    """The engine failing after a request's last output (an error handed to every open stream) must not hide it."""
    llm = AsyncLLM(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True))

    async def finish_then_fail() -> list:
        stream = llm.stream(llm.input_processor.process(PROMPT, GREEDY, "ends-then-fails"))
        items = [await anext(stream)]
        deadline = time.time() + 30
        while llm.stats.engine.num_running + llm.stats.engine.num_waiting > 0:  # until the request has ended
            assert time.time() < deadline, "the request did not end"
            await asyncio.sleep(0.005)
        llm._fail_streams(RuntimeError("injected after the end"))
        await asyncio.sleep(0.05)  # both hand-overs reach this loop before the stream is read again
        items += [out async for out in stream]
        return items

    try:
        items = asyncio.run(finish_then_fail())
    finally:
        llm.shutdown()
    assert items[-1].finished and len(items[-1].outputs[0].token_ids) == GREEDY.max_tokens
