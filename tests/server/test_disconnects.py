"""Clients that leave and clients that send a lot: nothing keeps running for a client that is gone, and nothing a
client sends stalls the event loop for the others."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest

from pagellm.server.app import DEFAULT_MAX_BODY_BYTES
from tests.server.conftest import MODEL, start_server

LONG_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Write a very long story."}],
    "max_tokens": 2000,
    "ignore_eos": True,
}


def test_non_streaming_client_timeouts_abort_every_attempt(server):
    """The `openai` client times out and retries twice: each of the three attempts must stop when it is given up,
    not run on to max_tokens holding its KV blocks."""
    before = server.llm.stats.engine.generation_tokens_total
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=1.0, max_retries=2)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(
            **{k: v for k, v in LONG_CHAT.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True}
        )
    server.wait_idle(timeout=1.0)
    assert server.llm.stats.engine.generation_tokens_total - before < LONG_CHAT["max_tokens"]


def test_hang_up_mid_request_frees_the_engine_within_a_step(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=LONG_CHAT, timeout=0.8)
    left = time.time()
    server.wait_idle(timeout=1.0)
    assert time.time() - left < 1.0
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**LONG_CHAT, "max_tokens": 3}).status_code == 200


def max_size_prompt_body() -> bytes:
    rng = random.Random(0)
    words = ["river", "stone", "über", "数据", "light", "the", "of", "quickly", "moon", "a"]
    text = " ".join(rng.choice(words) for _ in range(800_000))
    body = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 1}).encode()
    return body[: DEFAULT_MAX_BODY_BYTES - 64].rsplit(b" ", 1)[0] + b'", "max_tokens": 1}'


def test_health_answers_fast_while_a_max_size_prompt_is_tokenized(async_llm):
    srv, url = start_server(async_llm)  # the default body limit
    try:
        body = max_size_prompt_body()
        result: dict = {}

        def post() -> None:
            started = time.time()
            resp = httpx.post(
                f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120
            )
            result.update(status=resp.status_code, error=resp.json()["error"], seconds=time.time() - started)

        worker = threading.Thread(target=post)
        latencies = []
        with httpx.Client() as client:
            client.get(f"{url}/health")  # the connection is open before the big request starts
            worker.start()
            while worker.is_alive():
                started = time.time()
                assert client.get(f"{url}/health").status_code == 200
                latencies.append(time.time() - started)
                time.sleep(0.01)
        worker.join()
        assert result["status"] == 400 and "too long" in result["error"]["message"]  # it was tokenized in full
        assert result["seconds"] > 0.5  # so the measurement covered real tokenizing time
        # A loop blocked by the tokenizer would answer once, after it: here it answers all along. (An absolute
        # bound is the 2-core CI machine's scheduling more than ours: 33 ms alone, 245 ms once under load.)
        worst = max(latencies)
        assert len(latencies) >= 5 and worst < result["seconds"] / 3, (
            f"/health took up to {worst * 1000:.0f} ms during {result['seconds']:.2f} s of tokenizing"
        )
        assert sorted(latencies)[len(latencies) // 2] < 0.05
    finally:
        srv.should_exit = True
