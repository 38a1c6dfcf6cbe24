"""Kernel benchmarks on the GPU: paged decode attention (bf16 and INT8 K/V) against torch SDPA on contiguous,
unpaged K/V and against the bytes it must move / HBM bandwidth; paged prefill attention against SDPA's flash kernel
and the bf16 rate; fused add+RMSNorm and the KV write against
bandwidth; the one-row GEMV against cuBLAS (F.linear) and the sampling kernels against torch, both also against
bandwidth.

    python benchmarks/kernel_bench.py [--bandwidth BYTES_PER_S]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, measured_limits, write_results  # noqa: E402
from pagellm.kernels.decode_attention import paged_decode_attention, split_size_for  # noqa: E402
from pagellm.kernels.gemv import gemv  # noqa: E402
from pagellm.kernels.kv_write import rope_and_write_kv  # noqa: E402
from pagellm.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from pagellm.kernels.reference import quantize_int8  # noqa: E402
from pagellm.kernels.rmsnorm import rms_norm  # noqa: E402
from pagellm.kernels.sampling import argmax_rows, sample_rows  # noqa: E402
from pagellm.model.attention import allocate_kv_caches  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def bench_ms(fn, rep: int = 300, warmup: int = 50) -> float:
    """Median ms of `fn` captured in a CUDA graph, replayed after an L2 flush each time. do_bench records its start
    event right after the flush is queued: when fn's own launches (Python, allocations) take the host longer than
    the flush takes the GPU, the GPU idles inside the timed span. That is the likely reason why 1 x 32k decode
    measured 0.051 ms in one run and 0.113 ms in another (cuDNN's single launch: 0.051 ms in both). A replay is
    one launch."""
    fn()  # compiles, and warms the allocator outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")


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


def bandwidth_row(kernel: str, batch: int, context: int, ms: float, moved: int, bandwidth: float, **peers) -> dict:
    return {
        "kernel": kernel,
        "batch": batch,
        "context": context,
        "ms": ms,
        "GB/s": moved / ms / 1e6,
        "% of HBM": 100 * moved / ms / 1e-3 / bandwidth,
        **peers,
    }


def decode_row(batch: int, ctx: int, int8: bool, bandwidth: float, peers: bool = True) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v, ks, vs, tables = paged_cache(batch, ctx, int8, gen)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    split = split_size_for(max(ctx, 8192), batch, int8, BLOCK)
    ms = bench_ms(lambda: paged_decode_attention(q, k, v, tables, lens, DIM**-0.5, ctx, split, ks, vs))
    kv_bytes = 2 * batch * ctx * KV_HEADS * DIM * k.element_size() + (2 * batch * ctx * KV_HEADS * 4 if int8 else 0)
    row = bandwidth_row(f"decode {'int8' if int8 else 'bf16'}", batch, ctx, ms, kv_bytes, bandwidth)
    if peers and not int8:  # the peer: SDPA on contiguous, unpaged K/V (its best case: no gather)
        kc = torch.randn(batch, KV_HEADS, ctx, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        vc = torch.randn_like(kc)
        qc = q.view(batch, HEADS, 1, DIM)
        for name, backend in (
            ("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
            ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
        ):
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
        rows.append(bandwidth_row("add+rmsnorm", tokens, hidden, ms, moved, bandwidth))
    tokens = 8192
    slots = torch.randperm(65536, device="cuda", generator=gen)[:tokens]
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=gen)
    cos_sin = torch.randn(4096, DIM, device="cuda", generator=gen)
    q = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(tokens, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    for int8 in (False, True):
        cache = allocate_kv_caches(1, 4096, BLOCK, KV_HEADS, DIM, torch.int8 if int8 else torch.bfloat16, kv.device)[0]
        ms = bench_ms(
            lambda: rope_and_write_kv(
                q, kv, kv, positions, cos_sin, cache.key, cache.value, slots, cache.key_scale, cache.value_scale
            )
        )
        # q read and written in place; k and v read, then written to the cache
        moved = 2 * q.numel() * 2 + 2 * kv.numel() * 2 + 2 * kv.numel() * cache.key.element_size()
        rows.append(bandwidth_row(f"rope + kv write {'int8' if int8 else 'bf16'}", tokens, 0, ms, moved, bandwidth))
    return rows


def prefill_rows(flops: float, peers: bool = True) -> list[dict]:
    """Paged prefill attention (bf16 K/V) of whole prompts and of chunks after a cached prefix, against SDPA's
    flash kernel on contiguous K/V (whole prompts only: its causal mask is top-left aligned) and the bf16 rate.
    Shapes: Qwen3-0.6B's heads (16 query, 8 KV) and Llama-3.1-8B's (32, 8), 128 a head."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for heads, seqs, query, context in ((16, 14, 574, 0), (16, 8, 1024, 0), (16, 4, 512, 1024), (32, 14, 574, 0)):
        seq_len = context + query
        blocks_per_seq = -(-seq_len // BLOCK)
        k = torch.randn(seqs * blocks_per_seq, BLOCK, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn_like(k)
        tables = torch.randperm(k.shape[0], device="cuda", generator=gen).view(seqs, -1).to(torch.int32)
        q = torch.randn(seqs * query, heads, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        starts = torch.arange(seqs + 1, device="cuda", dtype=torch.int32) * query
        lens = torch.full((seqs,), seq_len, dtype=torch.int32, device="cuda")
        ms = bench_ms(lambda: paged_prefill_attention(q, k, v, tables, starts, lens, DIM**-0.5, query))
        # Query i sees context + i + 1 keys: q @ k^T and p @ v, 2 FLOPs a multiply-add each.
        work = 4 * DIM * heads * seqs * (query * (context + 1) + query * (query - 1) // 2)
        row = {"kernel": f"prefill {heads}/{KV_HEADS} heads", "batch": seqs, "context": f"{context}+{query}", "ms": ms}
        row.update({"TFLOP/s": work / ms / 1e9, "% of bf16 rate": 100 * work / ms / 1e-3 / flops})
        if peers and context == 0:
            qc = q.view(seqs, query, heads, DIM).transpose(1, 2)
            kc = torch.randn(seqs, KV_HEADS, query, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            vc = torch.randn_like(kc)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                row["sdpa_flash_ms"] = bench_ms(
                    lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
                )
        rows.append(row)
    return rows


def gemv_rows(bandwidth: float) -> list[dict]:
    """Batch-1 linear layers of Llama-3.1-8B (qkv, o, down, LM head) and Qwen3-0.6B (o). Each run goes through
    enough copies of the weight (> 400 MB) that none is served from the 50 MB L2, as in a real decode step; the
    copies run inside one CUDA graph, so the launches cost what they cost in the engine's graphs."""
    rows = []
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096), (1024, 2048)):
        copies = max(2, -(-400 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ours, peer = ([lambda w=w, fn=fn: fn(x, w) for w in weights] for fn in (gemv, F.linear))
        ms = triton.testing.do_bench_cudagraph(lambda: [f() for f in ours], rep=200) / copies
        cublas = triton.testing.do_bench_cudagraph(lambda: [f() for f in peer], rep=200) / copies
        rows.append(bandwidth_row("gemv", n, k, ms, n * k * 2, bandwidth, torch_ms=cublas))
        del weights
    return rows


def sampling_rows(bandwidth: float) -> list[dict]:
    """One draw per row of bf16 logits (the throughput workload's temperature 0.8, top-p 0.95 and plain
    temperature sampling) against torch's softmax + multinomial, and the greedy argmax against torch's argmax.
    Bytes moved: one read of the logits."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for name, batch, vocab, top_p in (
        ("sample top-p 0.95", 256, 151936, 0.95),
        ("sample", 256, 151936, 1.0),
        ("argmax", 1, 128256, None),
    ):
        logits = (2 * torch.randn(batch, vocab, device="cuda", generator=gen)).bfloat16()
        if top_p is None:
            ms, peer = bench_ms(lambda: argmax_rows(logits)), bench_ms(lambda: logits.argmax(-1))
        else:
            inv_t = torch.full((batch,), 1 / 0.8, device="cuda")
            greedy = torch.zeros(batch, dtype=torch.int32, device="cuda")
            top_ps = torch.full((batch,), top_p, device="cuda")
            seeds = torch.arange(batch, device="cuda")
            ms = bench_ms(lambda: sample_rows(logits, inv_t, greedy, top_ps, seeds))
            peer = bench_ms(lambda: torch.multinomial(torch.softmax(logits.float() * inv_t[:, None], -1), 1))
        rows.append(bandwidth_row(name, batch, vocab, ms, logits.numel() * 2, bandwidth, torch_ms=peer))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bandwidth", type=float, help="copy bandwidth, bytes/s (default: measured_limits)")
    args = parser.parse_args()
    args.bandwidth = args.bandwidth or measured_limits()[0]
    rows = [
        decode_row(b, c, int8, args.bandwidth)
        for b, c in ((64, 4096), (1, 32768), (16, 16384), (1, 16384))
        for int8 in (False, True)
    ]
    rows += prefill_rows(measured_limits()[1])
    rows += norm_rope_rows(args.bandwidth) + gemv_rows(args.bandwidth) + sampling_rows(args.bandwidth)
    by_key = {(r["kernel"], r["batch"], r["context"]): r for r in rows}
    for ctx_b in ((16, 16384), (1, 16384)):
        bf16, int8 = by_key[("decode bf16", *ctx_b)], by_key[("decode int8", *ctx_b)]
        int8["int8 speedup"] = bf16["ms"] / int8["ms"]
    columns = [
        "kernel",
        "batch",
        "context",
        "ms",
        "GB/s",
        "% of HBM",
        "sdpa_cudnn_ms",
        "sdpa_flash_ms",
        "torch_ms",
        "int8 speedup",
        "TFLOP/s",
        "% of bf16 rate",
    ]
    table = markdown_table(rows, columns)
    write_results(
        "kernels",
        {
            "environment": environment(),
            "bandwidth": args.bandwidth,
            "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block": BLOCK},
            "batch x context": "decode: sequences x context tokens; add+rmsnorm: tokens x hidden; "
            "rope + kv write: tokens; gemv: N x K; sample/argmax: rows x vocabulary",
            "rows": rows,
        },
        table,
    )
    print(table)


if __name__ == "__main__":
    main()
