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
from pagellm.tokenizer import Tokenizer, has_tokenizer, read_chat_template


class ModelFrontend:
    """The part of an engine that is there before its weights: its config, the model's files and config, the
    tokenizer, the context limit, the input processor and the sampling defaults (`generation_config`). `Engine`
    and `EngineCoreClient` (which leaves the weights to its processes) are built on it: `find_model`, which checks
    every option, then `load_tokenizer`, which its subclasses run beside their own start-up (importing transformers
    and reading the tokenizer take 1-3 s)."""

    def __init__(self, config: EngineConfig) -> None:
        self.find_model(config)
        self.load_tokenizer()

    def find_model(self, config: EngineConfig) -> None:
        """The model's files and config, the context limit, the sampling defaults and the chat template's text:
        quick, and where a bad option is an error before anything is loaded."""
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model, quiet=config.quiet)
        self.model_config = ModelConfig.from_dict(load_config_dict(self.model_dir))
        self._chat_template: str | None = None
        if config.chat_template is not None:
            if not has_tokenizer(self.model_dir):
                raise InvalidParameter("chat_template", "chat_template: this model has no tokenizer to apply it with")
            self._chat_template = read_chat_template(config.chat_template)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.default_sampling = sampling_defaults(self.model_dir, config.generation_config)

    def load_tokenizer(self) -> None:
        """The tokenizer and what needs it: the EOS ids, the grammar compiler and the input processor."""
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(self.model_dir)
        if self._chat_template is not None:
            self.tokenizer.use_chat_template(self._chat_template)
        eos_ids = eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, eos_ids)
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, self.max_model_len, eos_ids, grammar_compiler
        )
