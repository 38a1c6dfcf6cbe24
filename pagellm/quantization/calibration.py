"""Calibration activations: each decoder linear's inputs over some text, from one full-precision pass of HF
transformers (the quantizers that look at activations, AWQ and GPTQ, start from these)."""

from __future__ import annotations

from pathlib import Path

import torch

CALIBRATION_TOKENS = 512


def calibration_ids(model_dir: Path, text_file: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(text_file.read_text())["input_ids"][:CALIBRATION_TOKENS]
    if len(ids) < 64:
        raise ValueError(f"calibration={str(text_file)!r} holds {len(ids)} tokens: give at least 64")
    return ids


def calibration_inputs(model_dir: Path, ids: list[int]) -> tuple[object, dict[str, torch.Tensor]]:
    """Each decoder linear's input activations [tokens, in_features] over the calibration tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:

            def record(_module, args, _output, name=name) -> None:
                inputs[name] = args[0].reshape(-1, args[0].shape[-1]).detach()

            hooks.append(module.register_forward_hook(record))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return model.config, inputs
