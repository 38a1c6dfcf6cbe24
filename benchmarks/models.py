"""Real model shapes for speed work with dummy weights (like vLLM's load_format='dummy'): a config.json only."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

SHAPES = {
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "eos_token_id": 151645,
    },
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 128009,
    },
}


def model_dir(name: str) -> str:
    """A directory holding only the config.json of a named shape (a directory's path is itself)."""
    if Path(name).is_dir():
        return name
    path = Path(tempfile.mkdtemp(prefix=f"pagellm-{name}-"))
    (path / "config.json").write_text(json.dumps(SHAPES[name]))
    return str(path)


def weight_bytes(name: str, bytes_per_param: int = 2) -> int:
    c = SHAPES[name]
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    attn = h * head_dim * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2)
    per_layer = attn + 3 * h * i + 2 * h
    embed = v * h * (1 if c["tie_word_embeddings"] else 2)
    return (layers * per_layer + embed + h) * bytes_per_param
