"""The HF tokenizer, its chat template, and incremental detokenization (via `tokenizers.DecodeStream`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from tokenizers.decoders import DecodeStream

from pagellm.errors import InvalidParameter

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Beside a tokenizer pagellm saved (a GGUF file's conversion): the class AutoTokenizer loads it as, and under which
# transformers version. Transformers' generic fast tokenizer then loads it directly: AutoTokenizer would import the
# model's config module first, 1.1 s on the 2-core CPU machine (transformers 5.25: it pulls in sympy and
# torch.distributed.tensor), most of the embedded model's start-up wait for its tokenizer.
LOADED_AS_FILE = "pagellm_tokenizer.json"
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")  # transformers 4 and 5 names
# Names that apply_chat_template or the template itself already binds: extra template variables cannot take them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "bos_token",
        "eos_token",
        "raise_exception",
    }
)


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES)


def record_loaded_class(model_dir: str | Path) -> None:
    """Note in LOADED_AS_FILE the class AutoTokenizer loads the directory's tokenizer as (see `Tokenizer.from_dir`)."""
    import transformers

    loaded = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    record = {"class": type(loaded).__name__, "transformers": transformers.__version__}
    (Path(model_dir) / LOADED_AS_FILE).write_text(json.dumps(record))


def _loads_as_generic(model_dir: Path) -> bool:
    """Whether LOADED_AS_FILE says that this transformers version's AutoTokenizer loads the directory's tokenizer
    as the generic fast tokenizer."""
    try:
        record = json.loads((model_dir / LOADED_AS_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(record, dict):
        return False
    import transformers

    return record.get("class") in GENERIC_TOKENIZER_CLASSES and record.get("transformers") == transformers.__version__


def read_chat_template(template: str) -> str:
    """The text of a chat template option (vLLM's --chat-template): a Jinja file's path or, where it holds Jinja's
    braces or a line break, the template itself."""
    if any(char in template for char in "{}\n"):
        return template
    try:
        return Path(template).read_text()
    except OSError as exc:
        raise InvalidParameter(
            "chat_template",
            f"chat_template={template!r}: looks like a file's path, but it could not be read ({exc.strerror})",
        ) from None


class Tokenizer:
    """Thin wrapper over a transformers tokenizer: encode, decode, chat template, EOS ids."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer  # the Rust `tokenizers.Tokenizer`

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer saved in a model directory, or None when the directory has none."""
        if not has_tokenizer(path):
            return None
        if _loads_as_generic(Path(path)):  # what AutoTokenizer would load, without its detour (LOADED_AS_FILE)
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(path)))
        from transformers import AutoTokenizer  # a second of import time, spent only on models with a tokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def use_chat_template(self, template: str) -> None:
        """Replace the model's chat template with `template`'s text (see `read_chat_template`)."""
        self.hf.chat_template = template

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        require_unicode(text, "prompt")
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as the model's chat template writes it, with the tools it may call (OpenAI's
        format); `template_kwargs` are extra template variables (e.g. enable_thinking). continue_final_message
        leaves the last message open (no end-of-turn after it), so the model goes on with it."""
        if not self.hf.chat_template:
            raise InvalidParameter(
                "messages", "messages: this model's tokenizer has no chat template; send a plain prompt instead"
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidParameter(
                "continue_final_message",
                "continue_final_message: cannot be combined with add_generation_prompt=true (set it to false)",
            )
        template_kwargs = template_kwargs or {}
        taken = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(template_kwargs))
        if taken:
            raise InvalidParameter(
                "chat_template_kwargs",
                f"chat_template_kwargs: {', '.join(taken)} is set by the server, not the request",
            )
        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
        except TemplateError as exc:
            raise InvalidParameter("messages", f"messages: the chat template rejected them: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # The template is the model's code run on the request's data: a crash in it is the request's fault.
            raise InvalidParameter("messages", f"messages: the chat template failed on them: {exc!r}") from exc

    def chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, template_kwargs, tools, continue_final_message)
        require_unicode(text, "messages")
        # The template already wrote the special tokens (BOS and role markers): add none.
        return self.hf.encode(text, add_special_tokens=False)


def require_unicode(text: str, field: str) -> None:
    """InvalidParameter unless `text` is valid Unicode: JSON may carry a lone UTF-16 surrogate (an unpaired
    \\udXXX escape), which Python keeps in a str but the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        raise InvalidParameter(field, f"{field}: not valid Unicode text (a lone surrogate, U+{bad:04X})") from exc


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one step at a time, without re-decoding everything.

    `DecodeStream` holds back bytes of a multi-byte character split across tokens until it is complete.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        # Seeding with the prompt's tail lets the first output token decode with its correct leading space.
        self._stream = DecodeStream(ids=prompt_ids[-8:], skip_special_tokens=skip_special_tokens)
        self._stream.step(tokenizer.backend, [])
        self.text = ""

    def step(self, token_id: int) -> str:
        """Decode one more token; returns the text it adds (possibly empty)."""
        piece = self._stream.step(self._tokenizer.backend, token_id) or ""
        self.text += piece
        return piece
