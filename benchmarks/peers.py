"""vLLM and pagellm side by side from one device call: every row a workload, both engines' figures, the ratio.

vLLM's side is ../shared/peers/vllm_bundle.sh (its header says how it reaches the GPU in two calls); in the second
call, once it is installed, this script runs vLLM's workloads (vllm_bench.py) and pagellm's twins
(benchmarks/peer_workloads.py) one process at a time, cold starts on fresh compile caches, then writes
benchmarks/results/peers-<date>.{json,md,png}:

    bash .peer/vllm_bundle.sh stash .peer/p2 && bash .peer/vllm_bundle.sh install &&
    python benchmarks/peers.py --peer-dir .peer --models qwen3 --deadline $(($(date +%s)+520)) &&
    cp benchmarks/results/peers-* $OUT/

and, in a third call while the machine is warm (10 minutes a call), `--models llama8b`: each call measures into
/tmp/peers and writes the results file from every run found there, so the last one holds both models.
`--merge DIR` only rebuilds the results file from the runs in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

HERE = Path(__file__).resolve().parent
VLLM_ENV = {  # as vllm_bundle.sh runs it: FlashInfer is not carried, so its sampler is switched off
    "PYTHONPATH": "/tmp/site",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# (row label, result section, figure, higher is better)
METRICS = [
    ("standard offline workload, output tok/s", "throughput", "output_tok_per_s", True),
    ("batch-1 decode tok/s", "batch1", "decode_only_tok_per_s", True),
    ("batch-16 decode tok/s", "batch16", "decode_only_tok_per_s", True),
    ("batch-1 time to first token (128-token prompt), s", "batch1", "ttft_s_median", False),
]


def fresh_caches() -> None:
    for path in (Path.home() / ".cache" / "vllm", Path.home() / ".triton" / "cache", Path("/tmp/torchinductor_root")):
        shutil.rmtree(path, ignore_errors=True)


def run_one(engine: str, mode: str, model: str, out: Path, peer_dir: Path, seconds: int) -> None:
    """One measured process; its JSON lands in `out` even when it fails or times out."""
    if engine == "vllm":
        cmd = [sys.executable, str(peer_dir / "vllm_bench.py"), mode, "--model", model, "--out", str(out)]
        env = {**os.environ, **VLLM_ENV}
    else:
        cmd = [sys.executable, str(HERE / "peer_workloads.py"), mode, "--model", model, "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    env["PEER_T0"] = f"{time.time():.6f}"
    log = out.with_suffix(".log")
    try:
        with log.open("w") as f:
            subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=seconds, check=False)
    except subprocess.TimeoutExpired:
        print(f"{engine} {mode} {model}: timed out after {seconds} s", flush=True)
    tail = log.read_text().splitlines()[-3:]
    print(f"{engine} {mode} {model}:", *tail, sep="\n  ", flush=True)


def rows_from(results: Path, models: list[str]) -> list[dict]:
    rows = []
    for model in models:
        if not list(results.glob(f"*-{model}-*.json")):
            continue
        runs = {}
        for engine in ("vllm", "pagellm"):
            path = results / f"{engine}-{model}-bench.json"
            runs[engine] = json.loads(path.read_text()) if path.exists() else {}
        name = runs["pagellm"].get("model") or runs["vllm"].get("model") or model
        for label, section, figure, higher in METRICS:
            v = runs["vllm"].get(section, {}).get(figure)
            p = runs["pagellm"].get(section, {}).get(figure)
            ratio = (p / v if higher else v / p) if v and p else None
            rows.append({"model": name, "workload": label, "vllm": v, "pagellm": p, "pagellm_advantage": ratio})
        cold = {}
        for engine in ("vllm", "pagellm"):
            path = results / f"{engine}-{model}-coldstart.json"
            run = json.loads(path.read_text()) if path.exists() else {}
            cold[engine] = run.get("coldstart", {}).get("t_process_start_to_first_token_s")
        if any(cold.values()):
            v, p = cold["vllm"], cold["pagellm"]
            rows.append(
                {
                    "model": name,
                    "workload": "cold start to first token, fresh caches, s",
                    "vllm": v,
                    "pagellm": p,
                    "pagellm_advantage": v / p if v and p else None,
                }
            )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["pagellm_advantage"]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(shown) + 1))
    labels = [f"{r['model']}: {r['workload']}" for r in shown]
    ax.barh(range(len(shown)), [r["pagellm_advantage"] for r in shown])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.set_xlabel("pagellm / vLLM (same run; >1: pagellm ahead)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-dir", type=Path, default=Path(".peer"), help="where vllm_bench.py is")
    parser.add_argument("--models", nargs="+", default=["qwen3", "llama8b"], choices=["qwen3", "llama8b"])
    parser.add_argument("--deadline", type=float, default=time.time() + 3600, help="epoch seconds")
    parser.add_argument("--work", type=Path, default=Path("/tmp/peers"), help="where each run's JSON and log go")
    parser.add_argument("--merge", type=Path, default=None, help="only merge the JSON files found here")
    args = parser.parse_args()
    work = args.merge or args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.merge is None:
        # Cold starts first, each on fresh caches (the engine's compile caches and Triton's), then the benchmarks.
        plan = [(e, "coldstart", args.models[0], 300) for e in ("vllm", "pagellm")]
        plan += [(e, "bench", m, 540) for m in args.models for e in ("vllm", "pagellm")]
        for engine, mode, model, cap in plan:
            left = int(args.deadline - time.time())
            if left < 60:
                print(f"skipped {engine} {mode} {model}: {left} s left", flush=True)
                continue
            if mode == "coldstart":
                fresh_caches()
            run_one(engine, mode, model, work / f"{engine}-{model}-{mode}.json", args.peer_dir, min(cap, left))
    rows = rows_from(work, ["qwen3", "llama8b"])
    table = markdown_table(rows, ["model", "workload", "vllm", "pagellm", "pagellm_advantage"])
    note = "vLLM 0.26.0 at its defaults (FlashInfer sampler off: not carried) and pagellm, dummy bf16 weights"
    path = write_results("peers", {"environment": environment(), "rows": rows, "note": note}, table)
    plot(rows, path.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
