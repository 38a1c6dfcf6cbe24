"""Structured outputs and tool calling through the `openai` client: every constrained output parses and validates
(jsonschema is the oracle), sampled at temperature 1, streamed and not; bad schemas are 400s."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server.conftest import MODEL, start_server
from tests.server.test_errors_and_load import CHAT, assert_error

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 12}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
     "required": ["score"]},
    {"type": "object", "properties": {"kind": {"const": "fruit"}, "name": NAME}, "required": ["kind", "name"]},
    {"anyOf": [{"type": "object", "properties": {"cat": NAME}, "required": ["cat"]},
               {"type": "object", "properties": {"dog": NAME}, "required": ["dog"]}]},
    {"type": "object", "properties": {"items": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0,
     "maximum": 9}, {"enum": ["a", "b"]}], "items": False, "minItems": 2}}, "required": ["items"]},
    {"$defs": {"pet": {"type": "object", "properties": {"name": NAME}, "required": ["name"]}},
     "type": "object", "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}},
     "required": ["pets"]},
]  # fmt: skip


@pytest.fixture(scope="module")
def aclient(server):
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


async def constrained(client: AsyncOpenAI, schema: dict, seed: int, stream: bool) -> tuple[str, str]:
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with a JSON value."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        temperature=1.0,
        seed=seed,
        max_tokens=200,
    )
    if not stream:
        resp = await client.chat.completions.create(**args)
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_json_schemas_at_temperature_1_streamed_and_not(server, aclient):
    async def run_all():
        return await asyncio.gather(
            *(constrained(aclient, schema, seed, stream) for seed, schema in enumerate(SCHEMAS) for stream in (0, 1))
        )

    results = asyncio.run(run_all())
    for (text, finish), schema in zip(results, [s for s in SCHEMAS for _ in (0, 1)]):
        assert finish == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)
    server.wait_idle()


def test_json_object_regex_choice_and_grammar(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    base = dict(model=MODEL, temperature=1.0, max_tokens=60, n=3, seed=4)
    messages = [{"role": "user", "content": "Describe a cat."}]
    obj = client.chat.completions.create(
        **{**base, "max_tokens": 150}, messages=messages, response_format={"type": "json_object"}
    )
    assert all(isinstance(json.loads(c.message.content), dict) for c in obj.choices)
    regex = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,2}"
    out = client.completions.create(**base, prompt="Age:", extra_body={"structured_outputs": {"regex": regex}})
    assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    choices = ["sunny", "rainy", "foggy"]
    out = client.chat.completions.create(**base, messages=messages, extra_body={"guided_choice": choices})
    assert all(c.message.content in choices for c in out.choices)
    # A grammar that allows one sentence only: the request ends on EOS right after it.
    out = client.completions.create(**base, prompt="Say yes:", extra_body={"guided_grammar": 'root ::= "yes"'})
    assert all(c.text == "yes" and c.finish_reason == "stop" for c in out.choices)
    lark = client.completions.create(**base, prompt="Pick:", extra_body={"guided_grammar": 'start: "left" | "right"'})
    assert all(c.text in ("left", "right") for c in lark.choices)
    server.wait_idle()


@pytest.mark.parametrize(
    "extra,param,text",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema", "not a valid JSON schema"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}}}},
         "response_format.json_schema.schema", "#/not is not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", None),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Unclosed"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"shape": "round"}}, "structured_outputs.shape", "unknown field"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF"),
        ({"guided_choice": []}, "guided_choice", "guided_choice: structured_outputs.choice=[] is invalid"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs",
         "structured_outputs.choice=[] is invalid: must be a non-empty list of non-empty strings"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs", "structured_outputs.regex='' is invalid"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
          "tool_choice": "required"}, "tools.0.function.parameters", "not a valid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
          "function": {"name": "g"}}}, "tool_choice.function.name", "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "--tool-call-parser"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ],
)  # fmt: skip
def test_bad_structures_are_400s(server, extra, param, text):
    for stream in (False, True):  # found before a stream starts
        resp = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **extra, "stream": stream})
        assert_error(resp, 400, param, text)


WEATHER = {
    "type": "object",
    "properties": {"city": NAME, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
]  # fmt: skip
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def reassemble(stream) -> tuple[str, list[dict], str | None]:
    """Content, tool calls and finish reason from streamed chunks, merged the way the openai client's own
    stream helpers do (by tool-call index)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_choice_give_valid_calls(server, tool_choice):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=1.0,
        max_tokens=120,
    )
    for seed in range(3):
        resp = client.chat.completions.create(**args, seed=seed)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        content, calls, finish = reassemble(client.chat.completions.create(**args, seed=seed, stream=True))
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]


@pytest.fixture(scope="module")
def parsing_server(async_llm):
    """A server with the hermes tool parser and the qwen3 reasoning parser."""
    srv, url = start_server(async_llm, tool_call_parser="hermes", reasoning_parser="qwen3")
    yield url
    srv.should_exit = True


def test_auto_tool_calls_and_reasoning_end_to_end(parsing_server):
    """The output is forced into the hermes format by a regex, so the parsers see a real engine's reply."""
    client = OpenAI(base_url=f"{parsing_server}/v1", api_key="x", max_retries=0)
    reply = (
        r'<think>\nThe user wants weather\.\n</think>\n\nChecking\. <tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "Paris", "days": 2\}\}\n</tool_call>'
    )
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        max_tokens=120,
        extra_body={"guided_regex": reply},
    )
    resp = client.chat.completions.create(**args)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking." and message.model_extra["reasoning_content"] == "The user wants weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    chunks = list(client.chat.completions.create(**args, stream=True))
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    content, calls, finish = reassemble(chunks)
    assert reasoning.strip() == "The user wants weather." and content.strip() == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert finish == "tool_calls"
    # The arguments streamed as the model wrote them, in several pieces.
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2
    # A tool result goes back through the chat template, the earlier call's arguments as an object.
    followup = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in message.tool_calls]},
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"forecast": "sun"}'},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=5,
    )
    assert followup.choices[0].finish_reason in ("stop", "length")
