"""GGUF -> HF directory: dequantized weights (float32 safetensors), config.json and the tokenizer.

Weights are dequantized with the `gguf` package and llama.cpp's q/k row permutation is undone, so the result is
an ordinary HF Llama checkpoint. The tokenizer and chat template come from the GGUF metadata through
transformers. The conversion is cached on disk keyed by the file's path, size and mtime. Served quantized
(quantization='gguf'), the weights are read from the file itself instead (`read_gguf_weights`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from pagellm.quantization.config import is_gguf_linear
from pagellm.tokenizer import record_loaded_class

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


# The block types of the decoder's linear weights, kept beside the cached conversion: quantization='gguf' reads
# them there instead of parsing the file's metadata again (2 s for SmolLM2's, most of it the tokenizer's strings).
LINEAR_TYPES_FILE = "gguf_linear_types.json"
CACHE_FORMAT = 3  # part of the cache key: conversions cached before LINEAR_TYPES_FILE (2) or the tokenizer's
# loaded class (3) was noted beside them are made again


def cache_dir_for(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    source = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CACHE_FORMAT}"
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    root = Path(os.environ.get("PAGELLM_CACHE", Path.home() / ".cache" / "pagellm"))
    return root / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf_cached(gguf_path: str | Path, quiet: bool = False) -> Path:
    """The HF directory for this GGUF file, converting it on first use."""
    gguf_path = Path(gguf_path)
    out = cache_dir_for(gguf_path)
    if not (out / ".complete").exists():
        reader = GGUFReader(gguf_path)
        _write_hf_dir(reader, gguf_path, out, quiet)
        record_loaded_class(out)  # the cache is pagellm's own: its tokenizer stays as AutoTokenizer loaded it
        linear_types = sorted({t.tensor_type.name for t in reader.tensors if is_gguf_linear(t.name)})
        (out / LINEAR_TYPES_FILE).write_text(json.dumps(linear_types))
        (out / ".complete").touch()
    return out


def gguf_linear_types(gguf_path: str | Path) -> list[str]:
    """The block type names of a GGUF's decoder linear weights (from its cached conversion)."""
    return json.loads((convert_gguf_cached(gguf_path, quiet=True) / LINEAR_TYPES_FILE).read_text())


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, quiet: bool = False) -> Path:
    return _write_hf_dir(GGUFReader(gguf_path), Path(gguf_path), Path(out_dir), quiet)


def _write_hf_dir(reader: GGUFReader, gguf_path: Path, out_dir: Path, quiet: bool) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _hf_config(reader)
    tensors = dict(read_gguf_tensors(reader, config, quantized_as=None, quiet=quiet))
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, out_dir)
    return out_dir


def read_gguf_tensors(
    reader: GGUFReader, config: dict, quantized_as: tuple[int, int] | None, quiet: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named fp32 tensors, dequantized; with `quantized_as` (bits, group size), the decoder's linear weights
    come instead as their stored integers, group scales and offsets (`qweight`, `scales`, `offsets`: the layout
    of kernels/quant_matmul.py)."""
    from pagellm.quantization.gguf_blocks import GGUF_FORMATS, decode_blocks
    from pagellm.quantization.packing import pack_int32

    permuted = config["model_type"] in ("llama", "mistral")  # llama.cpp permutes q/k only for these
    desc = "Reading GGUF" if quantized_as else "Dequantizing GGUF"
    for tensor in tqdm(reader.tensors, desc=desc, disable=quiet):
        name = _hf_name(tensor.name)
        shape = tuple(reversed(tensor.shape.tolist()))
        heads = None
        if permuted and name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif permuted and name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        if quantized_as is not None and is_gguf_linear(tensor.name):
            bits, group = quantized_as
            q, scales, offsets = decode_blocks(tensor.tensor_type, tensor.data, shape[0])
            repeat = GGUF_FORMATS[tensor.tensor_type][1] // group  # a coarser group as several of the model's
            parts = {
                "qweight": pack_int32(q, bits),
                "scales": scales.repeat_interleave(repeat, dim=1),
                "offsets": offsets.repeat_interleave(repeat, dim=1),
            }
        else:
            data = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            parts = {"weight": torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))}
        for part, value in parts.items():
            yield name.removesuffix("weight") + part, value if heads is None else _unpermute(value, heads)


def read_gguf_weights(gguf_path: str | Path, bits: int, group: int, quiet: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors for quantized serving: decoder linears as stored integers, the rest dequantized."""
    reader = GGUFReader(gguf_path)
    yield from read_gguf_tensors(reader, _hf_config(reader), (bits, group), quiet)


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
