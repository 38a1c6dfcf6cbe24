"""Greedy tokens and prompt logprobs against HF transformers (the oracle), fp32 on CPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.errors import InvalidParameter
from tests.conftest import hf_greedy, make_tiny_model

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors: red,",
    "In 1969, astronauts",
    "Photosynthesis is the process by which",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
]


def test_smollm2_greedy_matches_hf(smollm2_llm, hf_smollm2):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = smollm2_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy(hf_smollm2, out.prompt_token_ids, 48)
        assert out.outputs[0].token_ids == expected, prompt
    assert smollm2_llm.engine.stats().num_free_blocks == smollm2_llm.engine.stats().num_blocks


def test_smollm2_chat_template_and_answer(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    expected = smollm2_llm.tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert smollm2_llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == expected
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ends on <|im_end|>


def test_smollm2_continues_a_started_reply_like_hf(smollm2_llm, hf_smollm2):
    """continue_final_message: the prompt is HF's rendering with the last message left open, and the reply
    goes on from it as HF's greedy decode does."""
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = smollm2_llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True, use_tqdm=False)
    hf_tokenizer = smollm2_llm.tokenizer.hf
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    assert out[0].prompt_token_ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_smollm2, out[0].prompt_token_ids, 12)
    with pytest.raises(InvalidParameter, match="continue_final_message: cannot be combined with add_generation"):
        smollm2_llm.chat(messages, params, continue_final_message=True, use_tqdm=False)


def test_smollm2_truncated_prompt_reads_its_last_tokens_like_hf(smollm2_llm, hf_smollm2):
    long_ids = smollm2_llm.tokenizer.encode(PROMPTS[0] * 8)
    keep = 24
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=keep)
    out = smollm2_llm.generate([long_ids, long_ids[:30], long_ids[:10]], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in out] == [long_ids[-keep:], long_ids[30 - keep : 30], long_ids[:10]]
    for o in out:
        assert o.outputs[0].token_ids == hf_greedy(hf_smollm2, o.prompt_token_ids, 8)
    with pytest.raises(InvalidParameter, match="truncate_prompt_tokens=0 is invalid"):
        SamplingParams(truncate_prompt_tokens=0)


def test_truncation_to_what_fits_lets_a_too_long_prompt_run(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    limit = llm.engine.max_model_len
    ids = [3 + i % 400 for i in range(limit + 40)]
    with pytest.raises(InvalidParameter, match="prompt: .* is too long"):
        llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate(ids, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-(limit - 1) :] and len(out.outputs[0].token_ids) == 1


def test_smollm2_prompt_logprobs_match_hf(smollm2_llm, hf_smollm2):
    prompt = "The quick brown fox jumps over the lazy dog because it was"
    out = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[
        0
    ]
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        top = ref[pos - 1].topk(3)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[tid].rank == rank and abs(entry[tid].logprob - lp) < 1e-4


FAMILIES = [
    ("Llama", {}),
    (
        "Llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    ("Llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "tie_word_embeddings": True}),
    ("Mistral", {"sliding_window": None}),
    ("Qwen2", {}),
    ("Qwen3", {"head_dim": 32}),
]


@pytest.mark.parametrize(
    "arch,overrides", FAMILIES, ids=["llama", "llama3-rope", "linear-rope-tied", "mistral", "qwen2", "qwen3"]
)
def test_random_weight_families_match_hf(tmp_path_factory, arch, overrides):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory, arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, quiet=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    # Prompt logprobs against HF's log-softmax.
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompts[3]])).logits[0], dim=-1)
    for pos in range(1, len(prompts[3])):
        tid = prompts[3][pos]
        assert abs(out.prompt_logprobs[pos][tid].logprob - ref[pos - 1, tid].item()) < 1e-4


def test_smollm2_bad_words_are_never_completed_like_hf(smollm2_llm, hf_smollm2, smollm2_gguf):
    """vLLM's bad_words against HF's bad_words_ids (its own tokenizer spelling each as written and after a
    space): the same greedy tokens. A phrase of two tokens bans its second only right after its first."""
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    prompt = "The quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = smollm2_llm.generate(prompt, params, use_tqdm=False)[0]
    words = ["brown bear", "example"]
    assert all(w in free.outputs[0].text for w in words)
    banned = [hf_tokenizer.encode(p + w, add_special_tokens=False) for w in words for p in ("", " ")]
    assert [6354, 7012] in banned  # " brown", " bear"
    out = smollm2_llm.generate(prompt, replace(params, bad_words=words), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_smollm2, free.prompt_token_ids, 24, bad_words_ids=banned)
    assert " brown" in out.text and not any(w in out.text for w in words)


def test_smollm2_allowed_token_ids_like_hf(smollm2_llm, hf_smollm2):
    prompt = "List three colors: red,"
    free = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    allowed = sorted(set(free[0].outputs[0].token_ids[1:]) | {28, 314, 1005})  # not the first token it picked
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    out = smollm2_llm.generate(prompt, params, use_tqdm=False)[0]
    expected = hf_greedy(hf_smollm2, out.prompt_token_ids, 8, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    assert out.outputs[0].token_ids == expected and set(expected) <= set(allowed)
    with pytest.raises(InvalidParameter, match="allowed_token_ids: token ids must be in"):
        smollm2_llm.generate(prompt, SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(InvalidParameter, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    only = smollm2_llm.tokenizer.encode(" Paris", add_special_tokens=False)
    with pytest.raises(InvalidParameter, match="bad_words: they ban every token of allowed_token_ids"):
        smollm2_llm.generate(prompt, SamplingParams(allowed_token_ids=only, bad_words=["Paris"]), use_tqdm=False)
