"""The bf16 matmuls of decode steps on the GPU: each tile configuration of `few_rows_matmul` at 16 rows on the
decoder and LM-head shapes of Llama-3.1-8B and Qwen3-0.6B, against cuBLAS (`F.linear`) and the bandwidth limit;
then the chosen tiles (`few_rows_tiles`) at 2, 4, 8 and 16 rows, and the one-row GEMV, against cuBLAS. Every
configuration's output is checked against torch first. Each timing runs through enough copies of the weight
(> 400 MB) that none is served from L2, back to back inside one CUDA graph, as a decode step's matmuls run.

Triton compiles each configuration once; `--workers` processes compile them in parallel into Triton's cache
before the timing, which then runs alone on the GPU.

    python benchmarks/matmul_sweep.py [--bandwidth BYTES_PER_S] [--workers 12] [--rep 40]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, measured_limits, write_results  # noqa: E402
from pagellm.kernels.gemv import Tiles, few_rows_matmul, few_rows_tiles, gemv  # noqa: E402

# (N, K) of q|k|v, o, gate|up, down and the LM head.
SHAPES = {
    "llama8b qkv": (6144, 4096),
    "llama8b o": (4096, 4096),
    "llama8b gate_up": (28672, 4096),
    "llama8b down": (4096, 14336),
    "llama8b lm_head": (128256, 4096),
    "qwen3 qkv": (4096, 1024),
    "qwen3 o": (1024, 2048),
    "qwen3 gate_up": (6144, 1024),
    "qwen3 down": (1024, 3072),
    "qwen3 lm_head": (151936, 1024),
}
ROWS = (2, 4, 8, 16)
GRID = [
    Tiles(n, k, w, s, swap)
    for swap, n, k, w, s in itertools.product([False, True], [16, 32, 64], [128, 256, 512], [4], [3, 4])
]


def compile_share(grid: list[Tiles]) -> None:
    """Worker: run each configuration once, so Triton's cache holds its binary."""
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
    for tiles in grid:
        try:
            few_rows_matmul(x, w, tiles)
        except Exception:  # a tile the compiler refuses; the timing pass records it
            pass
    torch.cuda.synchronize()


def time_ms(fn, weights: list[torch.Tensor], rep: int) -> float:
    """ms per weight of fn(w) over every copy, replayed as one CUDA graph."""
    return triton.testing.do_bench_cudagraph(lambda: [fn(w) for w in weights], rep=rep) / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth", type=float, help="bytes/s (default: measured_limits)")
    parser.add_argument("--workers", type=int, default=12, help="compiling processes")
    parser.add_argument("--rep", type=int, default=40, help="ms of timing per configuration")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE")
    args = parser.parse_args()
    args.bandwidth = args.bandwidth or measured_limits()[0]
    shapes = {name: SHAPES[name] for name in args.shapes}
    started = time.time()
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        list(pool.map(compile_share, [GRID[i :: args.workers] for i in range(args.workers)]))
    print(f"compiled {len(GRID)} configurations in {time.time() - started:.0f} s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    times: dict[Tiles, list[float]] = {t: [] for t in GRID}
    sweep, table = [], []
    for shape, (n, k) in shapes.items():
        copies = max(2, -(-400 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(copies)]
        limit_ms = n * k * 2 / args.bandwidth * 1e3
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        exact = x16.double() @ weights[0].double().T
        configs = []
        for tiles in GRID:
            try:
                out = few_rows_matmul(x16, weights[0], tiles).double()
                err = ((out - exact).norm() / exact.norm()).item()
                if not err < 1e-2:
                    raise ArithmeticError(f"relative error {err:.3g}")
                ms = time_ms(lambda w, t=tiles: few_rows_matmul(x16, w, t), weights, args.rep)
            except Exception as exc:  # a tile the compiler refuses (shared memory, registers) or a wrong one
                configs.append({"tiles": tiles, "error": f"{type(exc).__name__}: {exc}"[:200]})
                times[tiles].append(math.inf)
                continue
            configs.append({"tiles": tiles, "ms": ms})
            times[tiles].append(ms)
        ok = [c for c in configs if "ms" in c]
        top = min(ok, key=lambda c: c["ms"])
        sweep.append({"shape": shape, "n": n, "k": k, "configs": configs})
        for m in (1,) + ROWS:
            x = x16[:m].contiguous()
            cublas = time_ms(lambda w: F.linear(x, w), weights, args.rep)
            ours = time_ms(lambda w: gemv(x, w) if m == 1 else few_rows_matmul(x, w), weights, args.rep)
            row = {"shape": shape, "rows": m, "kernel": "gemv" if m == 1 else "few_rows"}
            row.update(ms=ours, cublas_ms=cublas, speedup=cublas / ours, pct_of_bandwidth=100 * limit_ms / ours)
            if m == 16:
                row.update(default_tiles=str(tuple(few_rows_tiles(n))), best_tiles=str(tuple(top["tiles"])))
                row.update(best_ms=top["ms"], best_pct_of_bandwidth=100 * limit_ms / top["ms"])
            table.append(row)
            print(row, flush=True)
        del weights
    for group in ("llama8b", "qwen3"):
        idx = [i for i, s in enumerate(shapes) if s.startswith(group)]
        if not idx:
            continue
        overall = min(GRID, key=lambda t: sum(math.log(times[t][i]) for i in idx))
        geo = math.exp(sum(math.log(times[overall][i]) for i in idx) / len(idx))
        row = {"shape": f"{group} (geomean)", "rows": 16, "best_tiles": str(tuple(overall)), "best_ms": geo}
        table.append(row)
        print(row, flush=True)
    columns = ["shape", "rows", "kernel", "ms", "cublas_ms", "speedup", "pct_of_bandwidth", "default_tiles"]
    columns += ["best_tiles", "best_ms", "best_pct_of_bandwidth"]
    md = markdown_table(table, columns)
    note = "tiles: (block_n, block_k, warps, stages, swap_ab); weights rotated beyond L2 inside one CUDA graph"
    write_results("matmul-sweep", {"environment": environment(), "note": note, "rows": table, "sweep": sweep}, md)
    print(md)


if __name__ == "__main__":
    main()
