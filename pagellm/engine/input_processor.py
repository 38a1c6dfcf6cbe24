"""Input processing: prompts to validated token ids, and a request to its n samples. Reads only state fixed at
start-up (tokenizer, model limits), so it is safe on any thread: AsyncLLM validates on the caller's."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pagellm.config import ModelConfig
from pagellm.engine.structured_outputs import GrammarCompiler
from pagellm.errors import InvalidParameter
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar


@dataclass(frozen=True)
class SampleRequest:
    """One of a request's n samples, as the scheduler will run it."""

    request_id: str
    index: int
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what fits in max_model_len


@dataclass(frozen=True)
class ProcessedRequest:
    """A validated request: plain values, handed to the engine (and its thread) and never changed after."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleRequest]
    grammar: CompiledGrammar | None = None  # structured outputs: what every sample's tokens must follow
    arrival_time: float = field(default_factory=time.time)

    def renamed(self, request_id: str) -> ProcessedRequest:
        """The same request under another id (its samples' ids follow)."""
        n = len(self.samples)
        samples = [replace(s, request_id=sample_request_id(request_id, s.index, n)) for s in self.samples]
        return replace(self, request_id=request_id, samples=samples)


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """A sample's id: its request's own when the request has one sample."""
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        model_config: ModelConfig,
        max_model_len: int,
        eos_token_ids: set[int],
        grammar_compiler: GrammarCompiler,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammar_compiler = grammar_compiler

    def tokenize(self, prompt: str | list[int], truncate_prompt_tokens: int | None = None) -> list[int]:
        """Token ids of a prompt, validated: non-empty, ids in the vocabulary, shorter than max_model_len once
        cut to its last `truncate_prompt_tokens` (-1: to max_model_len - 1)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "prompt: this model has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidParameter("prompt", "prompt: must not be empty")
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            ids = ids[-keep:]
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidParameter("prompt", f"prompt: token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"prompt: {len(ids)} tokens is too long: max_model_len="
                f"{self.max_model_len} must leave room for at least one output token",
            )
        return ids

    def process(self, prompt: str | list[int], params: SamplingParams | None, request_id: str) -> ProcessedRequest:
        """Validate a request and fan it out into its n samples. The caller's `params` is left as it was: each
        sample gets its own copy, with the model's EOS ids as stop tokens unless ignore_eos."""
        ids = self.tokenize(prompt, params and params.truncate_prompt_tokens)
        params = params or SamplingParams()
        for name, token_ids in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            if any(t >= self.vocab_size for t in token_ids):
                raise InvalidParameter(name, f"{name}: token ids must be in [0, {self.vocab_size})")
        params = replace(
            params,
            all_stop_token_ids=set() if params.ignore_eos else set(self.eos_token_ids),
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
        )
        # Where every logit would be -inf, no token could be sampled: refused up front.
        banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
        usable = set(params.allowed_token_ids or []) - banned
        if params.allowed_token_ids and not usable:
            raise InvalidParameter("bad_words", "bad_words: they ban every token of allowed_token_ids")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler.compile(params.structured_outputs)
            if usable and not self.grammar_compiler.opens_with_any(grammar, usable):
                raise InvalidParameter(
                    "allowed_token_ids", "allowed_token_ids: the structured output can start with none of them"
                )
        n = params.n
        children = [params] if n == 1 else [params.for_child(i) for i in range(n)]
        samples = [SampleRequest(sample_request_id(request_id, i, n), i, p, max_tokens) for i, p in enumerate(children)]
        return ProcessedRequest(request_id, prompt if isinstance(prompt, str) else None, ids, samples, grammar)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """The token sequences that spell each bad word (vLLM's rule): the word as written and after a space
        (mid-sentence, BPE vocabularies spell a word with its leading space)."""
        if bad_words and self.tokenizer is None:
            raise InvalidParameter("bad_words", "bad_words: this model has no tokenizer to spell them")
        sequences: list[list[int]] = []
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences


def eos_token_ids(model_dir: Path, model_config: ModelConfig, tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end generation: config.json's, generation_config.json's and the tokenizer's EOS."""
    ids = set(model_config.eos_token_ids)
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
