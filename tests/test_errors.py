"""Bad input fails early with a message naming the field; the engine keeps serving and leaks no blocks."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from tests.conftest import hf_greedy


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_rejected_engine_keeps_serving(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=64, quiet=True)
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt.*empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt.*too long.*max_model_len=64"):
        llm.generate([list(range(64))], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt.*token ids"):
        llm.generate([[1, 100_000]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt.*no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)
    with pytest.raises(
        ValueError, match=r"prompts: a prompt dict takes exactly one of \['prompt', 'prompt_token_ids'\]"
    ):
        llm.generate({"prompt_token_ids": [1], "multi_modal_data": {}}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts: prompt_token_ids must be a list"):
        llm.generate([{"prompt_token_ids": "1 2"}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts: must be a string, a list of token ids.*; got 5"):
        llm.generate(5, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts: each prompt must be a string.*; got None"):
        llm.generate([[1], None], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: must be a SamplingParams or a list of them; got dict"):
        llm.generate([[1]], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: each entry must be a SamplingParams"):
        llm.generate([[1]], [None], use_tqdm=False)
    with pytest.raises(ValueError, match="messages: must not be empty"):
        llm.chat([], use_tqdm=False)
    # One bad prompt in a batch queues nothing.
    with pytest.raises(ValueError):
        llm.generate([[1, 2], []], use_tqdm=False)
    assert not engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_vllm_prompt_dicts_equal_their_plain_forms(smollm2_llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = smollm2_llm.tokenizer.encode("Once upon a time")
    plain = smollm2_llm.generate(["Once upon a time", ids], greedy, use_tqdm=False)
    dicts = smollm2_llm.generate([{"prompt": "Once upon a time"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    single = smollm2_llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert dicts[1].prompt_token_ids == ids


def test_text_prompts_are_tokenized_once(tiny_chat_model_dir):
    """generate validates every prompt before queueing any, with the ids it then queues: a text is encoded once."""
    llm = LLM(str(tiny_chat_model_dir), device="cpu", dtype="float32", max_model_len=128, quiet=True)
    tokenizer, encoded = llm.tokenizer, []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, *args, **kwargs: encoded.append(text) or encode(text, *args, **kwargs)
    prompts = ["Once upon a time", "The sky is"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert encoded == prompts
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [encode(p) for p in prompts]


def test_output_stops_at_max_model_len(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=32, quiet=True)
    out = llm.generate([list(range(1, 21))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True)
    engine = llm.engine
    rid = engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    keep = engine.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    aborted = engine.abort(rid)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == [keep]
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_an_id_reused_while_its_aborted_request_is_in_flight_serves_the_new_request(tiny_llama_dir):
    """Asynchronous scheduling keeps a step in flight: its row of the aborted request must not reach the new request
    of that id, which generates what HF transformers does for its own prompt."""
    from transformers import AutoModelForCausalLM

    engine = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", quiet=True).engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request([1, 2, 3], params, "x")
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished()  # a look-ahead step of "x" is in flight
    engine.abort("x")
    engine.add_request([4, 5, 6], params, "x")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    assert [o.request_id for o in outs if o.finished] == ["x"]
    assert outs[-1].prompt_token_ids == [4, 5, 6] and outs[-1].outputs[0].token_ids == hf_greedy(hf, [4, 5, 6], 20)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


@pytest.mark.parametrize("model", ["/no/such/dir", "no-such-model.gguf", "not a hub id"])
def test_unknown_model_is_a_clear_error(model, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="model="):
        LLM(model, device="cpu", quiet=True)


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="model='nobody/nothing' not found"):
        LLM("nobody/nothing", device="cpu", quiet=True)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
        ({"block_size": 3}, "block_size"),
        ({"dtype": "int3"}, "dtype"),
        ({"load_format": "pickle"}, "load_format"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_engine_args(kwargs, field, tiny_llama_dir):
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_llama_dir), device="cpu", quiet=True, **kwargs)
