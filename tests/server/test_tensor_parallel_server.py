"""`pagellm serve -tp 2` on the CPU (gloo): it answers like any server, and when a rank dies the request in
flight gets a 5xx error body and the server exits with an error within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import free_port


@pytest.fixture
def tp_server(tiny_chat_model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.cli", "serve", "--model", str(tiny_chat_model_dir), "--port", str(port)]
        + ["--device", "cpu", "--quiet", "-tp", "2", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def rank_pids(parent: int) -> list[int]:
    """The rank processes the server spawned (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(parent), "-f", "spawn_main"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def test_tp_server_answers_then_dies_cleanly_with_its_rank(tp_server):
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
    ranks = rank_pids(proc.pid)
    assert ranks, "no rank process"
    os.kill(ranks[0], signal.SIGKILL)
    assert proc.wait(timeout=15) != 0
    client.join(timeout=15)
    response = result.get("response")
    assert response is not None and response.status_code >= 500, result
    assert response.json()["error"]["message"]  # OpenAI's error body: the rank's death or the collective it broke
