"""The plain-torch kernels against naive dense computations."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import reference


def dense_attention(q, k, v, scale):
    """q [Lq, H, D], k/v [Lk, Hkv, D]; query i sees keys j <= Lk - Lq + i."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    lq, lk = q.shape[0], k.shape[0]
    visible = torch.arange(lk)[None] <= (lk - lq + torch.arange(lq))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize(
    "seqs",  # (query_len, seq_len)
    [[(1, 1), (3, 9), (5, 5), (1, 17), (16, 16)], [(5, 5), (16, 16), (1, 1), (11, 11)]],
    ids=["chunks-after-context", "whole-prompts"],
)
def test_paged_attention_matches_dense(kv_dtype, heads, kv_heads, seqs):
    gen = torch.Generator().manual_seed(0)
    block_size, num_blocks, dim = 4, 64, 32
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    scales = (
        (torch.zeros(num_blocks, block_size, kv_heads), torch.zeros(num_blocks, block_size, kv_heads))
        if kv_dtype == torch.int8
        else (None, None)
    )
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qs, expected = [], [], []
    for q_len, s_len in seqs:
        blocks = [perm.pop() for _ in range(-(-s_len // block_size))]
        tables.append(blocks + [0] * (8 - len(blocks)))
        k = torch.randn(s_len, kv_heads, dim, generator=gen)
        v = torch.randn(s_len, kv_heads, dim, generator=gen)
        pos = torch.arange(s_len)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        reference.write_kv(k, v, key_cache, value_cache, slots, *scales)
        if kv_dtype == torch.int8:  # compare against what the cache holds after quantization
            k = reference.gather_kv(key_cache, scales[0], slots[None], torch.float32)[0]
            v = reference.gather_kv(value_cache, scales[1], slots[None], torch.float32)[0]
        q = torch.randn(q_len, heads, dim, generator=gen)
        qs.append(q)
        expected.append(dense_attention(q, k, v, dim**-0.5))
    qsl = torch.tensor([0] + [q for q, _ in seqs]).cumsum(0).to(torch.int32)
    out = reference.paged_attention(
        torch.cat(qs),
        key_cache,
        value_cache,
        torch.tensor(tables, dtype=torch.int32),
        qsl,
        torch.tensor([s for _, s in seqs], dtype=torch.int32),
        dim**-0.5,
        max(q for q, _ in seqs),
        max(s for _, s in seqs),
        *scales,
    )
    assert torch.allclose(out.double(), torch.cat(expected), atol=1e-5)


def test_int8_quantization_error_is_bounded():
    x = torch.randn(100, 4, 64)
    q, scale = reference.quantize_int8(x)
    err = (q.float() * scale[..., None] - x).abs()
    assert torch.all(err <= scale[..., None] / 2 + 1e-6)
    assert q.abs().max() == 127


def test_padding_slots_are_skipped():
    cache = torch.zeros(2, 4, 1, 8)
    values = torch.ones(3, 1, 8)
    reference.write_kv(values, values, cache, cache.clone(), torch.tensor([0, -1, 5]))
    assert cache.view(-1, 1, 8)[[0, 5]].eq(1).all() and cache.sum() == 16


@pytest.mark.parametrize("rows", [[4, 1, 2], [0, 1, 2, 3, 4, 5]])
@pytest.mark.parametrize("vocab", [1000, 4096 + 33])
def test_cpu_token_bitmask_follows_the_layout(rows, vocab):
    """The CPU path's mask (numpy's unpacking) against the layout itself, bit t % 32 of word t // 32, and against
    the torch twin, on a view of the first rows of a larger logits tensor (as the sampler's logits are)."""
    from pagellm.kernels.ops import TorchOps

    gen = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(8, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), -(-vocab // 32)), generator=gen, dtype=torch.int32)
    index = torch.tensor(rows, dtype=torch.int32)
    out = logits.clone()
    TorchOps().apply_token_bitmask(out[:6], bitmask, index)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, index)
    assert torch.equal(out, expected)
    words = bitmask.tolist()
    for i in range(8):
        if i not in rows:
            assert torch.equal(out[i], logits[i])
            continue
        allowed = torch.tensor([(words[rows.index(i)][t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)])
        assert torch.equal(out[i][allowed], logits[i][allowed])
        assert torch.all(out[i][~allowed] == float("-inf"))
