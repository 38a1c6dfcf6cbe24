"""Sampling laws on a tiny vocabulary, checked against the distribution each parameter specifies."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.core.step import SamplingRow
from pagellm.errors import InvalidParameter
from pagellm.kernels.ops import TorchOps
from pagellm.runner.sampler import Sampler, apply_logit_bias, apply_penalties, mask_disallowed_tokens

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
N = 40_000


def sample_counts(params: SamplingParams, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(seed, torch.device("cpu"), TorchOps())
    rows = [SamplingRow(params, 0, [0], []) for _ in range(N)]
    tokens = sampler.sample(LOGITS.expand(N, -1).clone(), sampler.prepare(rows)).token_ids
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / N


def assert_close_to(freq: torch.Tensor, probs: torch.Tensor) -> None:
    # 4.5 standard errors per token: a wrong law fails, sampling noise does not.
    tol = 4.5 * torch.sqrt(probs * (1 - probs) / N) + 1e-9
    assert torch.all((freq - probs).abs() <= tol), (freq, probs)
    assert torch.all(freq[probs == 0] == 0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature):
    assert_close_to(sample_counts(SamplingParams(temperature=temperature)), torch.softmax(LOGITS / temperature, 0))


def test_top_k():
    expected = torch.softmax(LOGITS, 0)
    expected[3:] = 0
    assert_close_to(sample_counts(SamplingParams(top_k=3)), expected / expected.sum())


def test_top_p_keeps_the_smallest_nucleus():
    # The kernel's algorithm (rejection rounds, each drawing among the tokens more likely than the last rejected).
    probs = torch.softmax(LOGITS, 0)
    # top_p = 0.7: tokens are kept while the mass before them is < 0.7.
    keep = (probs.cumsum(0) - probs) < 0.7
    expected = torch.where(keep, probs, torch.zeros_like(probs))
    assert_close_to(sample_counts(SamplingParams(top_p=0.7)), expected / expected.sum())


def test_min_p_then_top_k_then_top_p():
    probs = torch.softmax(LOGITS / 0.7, 0)
    probs = torch.where(probs >= 0.1 * probs.max(), probs, torch.zeros_like(probs))  # min_p
    probs[5:] = 0  # top_k
    probs = probs / probs.sum()
    keep = (probs.cumsum(0) - probs) < 0.8  # top_p on what is left
    expected = torch.where(keep, probs, torch.zeros_like(probs))
    freq = sample_counts(SamplingParams(temperature=0.7, min_p=0.1, top_k=5, top_p=0.8))
    assert_close_to(freq, expected / expected.sum())


def test_min_p():
    probs = torch.softmax(LOGITS, 0)
    expected = torch.where(probs >= 0.3 * probs.max(), probs, torch.zeros_like(probs))
    assert_close_to(sample_counts(SamplingParams(min_p=0.3)), expected / expected.sum())


def test_greedy_is_argmax():
    assert sample_counts(SamplingParams(temperature=0))[0] == 1.0


def test_logit_bias_shifts_the_law_by_exp_bias():
    bias = {0: -2.0, 3: 1.5, 7: 4.0}
    shifted = LOGITS.clone()
    for token, b in bias.items():
        shifted[token] += b
    assert_close_to(sample_counts(SamplingParams(logit_bias=bias)), torch.softmax(shifted, 0))


def test_logit_bias_rows_are_their_own():
    logits = torch.zeros(3, 5)
    rows = [
        SamplingRow(SamplingParams(logit_bias={1: 2.0}), 0, [0], []),
        SamplingRow(SamplingParams(), 0, [0], []),
        SamplingRow(SamplingParams(logit_bias={4: -1.0, 1: 0.5}), 0, [0], []),
    ]
    out = apply_logit_bias(logits, rows)
    expected = torch.zeros(3, 5)
    expected[0, 1], expected[2, 4], expected[2, 1] = 2.0, -1.0, 0.5
    assert torch.equal(out, expected) and torch.equal(logits, torch.zeros(3, 5))  # the model's logits untouched


def test_logit_bias_in_the_engine(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={77: 100})
    assert llm.generate([[1, 2, 3]], forced, use_tqdm=False)[0].outputs[0].token_ids == [77] * 6
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={free[0]: -100})
    assert llm.generate([[1, 2, 3]], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != free[0]
    with pytest.raises(InvalidParameter, match="logit_bias"):
        llm.generate([[1, 2, 3]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(InvalidParameter, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    rows = [SamplingRow(params, draw_index=0, prompt_token_ids=[2], output_token_ids=[0, 0, 1])]
    out = apply_penalties(logits, rows)[0]
    # token 0: seen twice -> 2/2 - 0.25*2 - 0.5; token 1: once, negative -> -1*2 - 0.25 - 0.5;
    # token 2: prompt only -> 0.5/2 (no presence/frequency: those count generated tokens); token 3 untouched.
    assert torch.allclose(out, torch.tensor([2 / 2 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 0.25, 1.0]))


def test_seed_reproduces_whatever_the_batch(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    # top_p: how many rejection rounds the other rows need must not change the seeded row's draws.
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.0, top_p=0.5, max_tokens=30, ignore_eos=True)
    crowd = llm.generate([[5, 6], [1, 2, 3], [7, 8, 9, 10, 11]], [noise, seeded, noise], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate([[1, 2, 3]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_gives_n_distinct_samples(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    out = llm.generate(
        [[1, 2, 3]], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_stop_string_and_stop_token(smollm2_llm):
    prompt = "Once upon a time"
    full = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    stop = full.text[30:36]
    cut = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[
        0
    ].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)

    stop_token = full.token_ids[10]
    first = full.token_ids.index(stop_token)
    by_token = smollm2_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]), use_tqdm=False
    )[0].outputs[0]
    assert by_token.token_ids == full.token_ids[: first + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_token)


def test_min_tokens_blocks_eos(smollm2_llm):
    chat = [{"role": "user", "content": "Say hi."}]
    short = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop"
    n = len(short.token_ids) + 5
    longer = smollm2_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=n), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(longer.token_ids) >= n


def test_logprobs_are_raw_model_logprobs(smollm2_llm):
    out = smollm2_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, position in zip(out.token_ids, out.logprobs):
        assert position[token].rank == 1  # greedy picks the top token
        assert len(position) == 3 and all(lp.logprob <= 0 for lp in position.values())
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_allowed_token_ids_renormalize_the_law_over_them():
    allowed = [1, 4, 6]
    expected = torch.zeros_like(LOGITS)
    expected[allowed] = torch.softmax(LOGITS[allowed], 0)
    assert_close_to(sample_counts(SamplingParams(allowed_token_ids=allowed)), expected)


def test_bad_words_ban_the_token_that_would_complete_one():
    params = SamplingParams()
    params.bad_words_token_ids = [[5], [2, 3], [1, 2, 4]]  # as the engine spells the words
    rows = [
        SamplingRow(params, 0, [2], []),  # nothing generated: only the one-token word
        SamplingRow(params, 0, [0], [7, 2]),  # [2, 3] would complete
        SamplingRow(params, 0, [0], [1, 2]),  # [1, 2, 4] would complete, and [2, 3]
        SamplingRow(SamplingParams(allowed_token_ids=[0, 3]), 0, [0], []),
    ]
    out = mask_disallowed_tokens(torch.zeros(4, 8), rows)
    banned = [{5}, {5, 3}, {5, 3, 4}, {1, 2, 4, 5, 6, 7}]
    for row, tokens in zip(out, banned):
        assert {t for t in range(8) if row[t] == float("-inf")} == tokens
