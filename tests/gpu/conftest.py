"""The GPU tests' model: small enough to build in a second, wide enough for the GPU kernels' tiles."""

from __future__ import annotations

import pytest

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
