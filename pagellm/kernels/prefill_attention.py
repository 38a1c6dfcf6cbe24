"""Triton: attention of a chunk of query tokens over paged K/V (chunked prefill, prefix-cache hits, mixed batches).

Grid (sequence, KV head, query tile). A program computes a tile of BLOCK_Q query tokens for all GROUP query heads
that share its KV head (rows token-major, BLOCK_Q * BLOCK_G in all: the group padded to a power of two), so each
K/V tile is loaded once per group instead of once per query head. Query i of a sequence with context
c = seq_len - query_len sees keys j <= c + i (causal, lower-right aligned): key tiles every row of the tile sees run
without the causal mask, the tiles across the diagonal with it, and key tiles past the tile's last visible key are
skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.paged_kv import accumulate, asm_conversions, kv_strides, load_kv_tile, query_operand, tile_scores


# Nothing that changes with the batch may pick a new specialization mid-serving: the block-table width (a stride),
# and the alignment of the metadata views that mixed steps pass for the sequences after their decodes.
@triton.jit(
    do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["block_tables_ptr", "qsl_ptr", "seq_lens_ptr"]
)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    qsl_ptr,
    seq_lens_ptr,
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
    stride_ot,
    stride_oh,
    sm_scale,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_INT8: tl.constexpr,
    IEEE: tl.constexpr,
    ASM_CVT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first = tile * BLOCK_Q  # the tile's first query token
    if first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    r = tl.arange(0, BLOCK_Q * BLOCK_G)  # row r: query token first + r // BLOCK_G, head r % BLOCK_G of the group
    tokens = first + r // BLOCK_G
    heads = kv_head * GROUP + r % BLOCK_G
    r_mask = (tokens < q_len) & (r % BLOCK_G < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_offsets = (q_start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_ptr + q_offsets + d[None, :], mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    # Scores in base 2: log2(e) folded into the softmax scale makes each exponential one MUFU.EX2 with no multiply
    # before it; the loop's time follows its instruction count (16% fewer: 17-22% faster on the H100,
    # ab-prefill-exp2-h100-2026-12-07).
    qk_scale = sm_scale * 1.4426950408889634
    q = query_operand(q, qk_scale, KV_INT8)

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, context + first + BLOCK_Q)
    # Keys 0 .. context + first are visible to every row: whole tiles of them need no causal mask.
    unmasked_end = (context + first + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, kv_end, BLOCK_N):
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            block_tables_ptr,
            seq,
            kv_head,
            n0,
            kv_end,
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
        )
        s = tile_scores(q, k, k_scale, qk_scale, KV_INT8, IEEE)
        if n0 >= unmasked_end:
            offs = n0 + tl.arange(0, BLOCK_N)
            visible = (offs[None, :] <= context + tokens[:, None]) & (offs < kv_end)[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see nothing: avoid inf - inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = accumulate(acc, alpha, p, v, v_scale, KV_INT8, IEEE)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offsets = (q_start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(out_ptr + o_offsets + d[None, :], out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`: flat q [T, H, D]; sequence b owns the tokens
    query_start_loc[b]:[b+1] (offsets into q and out). Returns [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.numel()
    kv_int8 = key_cache.dtype == torch.int8
    scales = (key_scale, value_scale) if kv_int8 else (key_cache, value_cache)
    kv_heads = key_cache.shape[2]
    block_g = triton.next_power_of_2(num_heads // kv_heads)
    # Tiles of 64 rows (query tokens x the group's heads) for long queries: on the H100 1-8% faster than 128 rows
    # and 8 warps at all but a 512-token chunk after 1,024 (3% slower; ab-prefill-gqa-h100-2026-12-07). Short
    # queries (a few tokens beside decodes) get 16 tokens a tile.
    block_q = max(1, 64 // block_g) if max_query_len > 32 else 16
    block_size = key_cache.shape[1]
    grid = (batch, kv_heads, triton.cdiv(max_query_len, block_q))
    _prefill_kernel[grid](
        q,
        key_cache,
        value_cache,
        scales[0],
        scales[1],
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        *kv_strides(key_cache, value_cache, key_scale),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        GROUP=num_heads // kv_heads,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_Q=block_q,
        BLOCK_N=max(64, block_size),
        BLOCK_SIZE=block_size,
        KV_INT8=kv_int8,
        IEEE=q.dtype == torch.float32,
        ASM_CVT=asm_conversions(q),
        num_warps=8 if block_q * block_g >= 128 else 4,
        num_stages=2,
    )
    return out
