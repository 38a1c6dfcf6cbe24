"""Shared fixtures: the SmolLM2 GGUF (pagellm and the HF transformers oracle), tiny random-weight models."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run through the interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.model.loader import default_model

torch.set_num_threads(2)


# The slow tier (`make test-fast` leaves it out): the real model and its HF oracle, a live server and browser,
# training, and kernels run by the Triton interpreter.
SLOW_FIXTURES = {"smollm2_gguf", "smollm2_llm", "hf_smollm2", "async_llm", "server", "secured_server", "tiny_server"}
SLOW_DIRS = ("kernels", "server", "training")


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.path.parent.name in SLOW_DIRS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return Path(default_model())


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    from pagellm import LLM

    return LLM(str(smollm2_gguf), dtype="float32", device="cpu", quiet=True)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """HF transformers loading the same GGUF file: the independent oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, **constraints) -> list[int]:
    """HF generate, greedy, one prompt at a time (no padding), running to exactly max_new_tokens with EOS
    treated as an ordinary token (as pagellm's ignore_eos does); `constraints` are generate()'s own (e.g.
    bad_words_ids, prefix_allowed_tokens_fn)."""
    model.generation_config.eos_token_id = None  # generate() would fall back to the model's EOS otherwise
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **constraints
        )
    return out[0, len(prompt_ids) :].tolist()


TINY_SHAPES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def make_tiny_model(tmp_path_factory, arch: str, **overrides) -> Path:
    """Save a small random-weight HF model of the given family; returns its directory."""
    import transformers

    config_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    config = config_cls(**{**TINY_SHAPES, **overrides})
    torch.manual_seed(zlib.crc32(arch.encode()) % 1000)  # str hashes differ between processes
    model = model_cls(config).eval()
    with torch.no_grad():  # peakier logits than the default init, so greedy choices are far from ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp(arch.lower())
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory, "Llama")


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory, smollm2_gguf) -> Path:
    """A small random-weight Llama with SmolLM2's tokenizer and chat template: every step takes milliseconds, so
    fuzzed requests of any size finish quickly."""
    from pagellm.model.loader import resolve_model_dir
    from pagellm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model_dir(str(smollm2_gguf), quiet=True))
    path = make_tiny_model(tmp_path_factory, "Llama", vocab_size=tokenizer.vocab_size, max_position_embeddings=256)
    tokenizer.hf.save_pretrained(path)
    return path


# What a model's generation_config.json may recommend (beside HF's usual keys): greedy, a repetition penalty and at
# most 4 tokens, so that whether they were applied shows in every output.
RECOMMENDED_SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 4, "do_sample": False}


@pytest.fixture(scope="session")
def recommending_model_dir(tiny_chat_model_dir, tmp_path_factory) -> Path:
    """The tiny chat model with a generation_config.json recommending RECOMMENDED_SAMPLING."""
    path = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_chat_model_dir, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, **RECOMMENDED_SAMPLING}))
    return path
