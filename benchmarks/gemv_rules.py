"""Batch-1 decode on the GPU under other tile rules for the one-row GEMV (`kernels.gemv.gemv_tiles`), or other
split sizes for the decode attention, each rule in fresh processes, in the order A..Z Z..A so that the machine's
drift falls on all alike, with each kernel's share of the GPU timeline (`profile_step.critical_path`). Kernel
sweeps (`matmul_sweep.py`) time one matmul at a time; under PDL a GEMV's cost depends on what it overlaps, so rules
are compared here in whole decode steps.

    python benchmarks/gemv_rules.py --model Qwen3-0.6B --rules current whole4096 whole16384 narrow4
    python benchmarks/gemv_rules.py --rules current --tree before=/tmp/base   # /tmp/base/pagellm, same rule

A rule applies to the weights it names (`SMALL`: up to `gemv.SMALL_WEIGHT` elements; `ALL`: every weight but the
LM head, n > 16384); the others keep `gemv_tiles`' tiles. `SPLIT` rules set the small-batch decode attention's split
size and tile instead (`decode_attention.MIN_SPLIT` / `BLOCK_N`), the GEMV as it is.

    python benchmarks/gemv_rules.py --rules current split128 split128x128 split256 split4096 --name decode-splits
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

# rule name -> (weights it applies to, how its tiles are made: "whole <elements> <warps>" or
# "tiles <block_n> <block_k> <warps> <stages>"), or ("SPLIT", "<split tokens> <tile tokens>")
RULES = {
    "current": ("SMALL", None),
    "whole4096": ("SMALL", "whole 4096 4"),
    "whole16384": ("SMALL", "whole 16384 4"),
    "whole16384x8": ("SMALL", "whole 16384 8"),
    "narrow2": ("SMALL", "tiles 2 512 4 4"),
    "narrow4": ("SMALL", "tiles 4 1024 4 2"),
    "streamed": ("SMALL", "tiles 8 512 4 4"),  # the tiles small weights had before whole rows
    "whole8192-all": ("ALL", "whole 8192 4"),
    "narrow4-all": ("ALL", "tiles 4 512 4 4"),
    "split128": ("SPLIT", "128 64"),
    "split128x128": ("SPLIT", "128 128"),  # one 128-token tile per split
    "split256": ("SPLIT", "256 64"),
    "split4096": ("SPLIT", "4096 64"),  # one split per sequence up to 4,096 tokens
}

CHILD = """
import json, statistics, sys, torch, triton
import pagellm.kernels.gemv as gemv
from torch.profiler import ProfilerActivity, profile
scope, make, model = sys.argv[1], sys.argv[2], sys.argv[3]
current = gemv.gemv_tiles

def ruled(n, k):
    applies = n <= 16384 and (scope == "ALL" or n * k <= getattr(gemv, "SMALL_WEIGHT", 8 << 20))
    if make == "-" or not applies:
        return current(n, k)
    kind, *values = make.split()
    values = [int(v) for v in values]
    if kind == "tiles":
        return gemv.Tiles(*values)
    elements, warps = values
    row = triton.next_power_of_2(k)
    if row > elements:
        return current(n, k)
    return gemv.Tiles(min(16, elements // row), row, warps, 1)

if scope == "SPLIT":
    import pagellm.kernels.decode_attention as decode_attention
    decode_attention.MIN_SPLIT[False, True], decode_attention.BLOCK_N[False, True] = map(int, make.split())
else:
    gemv.gemv_tiles = ruled
from pagellm import LLM, SamplingParams
from benchmarks.latency import decode_rate
from benchmarks.models import model_dir
from benchmarks.profile_step import critical_path
llm = LLM(model_dir(model), load_format="dummy", max_model_len=4096, max_num_seqs=64, quiet=True)
rates = [decode_rate(llm, 1, 128, 256)[0] for _ in range(3)]
engine = llm.engine
engine.add_request(list(range(100, 228)), SamplingParams(max_tokens=10_000, ignore_eos=True))
for _ in range(40):
    engine.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
path = critical_path(prof.events(), 20)[:10]
print("RESULT " + json.dumps({"tok_s": statistics.median(rates), "runs": rates, "critical_path": path}))
"""


def measure(tree: Path, rule: str, model: str) -> dict:
    scope, make = RULES[rule]
    return run_in_tree(tree, CHILD, [scope, make or "-", model])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen3-0.6B")
    parser.add_argument("--rules", nargs="+", default=["current", "whole4096", "whole16384"], choices=list(RULES))
    parser.add_argument("--tree", nargs="*", default=[], help="LABEL=DIR: a package to run with the first rule")
    parser.add_argument("--name", default="gemv-rules")
    args = parser.parse_args()
    variants = [(rule, rule, ROOT) for rule in args.rules]
    variants += [(label, args.rules[0], Path(d).resolve()) for label, d in (t.split("=", 1) for t in args.tree)]
    runs: dict[str, list[dict]] = {}
    for label, rule, tree in variants + variants[::-1]:
        start = time.perf_counter()
        result = measure(tree, rule, args.model)
        runs.setdefault(label, []).append(result)
        print(f"{label}: {result['tok_s']:.1f} tok/s ({time.perf_counter() - start:.0f} s)", flush=True)
    first = statistics.mean(r["tok_s"] for r in runs[variants[0][0]])
    rows = []
    for label, results in runs.items():
        tok_s = statistics.mean(r["tok_s"] for r in results)
        path = {row["name"]: row["us_per_step"] for row in results[0]["critical_path"]}
        rows.append(
            {
                "variant": label,
                "b1_tok_s": tok_s,
                "vs_first": tok_s / first,
                "gemv_us": path.get("_gemv_kernel", 0.0),
                "attention_us": path.get("_decode_partial_kernel", 0.0) + path.get("_decode_merge_kernel", 0.0),
                "idle_us": path.get("(idle)", 0.0),
                "runs": [r["tok_s"] for r in results],
                "critical_path": results[0]["critical_path"],
            }
        )
    table = markdown_table(rows, ["variant", "b1_tok_s", "vs_first", "gemv_us", "attention_us", "idle_us"])
    note = (
        f"{args.model}, dummy bf16 weights, batch-1 decode (128-token prompt, 256 new tokens, median of 3 per "
        "process, mean of two processes, order A..Z Z..A); gemv_us / attention_us / idle_us: per step, the one-row "
        "GEMVs', the decode attention's (partial + merge) and the idle share of the GPU timeline "
        "(profile_step.critical_path, one process)"
    )
    write_results(args.name, {"environment": environment(), "note": note, "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
