"""Kernel benchmarks on the GPU: paged decode attention (bf16 and INT8 K/V) against torch SDPA on contiguous,
unpaged K/V and against the bytes it must move / HBM bandwidth; fused add+RMSNorm and RoPE against bandwidth.

    python benchmarks/kernels.py [--bandwidth 4.3e12]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from pagellm.kernels.decode_attention import paged_decode_attention, split_size_for  # noqa: E402
from pagellm.kernels.kv_write import write_kv  # noqa: E402
from pagellm.kernels.reference import quantize_int8  # noqa: E402
from pagellm.kernels.rmsnorm import rms_norm  # noqa: E402
from pagellm.model.attention import allocate_kv_caches  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def paged_cache(batch: int, ctx: int, int8: bool, gen: torch.Generator):
    blocks_per_seq = ctx // BLOCK
    num_blocks = batch * blocks_per_seq
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    if not int8:
        return k, v, None, None, tables
    cache = allocate_kv_caches(1, num_blocks, BLOCK, KV_HEADS, DIM, torch.int8, k.device)[0]  # engine layout
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    for dst, src in zip((cache.key, cache.value, cache.key_scale, cache.value_scale), (kq, vq, ks, vs)):
        dst.copy_(src)
    return cache.key, cache.value, cache.key_scale, cache.value_scale, tables


def decode_row(batch: int, ctx: int, int8: bool, bandwidth: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v, ks, vs, tables = paged_cache(batch, ctx, int8, gen)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    split = split_size_for(max(ctx, 8192), batch)
    ms = bench_ms(lambda: paged_decode_attention(q, k, v, tables, lens, DIM ** -0.5, ctx, split, ks, vs))
    kv_bytes = 2 * batch * ctx * KV_HEADS * DIM * k.element_size() + (2 * batch * ctx * KV_HEADS * 4 if int8 else 0)
    row = {"kernel": f"decode {'int8' if int8 else 'bf16'}", "batch": batch, "context": ctx, "ms": ms,
           "GB/s": kv_bytes / ms / 1e6, "% of HBM": 100 * kv_bytes / ms / 1e-3 / bandwidth}
    if not int8:  # the peer: SDPA on contiguous, unpaged K/V (its best case: no gather)
        kc = torch.randn(batch, KV_HEADS, ctx, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn_like(kc)
        qc = q.view(batch, HEADS, 1, DIM)
        for name, backend in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                              ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    sdpa_ms = bench_ms(lambda: F.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True))
                row[f"sdpa_{name}_ms"] = sdpa_ms
            except RuntimeError:
                row[f"sdpa_{name}_ms"] = float("nan")
    return row


def norm_rope_rows(bandwidth: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for tokens, hidden in ((4096, 4096), (16384, 1024)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
        ms = bench_ms(lambda: rms_norm(x, w, 1e-6, r))
        moved = 4 * x.numel() * 2  # read x, r; write out, residual
        rows.append({"kernel": "add+rmsnorm", "batch": tokens, "context": hidden, "ms": ms,
                     "GB/s": moved / ms / 1e6, "% of HBM": 100 * moved / ms / 1e-3 / bandwidth})
    slots = torch.randperm(65536, device="cuda", generator=gen)[:8192]
    kv = torch.randn(8192, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    for int8 in (False, True):
        cache = allocate_kv_caches(1, 4096, BLOCK, KV_HEADS, DIM, torch.int8 if int8 else torch.bfloat16,
                                   kv.device)[0]
        ms = bench_ms(lambda: write_kv(kv, kv, cache.key, cache.value, slots, cache.key_scale, cache.value_scale))
        moved = 2 * kv.numel() * 2 + 2 * kv.numel() * cache.key.element_size()
        rows.append({"kernel": f"kv write {'int8' if int8 else 'bf16'}", "batch": 8192, "context": 0, "ms": ms,
                     "GB/s": moved / ms / 1e6, "% of HBM": 100 * moved / ms / 1e-3 / bandwidth})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="measured copy bandwidth, bytes/s")
    args = parser.parse_args()
    rows = [decode_row(b, c, int8, args.bandwidth)
            for b, c in ((64, 4096), (1, 32768), (16, 16384), (1, 16384))
            for int8 in (False, True)]
    rows += norm_rope_rows(args.bandwidth)
    by_key = {(r["kernel"], r["batch"], r["context"]): r for r in rows}
    for ctx_b in ((16, 16384), (1, 16384)):
        bf16, int8 = by_key[("decode bf16", *ctx_b)], by_key[("decode int8", *ctx_b)]
        int8["int8 speedup"] = bf16["ms"] / int8["ms"]
    columns = ["kernel", "batch", "context", "ms", "GB/s", "% of HBM", "sdpa_cudnn_ms", "sdpa_flash_ms",
               "int8 speedup"]
    table = markdown_table(rows, columns)
    write_results("kernels", {"environment": environment(), "bandwidth": args.bandwidth,
                              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK},
                              "rows": rows}, table)
    print(table)


if __name__ == "__main__":
    main()
