"""What serving a model needs before (and without) its weights: its files, config, tokenizer, context limit and
the input processor. The engine builds one; a data-parallel front end builds its own and leaves the weights to
its replicas."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagellm.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagellm.engine.input_processor import InputProcessor, eos_token_ids
from pagellm.engine.structured_outputs import GrammarCompiler
from pagellm.model.loader import load_config_dict, resolve_model_dir
from pagellm.tokenizer import Tokenizer


@dataclass
class ModelFrontend:
    model_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    input_processor: InputProcessor


def load_frontend(config: EngineConfig) -> ModelFrontend:
    model_dir = resolve_model_dir(config.model, quiet=config.quiet)
    model_config = ModelConfig.from_dict(load_config_dict(model_dir))
    tokenizer = Tokenizer.from_dir(model_dir)
    max_model_len = resolve_max_model_len(config, model_config)
    eos_ids = eos_token_ids(model_dir, model_config, tokenizer)
    grammar_compiler = GrammarCompiler(tokenizer, model_config.vocab_size, eos_ids)
    processor = InputProcessor(tokenizer, model_config, max_model_len, eos_ids, grammar_compiler)
    return ModelFrontend(model_dir, model_config, tokenizer, max_model_len, processor)
