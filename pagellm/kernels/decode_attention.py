"""Triton: paged decode attention (one query token per sequence), flash-decoding style.

Stage 1, grid (sequence, KV head, split): each program walks its split of the context tile by tile through the
block table, for all query heads of its KV head at once (GQA: each K/V tile is loaded once; the head group is
padded to 16 rows because `tl.dot` needs M >= 16), and stores a normalized partial output plus its log-sum-exp.
Stage 2, grid (sequence, head): merges all splits in one tile, each weighted by its log-sum-exp.

The split size depends on the engine's max_model_len and on whether the batch is small (at most
SMALL_BATCH sequences, a CUDA-graph size, so a padded graph and an eager step of the same batch agree): few
sequences leave most of the GPU idle unless each context is cut finer. Outputs are therefore invariant to what
else is batched within each of the two classes, and with the grid sized for max_model_len a captured CUDA graph
stays valid. INT8 K/V are dequantized by folding the per-token scales into the scores (K) and the probabilities
(V); values are converted to fp16 tile by tile (exact), while q @ k^T runs on int8 tensor cores with the query
split into two int8 halves, about fp16's precision (fp32 queries keep fp32 products); see `paged_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.paged_kv import (
    accumulate,
    asm_conversions,
    int8_tile_scores,
    kv_strides,
    load_kv_tile,
    query_operand,
    split_query_int8,
    tile_scores,
)
from pagellm.kernels.pdl import launch_early, wait_for_inputs

# Tiles and pipelining picked by benchmarks/decode_sweep.py on the H200 (results/decode_sweep-*.json).
# Context tokens per tile, by (K/V are int8, the batch is small).
BLOCK_N = {(False, False): 32, (False, True): 64, (True, False): 128, (True, True): 128}
# Context tokens per split, at least, by (K/V are int8, the batch is small). INT8 programs of a large batch want
# to be long: each one's first tile load is exposed, and at half the bytes per token that costs twice as much
# (results/decode_int8_sweep-2026-12-02).
MIN_SPLIT = {(False, False): 512, (False, True): 64, (True, False): 4096, (True, True): 64}
SMALL_BATCH = 8
# Registers per thread for the int8 q @ k^T loop: capped so that four programs fit an SM instead of three, with
# no spills (benchmarks/sm90_report.py; timings in results/decode_int8_dot-2026-12-03).
INT8_DOT_REGISTERS = 128
MAX_SPLITS = 64


def decode_tile(kv_int8: bool, num_seqs: int, block_size: int) -> int:
    """Context tokens per tile: the tuned tile, or one whole cache block where blocks are larger."""
    return max(BLOCK_N[kv_int8, num_seqs <= SMALL_BATCH], block_size)


def split_size_for(max_model_len: int, num_seqs: int, kv_int8: bool, block_size: int) -> int:
    """Tokens per split, a multiple of the tile (`decode_tile`): at least MIN_SPLIT, and few enough splits that a
    max-length grid stays small."""
    size = max(MIN_SPLIT[kv_int8, num_seqs <= SMALL_BATCH], -(-max_model_len // MAX_SPLITS))
    tile = decode_tile(kv_int8, num_seqs, block_size)
    return -(-size // tile) * tile


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    sm_scale,
    split_size,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,
    IEEE: tl.constexpr,
    ASM_CVT: tl.constexpr,
    INT8_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)  # before the empty splits' return too: every program waits
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_size
    if start >= seq_len:
        return
    end = tl.minimum(start + split_size, seq_len)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if INT8_DOT:
        q_hi, q_lo, q_scale = split_query_int8(q, sm_scale)
    q = query_operand(q, sm_scale, KV_INT8)  # with INT8_DOT only its dtype is used: the one values convert to

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            block_tables_ptr,
            seq,
            kv_head,
            n0,
            end,
            d,
            d_mask,
            stride_bt,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            stride_vd,
            stride_sb,
            stride_ss,
            stride_sh,
            q.dtype,
            BLOCK_N,
            BLOCK_SIZE,
            KV_INT8,
            ASM_CVT,
            CONVERT_K=not INT8_DOT,
        )
        if INT8_DOT:
            s = int8_tile_scores(q_hi, q_lo, q_scale, k, k_scale)
        else:
            s = tile_scores(q, k, k_scale, sm_scale, KV_INT8, IEEE)
        s = tl.where((n0 + tl.arange(0, BLOCK_N) < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = accumulate(acc, alpha, p, v, v_scale, KV_INT8, IEEE)
        m_i = m_new
    out = acc / l_i[:, None]
    lse = m_i + tl.log(l_i)
    out_ptrs = part_out_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(out_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ot,
    stride_oh,
    split_size,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    # All splits in one tile (BLOCK_S >= the grid's splits): one round of loads, not a loop of dependent ones.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_splits = tl.cdiv(tl.load(seq_lens_ptr + seq), split_size)
    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=s_mask, other=float("-inf"))
    o = tl.load(
        part_out_ptr + seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    w = tl.exp(lse - tl.max(lse, axis=0))
    total = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    split_size: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence) over paged K/V; returns [B, H, D]. The grid covers `max_seq_len`
    (pass max_model_len under CUDA-graph capture); splits past a sequence's end exit at once."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_splits = max(1, -(-max_seq_len // split_size))
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    kv_int8 = key_cache.dtype == torch.int8
    ieee = q.dtype == torch.float32
    int8_dot = kv_int8 and not ieee and head_dim <= 256  # fp32 queries keep exact products (tests)
    scales = (key_scale, value_scale) if kv_int8 else (key_cache, value_cache)
    block_d = triton.next_power_of_2(head_dim)
    block_size = key_cache.shape[1]
    block_n = max(block_n, block_size) if block_n else decode_tile(kv_int8, batch, block_size)
    pdl = launch_early(q, batch)
    if split_size <= block_n:
        num_stages = 1  # one tile per program: nothing to pipeline, and a pipeline's prologue costs time
    _decode_partial_kernel[(batch, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        scales[0],
        scales[1],
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        *kv_strides(key_cache, value_cache, key_scale),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        scale,
        split_size,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        KV_INT8=kv_int8,
        IEEE=ieee,
        ASM_CVT=asm_conversions(q),
        INT8_DOT=int8_dot,
        num_warps=num_warps,
        num_stages=num_stages,
        maxnreg=INT8_DOT_REGISTERS if int8_dot else None,
        PDL=pdl,
        launch_pdl=pdl,
    )
    _decode_merge_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        split_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits),
        PDL=pdl,
        launch_pdl=pdl,
    )
    return out
