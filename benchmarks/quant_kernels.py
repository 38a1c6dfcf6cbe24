"""The quantized-weight matmuls on the GPU at Llama-3.1-8B's shapes: each tile configuration of
`weight_only_matmul` (INT4 groups of 128 as AWQ/GPTQ, FP8 per channel) for 1, 16 and 64 rows (INT4 also for
128-1024 rows: how far the fused matmul beats the engine's dequantize + cuBLAS), against the bf16
GEMV / cuBLAS on the same shape, the prefill paths (dequantize + cuBLAS; FP8 x FP8 `torch._scaled_mm`) and the
bandwidth limit of the bytes each must read. Every configuration's output is checked against torch first. The
table lists the best configuration per (format, rows, shape) and the best single one per (format, rows) over the
four shapes (what `matmul_tiles` picks); the JSON holds the whole sweep. INT4 dot tiles whose block_k divides the
group (128) run on BASE + q with the group scales applied to the sums (`_biased_int4_dot`) unless the tiles say
otherwise (int4_dot), the others dequantize each value through fp32 to bf16 first; one row is also tried on dot
tiles (block_m 16) beside the integer GEMV.

Triton compiles each configuration once; `--workers` processes compile them in parallel into Triton's cache
before the timing, which then runs alone on the GPU.

    python benchmarks/quant_kernels.py [--bandwidth BYTES_PER_S] [--quick] [--workers 12] [--rows 16] [--formats int4]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, measured_limits, write_results  # noqa: E402
from benchmarks.kernel_bench import bench_ms  # noqa: E402
from pagellm.kernels import reference  # noqa: E402
from pagellm.kernels.gemv import gemv  # noqa: E402
from pagellm.kernels.quant_matmul import Tiles, dequantize, fp8_quantize_rows, weight_only_matmul  # noqa: E402

# Llama-3.1-8B's decoder linears (N, K): q|k|v, o, gate|up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128
ROWS = (1, 16, 64)
MANY_ROWS = (128, 256, 512, 1024)  # where INT4 leaves the fused matmul for dequantize + cuBLAS (--rows)
FORMATS = ("int4", "fp8")


def tile_grid(fmt: str, m: int) -> list[Tiles]:
    if m == 1:
        block_k = [512, 1024, 2048, 4096] if fmt == "int4" else [512, 1024, 2048]
        block_n = [4, 8, 16, 32] if fmt == "int4" else [4, 8, 16]
        gemv = [Tiles(1, n, k, w, s) for n, k, w, s in itertools.product(block_n, block_k, [4, 8], [2, 4])]
        if fmt == "fp8":
            return gemv
        return gemv + [
            Tiles(16, n, 128, 4, s, swap) for n, s, swap in itertools.product([16, 32, 64], [3, 4], [False, True])
        ]
    if m == 16:
        if fmt == "fp8":
            grid = itertools.product([False, True], [32, 64, 128], [128, 256], [4, 8], [3, 4], [1, 2, 4])
        else:  # INT4 dots on pair planes (block_k dividing the group), swapped: split_k up to 8
            grid = itertools.product([True], [64, 128], [64, 128], [4, 8], [2, 3, 4], [1, 2, 4, 8])
        return [Tiles(16, n, k, w, s, swap, split) for swap, n, k, w, s, split in grid]
    if fmt == "fp8":  # above 16 rows FP8 runs on the FP8 tensor cores
        return []
    if m == 64:
        grid = itertools.product([False, True], [32, 64, 128], [64, 128], [1, 2, 4], ["base", "scaled"])
        return [Tiles(64, n, k, 4, 3, swap, split, dot) for swap, n, k, split, dot in grid]
    # More rows: larger tiles, and the weights scaled before the dot (in bf16 pairs or through fp32).
    blocks = [(64, 64), (64, 128), (128, 64), (128, 128), (256, 64)]
    grid = itertools.product(blocks, [64, 128], [4, 8], [False, True], ["scaled", "fp32"])
    return [Tiles(bm, bn, k, w, 3, swap, 1, dot) for (bm, bn), k, w, swap, dot in grid]


def tiles_name(tiles: Tiles) -> str:
    return "x".join(v if isinstance(v, str) else str(int(v)) for v in tiles)


def weights(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(stored weight, scales, offsets, bytes read per pass)."""
    if fmt == "fp8":
        w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda") * 1e-2
        return w, scale, None, n * k + n * 4
    q = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
    scales = torch.rand(n, k // GROUP, device="cuda", dtype=torch.float16) * 1e-2
    offsets = -8 * scales
    return q, scales, offsets, n * k // 2 + 2 * scales.numel() * 2


def run(x, w, scales, offsets, fmt: str, tiles: Tiles | None = None) -> torch.Tensor:
    return weight_only_matmul(x, w, scales, offsets, 4 if fmt == "int4" else 8, GROUP, tiles=tiles)


def compile_share(jobs: list[tuple[str, int, Tiles]]) -> None:
    """Worker: run each configuration once on the first shape, so Triton's cache holds its binary."""
    n, k = SHAPES["qkv"]
    for fmt, m, tiles in jobs:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, scales, offsets, _ = weights(fmt, n, k)
        try:
            run(x, w, scales, offsets, fmt, tiles)
        except Exception:  # a tile the compiler refuses; the timing pass records it
            pass
    torch.cuda.synchronize()


def baselines(fmt: str, m: int, x, w, scales, offsets, dense, rep: int) -> dict:
    """The bf16 path on the same shape, and the prefill path of this format."""
    out = {"bf16_ms": bench_ms(lambda: gemv(x, dense) if m == 1 else F.linear(x, dense), rep, warmup=10)}
    if m > 1 and fmt == "int4":
        out["dequantize_cublas_ms"] = bench_ms(
            lambda: F.linear(x, dequantize(w, scales, offsets, 4, GROUP, x.dtype)), rep, warmup=10
        )
    if m > 1 and fmt == "fp8":

        def scaled_mm():
            q, s = fp8_quantize_rows(x)
            return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=scales[None, :], out_dtype=x.dtype)

        out["fp8_tensor_cores_ms"] = bench_ms(scaled_mm, rep, warmup=10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth", type=float, help="bytes/s (default: measured_limits)")
    parser.add_argument("--quick", action="store_true", help="every 5th configuration only")
    parser.add_argument("--workers", type=int, default=12, help="compiling processes")
    parser.add_argument("--rep", type=int, default=40, help="ms of timing per configuration")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), choices=ROWS + MANY_ROWS)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--name", default="quant-kernels", help="results file name (before the date)")
    args = parser.parse_args()
    args.bandwidth = args.bandwidth or measured_limits()[0]
    plan = {(fmt, m): tile_grid(fmt, m)[:: 5 if args.quick else 1] for fmt in args.formats for m in args.rows}
    # One compile per binary: the row count is no constexpr, so each (format, tiles) compiles once for every m.
    jobs = list({(fmt, t): (fmt, m, t) for (fmt, m), grid in plan.items() for t in grid}.values())
    started = time.time()
    if args.workers > 1:
        ctx = torch.multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
            list(pool.map(compile_share, [jobs[i :: args.workers] for i in range(args.workers)]))
    print(f"compiled {len(jobs)} configurations in {time.time() - started:.0f} s", flush=True)
    sweep, best = [], []
    for (fmt, m), grid in plan.items():
        if not grid:
            continue
        times: dict[Tiles, list[float]] = {t: [] for t in grid}
        for shape, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w, scales, offsets, moved = weights(fmt, n, k)
            exact = reference.weight_only_matmul(x, w, scales, offsets, 4 if fmt == "int4" else 8, GROUP).float()
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            base = baselines(fmt, m, x, w, scales, offsets, dense, args.rep)
            rows = []
            for tiles in grid:
                try:
                    err = ((run(x, w, scales, offsets, fmt, tiles).float() - exact).norm() / exact.norm()).item()
                    if not err < 2e-2:
                        raise ArithmeticError(f"relative error {err:.3g}")
                    ms = bench_ms(lambda: run(x, w, scales, offsets, fmt, tiles), args.rep, warmup=10)
                except Exception as exc:  # a tile the compiler refuses (shared memory, registers) or a wrong one
                    rows.append({"tiles": tiles, "error": f"{type(exc).__name__}: {exc}"[:200]})
                    times[tiles].append(math.inf)
                    continue
                rows.append({"tiles": tiles, "ms": ms, "gb_s": moved / ms / 1e6})
                times[tiles].append(ms)
            sweep.append({"shape": shape, "rows": m, "format": fmt, **base, "configs": rows})
            ok = [r for r in rows if "ms" in r]
            if not ok:
                print(f"{fmt} x {m} rows on {shape}: every configuration failed, e.g. {rows[0]['error']}", flush=True)
                continue
            top = min(ok, key=lambda r: r["ms"])
            default_ms = bench_ms(lambda: run(x, w, scales, offsets, fmt), args.rep, warmup=10)
            best.append(
                {
                    "format": fmt,
                    "rows": m,
                    "shape": shape,
                    "best_tiles": tiles_name(top["tiles"]),
                    "best_ms": top["ms"],
                    "default_ms": default_ms,
                    "%_of_bandwidth": 100 * moved / (top["ms"] / 1e3) / args.bandwidth,
                    **base,
                    "speedup_vs_bf16": base["bf16_ms"] / top["ms"],
                }
            )
            print(best[-1], flush=True)
        overall = min(grid, key=lambda t: sum(map(math.log, times[t])))  # geometric mean over the shapes
        print(f"best single tiles for {fmt} x {m} rows: {overall} {times[overall]}", flush=True)
        best.append(
            {
                "format": fmt,
                "rows": m,
                "shape": "all four (geomean)",
                "best_tiles": tiles_name(overall),
                "best_ms": math.exp(sum(map(math.log, times[overall])) / len(times[overall])),
            }
        )
    columns = ["format", "rows", "shape", "best_tiles", "best_ms", "default_ms", "%_of_bandwidth", "bf16_ms"]
    columns += ["dequantize_cublas_ms", "fp8_tensor_cores_ms", "speedup_vs_bf16"]
    table = markdown_table(best, columns)
    note = "tiles: block_m x block_n x block_k x warps x stages x swap_ab x split_k x int4_dot"
    write_results(args.name, {"environment": environment(), "note": note, "best": best, "sweep": sweep}, table)
    print(table)


if __name__ == "__main__":
    main()
