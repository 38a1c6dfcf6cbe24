"""INT8 KV cache on real text: perplexity within 1% of a bf16 KV cache (SmolLM2, CPU reference path)."""

from __future__ import annotations

import math

from pagellm import LLM, SamplingParams

# Prose written for this test (no dataset can be downloaded here).
TEXT = """The harbour town woke slowly in winter. Before dawn the fishing boats left one by one, their lamps swinging
over the black water, and the gulls followed them out past the breakwater. By eight o'clock the bakery on the
corner had opened its shutters, and the smell of bread drifted down the hill towards the market square. Old men
sat on the bench outside the post office and argued about the weather, the price of diesel and the football
results, as they had done every morning for thirty years. Children ran past them on the way to school, carrying
satchels that were too heavy and scarves that were too long. In the afternoon the light turned grey and the
wind came in from the north, rattling the windows of the houses along the front. Most people stayed indoors,
but the lighthouse keeper climbed the spiral stairs as usual to check the lamp, counting the steps under his
breath. When the boats returned at dusk, the whole town seemed to gather on the quay to watch them unload their
catch, and for a little while the cold was forgotten."""


def perplexity(llm: LLM) -> float:
    out = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    nll = [-out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return math.exp(sum(nll) / len(nll))


def test_int8_kv_perplexity_within_one_percent(smollm2_gguf):
    # Chunks of 32 tokens: every later chunk attends to earlier tokens through the (quantized) cache.
    common = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, quiet=True)
    bf16 = perplexity(LLM(str(smollm2_gguf), kv_cache_dtype="bfloat16", **common))
    int8 = perplexity(LLM(str(smollm2_gguf), kv_cache_dtype="int8", **common))
    assert abs(int8 - bf16) / bf16 < 0.01, (bf16, int8)
    assert 2 < bf16 < 60  # a real model reading real text
