"""Quantized checkpoints written from the formats' definitions, independently of pagellm's quantization code, and
the full-precision weights each one stands for (the HF oracle runs on those).

- AWQ (AutoAWQ GEMM): qweight [K, N/8] and qzeros [K/G, N/8] int32 packed along N, nibble i of a word holding
  column [0, 2, 4, 6, 1, 3, 5, 7][i] of its eight; scales [K/G, N]; w = (q - zero) * scale.
- GPTQ v1: qweight [K*b/32, N] packed along K; qzeros [K/G, N*b/32] packed along N holding zero - 1; scales
  [K/G, N]; g_idx [K], the group of each input column (act-order: a permutation's groups).
- FP8: e4m3 weight [N, K]; weight_scale per tensor ([1], quant_method fp8) or per channel ([N, 1],
  compressed-tensors).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def hf_model_with(model_dir: Path, state: dict[str, torch.Tensor]):
    """HF transformers' model of `model_dir` holding `state` in fp32: the oracle run on the weights a quantized
    checkpoint stands for."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model


def pack_lsb_first(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned values -> int32 [R, C * bits / 32], value j of each word at bits [bits*j, bits*(j+1))."""
    per_word = 32 // bits
    words = torch.zeros(values.shape[0], values.shape[1] // per_word, dtype=torch.int64)
    for j in range(per_word):
        words |= values[:, j::per_word].to(torch.int64) << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def group_rtn(w: torch.Tensor, bits: int, columns_of_group: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Asymmetric round-to-nearest per group (a group is any set of input columns): q [N, K], and the fp16 scale
    and integer zero of each (row, group) [N, G]."""
    top = 2**bits - 1
    q = torch.empty(w.shape, dtype=torch.int64)
    scales, zeros = [], []
    for cols in columns_of_group:
        part = w[:, cols].float()
        scale = ((part.amax(1) - part.amin(1)).clamp_min(1e-5) / top).half()
        zero = (-part.amin(1) / scale.float()).round().clamp(0, top)
        q[:, cols] = ((part / scale.float()[:, None]).round() + zero[:, None]).clamp(0, top).long()
        scales.append(scale)
        zeros.append(zero.long())
    return q, torch.stack(scales, 1), torch.stack(zeros, 1)


def _write(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy2(path, out / path.name)
    return out


def write_awq(src: Path, out: Path, group: int) -> dict[str, torch.Tensor]:
    """An AWQ checkpoint of `src`; returns the full-precision state dict it stands for."""
    weights, tensors, dense = load_file(src / "model.safetensors"), {}, {}
    for name, w in weights.items():
        if not LINEAR.match(name):
            tensors[name] = dense[name] = w
            continue
        n, k = w.shape
        q, scales, zeros = group_rtn(w, 4, [torch.arange(g, g + group) for g in range(0, k, group)])
        by_column = q.T.reshape(k, n // 8, 8)[..., AWQ_ORDER].reshape(k, n)
        zeros_by_column = zeros.T.reshape(k // group, n // 8, 8)[..., AWQ_ORDER].reshape(k // group, n)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = pack_lsb_first(by_column, 4)
        tensors[f"{prefix}.qzeros"] = pack_lsb_first(zeros_by_column, 4)
        tensors[f"{prefix}.scales"] = scales.T.contiguous()
        dense[name] = ((q - zeros.repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)).float()
    _write(
        src,
        out,
        tensors,
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
    )
    return dense


def write_gptq_act_order(src: Path, out: Path, bits: int, group: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPTQ v1 checkpoint with act-order: each layer input's columns are grouped by one random permutation (the
    same for the projections reading one input, as GPTQ's Hessian ordering makes them)."""
    weights, tensors, dense = load_file(src / "model.safetensors"), {}, {}
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for name, w in weights.items():
        if not LINEAR.match(name):
            tensors[name] = dense[name] = w
            continue
        n, k = w.shape
        reads = name.split(".")[2] + ("o" if "o_proj" in name else "down" if "down_proj" in name else "in")
        perm = perms.setdefault((reads, k), torch.randperm(k, generator=gen))
        groups = [perm[g : g + group] for g in range(0, k, group)]
        g_idx = torch.empty(k, dtype=torch.int32)
        for i, cols in enumerate(groups):
            g_idx[cols] = i
        q, scales, zeros = group_rtn(w, bits, groups)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.qweight"] = pack_lsb_first(q, bits).T.contiguous()
        tensors[f"{prefix}.qzeros"] = pack_lsb_first((zeros - 1).T.contiguous(), bits)
        tensors[f"{prefix}.scales"] = scales.T.contiguous()
        tensors[f"{prefix}.g_idx"] = g_idx
        column_group = g_idx.long()
        dense[name] = ((q - zeros[:, column_group]) * scales.float()[:, column_group]).float()
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": True, "sym": False}
    _write(src, out, tensors, config)
    return dense


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(1, keepdim=True) / 448.0
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_at_load_weights(src: Path) -> dict[str, torch.Tensor]:
    """What quantization='fp8' makes of a full-precision checkpoint: e4m3 per channel."""
    dense = load_file(src / "model.safetensors")
    for name, w in dense.items():
        if LINEAR.match(name):
            q, scale = fp8_per_channel(w)
            dense[name] = q.float() * scale
    return dense


def write_fp8(src: Path, out: Path, per_channel: bool) -> dict[str, torch.Tensor]:
    """Per channel: compressed-tensors `float-quantized`; per tensor: the `fp8` format (AutoFP8's)."""
    weights, tensors, dense = load_file(src / "model.safetensors"), {}, {}
    for name, w in weights.items():
        if not LINEAR.match(name):
            tensors[name] = dense[name] = w
            continue
        prefix = name.removesuffix(".weight")
        if per_channel:
            q, scale = fp8_per_channel(w)
        else:
            scale = w.float().abs().amax().reshape(1) / 448.0
            q = (w.float() / scale).to(torch.float8_e4m3fn)
            tensors[f"{prefix}.input_scale"] = torch.ones(1)  # static activation scale: the engine scales per token
        tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale"] = q, scale
        dense[name] = q.float() * scale
    if per_channel:
        fp8 = {"type": "float", "num_bits": 8}
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**fp8, "strategy": "channel"}}},
            "ignore": ["lm_head"],
        }
    else:
        config = {"quant_method": "fp8", "activation_scheme": "static"}
    _write(src, out, tensors, config)
    return dense
