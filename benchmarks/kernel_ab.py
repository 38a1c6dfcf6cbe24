"""Same-run A/B of the attention kernels of two or more versions of pagellm on the GPU: kernel_bench's paged
prefill rows and paged decode rows (bf16 and INT8 K/V, no SDPA peers), each version timed in a fresh process, in
the order A B .. B A so that the machine's drift falls on all alike. Kernel figures move between runs by more than
the few percent a kernel change is worth, so only a same-run ratio says whether it pays.

    git archive HEAD pagellm | tar x -C .devcarry/base   # the baseline's package
    python benchmarks/kernel_ab.py --trees HEAD=.devcarry/base tree=.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, markdown_table, run_in_tree, write_results  # noqa: E402

# (sequences, context tokens): a large batch of the standard workload's lengths, kernel_bench's long contexts.
DECODE_SHAPES = ((256, 640), (64, 4096), (16, 16384), (1, 16384), (1, 1024))

# One process: one version's kernel rows, printed as JSON.
CHILD = """
import json, sys
import pagellm  # first: the benchmarks' imports put this checkout on sys.path
assert pagellm.__file__.startswith(sys.argv[2]), (pagellm.__file__, sys.argv[2])
from benchmarks.common import measured_limits
from benchmarks.kernel_bench import decode_row, prefill_rows
bandwidth, flops = measured_limits()
shapes = json.loads(sys.argv[1])
rows = prefill_rows(flops, peers=False)
rows += [decode_row(b, c, int8, bandwidth, peers=False) for b, c in shapes for int8 in (False, True)]
print("RESULT " + json.dumps(rows))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", required=True, metavar="LABEL=DIR", help="DIR holds that pagellm/")
    parser.add_argument("--name", default="kernel-ab", help="results file name (before the date)")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    labels = list(trees)
    timings: dict[str, list[list[dict]]] = {label: [] for label in labels}
    for label in labels + labels[::-1]:
        tree = Path(trees[label]).resolve()
        rows = run_in_tree(tree, CHILD, [json.dumps(DECODE_SHAPES), str(tree)])
        timings[label].append(rows)
        print(f"{label}: {[round(r['ms'], 4) for r in rows]}", flush=True)
    base = labels[0]
    table_rows = []
    for i, first in enumerate(timings[base][0]):
        row = {"kernel": first["kernel"], "batch": first["batch"], "context": first["context"]}
        for label in labels:
            row[f"{label} ms"] = statistics.mean(run[i]["ms"] for run in timings[label])
            row[f"{label} runs"] = [run[i]["ms"] for run in timings[label]]
        for label in labels[1:]:
            row[f"{base}/{label}"] = row[f"{base} ms"] / row[f"{label} ms"]
        table_rows.append(row)
    columns = [
        "kernel",
        "batch",
        "context",
        *(f"{label} ms" for label in labels),
        *(f"{base}/{label}" for label in labels[1:]),
    ]
    table = markdown_table(table_rows, columns)
    write_results(
        args.name,
        {
            "environment": environment(),
            "trees": trees,
            "note": "each version's ms is the mean of its two processes (A B .. B A); base/x > 1: x is faster",
            "rows": table_rows,
        },
        table,
    )
    print(table)


if __name__ == "__main__":
    main()
