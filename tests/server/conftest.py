"""A real pagellm server on loopback (uvicorn in a background thread) over SmolLM2."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from pagellm.config import EngineConfig
from pagellm.distributed.executor import free_port
from pagellm.engine.async_llm import AsyncLLM
from pagellm.server.app import create_app

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class RunningServer:
    url: str
    llm: AsyncLLM

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine has nothing left to do and every KV block is free again."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            stats = self.llm.stats.engine
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_blocks:
                return
            time.sleep(0.05)
        raise AssertionError(f"engine not idle: {self.llm.stats.engine}")


def spawn_serve(*flags: str) -> tuple[subprocess.Popen, str]:
    """`pagellm serve` on the CPU in a process of its own, on a free port; its output is a text pipe."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagellm.cli", "serve", "--port", str(port), "--device", "cpu", "--quiet", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


class OutputReader:
    """Reads a server's output on a thread of its own, so that a full pipe never blocks the server; `text` is all
    of it once the server (and every process holding its output) has exited and `join` has returned."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        self.text = proc.stdout.read()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def wait_until_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    """Until url/health answers 200; fails at once if one of the server's processes exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        exited = [p.returncode for p in procs if p.poll() is not None]
        assert not exited, f"a server process exited with {exited[0]}"
        time.sleep(0.2)
    raise AssertionError(f"{url} did not become healthy in {timeout} s")


def start_server(llm: AsyncLLM, **app_kwargs) -> tuple[uvicorn.Server, str]:
    port = free_port()
    app = create_app(llm, MODEL, **app_kwargs)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url, [], timeout=10)
    return server, url


@pytest.fixture(scope="session")
def async_llm(smollm2_gguf):
    llm = AsyncLLM(EngineConfig(model=str(smollm2_gguf), device="cpu", dtype="float32", quiet=True))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(async_llm):
    srv, url = start_server(async_llm, max_body_bytes=64 * 1024)
    yield RunningServer(url, async_llm)
    srv.should_exit = True


@pytest.fixture(scope="session")
def tiny_server(tiny_chat_model_dir):
    llm = AsyncLLM(EngineConfig(model=str(tiny_chat_model_dir), device="cpu", dtype="float32", quiet=True))
    srv, url = start_server(llm, max_body_bytes=64 * 1024)
    yield RunningServer(url, llm)
    srv.should_exit = True
    llm.shutdown()


@pytest.fixture(scope="session")
def secured_server(async_llm):
    srv, url = start_server(async_llm, api_key=API_KEY)
    yield RunningServer(url, async_llm)
    srv.should_exit = True
