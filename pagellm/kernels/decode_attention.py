"""Triton: paged decode attention (one query token per sequence), flash-decoding style.

Stage 1, grid (sequence, KV head, split): each program walks its split of the context tile by tile through the
block table, for all query heads of its KV head at once (GQA: each K/V tile is loaded once; the head group is
padded to 16 rows because `tl.dot` needs M >= 16), and stores a normalized partial output plus its log-sum-exp.
Stage 2, grid (sequence, head): merges all splits in one tile, each weighted by its log-sum-exp. A sequence whose
context fits one split has its output stored by stage 1 (the merge of one split would copy it), and stage 2 skips it.

The split size depends on the engine's max_model_len and on whether the batch is small (at most
SMALL_BATCH sequences, a CUDA-graph size, so a padded graph and an eager step of the same batch agree): few
sequences leave most of the GPU idle unless each context is cut finer. Outputs are therefore invariant to what
else is batched within each of the two classes, and with the grid sized for max_model_len a captured CUDA graph
stays valid. INT8 K/V are dequantized by folding the per-token scales into the scores (K) and the probabilities
(V); values are converted to fp16 tile by tile (exact), while q @ k^T runs on int8 tensor cores with the query
split into two int8 halves, about fp16's precision (fp32 queries keep fp32 products); see `paged_kv`.

In pure-decode steps of a few sequences (`NewTokens`, `NEW_TOKENS_BATCHES`) stage 1 also does `kv_write`'s work,
which saves a dependent launch per layer: each program rotates its head group's queries (after Qwen3's q_norm) in
registers, and the program whose split holds the newest token rotates and stores that token's key and value heads
before it reads its tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagellm.kernels.kv_write import rotated_heads, store_kv_heads
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


class NewTokens(NamedTuple):
    """A pure-decode step's new tokens, one per sequence, for the decode kernel to rotate and store itself (what
    `kv_write.rope_and_write_kv` does otherwise): key and value rows [B, Hkv, D] (views with a contiguous last
    dim), positions and cache slots [B] (-1: padding, not stored), the rotary table and Qwen3's per-head norms."""

    key: torch.Tensor
    value: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0


# Pure-decode batches whose decode kernel takes `NewTokens` (H100, same run, results/ab-decode-rope-2026-12-07):
# Qwen3-0.6B decoded 2.2% faster at 16 sequences; at one (launched with PDL, where the separate kernel's launch hides
# behind the GEMV before it) 1.1% slower: the work added before the tile loads cost more than the launch it saved.
# Larger batches are not measured yet and keep the separate kernel.
NEW_TOKENS_BATCHES = range(2, 17)


def rotates_new_tokens(head_dim: int, num_seqs: int) -> bool:
    """Whether a pure-decode step of `num_seqs` sequences hands its new tokens to the decode kernel
    (`NEW_TOKENS_BATCHES`), which it can for the head sizes `_joins_halves` allows."""
    return num_seqs in NEW_TOKENS_BATCHES and _joins_halves(head_dim)


def _joins_halves(head_dim: int) -> bool:
    """The kernel joins a rotated head's two halves in registers, which needs a power-of-two head size."""
    return head_dim == triton.next_power_of_2(head_dim)


def decode_tile(kv_int8: bool, num_seqs: int, block_size: int) -> int:
    """Context tokens per tile: the tuned tile, or one whole cache block where blocks are larger."""
    return max(BLOCK_N[kv_int8, num_seqs <= SMALL_BATCH], block_size)


def split_size_for(max_model_len: int, num_seqs: int, kv_int8: bool, block_size: int) -> int:
    """Tokens per split, a multiple of the tile (`decode_tile`): at least MIN_SPLIT, and few enough splits that a
    max-length grid stays small."""
    size = max(MIN_SPLIT[kv_int8, num_seqs <= SMALL_BATCH], -(-max_model_len // MAX_SPLITS))
    tile = decode_tile(kv_int8, num_seqs, block_size)
    return -(-size // tile) * tile


@triton.jit
def _rotate_new_token(
    q_ptr, k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr, seq, kv_head, store, stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt,
    stride_vnh, stride_c, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, stride_sb,
    stride_ss, stride_sh, eps,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """The head group's queries [BLOCK_G, HEAD_DIM] rotated as `kv_write` rotates them (the same roundings); with
    `store`, the sequence's new key and value heads of `kv_head` are stored in the cache first, visible to this
    program's tile loads."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + seq)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_c + d)
    sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + d)
    q1, q2, _q_rows, _q_mask = rotated_heads(
        q_ptr + seq * stride_qt + kv_head * GROUP * stride_qh, stride_qh, GROUP, cos, sin, q_norm_ptr, eps,
        HALF, BLOCK_G, HALF, NORM,
    )  # fmt: skip
    if store:
        # Two rows of which one is the head: a one-row tile is a corner case the compiler need not handle.
        k1, k2, _k_rows, _k_mask = rotated_heads(  # names apart from q's: Triton types a name once
            k_new_ptr + seq * stride_knt + kv_head * stride_knh, stride_knh, 1, cos, sin, k_norm_ptr, eps,
            HALF, 2, HALF, NORM,
        )  # fmt: skip
        store_kv_heads(
            k1, k2, v_new_ptr + seq * stride_vnt + kv_head * stride_vnh, stride_vnh, kv_head, 1,
            tl.load(slot_ptr + seq), k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_kb, stride_ks,
            stride_kh, stride_vb, stride_vs, stride_vh, stride_vd, stride_sb, stride_ss, stride_sh, BLOCK_SIZE,
            HALF, 2, HALF, KV_INT8,
        )  # fmt: skip
        tl.debug_barrier()  # the stores above reach the threads that load the newest tile
    # [BLOCK_G, HALF] x 2 -> [BLOCK_G, 2, HALF] -> each row's halves side by side, as q is laid out
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_G, HEAD_DIM))
    return q.to(q_ptr.dtype.element_ty)


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
    out_ptr,
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
    stride_ot,
    stride_oh,
    sm_scale,
    split_size,
    k_new_ptr,
    v_new_ptr,
    pos_ptr,
    slot_ptr,
    cos_sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_c,
    eps,
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
    ROPE: tl.constexpr,
    NORM: tl.constexpr,
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
    if ROPE:
        q = _rotate_new_token(
            q_ptr, k_new_ptr, v_new_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr,
            v_cache_ptr, k_scale_ptr, v_scale_ptr, seq, kv_head, end == seq_len, stride_qt, stride_qh, stride_knt,
            stride_knh, stride_vnt, stride_vnh, stride_c, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, stride_vd, stride_sb, stride_ss, stride_sh, eps,
            GROUP, BLOCK_G, HEAD_DIM, BLOCK_SIZE, KV_INT8, NORM,
        )  # fmt: skip
    else:
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
    rows = g_mask[:, None] & d_mask[None, :]
    if seq_len <= split_size:  # the sequence's only split: its output, as the merge would leave it (w = 1)
        final_ptrs = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(final_ptrs, out.to(out_ptr.dtype.element_ty), mask=rows)
    else:
        part_ptrs = part_out_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(part_ptrs, out, mask=rows)
        tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i), mask=g_mask)


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
    if num_splits <= 1:  # its one split wrote the output (none: a padding row)
        return
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
    new_tokens: NewTokens | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one token per sequence) over paged K/V; returns [B, H, D]. The grid covers `max_seq_len`
    (pass max_model_len under CUDA-graph capture); splits past a sequence's end exit at once. With `new_tokens`
    (head_dim a power of two), q is taken before RoPE and left as it is, and the new keys and
    values are rotated and stored here: the cache need hold only each sequence's tokens before its new one."""
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
    new = _new_token_arguments(new_tokens, q)
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
        out,
        q.stride(0),
        q.stride(1),
        *kv_strides(key_cache, value_cache, key_scale),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        scale,
        split_size,
        *new,
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
        ROPE=new_tokens is not None,
        NORM=new_tokens is not None and new_tokens.q_norm is not None,
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


def _new_token_arguments(new_tokens: NewTokens | None, q: torch.Tensor) -> tuple:
    """The partial kernel's new-token arguments (k_new_ptr .. eps); unused stand-ins without `new_tokens`."""
    if new_tokens is None:
        return (q, q, q, q, q, q, q, 0, 0, 0, 0, 0, 0.0)
    if not _joins_halves(q.shape[-1]):
        raise ValueError(f"new_tokens needs a power-of-two head_dim, got {q.shape[-1]}")
    key, value = new_tokens.key, new_tokens.value
    norms = (new_tokens.q_norm, new_tokens.k_norm) if new_tokens.q_norm is not None else (q, q)
    return (
        key,
        value,
        new_tokens.positions,
        new_tokens.slot_mapping,
        new_tokens.cos_sin_cache,
        *norms,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        new_tokens.cos_sin_cache.stride(0),
        new_tokens.eps,
    )
