"""Drive a running pagellm server with streaming clients arriving as a Poisson process.

    pagellm serve &                          # or any OpenAI-compatible server
    python benchmarks/serving.py --url http://127.0.0.1:8000 --rates 1 2 4 --num-requests 32

Reports, per arrival rate: request throughput, output tokens/s, TTFT, TPOT and inter-token latency (ITL)
percentiles. Writes JSON, a markdown table and a PNG plot under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

TOPICS = [
    "a lighthouse",
    "the moon",
    "a lost key",
    "a robot chef",
    "an old map",
    "a thunderstorm",
    "a tiny dragon",
    "the ocean",
    "a secret garden",
    "a time machine",
]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    token_times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                token_times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = token_times[0] - start if token_times else float("nan")
    itl = list(np.diff(token_times)) if len(token_times) > 1 else []
    tpot = (end - token_times[0]) / (tokens - 1) if tokens > 1 and token_times else float("nan")
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "tokens": tokens, "latency": end - start}


async def run_rate(url: str, model: str, rate: float, num_requests: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(num_requests):
            prompt = f"Tell me a story about {rng.choice(TOPICS)} (#{i})."
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="serving")
    args = parser.parse_args()
    model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    rows = [
        asyncio.run(run_rate(args.url, model, rate, args.num_requests, args.max_tokens, args.seed))
        for rate in args.rates
    ]
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
        "model": model,
        "url": args.url,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    path = write_results(args.name, payload, table)
    plot(rows, path.with_suffix(".png"))
    print(table)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
