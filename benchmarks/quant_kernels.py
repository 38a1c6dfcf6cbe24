"""The quantized-weight matmuls on the GPU at Llama-3.1-8B's shapes: each tile configuration of
`weight_only_matmul` (INT4 groups of 128 as AWQ/GPTQ, FP8 per channel) for 1 and 16 rows, against the bf16 GEMV /
cuBLAS on the same shape and against the bandwidth limit of the bytes each must read. The table lists the best
configuration per (format, rows, shape); the JSON holds the whole sweep (what `_matmul_config` should pick).

    python benchmarks/quant_kernels.py [--bandwidth 4.3e12] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from benchmarks.kernels import bench_ms  # noqa: E402
from pagellm.kernels.gemv import gemv  # noqa: E402
from pagellm.kernels.quant_matmul import weight_only_matmul  # noqa: E402

# Llama-3.1-8B's decoder linears (N, K): q|k|v, o, gate|up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


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


def configs(m: int, quick: bool) -> list[tuple[int, int, int, int, int]]:
    if m == 1:
        grid = itertools.product([1], [4, 8, 16, 32], [128, 256, 512, 1024], [2, 4, 8], [2, 3, 4])
    else:
        grid = itertools.product([16], [32, 64, 128], [64, 128, 256], [4, 8], [2, 3, 4])
    grid = list(grid)
    return grid[::7] if quick else grid


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth", type=float, default=4.3e12)
    parser.add_argument("--quick", action="store_true", help="every 7th configuration only")
    args = parser.parse_args()
    sweep, best = [], []
    for (shape, (n, k)), m, fmt in itertools.product(SHAPES.items(), (1, 16), ("int4", "fp8")):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, scales, offsets, moved = weights(fmt, n, k)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        bf16_ms = bench_ms(lambda: gemv(x, dense)) if m == 1 else bench_ms(lambda: F.linear(x, dense))
        rows = []
        for config in configs(m, args.quick):
            try:
                ms = bench_ms(
                    lambda: weight_only_matmul(x, w, scales, offsets, 4 if fmt == "int4" else 8, GROUP, config=config)
                )
            except Exception as exc:  # a tile the compiler refuses (shared memory, registers)
                rows.append({"config": config, "error": type(exc).__name__})
                continue
            rows.append({"config": config, "ms": ms, "gb_s": moved / ms / 1e6})
        sweep.append({"shape": shape, "m": m, "format": fmt, "rows": rows})
        top = min((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        best.append(
            {
                "shape": shape,
                "rows": m,
                "format": fmt,
                "best_config": "x".join(map(str, top["config"])),
                "ms": top["ms"],
                "%_of_bandwidth": 100 * moved / (top["ms"] / 1e3) / args.bandwidth,
                "bf16_ms": bf16_ms,
                "speedup_vs_bf16": bf16_ms / top["ms"],
            }
        )
        print(best[-1], flush=True)
    table = markdown_table(best, list(best[0]))
    write_results("quant-kernels", {"environment": environment(), "best": best, "sweep": sweep}, table)
    print(table)


if __name__ == "__main__":
    main()
