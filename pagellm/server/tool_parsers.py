"""Tool calls in model output, per model family (vLLM's `--tool-call-parser` names), and the reasoning split.

A parser turns a finished reply into (content, tool calls), and while the reply streams says where tool-call text
begins (or may begin), so that no part of a call is streamed as content, and what its calls are so far: each once
its name is complete, with the text of its JSON arguments as far as the model wrote them (the pythonic format's
arguments are Python, so its calls come whole, each once its closing parenthesis is written).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """A tool call as far as a streaming reply tells: its name and a prefix of its arguments' JSON text (all of
    it once `complete`). The text grows as the reply does, so each prefix extends the one before."""

    name: str
    arguments: str
    complete: bool


WHITESPACE = " \n\t\r"
# The head of a call object, up to the '{' of its arguments: name first, as every supported format writes it.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def json_value_end(text: str, start: int) -> int | None:
    """Index after the JSON object or array opening at text[start], or None when the text ends inside it."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def streamed_call(text: str, pos: int) -> tuple[PartialCall | None, int | None]:
    """The call object `{"name": ..., "arguments" (or "parameters"): {...}}` at text[pos]: the call so far (None
    before its name is complete) and the index after the object (None while it is open)."""
    head = _CALL_HEAD.match(text, pos)
    if head is None:
        return None, None
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None, None
    arguments_end = json_value_end(text, head.end())
    if arguments_end is None:
        return PartialCall(name, text[head.end() :], False), None
    close = skip(text, arguments_end, WHITESPACE)
    end = close + 1 if close < len(text) and text[close] == "}" else None
    return PartialCall(name, text[head.end() : arguments_end], True), end


def streamed_call_sequence(text: str, pos: int, separators: str) -> list[PartialCall]:
    """The call objects from text[pos] on, one after the other with `separators` between them."""
    calls: list[PartialCall] = []
    while pos < len(text):
        call, end = streamed_call(text, pos)
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        pos = skip(text, end, separators)
    return calls


def _call(obj: Any, arguments_key: str) -> ToolCall:
    """A call from {"name": ..., arguments_key: {...}}; ValueError when obj is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be an object")
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesToolParser:
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number."""

    name = "hermes"
    START = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        try:
            calls = [_call(json.loads(body), "arguments") for body in self._CALL.findall(text[start:])]
        except ValueError:  # json.JSONDecodeError included: not a well-formed call, so plain text
            return text, []
        return text[:start].strip() or None, calls

    def streamable(self, text: str) -> int:
        """How much of the reply so far is content for sure: up to the first call, less a partial marker."""
        start = text.find(self.START)
        return start if start >= 0 else len(text) - _partial_marker(text, self.START)

    def streaming_calls(self, text: str) -> list[PartialCall]:
        calls = []
        for marker in re.finditer(re.escape(self.START), text):
            call, _ = streamed_call(text, skip(text, marker.end(), WHITESPACE))
            if call is None:
                break
            calls.append(call)
        return calls


class Llama3JsonToolParser:
    """Llama 3.1+: the reply is `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` when special tokens
    are kept), several separated by `;`."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        try:
            decoder, calls, pos = json.JSONDecoder(), [], 0
            while pos < len(body):
                obj, pos = decoder.raw_decode(body, pos)
                calls.append(_call(obj, "parameters"))
                pos = skip(body, pos, " \n\t;")
        except ValueError:
            return text, []
        return None, calls

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped) or stripped.startswith((self.TAG, "{")):
            return 0  # may still be, or is, a call: nothing streams as content
        return len(text)

    def streaming_calls(self, text: str) -> list[PartialCall]:
        pos = skip(text, 0, WHITESPACE)
        if text.startswith(self.TAG, pos):
            pos = skip(text, pos + len(self.TAG), WHITESPACE)
        return streamed_call_sequence(text, pos, WHITESPACE + ";")


class PythonicToolParser:
    """Llama 3.2 / 4 style: `[get_weather(city="Paris"), add(a=1, b=2)]`, arguments as Python literals."""

    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        calls = _python_calls(body) if body.startswith("[") and body.endswith("]") else None
        return (text, []) if calls is None else (None, calls)

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith(("[", "<|python_start|>")) else len(text)

    def streaming_calls(self, text: str) -> list[PartialCall]:
        """The calls whose closing parenthesis is written: the longest prefix that closes one parses as a list."""
        body = text.lstrip().removeprefix("<|python_start|>").lstrip()
        if not body.startswith("["):
            return []
        for end in range(len(body) - 1, 0, -1):
            if body[end] == ")":
                calls = _python_calls(body[: end + 1] + "]")
                if calls is not None:
                    return [PartialCall(call.name, call.arguments, True) for call in calls]
        return []


def _python_calls(body: str) -> list[ToolCall] | None:
    """The calls of a Python list of keyword-argument calls, or None when `body` is not one."""
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
            return None
        calls = []
        for element in tree.elts:
            if not isinstance(element.func, ast.Name) or element.args:
                return None
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in element.keywords}
            calls.append(ToolCall(element.func.id, json.dumps(arguments, ensure_ascii=False)))
    except (SyntaxError, ValueError):
        return None
    return calls


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}


def skip(text: str, pos: int, chars: str) -> int:
    """The index of the first character from `pos` on that is not one of `chars`."""
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


class Qwen3ReasoningParser:
    """`<think>...</think>` opening the reply (Qwen3, DeepSeek-R1 style): reasoning, then the answer."""

    name = "qwen3"
    START, END = "<think>", "</think>"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a finished reply."""
        if not text.startswith(self.START):
            return None, text
        body = text[len(self.START) :]
        end = body.find(self.END)
        if end < 0:  # cut off while thinking
            return body.strip("\n") or None, ""
        return body[:end].strip("\n") or None, body[end + len(self.END) :].lstrip("\n")

    def split_streaming(self, text: str) -> tuple[str, str]:
        """(reasoning, content) so far, each holding back a tail that may still turn into a tag."""
        if not text.startswith(self.START):
            return ("", "") if self.START.startswith(text) else ("", text)
        body = text[len(self.START) :].lstrip("\n")
        end = body.find(self.END)
        if end < 0:
            return body[: len(body) - _partial_marker(body, self.END)], ""
        return body[:end], body[end + len(self.END) :].lstrip("\n")


REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser,)}
