"""SamplingParams: how one request picks its tokens and when it stops (vLLM-compatible names and defaults)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace

from pagellm.errors import InvalidParameter, invalid_value

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top tokens a request may ask for per position


class RequestOutputKind(enum.Enum):
    """When and what the engine reports on a request (vLLM's names): after every new token everything so far
    (CUMULATIVE) or only what is new since the last report (DELTA: new tokens, text and logprobs; the prompt's fields
    come with the first report only), or once, when it finishes (FINAL_ONLY)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputsParams' constraints


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's names): exactly one of a JSON schema, any JSON object, a regex, a
    choice among strings, or a grammar (EBNF as xgrammar reads it, or Lark)."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond the separators

    def __post_init__(self) -> None:
        kinds = self._given()
        if len(kinds) != 1:
            raise InvalidParameter(
                "structured_outputs",
                "structured_outputs: set exactly one of json, json_object, regex, choice and grammar"
                + (f" (got {', '.join(kinds)})" if kinds else ""),
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise InvalidParameter(
                    "structured_outputs.json",
                    f"structured_outputs.json: a string schema must be JSON ({exc.msg} at character {exc.pos})",
                ) from exc
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise invalid_value("structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise invalid_value(f"structured_outputs.{name}", "", "a non-empty string")

    @property
    def kind(self) -> str:
        return self._given()[0]

    def _given(self) -> list[str]:
        """The constraints given: the empty schema ({}, any JSON) is one; so is an empty choice or pattern, refused."""
        return [name for name in _KINDS if getattr(self, name) not in (None, False)]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM's)
    bad_words: list[str] | None = None  # never complete one of these words (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Keep only the prompt's last k tokens (vLLM's; -1: as many as leave room for one output token).
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled in by the engine: the model's EOS ids, unless ignore_eos; the token sequences of the bad words.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(self.bad_words or [])
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise InvalidParameter("structured_outputs", f"structured_outputs: {exc}") from exc
        if self.top_k in (None, -1):  # vLLM spells "no top-k" as -1
            self.top_k = 0
        self._validate()
        if self.temperature < _GREEDY_EPS:  # vLLM treats tiny temperatures as greedy
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0 (0 means greedy)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "0 or -1 (disabled) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0 (1 means no penalty)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer or None"),
            (
                "max_tokens",
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "an integer >= 1 or None",
            ),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0, "an integer >= 0"),
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens is None
                or (isinstance(self.truncate_prompt_tokens, int) and self.truncate_prompt_tokens >= -1)
                and self.truncate_prompt_tokens != 0,
                "None, -1 (as many as fit) or an integer >= 1",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "a list of non-negative token ids",
            ),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None
                or (self.allowed_token_ids and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
                "None or a non-empty list of non-negative token ids",
            ),
            ("bad_words", all(isinstance(w, str) and w.strip() for w in self.bad_words), "a list of non-blank strings"),
            (
                "logit_bias",
                all(
                    isinstance(t, int) and t >= 0 and isinstance(b, int | float) and -100 <= b <= 100
                    for t, b in self.logit_bias.items()
                ),
                "a map of non-negative token ids to biases in [-100, 100]",
            ),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise invalid_value(name, getattr(self, name), allowed)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter(
                "min_tokens", f"min_tokens={self.min_tokens} is invalid: must be <= max_tokens={self.max_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether sampling depends on the tokens seen so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_output_history(self) -> bool:
        """Whether a row's mask or penalties read the tokens it generated so far (a bad word of several tokens is
        banned only where its first tokens were just generated)."""
        return self.has_penalties or any(len(ids) > 1 for ids in self.bad_words_token_ids)

    def for_child(self, index: int) -> SamplingParams:
        """Parameters of the index-th of n samples: one output each, seeds kept distinct."""
        seed = None if self.seed is None else self.seed + index
        return replace(
            self,
            n=1,
            seed=seed,
            all_stop_token_ids=set(self.all_stop_token_ids),
            logit_bias=dict(self.logit_bias),
            bad_words_token_ids=[list(ids) for ids in self.bad_words_token_ids],
        )
