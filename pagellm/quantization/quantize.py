"""`pagellm quantize`: a full-precision HF directory -> an AWQ, GPTQ or FP8 checkpoint that this engine (and
vLLM) load.

Round-to-nearest (RTN) per group of input columns: AWQ with zero points (AutoAWQ's GEMM packing; with a calibration
text, AWQ's activation-aware scales first: awq.py), GPTQ symmetric (the v1 format, act-order off; no Hessian
error correction), FP8 e4m3 with one scale per output channel as llm-compressor's compressed-tensors
`float-quantized` format writes it. The decoder's linear weights are quantized; embeddings, norms and the LM head
are copied as they are, with the config, tokenizer and chat template.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pagellm.model.loader import iter_safetensors, load_config_dict, safetensors_files
from pagellm.quantization.awq import awq_scaled_weights
from pagellm.quantization.calibration import calibration_ids, calibration_inputs
from pagellm.quantization.gptq import gptq_quantize
from pagellm.quantization.linear_methods import quantize_fp8_rows
from pagellm.quantization.packing import pack_int32

QUANTIZE_METHODS = ("awq", "gptq", "fp8")
_DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# The inverse of the AWQ unpacking order: nibble i of a word holds column AWQ_PACK_ORDER[i] of its 8.
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_model(
    model_dir: str | Path,
    out_dir: str | Path,
    method: str,
    bits: int = 4,
    group_size: int = 128,
    calibration: str | Path | None = None,
    symmetric: bool = True,
    quiet: bool = False,
) -> Path:
    """With `calibration` (a text file), its first CALIBRATION_TOKENS tokens calibrate the rounding: AWQ's
    activation-aware scales, or GPTQ's error compensation (the model is held in fp32 on the CPU for it).
    `symmetric` (GPTQ): zero points fixed at 2**(bits-1), as vLLM's Marlin kernels want; asymmetric ones are
    written in the gptq_v2 format (v1 cannot store a zero point of 0)."""
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"method={method!r} is invalid: must be one of {QUANTIZE_METHODS}")
    if method == "awq" and bits != 4:
        raise ValueError(f"bits={bits} is invalid for AWQ: must be 4")
    if method == "gptq" and bits not in (4, 8):
        raise ValueError(f"bits={bits} is invalid for GPTQ: must be 4 or 8")
    if method != "fp8" and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size={group_size} is invalid: must be a power of two >= 16")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config_dict(model_dir)
    if config.get("quantization_config"):
        raise ValueError(f"model={str(model_dir)!r} is quantized already; quantize a full-precision checkpoint")
    if calibration is not None and method == "fp8":
        raise ValueError("calibration is for method='awq' or 'gptq', not method='fp8'")
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = {
        name: source[tuple(slice(None) for _ in source.get_shape())]
        for name, source in iter_safetensors(safetensors_files(model_dir), True)
    }
    for name, tensor in weights.items():  # before any calibration work
        if method != "fp8" and _DECODER_LINEAR.match(name) and tensor.shape[1] % group_size:
            raise ValueError(
                f"group_size={group_size} is invalid for {name} with {tensor.shape[1]} input columns: "
                "must divide every linear layer's input size"
            )
    inputs: dict[str, torch.Tensor] = {}  # GPTQ's calibration activations, per linear layer
    if calibration is not None:
        ids = calibration_ids(model_dir, Path(calibration))
        if method == "awq":
            weights = awq_scaled_weights(model_dir, weights, ids, lambda w: rtn_dequantized(w, group_size))
        else:
            _, inputs = calibration_inputs(model_dir, ids)
    grid = rtn_symmetric if symmetric else rtn_asymmetric

    def quantizer(prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if method == "awq":
            return awq_tensors(weight, group_size)
        if method == "fp8":
            return fp8_tensors(weight)
        if prefix in inputs:
            return gptq_tensors(*gptq_quantize(weight, inputs[prefix], bits, group_size, grid), bits, symmetric)
        return gptq_tensors(*grid(weight, bits, group_size), bits, symmetric)

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(weights.items(), desc="Quantizing", disable=quiet):
        if _DECODER_LINEAR.match(name):
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.{k}": v for k, v in quantizer(prefix, tensor).items()})
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(method, bits, group_size, symmetric)
    if method != "fp8":
        config["torch_dtype"] = "float16"  # AWQ/GPTQ checkpoints are fp16 by convention (their scales are)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for path in model_dir.iterdir():  # tokenizer, chat template, generation config
        if (
            path.is_file()
            and path.suffix != ".safetensors"
            and path.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(path, out_dir / path.name)
    return out_dir


def rtn_dequantized(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """AWQ's rounding and back: what the scale search measures."""
    q, scales, zeros = rtn_asymmetric(weight, 4, group_size)
    per_column = {"repeats": group_size, "dim": 1}
    return (q - zeros.repeat_interleave(**per_column)) * scales.float().repeat_interleave(**per_column)


def quantization_config(method: str, bits: int, group_size: int, symmetric: bool = True) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "sym": symmetric,
            "desc_act": False,
            "checkpoint_format": "gptq" if symmetric else "gptq_v2",
        }
    fp8 = {"type": "float", "num_bits": 8, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "channel", "dynamic": False},
                "input_activations": {**fp8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def rtn_asymmetric(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """(q, scales, zeros) per group of `group_size` input columns: w ~= (q - zero) * scale, q in [0, 2**bits).
    (Clipping each group's range to the least squared weight error made SmolLM2's perplexity worse: outliers
    matter more than the bulk.)"""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    top = 2**bits - 1
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo).clamp_min(1e-5) / top).to(torch.float16)
    zeros = (-lo / scales.float()).round().clamp(0, top)
    q = (w / scales.float()[..., None]).round() + zeros[..., None]
    return q.clamp(0, top).reshape(n, k).to(torch.int32), scales, zeros.to(torch.int32)


def rtn_symmetric(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """GPTQ's symmetric grid: zero = 2**(bits-1), scale = 2 * absmax / (2**bits - 1)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group_size, group_size)
    top = 2**bits - 1
    scales = (2 * w.abs().amax(dim=-1)).clamp_min(1e-5).div(top).to(torch.float16)
    zero = 2 ** (bits - 1)
    q = ((w / scales.float()[..., None]).round() + zero).clamp(0, top)
    return q.reshape(n, k).to(torch.int32), scales, torch.full_like(scales, zero, dtype=torch.int32)


def awq_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [K/G, N/8] packed along N in AWQ's nibble order,
    scales [K/G, N]."""
    q, scales, zeros = rtn_asymmetric(weight, 4, group_size)

    def pack_awq(values: torch.Tensor) -> torch.Tensor:  # [rows, N] -> [rows, N / 8]
        reordered = values.reshape(values.shape[0], -1, 8)[..., AWQ_PACK_ORDER].reshape(values.shape)
        return pack_int32(reordered, 4)

    return {"qweight": pack_awq(q.T), "qzeros": pack_awq(zeros.T), "scales": scales.T.contiguous()}


def gptq_tensors(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, symmetric: bool
) -> dict[str, torch.Tensor]:
    """GPTQ: qweight [K * bits / 32, N] packed along K, qzeros [K/G, N * bits / 32] holding zero - 1 (v1, the
    symmetric grid's format) or zero (v2), scales [K/G, N], g_idx [K]."""
    k, group_size = q.shape[1], q.shape[1] // scales.shape[1]
    stored_zeros = zeros - 1 if symmetric else zeros
    return {
        "qweight": pack_int32(q, bits).T.contiguous(),
        "qzeros": pack_int32(stored_zeros.T.contiguous(), bits),
        "scales": scales.T.contiguous(),
        "g_idx": torch.arange(k, dtype=torch.int32) // group_size,
    }


def fp8_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """e4m3 weight [N, K] and one fp32 scale per output channel, [N, 1] as compressed-tensors stores it."""
    q, scale = quantize_fp8_rows(weight)
    return {"weight": q, "weight_scale": scale[:, None]}
