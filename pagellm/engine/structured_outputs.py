"""Structured outputs: grammars compiled by xgrammar, one matcher per constrained sample, and the per-step token
bitmask of the constrained rows.

Compiling happens with input processing, on the caller's thread (a bad schema is a 400 before anything is queued;
the engine thread never waits for a compile), and compiled grammars are cached by their source. On the engine
thread, a sample's matcher is advanced by each token the scheduler accepts and nothing else, so it never needs
rolling back: the bitmask of a look-ahead step is filled once the step before it has come back (while the
look-ahead step's forward pass runs on the device), on a thread of its own, so that the engine thread processes
the step's outputs meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from pagellm.core.step import GrammarBitmask, RequestUpdate, SchedulerOutput
from pagellm.errors import InvalidParameter
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.tokenizer import Tokenizer, require_unicode

if TYPE_CHECKING:
    import xgrammar

# JSON-schema keywords xgrammar would not enforce (checked on xgrammar 0.2.9): refused rather than ignored.
UNSUPPORTED_SCHEMA_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
)
MAX_WHITESPACE = 20  # JSON: the longest whitespace run allowed between tokens (no endless runs of spaces)
_CACHE_SIZE = 256
# xgrammar's batch fill releases the GIL (its one-matcher fill does not), so it runs beside the engine thread; from
# this many constrained rows on it uses several threads, below it one (starting threads costs ~1 ms a call).
BATCH_FILL_ROWS = 48
FILL_THREADS = min(8, (os.cpu_count() or 1) // 2)

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles StructuredOutputsParams to xgrammar grammars for one tokenizer; safe on any thread."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None  # built on first use: it reads the vocabulary
        self._cache: dict[tuple[str, str, bool], xgrammar.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The grammar of `params`, or InvalidParameter naming the field at fault."""
        if self.tokenizer is None:
            raise InvalidParameter("structured_outputs", "structured_outputs: this model has no tokenizer")
        kind = params.kind
        source = _source(params)
        key = (kind, source, params.disable_any_whitespace)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        compiled = self._compile(kind, source, params.disable_any_whitespace)
        with self._lock:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def opens_with_any(self, grammar: xgrammar.CompiledGrammar, token_ids: Iterable[int]) -> bool:
        """Whether an output of `grammar` may start with one of `token_ids` (bit t % 32 of word t // 32 of the
        first step's mask)."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)
        xgrammar.GrammarMatcher(grammar).fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        return any((words[t // 32] >> (t % 32)) & 1 for t in token_ids)

    def _compile(self, kind: str, source: str, compact: bool) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        field = f"structured_outputs.{kind}"
        require_unicode(source, field)  # xgrammar takes UTF-8
        try:
            if kind == "json":
                check_json_schema(json.loads(source), field)
                return _json_grammar(compiler, source, compact)
            if kind == "json_object":  # any object (xgrammar's built-in JSON grammar takes any value)
                return _json_grammar(compiler, '{"type": "object"}', compact, strict=False)
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(source)))
            if "::=" in source:  # xgrammar's EBNF; anything else is read as Lark
                return compiler.compile_grammar(source)
            return compiler.compile_lark(source)
        except RuntimeError as exc:  # xgrammar's parse and conversion errors
            raise InvalidParameter(field, f"{field}: {_xgrammar_message(exc)}") from exc
        except UnicodeDecodeError as exc:  # an error whose message xgrammar cut inside a multi-byte character
            raise InvalidParameter(field, f"{field}: xgrammar could not parse it") from exc

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer.hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # cached above, by source
            return self._compiler


def _json_grammar(
    compiler: xgrammar.GrammarCompiler, schema: str, compact: bool, strict: bool = True
) -> xgrammar.CompiledGrammar:
    """strict: no properties or items beyond those the schema names (xgrammar's strict mode)."""
    whitespace = None if compact else MAX_WHITESPACE
    return compiler.compile_json_schema(
        schema, any_whitespace=not compact, max_whitespace_cnt=whitespace, strict_mode=strict
    )


def _source(params: StructuredOutputsParams) -> str:
    if params.json is not None:
        return params.json if isinstance(params.json, str) else json.dumps(params.json, sort_keys=True)
    if params.choice is not None:
        return json.dumps(params.choice)
    return params.regex or params.grammar or ""


def check_json_schema(schema: Any, field: str) -> None:
    """A valid JSON schema (against its metaschema) that uses only keywords the grammar enforces."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidParameter(field, f"{field}: not a valid JSON schema: {exc.message}") from exc
    path = _unsupported_keyword(schema, "#")
    if path is not None:
        raise InvalidParameter(field, f"{field}: {path} is not supported (the output could not be held to it)")


def _unsupported_keyword(node: Any, path: str) -> str | None:
    if isinstance(node, list):
        return next((p for i, item in enumerate(node) if (p := _unsupported_keyword(item, f"{path}/{i}"))), None)
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        if key in UNSUPPORTED_SCHEMA_KEYWORDS or (key == "allOf" and isinstance(value, list) and len(value) > 1):
            return f"{path}/{key}"
        if key in ("enum", "const", "default", "examples"):  # values, not schemas
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions") and isinstance(value, dict):
            # Names to schemas: a property may be called "not" or "if".
            children = ((f"{path}/{key}/{name}", sub) for name, sub in value.items())
        else:
            children = iter([(f"{path}/{key}", value)])
        for child_path, child in children:
            found = _unsupported_keyword(child, child_path)
            if found is not None:
                return found
    return None


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly the choices."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _xgrammar_message(exc: RuntimeError) -> str:
    """xgrammar's message without its '[time] /path/file.cc:line: ' prefix."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc)).strip()


class StructuredOutputs:
    """The engine thread's side: a matcher per constrained sample, advanced by the tokens it is given."""

    def __init__(self, vocab_size: int, pin_memory: bool, stop_token_ids: Iterable[int]) -> None:
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        # A matcher terminates only by accepting one of these (the compiler's), so no other token needs the check.
        self._stop_token_ids = frozenset(stop_token_ids)
        self._fillers: dict[int, xgrammar.BatchGrammarMatcher] = {}  # by thread count
        self._fill_thread: ThreadPoolExecutor | None = None
        self._words = (vocab_size + 31) // 32
        self._pin_memory = pin_memory
        # One bitmask buffer for every step: a step's mask is filled only after the tokens of the step before it
        # came back, and those were sampled after that step's mask had been copied to the device. Pinned for the
        # GPU; allocating (and pinning) a fresh mask each step took ~1 ms of host time per step on the H200 host.
        self._buffer = torch.empty((0, self._words), dtype=torch.int32)

    def add(self, request_id: str, grammar: xgrammar.CompiledGrammar) -> None:
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(grammar)

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def accept(self, updates: list[RequestUpdate]) -> None:
        """Advance the matchers by the step's new tokens; forget the samples that finished, and those whose grammar
        is complete although the sample goes on (a stop token under ignore_eos or min_tokens): what they sample
        after it is unconstrained (as in vLLM), there being nothing left for the grammar to allow."""
        for update in updates:
            matcher = self._matchers.get(update.request_id)
            if matcher is None or update.new_token_id is None:
                continue
            if update.finish_reason is not None:
                del self._matchers[update.request_id]
            elif not matcher.accept_token(update.new_token_id):
                # The row had no token left (allowed_token_ids or bad_words exclude all the grammar allows, past
                # the first token, which input processing checks): logged; the sample goes on unconstrained.
                logger.error("request %s: token %d is outside its grammar", update.request_id, update.new_token_id)
                del self._matchers[update.request_id]
            elif update.new_token_id in self._stop_token_ids and matcher.is_terminated():
                del self._matchers[update.request_id]

    def start_bitmask(self, step: SchedulerOutput) -> Future[GrammarBitmask | None]:
        """The allowed tokens of the step's constrained sampling rows (None when it has none), filled on the fill
        thread: until its result is taken, no matcher may be advanced or removed."""
        import xgrammar

        ids = [row.request_id for row in step.rows if row.sampling is not None and row.request_id in self._matchers]
        if not ids:
            done: Future[GrammarBitmask | None] = Future()
            done.set_result(None)
            return done
        threads = FILL_THREADS if len(ids) >= BATCH_FILL_ROWS else 1
        if threads not in self._fillers:
            self._fillers[threads] = xgrammar.BatchGrammarMatcher(max_threads=threads)
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-bitmask")
        matchers = [self._matchers[i] for i in ids]
        bitmask = self._rows(len(ids))
        started = threading.Event()

        def fill() -> GrammarBitmask:
            started.set()
            self._fillers[threads].batch_fill_next_token_bitmask(matchers, bitmask)  # sets every word of each row
            return GrammarBitmask(ids, bitmask)

        future = self._fill_thread.submit(fill)
        # The fill thread needs the GIL to reach xgrammar's call (which releases it). Left to itself it would get
        # it only once this thread blocks on the result (or after the 5 ms switch interval), so the fill would
        # run after the output processing instead of beside it: wait until it is under way.
        started.wait()
        return future

    def _rows(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the bitmask buffer, grown to a power of two when too small."""
        if self._buffer.shape[0] < rows:
            size = 1 << (rows - 1).bit_length()
            self._buffer = torch.empty((size, self._words), dtype=torch.int32, pin_memory=self._pin_memory)
        return self._buffer[:rows]
