"""Plain-torch versions of every kernel: the CPU path and the oracle the Triton kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual) normalized, and the new residual x + residual. Matches HF Llama: normalize in fp32,
    cast back to the input dtype, then multiply by the weight."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8 per row of the last dim: x ~= q * scale. Rounds half up (floor(x + 0.5)),
    as the Triton kernel does."""
    scale = x.float().abs().amax(dim=-1).clamp_min(1e-8) / INT8_MAX
    q = torch.floor(x.float() / scale[..., None] + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor, key_scale: torch.Tensor | None = None,
             value_scale: torch.Tensor | None = None) -> None:
    """Store key/value [T, Hkv, D] at flat slots (block * block_size + offset) of caches
    [num_blocks, block_size, Hkv, D]; slot -1 is padding and skipped. INT8 caches get per-token, per-head
    scales in key_scale/value_scale [num_blocks, block_size, Hkv]."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key, value = key[keep], value[keep]
    flat_k = key_cache.view(-1, *key_cache.shape[2:])
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    if key_cache.dtype == torch.int8:
        qk, sk = quantize_int8(key)
        qv, sv = quantize_int8(value)
        flat_k[slots], flat_v[slots] = qk, qv
        key_scale.view(-1, key_scale.shape[-1])[slots] = sk
        value_scale.view(-1, value_scale.shape[-1])[slots] = sv
    else:
        flat_k[slots] = key.to(key_cache.dtype)
        flat_v[slots] = value.to(value_cache.dtype)


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_tables: torch.Tensor, max_seq_len: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Contiguous [B, max_seq_len, Hkv, D] copy of each sequence's cached keys or values (dequantized)."""
    block_size = cache.shape[1]
    num_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :num_blocks].long()
    batch = table.shape[0]
    out = cache[table].reshape(batch, num_blocks * block_size, *cache.shape[2:])[:, :max_seq_len]
    if cache.dtype == torch.int8:
        s = scale[table].reshape(batch, num_blocks * block_size, -1)[:, :max_seq_len]
        return (out.float() * s[..., None]).to(dtype)
    return out.to(dtype)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int,
                    key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of flat queries q [T, H, D] over paged K/V, causal with a query offset: query i of a sequence
    with context c = seq_len - query_len sees keys j <= c + i. Returns [T, H, D]."""
    batch = seq_lens.numel()
    num_tokens, num_heads, head_dim = q.shape
    keys = gather_kv(key_cache, key_scale, block_tables, max_seq_len, q.dtype)
    values = gather_kv(value_cache, value_scale, block_tables, max_seq_len, q.dtype)
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=q.device), query_lens, output_size=num_tokens)
    row_of_token = torch.arange(num_tokens, device=q.device) - query_start_loc[seq_of_token]
    padded_q = q.new_zeros(batch, max_query_len, num_heads, head_dim)
    padded_q[seq_of_token, row_of_token] = q
    query_pos = (seq_lens - query_lens)[:, None] + torch.arange(max_query_len, device=q.device)[None]
    key_pos = torch.arange(max_seq_len, device=q.device)
    mask = (key_pos[None, None] <= query_pos[..., None]) & (key_pos[None, None] < seq_lens[:, None, None])
    out = F.scaled_dot_product_attention(padded_q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[seq_of_token, row_of_token]
