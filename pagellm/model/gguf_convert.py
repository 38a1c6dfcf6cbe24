"""GGUF -> HF directory: dequantized weights (float32 safetensors), config.json and the tokenizer.

Weights are dequantized with the `gguf` package and llama.cpp's q/k row permutation is undone, so the result is
an ordinary HF Llama checkpoint. The tokenizer and chat template come from the GGUF metadata through
transformers. The conversion is cached on disk keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def cache_dir_for(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGELLM_CACHE", Path.home() / ".cache" / "pagellm"))
    return root / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf_cached(gguf_path: str | Path, quiet: bool = False) -> Path:
    """The HF directory for this GGUF file, converting it on first use."""
    gguf_path = Path(gguf_path)
    out = cache_dir_for(gguf_path)
    if not (out / ".complete").exists():
        convert_gguf(gguf_path, out, quiet=quiet)
        (out / ".complete").touch()
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, quiet: bool = False) -> Path:
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(gguf_path)
    config = _hf_config(reader)
    permuted = config["model_type"] in ("llama", "mistral")  # llama.cpp permutes q/k only for these
    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF", disable=quiet):
        name = _hf_name(tensor.name)
        data = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        weight = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        if permuted and name.endswith("q_proj.weight"):
            weight = _unpermute(weight, config["num_attention_heads"])
        elif permuted and name.endswith("k_proj.weight"):
            weight = _unpermute(weight, config["num_key_value_heads"])
        tensors[name] = weight
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, out_dir)
    return out_dir


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion, which interleaves the two rotary halves of each head's rows."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_config(reader: GGUFReader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"GGUF general.architecture={arch!r} is not supported; supported: {list(_ARCHITECTURES)}")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    num_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": _field(reader, f"{arch}.vocab_size", num_tokens),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
