"""What serving a model needs before (and without) its weights: its files, config, tokenizer, context limit and
the input processor. The engine is built on it, and so is the client of engines in other processes, which leaves
the weights to them."""

from __future__ import annotations

from pathlib import Path

from pagellm.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagellm.engine.generation_config import sampling_defaults
from pagellm.engine.input_processor import InputProcessor, eos_token_ids
from pagellm.engine.structured_outputs import GrammarCompiler
from pagellm.errors import InvalidParameter
from pagellm.model.loader import load_config_dict, resolve_model_dir
from pagellm.tokenizer import Tokenizer


class ModelFrontend:
    """The part of an engine that is there before its weights: its config, the model's files and config, the
    tokenizer, the context limit, the input processor and the sampling defaults (`generation_config`). `Engine`
    and `EngineCoreClient` (which leaves the weights to its processes) are built on it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model, quiet=config.quiet)
        self.model_config = ModelConfig.from_dict(load_config_dict(self.model_dir))
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(self.model_dir)
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise InvalidParameter("chat_template", "chat_template: this model has no tokenizer to apply it with")
            self.tokenizer.use_chat_template(config.chat_template)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.default_sampling = sampling_defaults(self.model_dir, config.generation_config)
        eos_ids = eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos_ids)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, self.max_model_len, eos_ids, grammar_compiler
        )
