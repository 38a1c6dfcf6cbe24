"""Where a decode step's time goes on the GPU: wall time per engine step against the GPU kernel time inside it
(the gap is host work the GPU waits for), the kernels that take the most time, each kernel's share of the GPU's
timeline (`critical_path`: under PDL a kernel starts while the one before it runs, so its duration overstates what it
costs) and, for the host's side, the operators with the most CPU time of their own.

    python benchmarks/profile_step.py --model Qwen3-0.6B --batch 1 --context 128
    python benchmarks/profile_step.py --model Qwen3-0.6B --prefill --context 128   # time to first token
    python benchmarks/profile_step.py --model Llama-3.1-8B --batch 256 --context 600 --quantization fp8
    python benchmarks/profile_step.py --model DIR --batch 64 --structured --trace trace.json.gz
    python benchmarks/profile_step.py --model DIR --batch 64 --structured --phases

With --structured every row decodes under a JSON schema that never ends within the run (an array of at least 1,000
records), so a step pays for accepting, filling and applying the token bitmask; DIR needs a tokenizer (SmolLM2's
config and tokenizer). --trace writes the profiled steps as a Chrome trace (host launches and GPU kernels on one
timeline: where the GPU waits for the host).

With --phases nothing is profiled: the engine's own calls inside `Engine.step` are timed (host milliseconds per
step), for the same batch unconstrained and, with --structured, constrained, alternately `--repeats` times, so
the constrained rows' cost shows phase by phase (what a structured-outputs change moves).

With --prefill each profiled step is a whole `LLM.generate` of `--batch` fresh prompts of `--context` tokens and
one output token (what the peers' first-token figure times).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import cProfile
import json
import pstats
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import model_dir  # noqa: E402
from benchmarks.structured import ENDLESS_RECORDS  # noqa: E402  rows decode for as long as asked
from pagellm import LLM, RequestOutputKind, SamplingParams  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def critical_path(events: Iterable, steps: int) -> list[dict]:
    """Per kernel name, how far its launches among the profiler's `events` moved the end of the GPU's work (a
    launch that ends by the time an earlier one ends moves it by nothing), per step; "(idle)" is the time no kernel
    ran. The rows sum to the GPU timeline's span."""
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    shares: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    busy_until = kernels[0].time_range.start if kernels else 0.0
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        if start > busy_until:
            shares["(idle)"][0] += start - busy_until
        shares[e.name[:90]][0] += max(0.0, end - max(start, busy_until))
        shares[e.name[:90]][1] += 1
        busy_until = max(busy_until, end)
    rows = [{"name": name, "us_per_step": us / steps, "calls_per_step": n / steps} for name, (us, n) in shares.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


@contextlib.contextmanager
def timed_calls(calls: dict[str, tuple[object, str]], seconds: dict[str, float]) -> Iterator[None]:
    """Adds the seconds of every call of each `object.attribute` to `seconds[label]` while inside."""
    originals = [(obj, name, getattr(obj, name)) for obj, name in calls.values()]

    def timed(label: str, original: Callable) -> Callable:
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        return call

    for label, (obj, name, original) in zip(calls, originals):
        setattr(obj, name, timed(label, original))
    try:
        yield
    finally:
        for obj, name, original in originals:
            setattr(obj, name, original)


def engine_phases(engine) -> dict[str, tuple[object, str]]:
    """The calls of Engine.step to time, by label; the indented ones run inside those above them."""
    runner = engine.runner
    return {
        "launch (the look-ahead step)": (engine, "_launch"),
        "  sampler.sample": (runner.sampler, "sample"),
        "collect (waits for the step's tokens)": (runner, "collect"),
        "scheduler.update_from_output": (engine.scheduler, "update_from_output"),
        "grammar accept": (engine.structured_outputs, "accept"),
        "start the bitmask fill": (engine.structured_outputs, "start_bitmask"),
        "output processing": (engine.output_processor, "process"),
        "wait for the fill": (concurrent.futures.Future, "result"),
        "sample_constrained": (runner, "sample_constrained"),
        "  apply_token_bitmask": (runner.ops, "apply_token_bitmask"),
    }


def run_phases(llm: LLM, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Steady decode of the batch, unconstrained and (with --structured) constrained, each run `--repeats` times
    alternately: wall and per-phase host ms per step."""
    engine = llm.engine
    kinds = ["unconstrained", "constrained"] if args.structured else ["unconstrained"]
    runs = []
    for repeat in range(args.repeats):
        for kind in kinds:
            params = SamplingParams(
                temperature=args.temperature,
                top_p=args.top_p,
                max_tokens=10_000,
                ignore_eos=True,
                structured_outputs={"json": ENDLESS_RECORDS} if kind == "constrained" else None,
                output_kind=RequestOutputKind.FINAL_ONLY,  # as LLM.generate asks (structured.py's batches)
            )
            request_ids = [engine.add_request(prompt, params) for prompt in prompts]
            for _ in range(args.warmup):
                engine.step()
            seconds: dict[str, float] = collections.defaultdict(float)
            with timed_calls(engine_phases(engine), seconds):
                _sync()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.step()
                wall = time.perf_counter() - start
            runs.append(
                {"kind": kind, "repeat": repeat, "wall_ms": wall / args.steps * 1e3}
                | {label: 1e3 * s / args.steps for label, s in seconds.items()}
            )
            for request_id in request_ids:
                engine.abort(request_id)
            while engine.has_unfinished():
                engine.step()
    labels = ["wall_ms"] + list(engine_phases(engine))
    print(f"{args.model} batch {args.batch}: host ms per step ({args.steps} steps after {args.warmup})")
    print(f"{'':40s}" + "".join(f"{r['kind'][:13]:>14s}" for r in runs))
    for label in labels:
        print(f"{label:40s}" + "".join(f"{r.get(label, 0.0):14.3f}" for r in runs))
    if args.structured:
        walls = {kind: [r["wall_ms"] for r in runs if r["kind"] == kind] for kind in kinds}
        ratios = [u / c for u, c in zip(walls["unconstrained"], walls["constrained"])]
        print("constrained throughput / unconstrained: " + ", ".join(f"{r:.3f}" for r in ratios))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "batch": args.batch, "runs": runs}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen3-0.6B")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--prefill", action="store_true", help="profile whole first-token requests")
    parser.add_argument("--structured", action="store_true", help="every row under a never-ending grammar")
    parser.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps")
    parser.add_argument("--phases", action="store_true", help="time Engine.step's calls instead of profiling")
    parser.add_argument("--warmup", type=int, default=30, help="--phases: steps before the timed ones")
    parser.add_argument("--repeats", type=int, default=2, help="--phases: runs of each kind, alternately")
    parser.add_argument("--quantization", default=None, help="the weights' format (fp8, awq, gptq; bf16 without)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(
        model_dir(args.model),
        load_format="dummy",
        max_model_len=4096,
        max_num_seqs=max(args.batch, 16),
        quantization=args.quantization,
        quiet=True,
    )
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        return [torch.randint(0, 30000, (args.context,), generator=gen).tolist() for _ in range(args.batch)]

    if args.phases:
        run_phases(llm, prompts(), args)
        return
    if args.prefill:
        first_token = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=1, ignore_eos=True)

        def step() -> None:
            llm.generate(prompts(), first_token, use_tqdm=False)

    else:
        grammar = {"json": ENDLESS_RECORDS} if args.structured else None
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=10_000,
            ignore_eos=True,
            structured_outputs=grammar,
        )
        for prompt in prompts():
            engine.add_request(prompt, params)
        decoding: set[str] = set()  # requests past their prefill (they have a token)
        while len(decoding) < args.batch:
            decoding |= {out.request_id for out in engine.step()}
        step = engine.step
    for _ in range(5):
        step()
    _sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync()  # the last step may still be in flight (asynchronous scheduling)
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        _sync()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    python_profile = cProfile.Profile()  # the host's Python: where its time goes between and inside launches
    python_profile.runcall(lambda: [step() for _ in range(args.steps)])
    _sync()
    stats = pstats.Stats(python_profile).stats  # (file, line, function) -> (calls, _, own seconds, total, _)
    top_python = sorted(stats.items(), key=lambda item: -item[1][2])[:15]
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time_total for e in kernels) / 1e3 / args.steps
    launches = sum(e.count for e in kernels) / args.steps
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:15]
    host = [e for e in averages if e.device_type == torch.autograd.DeviceType.CPU]
    top_host = sorted(host, key=lambda e: -e.self_cpu_time_total)[:12]
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "batch": args.batch,
        "context": args.context,
        "wall_ms_per_step": wall_ms,
        "gpu_kernel_ms_per_step": gpu_ms,
        "kernels_per_step": launches,
        "tok_s": args.batch / wall_ms * 1e3,
        "prefill": args.prefill,
        "structured": args.structured,
        "top_kernels": [
            {
                "name": e.key[:90],
                "us_per_step": e.device_time_total / args.steps,
                "calls_per_step": e.count / args.steps,
            }
            for e in top
        ],
        "critical_path": critical_path(prof.events(), args.steps)[:15],
        "top_host_ops": [
            {
                "name": e.key[:90],
                "self_cpu_us_per_step": e.self_cpu_time_total / args.steps,
                "calls_per_step": e.count / args.steps,
            }
            for e in top_host
        ],
        "top_python_functions": [
            {
                "name": f"{Path(file).name}:{line} {function}",
                "own_us_per_step": own * 1e6 / args.steps,
                "calls_per_step": calls / args.steps,
            }
            for (file, line, function), (calls, _, own, _, _) in top_python
        ],
    }
    print(
        f"{args.model} ({args.quantization or 'bf16'}) batch {args.batch}{' structured' if args.structured else ''} "
        f"ctx {args.context}: "
        f"wall {wall_ms:.3f} ms/step, GPU kernels "
        f"{gpu_ms:.3f} ms/step, {launches:.0f} kernels/step, {result['tok_s']:.0f} tok/s"
    )
    for k in result["top_kernels"]:
        print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['name']}")
    print("each kernel's share of the GPU timeline (how far it moved the end of the GPU's work):")
    for k in result["critical_path"]:
        print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['name']}")
    print("host operators (their own CPU time, profiler overhead included):")
    for k in result["top_host_ops"]:
        print(f"  {k['self_cpu_us_per_step']:9.1f} us  x{k['calls_per_step']:5.1f}  {k['name']}")
    print("host Python functions (their own time, under cProfile):")
    for k in result["top_python_functions"]:
        print(f"  {k['own_us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
