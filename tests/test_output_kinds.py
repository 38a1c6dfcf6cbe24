"""DELTA outputs (what the engine's process sends its client): joined up, a request's deltas are exactly its
CUMULATIVE outputs, step by step — text with a stop string held back until it is ruled out, token ids, logprobs,
n samples — and the prompt's fields come with the first delta only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagellm import RequestOutputKind, SamplingParams
from pagellm.outputs import RequestOutput

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village,"


def run_side_by_side(engine, params: SamplingParams) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """The same request as CUMULATIVE and as DELTA in one batch (seeded: the same tokens), every output of each."""
    engine.add_request(PROMPT, replace(params, output_kind=RequestOutputKind.CUMULATIVE), "cumulative")
    engine.add_request(PROMPT, replace(params, output_kind=RequestOutputKind.DELTA), "delta")
    got: dict[str, list[RequestOutput]] = {"cumulative": [], "delta": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    return got["cumulative"], got["delta"]


def assert_same_logprobs(mine: list[dict], theirs: list[dict]) -> None:
    """The same tokens and ranks; values to float noise (the second request's prompt is a prefix-cache hit, so the
    two run through differently shaped batches)."""
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert {t: (p.rank, p.decoded_token) for t, p in a.items()} == {
            t: (p.rank, p.decoded_token) for t, p in b.items()
        }
        assert [p.logprob for p in a.values()] == pytest.approx([p.logprob for p in b.values()], abs=1e-4)


def test_deltas_join_up_to_the_cumulative_outputs(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=40, logprobs=2, prompt_logprobs=1)
    free_text = run_side_by_side(engine, params)[0][-1].outputs[0].text
    stop = free_text[12:15]  # sample 0 ends on a stop string; its first characters are shown only once ruled out
    cumulative, deltas = run_side_by_side(engine, replace(params, stop=[stop]))

    assert len(cumulative) == len(deltas) > 5
    assert cumulative[-1].outputs[0].stop_reason == stop
    joined = deltas[0]
    assert joined.prompt_token_ids and joined.prompt_logprobs and joined.prompt == PROMPT
    for delta in deltas[1:]:
        assert (delta.prompt, delta.prompt_token_ids, delta.prompt_logprobs) == (None, [], None)
    for whole, delta in zip(cumulative, deltas, strict=True):
        joined = joined if delta is deltas[0] else joined.merged(delta)
        assert joined.finished == whole.finished
        for mine, theirs in zip(joined.outputs, whole.outputs, strict=True):
            assert (mine.text, mine.token_ids) == (theirs.text, theirs.token_ids)
            assert (mine.finish_reason, mine.stop_reason) == (theirs.finish_reason, theirs.stop_reason)
            assert_same_logprobs(mine.logprobs, theirs.logprobs)
            assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-4)
    assert_same_logprobs(joined.prompt_logprobs[1:], cumulative[-1].prompt_logprobs[1:])
    assert not engine.has_unfinished() and engine.stats().num_free_blocks == engine.stats().num_blocks


def test_an_aborted_delta_request_reports_only_what_is_new(smollm2_llm):
    engine = smollm2_llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request(PROMPT, params, "to-abort")
    seen: list[int] = []
    while len(seen) < 5:
        for out in engine.step():
            seen += out.outputs[0].token_ids
    last = engine.abort("to-abort")
    while engine.has_unfinished():  # the look-ahead step still in flight
        engine.step()
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert last.prompt_token_ids == []  # not the first report
    whole = smollm2_llm.generate(PROMPT, replace(params, output_kind=RequestOutputKind.CUMULATIVE), use_tqdm=False)
    assert (
        seen + last.outputs[0].token_ids == whole[0].outputs[0].token_ids[: len(seen) + len(last.outputs[0].token_ids)]
    )
