"""Same-run A/B of two versions of pagellm on the GPU: the standard offline workload's throughput and decode at
`--batches` (batch 1 by default), each measured in a fresh process per version, in the order A B B A so that the
machine's drift falls on both alike. The figures of a refactoring are only comparable within one run: between two
runs (or two machines) of the same code they move by more than the few percent such a change is allowed.

    git archive d9fbf08 pagellm | tar x -C .devcarry/base   # the baseline's package
    python benchmarks/ab.py --baseline .devcarry/base --label-a d9fbf08 --label-b HEAD
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, markdown_table, run_in_tree, write_results  # noqa: E402

# One process: the measures of one model with one version of pagellm (first on PYTHONPATH), printed as JSON.
CHILD = """
import json, sys, time
from pagellm import LLM, SamplingParams
from benchmarks.latency import decode_rate
from benchmarks.models import model_dir
from benchmarks.throughput import workload
name, throughput, batches = sys.argv[1], sys.argv[2] == "1", [int(b) for b in sys.argv[3].split(",")]
quantization = None if sys.argv[4] == "none" else sys.argv[4]
path, out = model_dir(name), {}
if throughput:
    prompts, out_lens = workload(256)
    llm = LLM(path, load_format="dummy", max_model_len=4096, quantization=quantization, quiet=True)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    out["output_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    del llm
    import gc, torch; gc.collect(); torch.cuda.empty_cache()
seqs = max(64, *batches)  # every decode batch asked for runs whole
llm = LLM(path, load_format="dummy", max_model_len=4096, max_num_seqs=seqs, quantization=quantization, quiet=True)
for batch in batches:
    out[f"b{batch}_tok_s"] = decode_rate(llm, batch, 128, 256)[0]
print("RESULT " + json.dumps(out))
"""


def measure(tree: Path, model: str, throughput: bool, batches: list[int], quantization: str) -> dict:
    return run_in_tree(tree, CHILD, [model, "1" if throughput else "0", ",".join(map(str, batches)), quantization])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="directory holding the baseline's pagellm/ package")
    parser.add_argument("--label-a", default="baseline")
    parser.add_argument("--label-b", default="this tree")
    parser.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Llama-3.1-8B"])
    parser.add_argument("--throughput-models", nargs="+", default=["Qwen3-0.6B"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1], help="decode batch sizes to time")
    parser.add_argument("--quantization", default="none", help="none, fp8, awq, gptq: both sides' weights")
    parser.add_argument("--name", default="ab", help="results file name (before the date)")
    args = parser.parse_args()
    trees = {"a": Path(args.baseline).resolve(), "b": ROOT}
    runs: dict[tuple[str, str], list[dict]] = {}
    for model in args.models:
        for side in "abba":
            start = time.perf_counter()
            result = measure(trees[side], model, model in args.throughput_models, args.batches, args.quantization)
            runs.setdefault((model, side), []).append(result)
            print(f"{model} {side}: {result} ({time.perf_counter() - start:.0f} s)", flush=True)
    rows = []
    for model in args.models:
        for metric in runs[model, "a"][0]:
            a = statistics.mean(r[metric] for r in runs[model, "a"])
            b = statistics.mean(r[metric] for r in runs[model, "b"])
            rows.append(
                {
                    "model": model,
                    "metric": metric,
                    args.label_a: a,
                    args.label_b: b,
                    "b_over_a": b / a,
                    "runs_a": [r[metric] for r in runs[model, "a"]],
                    "runs_b": [r[metric] for r in runs[model, "b"]],
                }
            )
    table = markdown_table(rows, ["model", "metric", args.label_a, args.label_b, "b_over_a"])
    write_results(
        args.name,
        {
            "environment": environment(),
            "rows": rows,
            "a": args.label_a,
            "b": args.label_b,
            "quantization": args.quantization,
            "note": f"dummy weights ({args.quantization if args.quantization != 'none' else 'bf16'}, bf16 "
            "activations), CUDA graphs, max_model_len 4096; mean of two processes "
            "each (order A B B A); throughput: 256 requests, in/out U[100, 1024], top-p 0.95; "
            f"decode: batches {args.batches}, 128-token prompts, 256 new tokens",
        },
        table,
    )
    print(table)


if __name__ == "__main__":
    main()
