"""Start-up: seconds from a fresh process's `import pagellm` to its first token, split into the import, the engine's
phases (`Engine.startup_seconds`) and the first request, and the process's peak resident memory by then; on the CPU
by default, on the embedded SmolLM2. Each run is a process of its own; with --baseline the same runs of another
version of pagellm alternate with this one's (A B B A ...), so that the machine's drift falls on both alike.

    python benchmarks/startup.py                         # CPU, the embedded model, 5 runs
    git archive HEAD pagellm | tar x -C /tmp/base        # a baseline's package
    python benchmarks/startup.py --baseline /tmp/base --label-a HEAD --label-b tree
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from pagellm import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1] or None, device=sys.argv[2], quiet=True)
t2 = time.perf_counter()
llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
t3 = time.perf_counter()
peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"total": t3 - t0, "import": t1 - t0, "engine": t2 - t1, "first_request": t3 - t2,
                  **llm.engine.startup_seconds, "peak_rss_mb": peak_rss_mb}))
"""


def start_once(package_root: Path, model: str, device: str) -> dict[str, float]:
    # Run from the package's directory: `python -c` puts the working directory first on sys.path.
    env = dict(os.environ, PYTHONPATH=str(package_root))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, model, device],
        capture_output=True,
        text=True,
        env=env,
        cwd=package_root,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(label: str, runs: list[dict[str, float]]) -> dict:
    """The median of each measure over the runs (phases a version lacks are left out)."""
    keys = [key for key in runs[0] if all(key in run for run in runs)]
    return {"version": label, "runs": len(runs)} | {key: statistics.median(run[key] for run in runs) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="", help="default: the embedded SmolLM2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=5, help="processes per version")
    parser.add_argument("--baseline", type=Path, help="a directory holding another version's pagellm package")
    parser.add_argument("--label-a", default="baseline")
    parser.add_argument("--label-b", default="this tree")
    parser.add_argument("--name", default="startup")
    args = parser.parse_args()

    versions = {args.label_b: ROOT} if args.baseline is None else {args.label_a: args.baseline, args.label_b: ROOT}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in versions}
    start_once(ROOT, args.model, args.device)  # warms the OS's file caches and pagellm's GGUF conversion cache
    for i in range(args.runs):
        order = list(versions.items()) if i % 2 == 0 else list(reversed(versions.items()))
        for label, root in order:
            runs[label].append(start_once(root, args.model, args.device))
    rows = [summary(label, version_runs) for label, version_runs in runs.items()]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    for row in rows:
        row.update({key: round(value, 3) for key, value in row.items() if isinstance(value, float)})
    table = markdown_table(rows, columns) + f"\n\nMedians of {args.runs} processes per version, alternating."
    payload = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    payload["runs"] = runs
    path = write_results(f"{args.name}-{args.device}", payload, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
