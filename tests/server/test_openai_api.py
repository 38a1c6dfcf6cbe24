"""The server driven by the official `openai` client: chat and completions, streamed and not."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.server.conftest import MODEL


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_paris(client, server):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert (
        resp.usage.completion_tokens > 0
        and resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    )
    server.wait_idle()


def test_chat_stream_matches_non_stream_and_reports_usage(client):
    messages = [{"role": "user", "content": "Name three fruits."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            pieces += [choice.delta.content] if choice.delta.content else []
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert len(pieces) > 3  # really streamed, token by token
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_logprobs_echo_stop_and_n(client):
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=12, logprobs=2)
    choice = resp.choices[0]
    assert len(choice.logprobs.tokens) == 12 == resp.usage.completion_tokens
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)

    echo = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=12, echo=True)
    assert echo.choices[0].text == "Once upon a time" + choice.text

    stop = choice.text[5:9]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=12, stop=[stop])
    assert cut.choices[0].text == choice.text[: choice.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"

    many = client.completions.create(
        model=MODEL, prompt=["Hello", "The sea is"], n=3, temperature=1.0, seed=5, max_tokens=6
    )
    assert sorted(c.index for c in many.choices) == list(range(6))


def test_completion_stream_with_token_ids_prompt(client, server):
    import httpx

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The sea is"}).json()["tokens"]
    plain = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8)
    stream = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == plain.choices[0].text


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.logprob - 1e-6


def test_tokenize_detokenize_roundtrip(server):
    import httpx

    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello world"


def test_metrics_exposed(client, server):
    import httpx

    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in [
        "pagellm:time_to_first_token_seconds_bucket",
        "pagellm:time_per_output_token_seconds_bucket",
        "pagellm:e2e_request_latency_seconds_count",
        "pagellm:num_requests_running",
        "pagellm:num_requests_waiting",
        "pagellm:kv_cache_usage_perc",
        "pagellm:prefix_cache_hit_rate",
        "pagellm:prompt_tokens_total",
        "pagellm:generation_tokens_total",
    ]:
        assert name in text, name
