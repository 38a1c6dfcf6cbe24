"""Shared helpers for benchmarks: environment facts and writing a dated table + JSON under results/."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"

# What this project's device machines measured (the device tool's KINDS.md): the device-to-device copy rate, bytes
# read and written per second, and an 8192^3 bf16 matmul on random data, FLOP/s. The H100's datasheet says 3.35 TB/s;
# 3.0 is what copying reached.
MEASURED_LIMITS = {"H200": (4.3e12, 790e12), "H100": (3.0e12, 790e12)}


def measured_limits() -> tuple[float, float]:
    """(bandwidth, bf16 FLOP/s) measured on this process's GPU (the H200's without one: roofline.py's arithmetic).
    A benchmark on a GPU not measured here is given them on its command line."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "H200"
    kind = next((kind for kind in MEASURED_LIMITS if kind in name), None)
    if kind is None:
        raise SystemExit(f"no measured limits for {name!r} (measured: {', '.join(MEASURED_LIMITS)}): pass them")
    return MEASURED_LIMITS[kind]


def add_bound_arguments(parser: argparse.ArgumentParser) -> None:
    """--bandwidth and --flops of a bound (roofline.py's), each `measured_limits`'s where not given."""
    parser.add_argument("--bandwidth", type=float, help="bytes/s of the bound (default: measured_limits)")
    parser.add_argument("--flops", type=float, help="bf16 FLOP/s of the bound (default: measured_limits)")


def bound_rates(args: argparse.Namespace) -> tuple[float, float]:
    """(bandwidth, flops) of `add_bound_arguments`' options: those given, the GPU's measured rates for the rest."""
    if args.bandwidth and args.flops:
        return args.bandwidth, args.flops
    bandwidth, flops = measured_limits()
    return args.bandwidth or bandwidth, args.flops or flops


def _commit() -> str:
    """The measured code's commit: PAGELLM_COMMIT where the tree travels without its .git (the device tool)."""
    if os.environ.get("PAGELLM_COMMIT"):
        return os.environ["PAGELLM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except OSError:
        return "unknown"
    return head.stdout.strip() or "unknown"


def environment() -> dict:
    env = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "commit": _commit(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import triton

            env["triton"] = triton.__version__
        except ImportError:
            pass
    return env


def _cell(value) -> str:
    """Floats with two decimals, or three significant digits below 1 (kernel times in ms)."""
    if not isinstance(value, float):
        return str(value)
    return f"{value:.2f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [_cell(row.get(c, "")) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_in_tree(tree: Path, source: str, args: list[str]) -> dict:
    """Run `source` in a fresh Python process that imports pagellm from `tree` (a package directory's parent) and
    the benchmarks from this checkout, and return the JSON it printed after "RESULT "."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{root}")
    # -P: `python -c` would put the working directory (this checkout) on sys.path ahead of PYTHONPATH, so that
    # another tree's side imported this checkout's pagellm too.
    proc = subprocess.run(
        [sys.executable, "-P", "-c", source, *args], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.split("RESULT ")[-1])


def write_results(name: str, payload: dict, table: str) -> Path:
    """Write results/<name>-<date>.json and .md; returns the JSON path. Where OUT names a directory (the device
    tool's output folder) both files are copied there too, so that a device call brings back what it measured
    without copying results/ wholesale (whose many files it would not all return)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(json.dumps(payload, indent=2))
    env = payload.get("environment", {})
    header = ", ".join(f"{k} {v}" for k, v in env.items())
    path.with_suffix(".md").write_text(f"# {name} ({stamp})\n\n{header}\n\n{table}\n")
    out = os.environ.get("OUT")
    if out and Path(out).is_dir():
        for written in (path, path.with_suffix(".md")):
            shutil.copy(written, out)
    return path
