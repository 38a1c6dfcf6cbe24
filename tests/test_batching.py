"""Continuous batching under pressure: preemption, chunked prefill and prefix-cache hits keep greedy tokens equal
to HF transformers, and every block is free afterwards."""

from __future__ import annotations

import random

from pagellm import LLM, SamplingParams
from tests.conftest import hf_greedy

SHARED_PREFIX = ("You are a careful assistant. Answer briefly and precisely, and never make things up. "
                 "Here is the question:")
QUESTIONS = ["Why is the sky blue?", "Name a prime number.", "What do bees make?", "Who wrote Hamlet?",
             "What is 2+2?", "Describe a cat.", "Where is Tokyo?", "What is water made of?"]


def test_stress_matches_hf(smollm2_gguf, hf_smollm2):
    rng = random.Random(0)
    prompts = [f"{SHARED_PREFIX} {q}" for q in QUESTIONS]  # long shared prefix: prefix-cache hits
    prompts += [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "story", "river"])
                         for _ in range(rng.randint(1, 60))) for _ in range(16)]  # mixed lengths
    max_tokens = [rng.randint(4, 20) for _ in prompts]
    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", num_kv_blocks=24, block_size=16,
              max_num_batched_tokens=64, max_num_seqs=16, quiet=True)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)

    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.kv_cache.stats.hits > 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished()
    for out, m in zip(outputs, max_tokens):
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, out.prompt_token_ids, m), out.prompt


def test_prefix_hit_reported_and_identical(smollm2_llm):
    engine = smollm2_llm.engine
    prompt = SHARED_PREFIX + " What is the tallest mountain?"
    params = SamplingParams(temperature=0, max_tokens=8)
    first = smollm2_llm.generate(prompt, params, use_tqdm=False)[0]
    second = smollm2_llm.generate(prompt, params, use_tqdm=False)[0]
    n_prompt = len(first.prompt_token_ids)
    assert second.num_cached_tokens == (n_prompt - 1) // 16 * 16 > 0  # full blocks only, never the last token
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
