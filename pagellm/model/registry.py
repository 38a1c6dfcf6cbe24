"""Which model class serves which HF architecture name."""

from __future__ import annotations

from pagellm.config import SUPPORTED_ARCHITECTURES, ModelConfig
from pagellm.model.llama import LlamaForCausalLM

# One implementation covers the family; the differences are flags read from config.json.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[config.architecture]
