"""The GPU tests' models: a tiny one, small enough to build in a second and wide enough for the GPU kernels'
tiles, and SmolLM2's GGUF where it was carried."""

from __future__ import annotations

import importlib.util

import pytest

from pagellm.model.loader import DEFAULT_MODEL_PACKAGE, default_model
from tests.conftest import make_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory,
        "Llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=2048,
    )


@pytest.fixture(scope="session")
def carried_smollm2_gguf() -> str:
    """SmolLM2's GGUF; the GPU machine has it only when carried there, and the test skips where it has not."""
    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("SmolLM2's GGUF is not on this machine: `bash benchmarks/gpu_suite.sh perplexity` says how")
    return default_model()
