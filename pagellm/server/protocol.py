"""OpenAI-compatible request bodies (pydantic) and their mapping onto SamplingParams.

Field names follow the OpenAI API plus vLLM's extras (top_k, min_p, repetition_penalty, prompt_logprobs, ...). Range
checks live in SamplingParams, so the library and the server reject the same values with the same messages. No
field is dropped silently: an unknown field is a 400, and a known one this server does not implement is a 400
naming it unless it carries its "off" value.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagellm.engine.beam_search import BeamSearchParams
from pagellm.errors import InvalidParameter
from pagellm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on samples per prompt


class StrictModel(BaseModel):
    # Infinity, NaN and 1e309 are not numbers a client can mean: 400, like any other bad value.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk also carries its choice's usage so far


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(StrictModel):
    """vLLM's `structured_outputs` extra body."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False


# Known fields this server does not implement: (field, the values that mean "not used", what the field asks for).
_NOT_IMPLEMENTED: list[tuple[str, tuple[Any, ...], str]] = [
    ("functions", (None, []), "function calling with `functions` (send `tools`)"),
    ("function_call", (None, "none"), "function calling with `function_call` (send `tool_choice`)"),
    ("suffix", (None, ""), "insertion (suffix)"),
    # vLLM's default; HF's fast tokenizers (the only kind loaded here) decode as their vocabulary says
    ("spaces_between_special_tokens", (True,), "choosing spaces between special tokens"),
]
# vLLM's older names for structured outputs: field -> StructuredOutputsParams field.
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the client's own records: it changes no output
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False  # vLLM's: n beams, whose n best hypotheses are the choices
    length_penalty: float = 1.0  # beam search's: hypotheses rank by log-probability / length ** length_penalty

    def beam_search_params(self, params: SamplingParams, max_model_len: int) -> BeamSearchParams | None:
        """What `use_beam_search` asks for: n beams, params' max_tokens (None: to the context's end). Deterministic
        (temperature and the other sampling fields play no part); what it cannot go with is refused."""
        if not self.use_beam_search:
            return None
        for name, requested in self.beam_search_exclusions(params).items():
            if requested:
                raise InvalidParameter("use_beam_search", f"use_beam_search: not available with {name}")
        try:
            return BeamSearchParams(self.n, params.max_tokens or max_model_len, params.ignore_eos, self.length_penalty)
        except InvalidParameter as exc:
            field = "n" if exc.param == "beam_width" else exc.param
            raise InvalidParameter(field, f"{field}: with use_beam_search, {exc}") from None

    def beam_search_exclusions(self, params: SamplingParams) -> dict[str, bool]:
        """The fields beam search cannot go with, and whether this request sets them."""
        return {
            "stream": self.stream,
            "logprobs": params.logprobs is not None,
            "prompt_logprobs": params.prompt_logprobs is not None,
            "structured outputs": params.structured_outputs is not None,
        }

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None,
        defaults: Mapping[str, Any],
    ) -> SamplingParams:
        """`defaults`: the model's (`generation_config`), for the sampling fields the request leaves unset; their
        max_tokens is also the ceiling of the request's, as in vLLM."""
        self._check_supported()

        def unless_set(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        if defaults.get("max_tokens") is not None:
            max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
        return SamplingParams(
            n=self.n,
            temperature=unless_set("temperature", 1.0),
            top_p=unless_set("top_p", 1.0),
            top_k=unless_set("top_k", 0),
            min_p=unless_set("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=unless_set("repetition_penalty", 1.0),
            logit_bias=self._token_biases(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            # A whole response needs only the final output: no output is built for it at every step (vLLM's way).
            output_kind=RequestOutputKind.CUMULATIVE if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    def requested_structure(self) -> tuple[str, StructuredOutputsParams] | None:
        """The output constraint the request asks for, and the field it came from (which a bad schema's error
        names). At most one field may ask."""
        found: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise InvalidParameter("response_format.json_schema", "response_format.json_schema: required")
            found.append(("response_format.json_schema.schema", {"json": self.response_format.json_schema.json_schema}))
        if self.structured_outputs is not None:
            body = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            found.append(("structured_outputs", body))
        for name, kind in GUIDED_ALIASES.items():
            if getattr(self, name) is not None:
                found.append((name, {kind: getattr(self, name)}))
        if len(found) > 1:
            raise InvalidParameter(found[1][0], f"{found[1][0]}: only one of {found[0][0]} and it may be set")
        if not found:
            return None
        field, spec = found[0]
        try:
            return field, StructuredOutputsParams(**spec)
        except InvalidParameter as exc:  # named after the request's field (a message may name it already)
            message = str(exc) if str(exc).startswith(field) else f"{field}: {exc}"
            raise InvalidParameter(field, message) from exc

    def _check_supported(self) -> None:
        for name, off_values, feature in _NOT_IMPLEMENTED:
            value = getattr(self, name, None)
            if all(value != off for off in off_values):
                raise InvalidParameter(name, f"{name}: {feature} is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options", "stream_options: only allowed with stream=true")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidParameter("prompt_logprobs", "prompt_logprobs: not available with stream=true")

    def _token_biases(self) -> dict[int, float]:
        """logit_bias's keys are token ids written as strings (JSON object keys)."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise InvalidParameter("logit_bias", f"logit_bias: keys must be token ids, got {key!r}")
            biases[int(key)] = bias
        return biases

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(t, int) for t in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def prompt_only(self) -> bool:
        """max_tokens=0 with echo: the prompt alone (and its logprobs), as lm-evaluation-harness scores text."""
        return self.echo and self.max_tokens == 0

    def beam_search_exclusions(self, params: SamplingParams) -> dict[str, bool]:
        return {**super().beam_search_exclusions(params), "echo": self.echo}

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of", f"best_of={self.best_of} is not supported: must equal n")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameter("max_tokens", "max_tokens: 0 is only valid with echo=true (the prompt alone)")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # echoed prompt tokens carry logprobs too
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        # The prompt alone still needs one step to score it: one token is drawn and not returned.
        max_tokens = 1 if self.prompt_only else self.max_tokens
        structure = self.requested_structure()
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs, structure and structure[1], defaults)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # image, audio and file parts have their own keys

    type: str
    text: str | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_message(self, position: int) -> dict[str, Any]:
        """The message as the chat template reads it: content as plain text."""
        message: dict[str, Any] = {"role": self.role, "content": self._text(position)}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls is not None:
            message["tool_calls"] = [
                _template_tool_call(call, f"messages.{position}.tool_calls.{i}")
                for i, call in enumerate(self.tool_calls)
            ]
        return message

    def _text(self, position: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise InvalidParameter(
                    f"messages.{position}.content.{j}",
                    f"messages.{position}.content.{j}: a {part.type!r} part; this model takes text parts only",
                )
        return "".join(part.text for part in self.content)


def _template_tool_call(call: dict[str, Any], field: str) -> dict[str, Any]:
    """An earlier tool call as templates read it: OpenAI sends its arguments as JSON text, templates (Qwen's,
    Llama's) write them out as an object."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParameter(field, f"{field}: needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as exc:
            raise InvalidParameter(field, f"{field}: function.arguments is not JSON") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.template_message(i) for i, m in enumerate(messages)]


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message is left open for the model to go on with (a prefilled reply)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def to_sampling_params(
        self, structured_outputs: StructuredOutputsParams | None, defaults: Mapping[str, Any]
    ) -> SamplingParams:
        """`structured_outputs`: what the request's own fields ask for (`requested_structure`) or what its
        tool_choice forces; `defaults`: the model's sampling defaults."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(
            self.requested_max_tokens, logprobs, self.prompt_logprobs, structured_outputs, defaults
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
