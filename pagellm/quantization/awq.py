"""AWQ's activation-aware scaling (Lin et al., 2023): before rounding, scale each linear layer's input channels by
s = mean|x|^alpha, so the channels that carry large activations lose less to rounding, and divide the operation
that feeds the layer by s, which leaves the full-precision model unchanged. Alpha is searched per layer group on
calibration text, minimising the group's output error after group-wise rounding.

The groups and what feeds them, per decoder layer: q/k/v (input_layernorm), o_proj (v_proj's rows: only where
every attention head has its own KV head), gate/up (post_attention_layernorm), down_proj (up_proj's rows). The
activations come from one full-precision pass of HF transformers over the calibration tokens: scaling is exact in
full precision, so later layers see the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pagellm.quantization.calibration import calibration_inputs

ALPHAS = [i / 20 for i in range(21)]


def awq_scaled_weights(
    model_dir: Path,
    weights: dict[str, torch.Tensor],
    calibration_ids: list[int],
    quantize_dequantize: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with AWQ's scales folded in (decoder linears scaled, norms and feeding
    projections divided); `quantize_dequantize` is the rounding the search measures."""
    config, inputs = calibration_inputs(model_dir, calibration_ids)
    out = {name: tensor.float().clone() for name, tensor in weights.items()}
    mha = config.num_attention_heads == config.num_key_value_heads
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        groups = [
            ([f"{prefix}.self_attn.{p}_proj" for p in "qkv"], f"{prefix}.input_layernorm", "norm"),
            ([f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"], f"{prefix}.post_attention_layernorm", "norm"),
            ([f"{prefix}.mlp.down_proj"], f"{prefix}.mlp.up_proj", "rows"),
        ]
        if mha:
            groups.insert(1, ([f"{prefix}.self_attn.o_proj"], f"{prefix}.self_attn.v_proj", "rows"))
        for linears, feeder, kind in groups:
            x = inputs[linears[0]]
            scale = _best_scale(x, [out[f"{name}.weight"] for name in linears], quantize_dequantize)
            for name in linears:
                out[f"{name}.weight"] *= scale[None, :]
            out[f"{feeder}.weight"] /= scale if kind == "norm" else scale[:, None]
            if f"{feeder}.bias" in out:  # Qwen2's v_proj
                out[f"{feeder}.bias"] /= scale
    return {name: tensor.to(weights[name].dtype) for name, tensor in out.items()}


def _best_scale(
    x: torch.Tensor, weights: list[torch.Tensor], quantize_dequantize: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The per-input-channel scale (over ALPHAS) whose rounded weights reproduce x @ W^T best."""
    x_mean = x.abs().mean(dim=0).clamp_min(1e-8)
    reference = [x @ w.T for w in weights]
    best, best_err = torch.ones_like(x_mean), float("inf")
    for alpha in ALPHAS:
        scale = x_mean.pow(alpha)
        scale = scale / (scale.max() * scale.min()).sqrt()  # keeps the scales centred on one
        err = sum(
            (x @ (quantize_dequantize(w * scale[None, :]) / scale[None, :]).T - ref).pow(2).sum().item()
            for w, ref in zip(weights, reference)
        )
        if err < best_err:
            best, best_err = scale, err
    return best
