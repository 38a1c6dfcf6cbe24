"""Weights from a sharded safetensors directory, from an HF cache laid out on disk (offline hub id), dummy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model.loader import resolve_model_dir

PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sharded_checkpoint_with_index(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = LLM(str(tmp_path), device="cpu", quiet=True)
    single = LLM(str(tiny_llama_dir), device="cpu", quiet=True)
    assert tokens(sharded) == tokens(single)


def test_hub_id_resolves_from_local_cache_offline(tiny_llama_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--pagellm-test--tiny-llama"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_llama_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)

    assert resolve_model_dir("pagellm-test/tiny-llama") == snapshot
    from_hub = LLM("pagellm-test/tiny-llama", device="cpu", quiet=True)
    assert tokens(from_hub) == tokens(LLM(str(tiny_llama_dir), device="cpu", quiet=True))


def test_dummy_weights_need_only_a_config(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path), device="cpu", quiet=True)
    a = LLM(str(tmp_path), device="cpu", load_format="dummy", seed=3, quiet=True)
    b = LLM(str(tmp_path), device="cpu", load_format="dummy", seed=3, quiet=True)
    assert tokens(a) == tokens(b)
    weight = a.engine.runner.model.layers[0].mlp.down_proj.weight.to_dense()
    assert 0.015 < weight.std().item() < 0.025


def test_gguf_conversion_is_an_hf_directory(smollm2_llm):
    """The cached conversion loads in HF transformers too, with the same weights pagellm uses."""
    from transformers import AutoModelForCausalLM

    model_dir = smollm2_llm.engine.model_dir
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ours = smollm2_llm.engine.runner.model
    q_size = ours.config.num_heads * ours.config.head_dim
    qkv = ours.layers[3].self_attn.qkv_proj.weight.to_dense()
    assert torch.equal(hf.model.layers[3].self_attn.q_proj.weight, qkv[:q_size])
    assert (model_dir / "tokenizer.json").exists()


TOKENIZER_PROBES = [
    "Hello world!",
    "  leading spaces,\ttabs\nand lines",
    "émoji 🤖 and 中文",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_a_gguf_conversions_tokenizer_loads_as_autotokenizer_loads_it(smollm2_llm):
    """The conversion notes the class AutoTokenizer (the oracle) loads its tokenizer as; the engine then loads that
    class directly, and it tokenizes, decodes and renders chats exactly as AutoTokenizer's."""
    import transformers

    from pagellm.tokenizer import GENERIC_TOKENIZER_CLASSES, LOADED_AS_FILE

    model_dir = smollm2_llm.engine.model_dir
    oracle = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert json.loads((model_dir / LOADED_AS_FILE).read_text()) == {
        "class": type(oracle).__name__,
        "transformers": transformers.__version__,
    }
    assert type(oracle).__name__ in GENERIC_TOKENIZER_CLASSES  # so the engine took the direct way
    ours = smollm2_llm.tokenizer
    assert type(ours.hf) is type(oracle)
    for text in TOKENIZER_PROBES:
        ids = oracle.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == oracle.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == oracle.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert ours.eos_token_id == oracle.eos_token_id and len(ours.hf) == len(oracle)


def test_a_tokenizer_noted_under_another_transformers_loads_through_autotokenizer(smollm2_llm, tmp_path, monkeypatch):
    import transformers

    from pagellm.tokenizer import LOADED_AS_FILE, Tokenizer

    model_dir = tmp_path / "conversion"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_llm.engine.model_dir / name, model_dir / name)
    (model_dir / LOADED_AS_FILE).write_text(json.dumps({"class": "TokenizersBackend", "transformers": "4.0.0"}))
    calls = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append(path) or original(path, **kw)
    )
    assert Tokenizer.from_dir(model_dir).encode("hi") == smollm2_llm.tokenizer.encode("hi")
    assert calls == [str(model_dir)]
