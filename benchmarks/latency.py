"""Latency on the GPU with dummy weights: batch-1 and batch-16 decode tokens/s, time to first token, and cold start
(from `import pagellm` to the first token, CUDA graphs included; the median and the slowest of three processes with
fresh Triton caches), against the weight-bandwidth limit.

    python benchmarks/latency.py --models Qwen3-0.6B Llama-3.1-8B
    python benchmarks/latency.py --models Llama-3.1-8B --quantization none fp8 awq --skip-cold-start

With --quantization each model runs once per method (dummy weights in that format: `none` is the model's bf16),
and the limit is the bandwidth over the bytes the loaded model holds (quantized linears, their scales, bf16
embeddings and norms). kv_memory_tokens is what the memory beside the weights holds, which grows by the weight
bytes a format saves; kv_cache_tokens what the engine allocates of it (at most max_num_seqs full-length sequences:
64 x 4,096 tokens here). --peer adds vLLM's figures of the same run (`vllm_quant_latency.py`) and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, measured_limits, write_results  # noqa: E402
from benchmarks.models import model_dir  # noqa: E402
from pagellm import LLM, SamplingParams  # noqa: E402

COLD_START = """
import json, sys, time
t0 = time.perf_counter()
from pagellm import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1], load_format="dummy", max_model_len=4096, max_num_seqs=64, quiet=True)
t2 = time.perf_counter()
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
print(json.dumps({"total": t3 - t0, "import": t1 - t0, "engine": t2 - t1, "first_request": t3 - t2,
                  **llm.engine.startup_seconds}))
"""


COLD_START_RUNS = 3


def decode_rate(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s over the batch, median time to first token in ms)."""
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 30000, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    outs = llm.generate(prompts, params, use_tqdm=False)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    ttft = statistics.median((o.metrics.first_token_time - o.metrics.arrival_time) * 1000 for o in outs)
    return batch * (new_tokens - 1) / (last - first), ttft


def cold_start(path: str, triton_cache_dir: str) -> dict[str, float]:
    """Seconds from a fresh process's `import pagellm` to its first token ("total"), split into the import, the
    engine's construction (and its phases) and the first request."""
    env = dict(os.environ, TRITON_CACHE_DIR=triton_cache_dir)
    out = subprocess.run(
        [sys.executable, "-c", COLD_START, path],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def held_weight_bytes(llm: LLM) -> int:
    """Bytes of every parameter the model holds (a tied embedding once): what one batch-1 token streams, taking
    the embedding's rows as read, as benchmarks/models.weight_bytes does."""
    return sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())


def add_peer(rows: list[dict], peer_runs: list[dict]) -> list[str]:
    """vLLM's decode figures of the same model and format beside pagellm's, and the ratios; the columns added."""
    by_key = {(run["model"], run["quantization"]): run for run in peer_runs if "error" not in run}
    for row in rows:
        run = by_key.get((row["model"], row["quantization"]))
        if run is None:
            continue
        for batch in (1, 16):
            peer = run[f"batch{batch}"]["decode_only_tok_per_s"]
            row[f"vllm_b{batch}_tok_s"] = peer
            row[f"b{batch}_vs_vllm"] = row[f"b{batch}_tok_s"] / peer
    return ["vllm_b1_tok_s", "b1_vs_vllm", "vllm_b16_tok_s", "b16_vs_vllm"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Llama-3.1-8B"])
    parser.add_argument("--quantization", nargs="+", default=["none"], help="none, fp8, awq, gptq")
    parser.add_argument("--bandwidth", type=float, help="bytes/s of the limit (default: measured_limits)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-cold-start", action="store_true")
    parser.add_argument("--peer", type=Path, default=None, help="vllm_quant_latency.py's JSON of the same run")
    args = parser.parse_args()
    bandwidth = args.bandwidth or measured_limits()[0]
    rows = []
    for name in args.models:
        path = model_dir(name)
        cold: dict = {}
        if not args.skip_cold_start:
            # Fresh Triton caches: every kernel compiles. Then once more on the last one's cache.
            fresh_dirs = [tempfile.mkdtemp() for _ in range(COLD_START_RUNS)]
            cold_fresh = [cold_start(path, cache) for cache in fresh_dirs]
            cold = {
                "cold_start_s": statistics.median(run["total"] for run in cold_fresh),
                "cold_start_max_s": max(run["total"] for run in cold_fresh),
                "cold_start_warm_triton_cache_s": cold_start(path, fresh_dirs[-1])["total"],
                "cold_start_runs": cold_fresh,
            }
        for method in args.quantization:
            quantization = None if method == "none" else method
            llm = LLM(
                path, load_format="dummy", max_model_len=4096, max_num_seqs=64, quantization=quantization, quiet=True
            )
            b1, ttft = decode_rate(llm, 1, 128, args.new_tokens)
            b16, ttft16 = decode_rate(llm, 16, 128, args.new_tokens)
            held = held_weight_bytes(llm)
            limit = bandwidth / held
            rows.append(
                {
                    "model": name,
                    "quantization": method,
                    "weight_gb": held / 1e9,
                    "kv_cache_tokens": llm.engine.stats().num_blocks * llm.engine.config.block_size,
                    "kv_memory_tokens": llm.engine.runner.memory_blocks * llm.engine.config.block_size,
                    "b1_tok_s": b1,
                    "b1_limit_tok_s": limit,
                    "b1_%_of_limit": 100 * b1 / limit,
                    "b16_tok_s": b16,
                    "ttft_ms_128": ttft,
                    "ttft_ms_b16": ttft16,
                    **(cold if method == args.quantization[0] else {}),
                }
            )
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    columns = [
        "model",
        "quantization",
        "weight_gb",
        "kv_cache_tokens",
        "kv_memory_tokens",
        "b1_tok_s",
        "b1_limit_tok_s",
        "b1_%_of_limit",
        "b16_tok_s",
        "ttft_ms_128",
        "ttft_ms_b16",
        "cold_start_s",
        "cold_start_max_s",
        "cold_start_warm_triton_cache_s",
    ]
    if args.peer is not None:
        columns += add_peer(rows, json.loads(args.peer.read_text())["runs"])
    table = markdown_table(rows, columns)
    write_results(
        "latency" if args.quantization == ["none"] else "latency-" + "-".join(args.quantization),
        {
            "environment": environment(),
            "rows": rows,
            "new_tokens": args.new_tokens,
            "note": "dummy weights, bf16, CUDA graphs on, max_model_len 4096",
            "peer": None if args.peer is None else json.loads(args.peer.read_text()),
        },
        table,
    )
    print(table)


if __name__ == "__main__":
    main()
