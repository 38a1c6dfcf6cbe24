"""Continuous batching under pressure: preemption, chunked prefill and prefix-cache hits keep greedy tokens equal
to HF transformers, and every block is free afterwards."""

from __future__ import annotations

import random

from pagellm import LLM, SamplingParams
from tests.conftest import hf_greedy

SHARED_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely, and never make things up. Here is the question:"
)
QUESTIONS = [
    "Why is the sky blue?",
    "Name a prime number.",
    "What do bees make?",
    "Who wrote Hamlet?",
    "What is 2+2?",
    "Describe a cat.",
    "Where is Tokyo?",
    "What is water made of?",
]


def test_stress_matches_hf(smollm2_gguf, hf_smollm2):
    rng = random.Random(0)
    prompts = [f"{SHARED_PREFIX} {q}" for q in QUESTIONS]  # long shared prefix: prefix-cache hits
    prompts += [
        " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "story", "river"]) for _ in range(rng.randint(1, 60)))
        for _ in range(16)
    ]  # mixed lengths
    max_tokens = [rng.randint(4, 20) for _ in prompts]
    llm = LLM(
        str(smollm2_gguf),
        device="cpu",
        dtype="float32",
        num_kv_blocks=24,
        block_size=16,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        quiet=True,
    )
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)

    assert engine.stats().num_preemptions > 0
    assert engine.stats().prefix_cache_hits > 0
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
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
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_async_scheduling_changes_nothing_but_timing(tiny_llama_dir, monkeypatch):
    """Launching decode steps before the previous tokens are back gives the same tokens as waiting for them:
    greedy, seeded top-p, top-k and plain draws, max_tokens reached with a token in flight, and stop tokens that
    end requests while their next step is in flight.

    A request stopped in flight leaves a wasted row in the step launched ahead, and the CPU's matmuls and masked
    attention round a row differently in a batch of another size. Inverse-transform draws (the sampling kernel's,
    and so its torch twin's) move to a neighbouring token when such a change crosses a boundary of the cumulative
    mass, often enough to show here; argmax does not. So the stops run with greedy requests, and the sampled
    requests stop at max_tokens only, which the look-ahead never schedules past: their batches are the same."""
    sampled = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=50, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=1, max_tokens=3, ignore_eos=True),
    ]
    stopping = [
        SamplingParams(temperature=0, max_tokens=50, stop_token_ids=list(range(0, 500, 9)), ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randrange(2, 40))] for _ in range(12)]

    def run(async_scheduling: bool, params: list[SamplingParams]) -> tuple[list, int]:
        llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", async_scheduling=async_scheduling, quiet=True)
        launched_early = 0
        launch = llm.engine.runner.launch

        def counting_launch(step):
            nonlocal launched_early
            launched_early += any(row.input_pending for row in step.rows)
            return launch(step)

        monkeypatch.setattr(llm.engine.runner, "launch", counting_launch)
        outs = llm.generate(prompts, [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
        assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], launched_early

    for params in (sampled, stopping):
        sync_outputs, early = run(False, params)
        assert early == 0
        async_outputs, early = run(True, params)
        assert early > 20
        assert async_outputs == sync_outputs
    assert {reason for _, reason in sync_outputs} == {"stop", "length"}
