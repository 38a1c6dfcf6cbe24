"""Multi-host tensor parallelism as torchrun starts it: two "nodes" of one rank each rendezvous through env:// on
127.0.0.1; node 0's rank serves HTTP, node 1's rank runs the worker loop (its calls come over gloo); a request is
served end to end, and another after the server idled longer than the collective timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.server.conftest import free_port, wait_until_healthy


def test_two_torchrun_nodes_serve_a_request(tiny_chat_model_dir, tmp_path):
    master, port = free_port(), free_port()
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            + ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master)]
            + ["-m", "pagellm.cli", "serve", "--model", str(tiny_chat_model_dir), "--device", "cpu", "--quiet"]
            + ["-tp", "2", "--port", str(port), "--served-model-name", "tiny"],
            # Idled past below (rank 0 keeps rank 1 waiting); long enough for rank 1 to wait at the rendezvous while
            # rank 0's server starts its engine's process, which then joins.
            env={**os.environ, "PAGELLM_COLLECTIVE_TIMEOUT_S": "16"},
            stdout=logs[node].open("w"),
            stderr=subprocess.STDOUT,
        )
        for node in (0, 1)
    ]
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(url, nodes)
        except AssertionError as exc:  # say why
            raise AssertionError(f"{exc}\n" + "\n".join(log.read_text()[-3000:] for log in logs)) from None
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
        for idle_s in (0, 20):
            time.sleep(idle_s)
            resp = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 6
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            try:
                node.wait(timeout=20)
            except subprocess.TimeoutExpired:
                node.kill()
