"""Tool calls in model output, per model family (vLLM's `--tool-call-parser` names), and the reasoning split.

A parser turns a finished reply into (content, tool calls), and while the reply streams says where tool-call text
begins (or may begin), so that no part of a call is streamed as content.
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
                pos = _skip(body, pos, " \n\t;")
        except ValueError:
            return text, []
        return None, calls

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped) or stripped.startswith((self.TAG, "{")):
            return 0  # may still be, or is, a call: nothing streams as content
        return len(text)


class PythonicToolParser:
    """Llama 3.2 / 4 style: `[get_weather(city="Paris"), add(a=1, b=2)]`, arguments as Python literals."""

    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
                return text, []
            calls = []
            for element in tree.elts:
                if not isinstance(element.func, ast.Name) or element.args:
                    return text, []
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in element.keywords}
                calls.append(ToolCall(element.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (SyntaxError, ValueError):
            return text, []
        return None, calls

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith(("[", "<|python_start|>")) else len(text)


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)}


def _skip(text: str, pos: int, chars: str) -> int:
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
