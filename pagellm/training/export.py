"""Training checkpoint -> standard HF Llama directory (config.json, model.safetensors, generation_config.json,
tokenizer files) that both transformers and `pagellm.LLM` load."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHECKPOINT = "checkpoint.pt"


def export_hf(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """`pagellm convert --checkpoint`: rebuild the model from a training checkpoint and write the HF directory.
    The tokenizer is read from the checkpoint's directory."""
    checkpoint = Path(checkpoint)
    if checkpoint.is_dir():
        checkpoint = checkpoint / CHECKPOINT
    if not checkpoint.exists():
        raise ValueError(f"checkpoint={str(checkpoint)!r} does not exist")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    model = LlamaForCausalLM(LlamaConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(checkpoint.parent))
    return export_hf(model.float().eval(), tokenizer, out_dir)
