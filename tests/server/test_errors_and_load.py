"""Bad input gets a 4xx in OpenAI's error shape; concurrent streams with hang-ups leak no KV blocks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI

from tests.server.conftest import API_KEY, MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def assert_error(resp: httpx.Response, status: int, param: str | None = None, text: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    if text is not None:
        assert text in err["message"], err


@pytest.mark.parametrize(
    "body,param",
    [
        ({**CHAT, "temperature": -1}, "temperature"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "max_tokens": -3}, "max_tokens"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "top_logprobs": 50, "logprobs": True}, "logprobs"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "max_tokens": 4}, "messages"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "n": 10_000}, "n"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "logit_bias": {"abc": 5}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
        ({**CHAT, "logit_bias": {str(10**9): 1}}, "logit_bias"),
        ({**CHAT, "stop_token_ids": [10**9]}, "stop_token_ids"),
        ({**CHAT, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({**CHAT, "chat_template_kwargs": {"messages": 5}}, "chat_template_kwargs"),
        ({**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
        ),
        ({**CHAT, "messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages.0.colour"),
    ],
)
def test_bad_chat_fields(server, body, param):
    assert_error(httpx.post(f"{server.url}/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    "field,value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("spaces_between_special_tokens", False),
    ],
)
def test_unimplemented_fields_are_refused_by_name(server, field, value):
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, field: value})
    assert_error(resp, 400, field, "not supported")


def test_unknown_and_unimplemented_completion_fields(server):
    url = f"{server.url}/v1/completions"
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert_error(httpx.post(url, json={**base, "suffix": " the end"}), 400, "suffix", "not supported")
    assert_error(httpx.post(url, json={**base, "frobnicate": 1}), 400, "frobnicate", "unknown field")
    assert_error(httpx.post(url, json={**base, "max_tokens": 0}), 400, "max_tokens", "echo")
    # The "off" values of the unimplemented fields are accepted: they ask for nothing.
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert ok.status_code == 200, ok.text
    ok = httpx.post(url, json={**base, "spaces_between_special_tokens": True})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "NaN", "1e309"])
def test_non_finite_floats_are_refused(server, number):
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hi"}}], "temperature": {number}}}'
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(resp, 400, "temperature")


def post_raw_json(url: str, body: dict) -> httpx.Response:
    """`body` as json.dumps writes it (ASCII, every non-ASCII character an escape, as JavaScript's JSON.stringify
    writes a lone surrogate), so a str holding a lone UTF-16 surrogate travels as valid JSON."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)


def test_lone_surrogates_and_non_json_schemas_are_refused(server):
    chat, completions = f"{server.url}/v1/chat/completions", f"{server.url}/v1/completions"
    lone = "\udcff"
    bad = {**CHAT, "messages": [{"role": "user", "content": f"Hi {lone}"}]}
    assert_error(post_raw_json(chat, bad), 400, "messages", "lone surrogate, U+DCFF")
    prompt = {"model": MODEL, "prompt": lone, "max_tokens": 2}
    assert_error(post_raw_json(completions, prompt), 400, "prompt", "lone surrogate")
    regex = {**CHAT, "structured_outputs": {"regex": f"a{lone}"}}
    assert_error(post_raw_json(chat, regex), 400, "structured_outputs", "lone surrogate")
    assert_error(post_raw_json(chat, {**CHAT, "guided_json": "{not json"}), 400, "guided_json", "must be JSON")
    # A surrogate pair is one character (an emoji here): accepted.
    paired = post_raw_json(chat, {**CHAT, "messages": [{"role": "user", "content": "Hi \U0001f600"}]})
    assert paired.status_code == 200, paired.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_more_tokens_than_the_context_is_refused_like_vllm(server):
    limit = server.llm.max_model_len
    for max_tokens in (limit, 2**70):
        resp = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens})
        assert_error(resp, 400, "max_tokens", f"This model's maximum context length is {limit} tokens")
    prompt = list(range(100, 100 + limit - 10))
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20})
    assert_error(resp, 400, "max_tokens", f"you requested {limit + 10} tokens ({limit - 10} in the prompt, 20 in")


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(tiny_server):
    # The tiny model has 256 positions: without max_tokens (and with EOS ignored) the reply ends at the context's end.
    model = httpx.get(f"{tiny_server.url}/v1/models").json()["data"][0]["id"]
    body = {**CHAT, "model": model, "max_tokens": None, "ignore_eos": True}
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert resp.json()["usage"]["total_tokens"] == tiny_server.llm.max_model_len == 256


def test_tokenize_bad_inputs(server):
    url = f"{server.url}/tokenize"
    assert_error(httpx.post(url, json={"messages": []}), 400, "messages")
    assert_error(httpx.post(url, json={}), 400, "prompt")
    assert_error(
        httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 5}}),
        400,
        "chat_template_kwargs",
    )
    chat = httpx.post(url, json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 3


def test_bad_completion_inputs(server):
    url = f"{server.url}/v1/completions"
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": ""}), 400, "prompt", "empty")
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": []}), 400, "prompt")
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": [1, 10**9]}), 400, "prompt")
    long_prompt = list(range(100, 100 + server.llm.max_model_len))
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": long_prompt}), 400, "prompt", "too long")
    assert_error(httpx.post(url, json={"model": "gpt-4", "prompt": "x"}), 404, None, "does not exist")
    assert_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": "x" * 70_000}), 413)
    # A chunked body has no Content-Length: the limit counts the bytes as they arrive.
    chunks = iter([b'{"model": "' + MODEL.encode() + b'", "prompt": "', b"x" * 70_000, b'"}'])
    assert_error(httpx.post(url, content=chunks, headers={"content-type": "application/json"}), 413)
    assert_error(httpx.post(url, json={"model": MODEL, "prompt": "x", "best_of": 3}), 400, "best_of")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_api_key(secured_server):
    url = f"{secured_server.url}/v1/chat/completions"
    assert_error(httpx.post(url, json=CHAT), 401)
    assert_error(httpx.post(url, json=CHAT, headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{secured_server.url}/health").status_code == 200


def test_concurrent_streams_with_hangups_free_every_block(server):
    async def one(client: AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me a story about the number {i}."}],
            max_tokens=40,
            temperature=0.8,
            seed=i,
            stream=True,
        )
        text, chunks = "", 0
        async for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if i % 3 == 0 and chunks >= 3:  # a third of the clients hang up early
                await stream.close()
                return "hung up"
        return text

    async def run_all() -> list[str]:
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert sum(r == "hung up" for r in results) == 11
    assert all(r for r in results)
    server.wait_idle()
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200
