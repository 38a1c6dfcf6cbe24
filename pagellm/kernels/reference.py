"""Plain-torch versions of every kernel: the CPU path and the oracle the Triton kernels are tested against."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.quantization.packing import unpack_int32

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Top-p draws: each rejection raises the bound, so rounds are few; past this many the top token is taken.
SAMPLE_MAX_ROUNDS = 32


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalized, and the new residual x + residual. Matches HF Llama: normalize in fp32,
    cast back to the input dtype, then multiply by the weight."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (HF `rotate_half`) of q [T, H, D] and k [T, Hkv, D].
    `cos_sin_cache` is [max_pos, D] holding cos in the first half and sin in the second."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, None, :half].to(q.dtype)
    sin = cos_sin[:, None, half:].to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the merged gate|up projection [T, 2I]: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8 per row of the last dim: x ~= q * scale. Rounds half up (floor(x + 0.5)),
    as the Triton kernel does."""
    scale = x.float().abs().amax(dim=-1).clamp_min(1e-8) / INT8_MAX
    q = torch.floor(x.float() / scale[..., None] + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """Store key/value [T, Hkv, D] at flat slots (block * block_size + offset) of caches
    [num_blocks, block_size, Hkv, D] (any strides); slot -1 is padding and skipped. INT8 caches get per-token,
    per-head scales in key_scale/value_scale [num_blocks, block_size, Hkv]."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    block, offset = slot_mapping // key_cache.shape[1], slot_mapping % key_cache.shape[1]
    if key_cache.dtype == torch.int8:
        (qk, sk), (qv, sv) = quantize_int8(key), quantize_int8(value)
        key_cache[block, offset], value_cache[block, offset] = qk, qv
        key_scale[block, offset], value_scale[block, offset] = sk, sv
    else:
        key_cache[block, offset] = key.to(key_cache.dtype)
        value_cache[block, offset] = value.to(value_cache.dtype)


@dataclass
class AttentionPlan:
    """What every layer's reference attention needs and only the batch decides: computed once per step."""

    key_slots: torch.Tensor  # [B, L] flat cache slot of each sequence's key j (L = max_seq_len)
    # [B, 1, max_q, L] query i of sequence b may see key j; None where every sequence is a whole prompt (no
    # cached context), whose mask is SDPA's own top-left causal one: its CPU kernel then skips the tiles above the
    # diagonal instead of computing and masking them.
    mask: torch.Tensor | None
    seq_of_token: torch.Tensor  # [T] which sequence each flat query token belongs to
    row_of_token: torch.Tensor  # [T] its row within that sequence's queries
    max_query_len: int


def plan_attention(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
) -> AttentionPlan:
    device = seq_lens.device
    batch, num_tokens = seq_lens.numel(), int(query_start_loc[-1])
    key_pos = torch.arange(max_seq_len, device=device)
    key_slots = block_tables.long()[:, key_pos // block_size] * block_size + key_pos % block_size
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=device), query_lens, output_size=num_tokens)
    row_of_token = torch.arange(num_tokens, device=device) - query_start_loc[seq_of_token]
    if max_query_len > 1 and bool((query_lens == seq_lens).all()):
        # Query i sees keys 0 .. i: a shorter prompt's padded keys are seen only by its padded queries, dropped.
        return AttentionPlan(key_slots, None, seq_of_token, row_of_token, max_query_len)
    query_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_query_len, device=device)[None]
    mask = (key_pos[None, None] <= query_pos[..., None]) & (key_pos[None, None] < seq_lens[:, None, None])
    return AttentionPlan(key_slots, mask[:, None], seq_of_token, row_of_token, max_query_len)


def gather_kv(
    cache: torch.Tensor, scale: torch.Tensor | None, key_slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Contiguous [B, L, Hkv, D] copy of each sequence's cached keys or values (dequantized)."""
    block, offset = key_slots // cache.shape[1], key_slots % cache.shape[1]
    out = cache[block, offset]
    if cache.dtype == torch.int8:
        return (out.float() * scale[block, offset][..., None]).to(dtype)
    return out.to(dtype)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Attention of flat queries q [T, H, D] over paged K/V, causal with a query offset: query i of a sequence
    with context c = seq_len - query_len sees keys j <= c + i. Returns [T, H, D]. `plan` (from
    `plan_attention`) saves recomputing the batch's indices and mask in every layer."""
    plan = plan or plan_attention(
        block_tables, query_start_loc, seq_lens, key_cache.shape[1], max_query_len, max_seq_len
    )
    batch = seq_lens.numel()
    keys = gather_kv(key_cache, key_scale, plan.key_slots, q.dtype).transpose(1, 2)
    values = gather_kv(value_cache, value_scale, plan.key_slots, q.dtype).transpose(1, 2)
    if plan.max_query_len == 1:  # decode: one query per sequence, nothing to pad
        out = F.scaled_dot_product_attention(
            q[:, :, None], keys, values, attn_mask=plan.mask[:, :, 0, None], scale=scale, enable_gqa=True
        )
        return out[:, :, 0]
    padded_q = q.new_zeros(batch, plan.max_query_len, *q.shape[1:])
    padded_q[plan.seq_of_token, plan.row_of_token] = q
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),
        keys,
        values,
        attn_mask=plan.mask,
        is_causal=plan.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[plan.seq_of_token, plan.row_of_token]


# Triton's Philox 4x32-10 constants (triton/language/random.py).
_PHILOX_KEYS = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_PHILOX_ROUNDS = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_LOW32 = np.uint64(0xFFFFFFFF)


def philox_uniform(seeds: np.ndarray, offset: int) -> np.ndarray:
    """`tl.rand(seed, offset)` for each int64 seed and a 32-bit offset, bit for bit: Philox 4x32 with 10 rounds,
    the first output word mapped to [0, 1) as Triton maps it. Products of two 32-bit words fit uint64 exactly."""
    seeds = seeds.astype(np.uint64)
    k0, k1 = seeds & _LOW32, (seeds >> np.uint64(32)) & _LOW32
    c0 = np.full_like(seeds, offset & 0xFFFFFFFF)
    c1, c2, c3 = np.zeros_like(seeds), np.zeros_like(seeds), np.zeros_like(seeds)
    a, b = _PHILOX_ROUNDS
    for _ in range(10):
        hi_b, hi_a = b * c2, a * c0
        c0, c2 = (hi_b >> np.uint64(32)) ^ c1 ^ k0, (hi_a >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = hi_b & _LOW32, hi_a & _LOW32
        k0, k1 = (k0 + _PHILOX_KEYS[0]) & _LOW32, (k1 + _PHILOX_KEYS[1]) & _LOW32
    x = c0.astype(np.uint32).view(np.int32)
    x = np.where(x < 0, -x - 1, x)  # int32 wraps as on the GPU
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def sample_rows(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    greedy: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    max_rounds: int = SAMPLE_MAX_ROUNDS,
) -> torch.Tensor:
    """The sampling kernel's algorithm (kernels/sampling.py), row-batched in torch: token ids [B] from logits
    [B, V] scaled by inv_temperature [B]; the argmax where greedy [B] != 0, else a top-p draw by inverse transform
    with one Philox uniform per round, keyed by seeds [B] as the kernel keys them. A draw is kept when the mass of
    the tokens more likely than it is below top_p; a rejected draw bounds the candidates from below, and the next
    round draws among the more likely tokens. After max_rounds rejections the top token is taken."""
    x = logits.float() * inv_temperature.float()[:, None]
    top = x.argmax(dim=-1)
    # In place (the CPU sampler runs this): two fewer passes over [B, V] than exp(x - amax) and a scaled copy.
    probs = x.sub_(x.gather(-1, top[:, None])).exp_()
    probs.mul_(1.0 / probs.sum(dim=-1, keepdim=True))
    token = top.clone()
    vocab = probs.shape[-1]
    seeds_np = seeds.cpu().numpy()
    rows = (greedy == 0).nonzero()[:, 0]
    lower = None  # candidates: tokens more likely than this (round 0: every token)
    mass = torch.ones(rows.numel(), device=x.device)  # of the candidates
    for round_ in range(max_rounds):
        if not rows.numel():
            break
        p = probs if rows.numel() == probs.shape[0] else probs[rows]
        u = torch.from_numpy(philox_uniform(seeds_np[rows.cpu().numpy()], round_)).to(x.device)
        candidates = p if lower is None else torch.where(p > lower[:, None], p, 0.0)
        # The first token whose running sum passes the target (the sums never fall: candidates are >= 0).
        before = torch.searchsorted(candidates.cumsum(dim=-1), (u * mass)[:, None], right=True)[:, 0]
        draw = torch.where(before < vocab, before, top[rows])  # rounding can leave the mass short
        p_draw = p.gather(-1, draw[:, None])
        mass_above = torch.where(p > p_draw, p, 0.0).sum(dim=-1)
        row_top_p = top_p[rows].float()
        accepted = (row_top_p >= 1.0) | (draw == top[rows]) | (mass_above < row_top_p)
        token[rows[accepted]] = draw[accepted]
        rows, lower, mass = rows[~accepted], p_draw[~accepted, 0], mass_above[~accepted]
    return token


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs: in place, -inf for the tokens of logits row rows[i] whose bit is clear in bitmask[i]
    (bit t % 32 of int32 word t // 32 set = token t allowed; xgrammar's layout)."""
    vocab = logits.shape[1]
    tokens = torch.arange(vocab, device=logits.device)
    words = bitmask[:, tokens // 32]
    allowed = ((words >> (tokens % 32)) & 1) != 0
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def dequantize_grouped(
    qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """The stored integer format (kernels/quant_matmul.py) as fp32 [N, K]: w = q * scale + offset per group."""
    q = unpack_int32(qweight, bits).float()
    per_column = {"dim": 1, "repeats": group_size}
    return q * scales.float().repeat_interleave(**per_column) + offsets.float().repeat_interleave(**per_column)


def weight_only_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of quant_matmul.weight_only_matmul (exact fp32; its one-row INT4 kernel's own twin is
    `int4_x16_matmul`): FP8 weights with per-row scales when `offsets` is None."""
    if offsets is None:
        w = weight.float() * scales.float()[:, None]
    else:
        w = dequantize_grouped(weight, scales, offsets, bits, group_size)
    out = x.float() @ w.T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def int4_x16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Twin of quant_matmul's one-row INT4 kernel: x per 32 columns as integers 254 * hi + lo (hi its absmax-127
    int8 rounding, lo that rounding's error in 1/254ths, both to nearest even), integer dots per 32 columns scaled
    by x's and the weight group's scales, the offsets against x's exact 32-column sums."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    x_max = xg.abs().amax(dim=-1)
    v = xg * torch.where(x_max > 0, 127.0 / x_max, 0.0)[..., None]
    hi = torch.round(v)
    x16 = 254.0 * hi + torch.round((v - hi) * 254.0)
    q = unpack_int32(qweight, 4).float().view(-1, k // 32, 32)
    dots = torch.einsum("mgc,ngc->mng", x16, q)  # integers below 2**24: exact in fp32
    per_x_group = {"dim": 1, "repeats": group_size // 32}
    w_scale = scales.float().repeat_interleave(**per_x_group)
    w_offset = offsets.float().repeat_interleave(**per_x_group)
    out = (dots * (x_max / (127.0 * 254.0))[:, None, :] * w_scale).sum(-1) + xg.sum(-1) @ w_offset.T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8 (e4m3): x ~= q * scale, scale = absmax / 448, as the Triton kernel does."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
