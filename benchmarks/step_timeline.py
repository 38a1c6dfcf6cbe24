"""Where the standard offline workload's time goes (benchmarks/throughput.py's), step by step: every engine step's
GPU time against that step's own bound, summed by kind of step.

A step's GPU time is the time between the ends of its work and of the step's before it on the stream (CUDA events
recorded after each launch): the GPU's idle time waiting for the host counts to the step it waited for. Its bound
is the larger of the bytes it moves (the weights once, each row's KV context) over the copy bandwidth and the FLOPs
it does (linears of every token, the LM head of every sampled row, attention) over the bf16 rate, as in
`roofline.standard_workload_bound`, which sums the same arithmetic over a workload whose requests all run at once.
Steps are grouped as prefill steps (any row of more than one token) and pure-decode steps by their number of rows.

    python benchmarks/step_timeline.py --models Qwen3-0.6B Llama-3.1-8B
    python benchmarks/step_timeline.py --models Llama-3.1-8B --max-num-batched-tokens 8192 16384
"""

from __future__ import annotations

import argparse
import bisect
import gc
import itertools
import sys
import time
from pathlib import Path
from typing import NamedTuple

import matplotlib
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_bound_arguments, bound_rates, environment, markdown_table, write_results  # noqa: E402
from benchmarks.models import SHAPES, model_dir  # noqa: E402
from benchmarks.roofline import ModelCost, model_cost, standard_workload_bound  # noqa: E402
from benchmarks.throughput import workload  # noqa: E402
from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.core.step import SchedulerOutput  # noqa: E402

# Pure-decode steps are grouped by rows: 1-16, 17-64, 65-128, 129-256, 257 and more.
DECODE_ROWS = (16, 64, 128, 256)
GROUPS = ["prefill", *(f"decode {lo + 1}-{hi}" for lo, hi in zip((0, *DECODE_ROWS), DECODE_ROWS))]
GROUPS.append(f"decode {DECODE_ROWS[-1] + 1}+")


class StepCost(NamedTuple):
    rows: int
    tokens: int
    context: int  # KV tokens the step's attention reads: each row's start plus its tokens
    prefill: bool
    memory_s: float
    compute_s: float


def step_cost(step: SchedulerOutput, cost: ModelCost, bandwidth: float, flops: float, fp8: bool) -> StepCost:
    context = sum(row.start + row.num_tokens for row in step.rows)
    # Row keys attended: each of a row's n tokens from position s attends s + i + 1 keys.
    keys = sum(row.num_tokens * row.start + row.num_tokens * (row.num_tokens + 1) // 2 for row in step.rows)
    sampled = sum(row.sampling is not None for row in step.rows)
    matmul = 2 * cost.linear_params * step.total_tokens + 2 * cost.head_params * sampled
    return StepCost(
        rows=len(step.rows),
        tokens=step.total_tokens,
        context=context,
        prefill=not step.is_decode_only,
        memory_s=(cost.step_bytes + cost.kv_token_bytes * context) / bandwidth,
        compute_s=matmul / (flops * (2 if fp8 else 1)) + cost.attention_flops_per_key * keys / flops,
    )


def group(step: StepCost) -> str:
    if step.prefill:
        return "prefill"
    return GROUPS[1 + bisect.bisect_left(DECODE_ROWS, step.rows)]


def timed_run(path: str, prompts, out_lens, cost: ModelCost, bandwidth: float, flops: float, fp8: bool, **kwargs):
    """(wall seconds, [(StepCost, GPU seconds)]) of the standard workload, every engine launch timed."""
    llm = LLM(path, load_format="dummy", quiet=True, **kwargs)
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    engine, launched = llm.engine, []
    launch = engine._launch

    def timed_launch(step: SchedulerOutput):
        in_flight = launch(step)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        launched.append((step_cost(step, cost, bandwidth, flops, fp8), end))
        return in_flight

    engine._launch = timed_launch
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True) for n in out_lens]
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    begin.record()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    torch.cuda.synchronize()
    del engine._launch  # the engine's own again, and no reference cycle holding the engine's memory
    ends = [begin] + [end for _, end in launched]
    steps = [(c, before.elapsed_time(end) / 1e3) for (c, _), before, end in zip(launched, ends, ends[1:])]
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return wall, steps


def summarize(steps: list[tuple[StepCost, float]]) -> list[dict]:
    """A row per group of steps and one for all: steps, GPU seconds, the bound's seconds and parts, the share of
    the GPU time the bound is, and the mean rows, tokens and KV context of a step."""
    groups: dict[str, list] = {}
    for c, gpu in steps:
        groups.setdefault(group(c), []).append((c, gpu))
    rows = []
    for name, members in [(g, groups[g]) for g in GROUPS if g in groups] + [("all", steps)]:
        gpu = sum(t for _, t in members)
        bound = sum(max(c.memory_s, c.compute_s) for c, _ in members)
        n = len(members)
        rows.append(
            {
                "steps": name,
                "count": n,
                "gpu_s": gpu,
                "bound_s": bound,
                "memory_bound_s": sum(c.memory_s for c, _ in members),
                "compute_bound_s": sum(c.compute_s for c, _ in members),
                "%_of_bound": 100 * bound / gpu,
                "gpu_ms_per_step": 1e3 * gpu / n,
                "rows": sum(c.rows for c, _ in members) / n,
                "tokens": sum(c.tokens for c, _ in members) / n,
                "context": sum(c.context for c, _ in members) / n,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Llama-3.1-8B"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--quantization", default="none", help="none, fp8, awq or gptq (dummy weights)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[None], help="a run each")
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256], help="a run each")
    parser.add_argument("--name", default="step-timeline")
    add_bound_arguments(parser)
    args = parser.parse_args()
    bandwidth, flops = bound_rates(args)
    prompts, out_lens = workload(args.num_requests)
    in_lens = list(map(len, prompts))
    runs, table_rows, timelines = [], [], {}
    for name, budget, seqs in itertools.product(args.models, args.max_num_batched_tokens, args.max_num_seqs):
        cost = model_cost(SHAPES[name], args.quantization, args.kv_cache_dtype)
        wall, steps = timed_run(
            model_dir(name),
            prompts,
            out_lens,
            cost,
            bandwidth,
            flops,
            args.quantization == "fp8",
            max_model_len=4096,
            max_num_batched_tokens=budget,
            max_num_seqs=seqs,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=None if args.quantization == "none" else args.quantization,
        )
        bound = standard_workload_bound(
            SHAPES[name], in_lens, out_lens, args.quantization, args.kv_cache_dtype, bandwidth, flops
        )
        label = f"{name} tokens={budget or 'default'} seqs={seqs}"
        summary = summarize(steps)
        slowest = max(range(len(steps)), key=lambda i: steps[i][1])
        run = {
            "run": label,
            "wall_s": wall,
            "output_tok_s": sum(out_lens) / wall,
            "workload_bound_s": bound["bound_s"],
            "slowest_step": slowest,
            "slowest_step_ms": 1e3 * steps[slowest][1],
            "groups": summary,
        }
        runs.append(run)
        timelines[label] = [(c.prefill, c.rows, t, max(c.memory_s, c.compute_s)) for c, t in steps]
        table_rows += [{"run": label, **row} for row in summary]
        print(label, f"wall {wall:.2f} s, {run['output_tok_s']:.0f} output tok/s", flush=True)
    columns = ["run", "steps", "count", "gpu_s", "bound_s", "memory_bound_s", "compute_bound_s", "%_of_bound"]
    columns += ["gpu_ms_per_step", "rows", "tokens", "context"]
    walls = "\n".join(
        f"- {r['run']}: wall {r['wall_s']:.2f} s ({r['output_tok_s']:.0f} output tok/s), "
        f"workload bound {r['workload_bound_s']:.2f} s; slowest step {r['slowest_step']}, {r['slowest_step_ms']:.1f} ms"
        for r in runs
    )
    table = walls + "\n\n" + markdown_table(table_rows, columns)
    path = write_results(
        args.name,
        {
            "environment": environment(),
            "bandwidth": bandwidth,
            "flops": flops,
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "runs": runs,
            "timelines": timelines,
        },
        table,
    )
    plot(timelines, path.with_suffix(".png"))
    print(table)


def plot(timelines: dict[str, list], path: Path) -> None:
    """GPU milliseconds of each step against its bound, one panel per run."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, 2.8 * len(timelines)), squeeze=False)
    for ax, (label, steps) in zip(axes[:, 0], timelines.items()):
        ax.plot([1e3 * t for _, _, t, _ in steps], lw=0.7, label="GPU time")
        ax.plot([1e3 * b for _, _, _, b in steps], lw=0.7, label="bound")
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("ms per step")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
