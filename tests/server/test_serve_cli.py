"""`pagellm serve` (what `make run` starts) on the embedded default model: it prints its URL and answers, holds up
under a soak of mixed clients (streaming, non-streaming with timeouts, hang-ups) and leaves nothing running, and
exits within seconds of SIGTERM with work in flight."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import OutputReader, spawn_serve, wait_until_healthy

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str
    banner: str
    output: OutputReader


@pytest.fixture(scope="module")
def served() -> Iterator[ServeProcess]:
    proc, url = spawn_serve()
    try:
        line = ""
        deadline = time.time() + 120
        while "http://" not in line and time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited"
        wait_until_healthy(url, [proc])
        yield ServeProcess(proc, url, line, OutputReader(proc))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=20)


def test_serve_default_model_prints_url_and_answers(served):
    assert f"{served.url}/" in served.banner and MODEL in served.banner
    page = httpx.get(f"{served.url}/")
    assert page.status_code == 200 and "pagellm" in page.text
    models = httpx.get(f"{served.url}/v1/models").json()
    assert models["data"][0]["id"] == MODEL


def engine_gauges(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    wanted = {"pagellm:num_requests_running", "pagellm:num_requests_waiting", "pagellm:kv_cache_usage_perc"}
    return {f.name: f.samples[0].value for f in families if f.name in wanted}


async def one_client(client: openai.AsyncOpenAI, impatient: openai.AsyncOpenAI, i: int, rng: random.Random) -> str:
    messages = [{"role": "user", "content": f"Tell me about the number {i}."}]
    kind = i % 3
    if kind == 0:  # non-streaming, with a client timeout that the longer ones run past
        try:
            await impatient.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=rng.choice([8, 400]), extra_body={"ignore_eos": True}
            )
            return "done"
        except openai.APITimeoutError:
            return "timed out"
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=rng.randint(8, 48), temperature=0.8, seed=i, stream=True
    )
    chunks = 0
    async for _ in stream:
        chunks += 1
        if kind == 2 and chunks >= 4:  # hangs up mid-stream
            await stream.close()
            return "hung up"
    return "done"


async def soak(url: str, num_requests: int, concurrency: int, seconds: float) -> list[str]:
    rng = random.Random(0)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(i)
    results: list[str] = []
    async with (
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=2.0) as impatient,
    ):

        async def worker() -> None:
            while not queue.empty():
                results.append(await one_client(client, impatient, queue.get_nowait(), rng))

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        _, unfinished = await asyncio.wait(workers, timeout=seconds)
        for task in unfinished:  # the minute is up: the clients still waiting leave
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
    return results


def test_soak_leaves_nothing_running(served):
    results = asyncio.run(soak(served.url, num_requests=200, concurrency=32, seconds=60))
    assert len(results) > 100, f"only {len(results)} of 200 requests finished within the minute"
    assert {"done", "timed out", "hung up"} <= set(results)
    deadline = time.time() + 5
    while time.time() < deadline and any(engine_gauges(served.url).values()):
        time.sleep(0.1)
    assert engine_gauges(served.url) == {
        "pagellm:num_requests_running": 0.0,
        "pagellm:num_requests_waiting": 0.0,
        "pagellm:kv_cache_usage_perc": 0.0,
    }


def test_sigterm_with_work_in_flight_exits_within_5_s(served):
    long = {"model": MODEL, "messages": [{"role": "user", "content": "A long story."}], "max_tokens": 1000}

    def post(stream: bool) -> None:
        try:
            httpx.post(f"{served.url}/v1/chat/completions", json={**long, "stream": stream}, timeout=30)
        except httpx.TransportError:
            pass  # the server went away: expected

    clients = [threading.Thread(target=post, args=(stream,), daemon=True) for stream in (False, True)]
    for client in clients:
        client.start()
    deadline = time.time() + 10
    while time.time() < deadline and engine_gauges(served.url)["pagellm:num_requests_running"] < 2:
        time.sleep(0.05)
    assert engine_gauges(served.url)["pagellm:num_requests_running"] == 2
    served.proc.send_signal(signal.SIGTERM)
    started = time.time()
    served.proc.wait(timeout=10)
    assert time.time() - started < 5.0
    served.output.join(timeout=10)
    # Nothing the engine's process made outlives it: multiprocessing's resource tracker would report it here.
    assert "leaked" not in served.output.text, served.output.text[-2000:]
