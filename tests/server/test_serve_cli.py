"""`pagellm serve` (what `make run` starts) on the embedded default model prints its URL and answers."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from tests.server.conftest import free_port


def test_serve_default_model_prints_url_and_answers():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.cli", "serve", "--port", str(port), "--device", "cpu", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = ""
        deadline = time.time() + 120
        while "http://" not in line and time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited"
        assert f"http://127.0.0.1:{port}/" in line and "SmolLM2-135M-Instruct" in line
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        page = httpx.get(f"http://127.0.0.1:{port}/")
        assert page.status_code == 200 and "pagellm" in page.text
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
