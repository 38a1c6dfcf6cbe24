"""Sweep the decode kernel's tile, warps, pipelining depth and split size on the GPU; prints the best per case."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kernel_bench import DIM, HEADS, paged_cache  # noqa: E402
from pagellm.kernels.decode_attention import paged_decode_attention  # noqa: E402


def main() -> None:
    results = []
    for (batch, ctx), int8 in itertools.product(((64, 4096), (1, 32768), (16, 16384)), (False, True)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        k, v, ks, vs, tables = paged_cache(batch, ctx, int8, gen)
        q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        best = None
        for block_n, warps, stages, split in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (256, 512, 1024)):
            if split % block_n:
                continue
            try:
                ms = triton.testing.do_bench(
                    lambda: paged_decode_attention(
                        q,
                        k,
                        v,
                        tables,
                        lens,
                        DIM**-0.5,
                        ctx,
                        split,
                        ks,
                        vs,
                        block_n=block_n,
                        num_warps=warps,
                        num_stages=stages,
                    ),
                    warmup=20,
                    rep=100,
                    return_mode="median",
                )
            except Exception as exc:  # e.g. out of shared memory
                print("skip", block_n, warps, stages, split, type(exc).__name__)
                continue
            row = dict(batch=batch, ctx=ctx, int8=int8, block_n=block_n, warps=warps, stages=stages, split=split, ms=ms)
            results.append(row)
            if best is None or ms < best["ms"]:
                best = row
        print("BEST", json.dumps(best))
    Path(sys.argv[1] if len(sys.argv) > 1 else "decode_sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
