"""Where a decode step's time goes on the GPU: wall time per engine step against the GPU kernel time inside it
(the gap is host work the GPU waits for), the kernels that take the most time and, for the host's side, the
operators with the most CPU time of their own.

    python benchmarks/profile_step.py --model Qwen3-0.6B --batch 1 --context 128
    python benchmarks/profile_step.py --model Qwen3-0.6B --prefill --context 128   # time to first token
    python benchmarks/profile_step.py --model DIR --batch 64 --structured --trace trace.json.gz

With --structured every row decodes under a grammar that never ends (JSON-like records, a regex), so a step pays
for accepting, filling and applying the token bitmask; DIR needs a tokenizer (SmolLM2's config and tokenizer).
--trace writes the profiled steps as a Chrome trace (host launches and GPU kernels on one timeline: where the
GPU waits for the host).

With --prefill each profiled step is a whole `LLM.generate` of `--batch` fresh prompts of `--context` tokens and
one output token (what the peers' first-token figure times).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import model_dir  # noqa: E402
from pagellm import LLM, SamplingParams  # noqa: E402

RECORDS = r'\[(\{"id": [0-9]{1,4}, "label": "[a-z ]{1,12}"\}, )*'  # never complete: rows decode for as long as asked


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(
        model_dir(args.model), load_format="dummy", max_model_len=4096, max_num_seqs=max(args.batch, 16), quiet=True
    )
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        return [torch.randint(0, 30000, (args.context,), generator=gen).tolist() for _ in range(args.batch)]

    if args.prefill:
        first_token = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=1, ignore_eos=True)

        def step() -> None:
            llm.generate(prompts(), first_token, use_tqdm=False)

    else:
        grammar = {"regex": RECORDS} if args.structured else None
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
        f"{args.model} batch {args.batch}{' structured' if args.structured else ''} ctx {args.context}: "
        f"wall {wall_ms:.3f} ms/step, GPU kernels "
        f"{gpu_ms:.3f} ms/step, {launches:.0f} kernels/step, {result['tok_s']:.0f} tok/s"
    )
    for k in result["top_kernels"]:
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
