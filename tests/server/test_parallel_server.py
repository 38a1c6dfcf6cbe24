"""`pagellm serve -tp 2` and `-dp 2` on the CPU (gloo, two processes): they answer like any server; when the engine's
process or another rank dies the request in flight gets a 5xx error body and the server exits with an error within
seconds; data-parallel replicas both serve, each with its own /metrics series."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import OutputReader, spawn_serve, wait_until_healthy


def start_serve(model_dir, *flags: str) -> tuple[subprocess.Popen, str]:
    proc, url = spawn_serve("--model", str(model_dir), "--served-model-name", "tiny", *flags)
    wait_until_healthy(url, [proc])
    OutputReader(proc)
    return proc, url


@pytest.fixture
def tp_server(tiny_chat_model_dir):
    proc, url = start_serve(tiny_chat_model_dir, "-tp", "2")
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def spawned_pids(parent: int) -> list[int]:
    """The processes `parent` spawned (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", "spawn_main"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


@pytest.mark.parametrize("victim", ["engine core", "rank 1"])
def test_tp_server_answers_then_dies_cleanly_with_its_engine(tp_server, victim):
    proc, url = tp_server
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    first = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 8
    result: dict = {}

    def long_request() -> None:
        body = {**chat, "max_tokens": 200, "ignore_eos": True}
        try:
            result["response"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        except httpx.TransportError as exc:
            result["error"] = exc

    client = threading.Thread(target=long_request)
    client.start()
    time.sleep(0.5)
    (core,) = spawned_pids(proc.pid)  # the server's engine process: rank 0, which spawned rank 1
    (rank1,) = spawned_pids(core)
    os.kill(core if victim == "engine core" else rank1, signal.SIGKILL)
    assert proc.wait(timeout=15) != 0
    client.join(timeout=15)
    response = result.get("response")
    assert response is not None and response.status_code >= 500, result
    assert response.json()["error"]["message"]  # OpenAI's error body: the rank's death or the collective it broke


def test_dp_server_spreads_requests_over_replicas(tiny_chat_model_dir):
    proc, url = start_serve(tiny_chat_model_dir, "-dp", "2")
    try:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0}
        body = {**chat, "ignore_eos": True}
        results: list[httpx.Response] = []
        clients = [
            threading.Thread(
                target=lambda: results.append(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60))
            )
            for _ in range(6)
        ]
        for client in clients:
            client.start()
        running: dict[str, float] = {}
        while any(c.is_alive() for c in clients):  # both replicas run requests at once
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
                if family.name == "pagellm:num_requests_running":
                    for sample in family.samples:
                        running[sample.labels["engine"]] = max(running.get(sample.labels["engine"], 0), sample.value)
            time.sleep(0.05)
        assert [r.status_code for r in results] == [200] * 6
        assert len({r.json()["choices"][0]["message"]["content"] for r in results}) == 1  # greedy: the same reply
        assert set(running) == {"0", "1"} and min(running.values()) > 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)
