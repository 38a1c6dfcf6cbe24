"""The server driven by the official `openai` client: chat and completions, streamed and not."""

from __future__ import annotations

import time
from contextlib import aclosing

import httpx
import pytest
import torch
from openai import BadRequestError, NotFoundError, OpenAI

from pagellm.engine.async_llm import RATE_WINDOW_S
from tests.conftest import hf_greedy
from tests.server.conftest import MODEL


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL) == client.models.list().data[0]
    with pytest.raises(NotFoundError, match="model=.nope. does not exist"):
        client.models.retrieve("nope")


def test_version(server):
    from importlib.metadata import version

    assert httpx.get(f"{server.url}/version").json() == {"version": version("pagellm")}


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


def test_a_whole_response_is_built_once_a_stream_at_every_step(client, server, monkeypatch):
    """The engine builds no per-step outputs for a request whose response is sent whole (vLLM's FINAL_ONLY)."""
    outputs_per_request = []
    stream = server.llm.stream

    async def counted(processed):
        count = 0
        async with aclosing(stream(processed)) as outputs:
            async for out in outputs:
                count += 1
                yield out
        outputs_per_request.append(count)

    monkeypatch.setattr(server.llm, "stream", counted)
    for streamed in (False, True):
        reply = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, stream=streamed, extra_body={"ignore_eos": True}
        )
        text = "".join(chunk.choices[0].text for chunk in reply) if streamed else reply.choices[0].text
        assert text
    assert outputs_per_request[0] == 1 and outputs_per_request[1] > 3


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
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello world"


def test_metrics_exposed(client, server):
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


def test_logit_bias_steers_sampling(client, server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "temperature": 0, "max_tokens": 6}
    free = client.chat.completions.create(**chat, logprobs=True)
    first = free.choices[0].logprobs.content[0].token
    first_id = httpx.post(f"{server.url}/tokenize", json={"prompt": first}).json()["tokens"]
    banned = client.chat.completions.create(**chat, logprobs=True, logit_bias={str(first_id[0]): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    forced = client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=5, logit_bias={"1000": 100}
    )
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": forced.choices[0].text})
    assert ids.json()["tokens"] == [1000] * 5


def test_allowed_token_ids_and_bad_words_through_the_client(client, server):
    prompt = {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 12}
    free = client.completions.create(**prompt).choices[0].text
    assert "brown bear" in free
    steered = client.completions.create(**prompt, extra_body={"bad_words": ["brown bear"]}).choices[0].text
    assert " brown" in steered and "brown bear" not in steered
    allowed = httpx.post(f"{server.url}/tokenize", json={"prompt": " red green blue"}).json()["tokens"]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": chat.choices[0].message.content}).json()["tokens"]
    assert len(ids) == 6 and set(ids) <= set(allowed)
    with pytest.raises(BadRequestError, match="allowed_token_ids"):
        client.completions.create(**prompt, extra_body={"allowed_token_ids": [10**7]})
    with pytest.raises(BadRequestError, match="bad_words: they ban every token of allowed_token_ids"):
        client.completions.create(**prompt, extra_body={"allowed_token_ids": allowed[:1], "bad_words": ["red"]})


def test_continuous_usage_stats_count_each_choice_so_far(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage of its choice up to it."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three fruits."}],
        temperature=0,
        max_tokens=12,
        n=2,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        per_choice[c.choices[0].index].append(c.usage.completion_tokens)
    for counts in per_choice.values():
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p holds log P(next token | ids[: p + 1]) by HF transformers."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_lm_eval_loglikelihood_request(server, hf_smollm2):
    """lm-evaluation-harness's `local-completions` loglikelihood request and its parsing (LocalCompletionsAPI's
    _create_payload and parse_logprobs): token-id prompts, echo, logprobs=1, max_tokens=1."""
    tokenize = lambda text: httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]  # noqa: E731
    pairs = [("The capital of France is", " Paris"), ("Two plus two equals", " four, of course")]
    requests = [(tokenize(ctx), tokenize(ctx + cont)) for ctx, cont in pairs]
    payload = {
        "model": MODEL,
        "prompt": [whole for _, whole in requests],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    out = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=60).json()
    for choice, (ctx, whole) in zip(sorted(out["choices"], key=lambda c: c["index"]), requests):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(whole) + 1  # the prompt, then the one drawn token
        ref = hf_logprobs(hf_smollm2, whole)
        ctxlen = len(ctx)
        expected = [ref[p - 1, whole[p]].item() for p in range(ctxlen, len(whole))]
        assert lp["token_logprobs"][ctxlen:-1] == pytest.approx(expected, abs=1e-4)
        greedy = all(
            t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1])
        )
        assert greedy == all(ref[p - 1].argmax().item() == whole[p] for p in range(ctxlen, len(whole)))
        # text_offset counts the echoed prompt's text, then the completion's.
        assert choice["text"].startswith("".join(lp["tokens"][: len(whole)]))
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server, hf_smollm2):
    prompt = "The sea is blue"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    out = httpx.post(f"{server.url}/v1/completions", json=body).json()
    choice = out["choices"][0]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    ref = hf_logprobs(hf_smollm2, ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [ref[p - 1, ids[p]].item() for p in range(1, len(ids))], abs=1e-4
    )
    assert "".join(choice["logprobs"]["tokens"]) == prompt


def test_prompt_logprobs_on_completions_and_chat(client, server, hf_smollm2):
    resp = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=1, extra_body={"prompt_logprobs": 2}
    ).model_dump()
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    entries = resp["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(hf_smollm2, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for p in range(1, len(ids)):
        assert entries[p][str(ids[p])]["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(2).indices.tolist()
        assert {int(t) for t, e in entries[p].items() if e["rank"] <= 2} == set(top)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).model_dump()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_streaming_n_sends_one_choice_per_chunk(client):
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to five."}],
        n=3,
        temperature=1.0,
        seed=3,
        max_tokens=8,
    )
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    for chunk in client.chat.completions.create(**args, stream=True):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    whole = client.chat.completions.create(**args)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(finishes) == {0, 1, 2}


def test_cors_favicon_and_idle_rate(server):
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in (
        "*",
        "http://example.com",
    )
    icon = httpx.get(f"{server.url}/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg")
    server.wait_idle()
    time.sleep(RATE_WINDOW_S + 0.2)
    assert httpx.get(f"{server.url}/stats").json()["tokens_per_second"] == 0.0


def test_streamed_logprobs_with_echo_equal_the_whole_response(client):
    args = dict(model=MODEL, prompt="Hello there", echo=True, logprobs=1, max_tokens=24, temperature=0)
    whole = client.completions.create(**args).choices[0]
    tokens, token_logprobs, offsets, text = [], [], [], ""
    for chunk in client.completions.create(**args, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
                offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert token_logprobs == pytest.approx(whole.logprobs.token_logprobs)


def test_vllm_prompt_options_through_the_client(client, server, hf_smollm2):
    """truncate_prompt_tokens: the model reads (and echo returns) the prompt's last tokens; continue_final_message:
    the reply goes on from a started assistant message. Both as HF's greedy decode of the same tokens."""
    prompt = "Once upon a time there was a small red fox who lived in the woods"
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    resp = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True},
    )
    tail = server.llm.tokenizer.decode(ids[-5:])
    assert resp.usage.prompt_tokens == 5 and resp.choices[0].text.startswith(tail)
    expected = server.llm.tokenizer.decode(hf_greedy(hf_smollm2, ids[-5:], 6))
    assert resp.choices[0].text == tail + expected
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True},
    )
    hf_tokenizer = server.llm.tokenizer.hf
    prompt_ids = hf_tokenizer.encode(
        hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True),
        add_special_tokens=False,
    )
    assert chat.usage.prompt_tokens == len(prompt_ids)
    assert chat.choices[0].message.content == server.llm.tokenizer.decode(hf_greedy(hf_smollm2, prompt_ids, 6))
    with pytest.raises(BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"continue_final_message": True}
        )
