"""What a chat reply becomes in the response: reasoning, content and tool calls, by the request's tool_choice and
the server's parsers; and the structure tool_choice `required` or a named function forces on the output."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagellm.engine.structured_outputs import check_json_schema
from pagellm.errors import InvalidParameter
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.server.protocol import ChatCompletionRequest, NamedToolChoice
from pagellm.server.tool_parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    WHITESPACE,
    PartialCall,
    Qwen3ReasoningParser,
    ToolCall,
    json_value_end,
    skip,
    streamed_call_sequence,
)

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ChatReply:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChatOutputRules:
    """How one request's reply text is split. tool_mode: "none" (content only), "auto" (the tool parser finds
    calls), "required" (a JSON list of {"name", "parameters"}) or "named" (the JSON arguments of `function`)."""

    tool_mode: str = "none"
    tool_parser: Any = None  # a tool_parsers parser, for "auto"
    reasoning_parser: Qwen3ReasoningParser | None = None
    function: str | None = None

    def final(self, text: str) -> ChatReply:
        reasoning, content = self.reasoning_parser.split(text) if self.reasoning_parser else (None, text)
        if self.tool_mode == "auto":
            content, calls = self.tool_parser.parse(content)
            return ChatReply(reasoning, content, calls)
        if self.tool_mode in ("required", "named"):
            calls = self._forced_calls(content)
            if calls is not None:
                return ChatReply(reasoning, None, calls)
        return ChatReply(reasoning, content)  # "none", or forced output cut short (max_tokens)

    def streaming(self, text: str) -> tuple[str, str, list[PartialCall]]:
        """(reasoning, content, tool calls) of the reply so far that can be sent: the content stops where tool-call
        text may begin, the calls are as far as they are written."""
        reasoning, content = self.reasoning_parser.split_streaming(text) if self.reasoning_parser else ("", text)
        if self.tool_mode == "auto":
            return reasoning, content[: self.tool_parser.streamable(content)], self.tool_parser.streaming_calls(content)
        start = skip(content, 0, WHITESPACE)
        if self.tool_mode == "required":  # [{"name": ..., "parameters": {...}}, ...]
            if not content.startswith("[", start):
                return reasoning, "", []
            first = skip(content, start + 1, WHITESPACE)
            return reasoning, "", streamed_call_sequence(content, first, WHITESPACE + ",")
        if self.tool_mode == "named":  # the arguments object itself
            if not content.startswith("{", start):
                return reasoning, "", []
            end = json_value_end(content, start)
            return reasoning, "", [PartialCall(self.function, content[start:end], end is not None)]
        return reasoning, content, []

    def _forced_calls(self, text: str) -> list[ToolCall] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.tool_mode == "named":
            return [ToolCall(self.function, json.dumps(value, ensure_ascii=False))]
        return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]


def finished_calls(streamed: list[PartialCall], parsed: list[ToolCall]) -> list[PartialCall]:
    """The calls of a finished reply in the form its stream sent them: the streamed text of each call's arguments
    when the stream saw the same calls, whole; else the parsed calls (a format the streaming scan does not read,
    such as arguments written as a JSON string)."""
    if [c.name for c in streamed] == [c.name for c in parsed] and all(c.complete for c in streamed):
        return streamed
    return [PartialCall(call.name, call.arguments, True) for call in parsed]


def chat_output_rules(
    req: ChatCompletionRequest, tool_parser: str | None, reasoning_parser: str | None
) -> tuple[ChatOutputRules, StructuredOutputsParams | None]:
    """The request's output rules and the structure its tool_choice forces (None: nothing forced). Raises
    InvalidParameter for tools or a tool_choice the server cannot serve."""
    reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
    tools = req.tools or []
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            check_json_schema(tool.function.parameters, f"tools.{i}.function.parameters")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ChatOutputRules(reasoning_parser=reasoning), None
    if not tools:
        raise InvalidParameter("tool_choice", f"tool_choice={_name(choice)!r} needs tools")
    if choice == "auto":
        if tool_parser is None:
            raise InvalidParameter("tool_choice", "tool_choice='auto' needs the server started with --tool-call-parser")
        return ChatOutputRules("auto", TOOL_PARSERS[tool_parser](), reasoning), None
    if choice == "required":
        schema = required_calls_schema(tools, req.parallel_tool_calls)
        return ChatOutputRules("required", reasoning_parser=reasoning), StructuredOutputsParams(json=schema)
    by_name = {tool.function.name: tool for tool in tools}
    if choice.function.name not in by_name:
        raise InvalidParameter(
            "tool_choice.function.name",
            f"tool_choice.function.name={choice.function.name!r} is not among the tools: {sorted(by_name)}",
        )
    parameters = by_name[choice.function.name].function.parameters or NO_PARAMETERS
    rules = ChatOutputRules("named", reasoning_parser=reasoning, function=choice.function.name)
    return rules, StructuredOutputsParams(json=parameters)


def required_calls_schema(tools: list, parallel: bool) -> dict[str, Any]:
    """A JSON list of one or more (one only without parallel calls) {"name", "parameters"} of the given tools."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "parameters": tool.function.parameters or NO_PARAMETERS,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _name(choice: str | NamedToolChoice) -> str:
    return choice if isinstance(choice, str) else choice.function.name
