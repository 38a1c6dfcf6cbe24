"""Drive an OpenAI-compatible server with streaming clients arriving as a Poisson process, on ShareGPT-like
request lengths drawn from a fixed seed; optionally start the server itself (pagellm or vLLM) for the run.

    pagellm serve &                          # or any OpenAI-compatible server that takes token-id prompts
    python benchmarks/serving.py --url http://127.0.0.1:8000 --rates 1 2 4 --num-requests 32
    python benchmarks/serving.py --serve pagellm --model DIR --load-format dummy --rates 4 16 64
    python benchmarks/serving.py --serve vllm --model DIR --load-format dummy ...   # vLLM importable (PYTHONPATH)

Prompts are random token ids (the same for every server, and free of any tokenizer's round trip); lengths are
log-normal around ShareGPT's (median input 200, output 180 tokens; cut to --max-input / --max-output), every
request generates its length (ignore_eos). Reports, per arrival rate: request throughput, output tokens/s, TTFT,
TPOT and inter-token latency (ITL, between streamed chunks) percentiles. Writes JSON, a markdown table and a PNG
plot under benchmarks/results/. DIR needs a tokenizer for the servers to stream text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

MEDIAN_INPUT, MEDIAN_OUTPUT, SIGMA = 200, 180, 0.9  # log-normal lengths near ShareGPT's (V3, as vLLM filters it)


def sharegpt_like(num_requests: int, seed: int, max_input: int, max_output: int, max_token_id: int) -> list:
    """(prompt token ids, output length) per request, the same for a given seed."""
    rng = np.random.default_rng(seed)
    inputs = np.clip(rng.lognormal(np.log(MEDIAN_INPUT), SIGMA, num_requests), 4, max_input).astype(int)
    outputs = np.clip(rng.lognormal(np.log(MEDIAN_OUTPUT), SIGMA, num_requests), 4, max_output).astype(int)
    return [(rng.integers(0, max_token_id, n).tolist(), int(m)) for n, m in zip(inputs, outputs)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "top_p": 0.95,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    token_times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = token_times[0] - start if token_times else float("nan")
    itl = list(np.diff(token_times)) if len(token_times) > 1 else []
    tpot = (end - token_times[0]) / (tokens - 1) if tokens > 1 and token_times else float("nan")
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "tokens": tokens, "latency": end - start}


async def run_rate(url: str, model: str, rate: float, requests: list, seed: int) -> dict:
    rng = random.Random(seed)
    num_requests = len(requests)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    def pct(values: list[float], q: float) -> float:
        values = [v for v in values if v == v]
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    row = {
        "rate": rate,
        "requests": num_requests,
        "duration_s": duration,
        "req_per_s": num_requests / duration,
        "out_tok_per_s": sum(r["tokens"] for r in results) / duration,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            row[f"{name}_p{q}_ms"] = pct(values, q)
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(rates, [r["out_tok_per_s"] for r in rows], "o-")
    axes[0].set(xlabel="arrival rate (req/s)", ylabel="output tokens/s", title="Throughput")
    for name, ax in (("ttft", axes[1]), ("tpot", axes[2])):
        for q in (50, 90, 99):
            ax.plot(rates, [r[f"{name}_p{q}_ms"] for r in rows], "o-", label=f"p{q}")
        ax.set(xlabel="arrival rate (req/s)", ylabel="ms", title=name.upper())
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def start_server(engine: str, args: argparse.Namespace, log: TextIO) -> subprocess.Popen:
    """`pagellm serve` or vLLM's OpenAI server on args.model, writing to `log`, once its /health answers."""
    common = ["--model", args.model, "--port", str(args.port), "--max-model-len", str(args.max_model_len)]
    common += ["--load-format", args.load_format]
    if engine == "pagellm":
        cmd = [sys.executable, "-m", "pagellm.cli", "serve", *common]
        path = [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    else:  # vLLM at its defaults; FlashInfer's sampler off, as the peers' bundle runs it
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common]
        env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1"}
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{engine} server exited with {server.returncode} (log: {args.server_log})")
        try:
            if httpx.get(f"{args.url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError(f"{engine} server did not answer /health within {args.start_timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="a running server (default: the one --serve starts)")
    parser.add_argument("--serve", choices=["pagellm", "vllm"], default=None, help="start this server for the run")
    parser.add_argument("--model", default=None, help="what --serve serves")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--start-timeout", type=int, default=600)
    parser.add_argument("--server-log", default=None)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--max-token-id", type=int, default=30000, help="prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="serving")
    args = parser.parse_args()
    if args.serve and (args.url or not args.model):
        parser.error("--serve takes --model, and no --url (it serves on --port)")
    args.url = args.url or f"http://127.0.0.1:{args.port}"
    with open(args.server_log or os.devnull, "w") as log:
        server = start_server(args.serve, args, log) if args.serve else None
        try:
            model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
            requests = sharegpt_like(args.num_requests, args.seed, args.max_input, args.max_output, args.max_token_id)
            rows = [asyncio.run(run_rate(args.url, model, rate, requests, args.seed)) for rate in args.rates]
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
    columns = [
        "rate",
        "req_per_s",
        "out_tok_per_s",
        "ttft_p50_ms",
        "ttft_p90_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p90_ms",
        "tpot_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
    ]
    table = markdown_table(rows, columns)
    payload = {
        "environment": environment(),
        "server": args.serve or args.url,
        "model": model,
        "args": vars(args),
        "rows": rows,
    }
    name = f"{args.name}-{args.serve}" if args.serve else args.name
    path = write_results(name, payload, table)
    plot(rows, path.with_suffix(".png"))
    print(table)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
