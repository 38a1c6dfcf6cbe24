"""Each Triton kernel against its plain-torch twin in `kernels/reference.py` on random inputs.

On CPU these run through the Triton interpreter (fp16/fp32; bf16 loads are wrong there); on a GPU the same tests
run natively and add bf16."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels import reference
from pagellm.kernels.activation import silu_and_mul
from pagellm.kernels.bitmask import apply_token_bitmask
from pagellm.kernels.decode_attention import NewTokens, paged_decode_attention, split_size_for
from pagellm.kernels.gemv import FEW_ROWS, Tiles, few_rows_matmul, gemv, rms_norm_gemv, silu_and_mul_gemv
from pagellm.kernels.kv_write import rope_and_write_kv
from pagellm.kernels.prefill_attention import paged_prefill_attention
from pagellm.kernels.rmsnorm import rms_norm
from pagellm.model.attention import allocate_kv_caches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def make_cache(num_blocks, block_size, kv_heads, dim, kv_dtype, gen):
    """A cache in the engine's layout (INT8 values slot-minor)."""
    cache = allocate_kv_caches(1, num_blocks, block_size, kv_heads, dim, kv_dtype, torch.device(DEVICE))[0]
    return cache.key, cache.value, (cache.key_scale, cache.value_scale)


def fill_sequences(seq_lens, block_size, num_blocks, kv_heads, dim, dtype, kv_dtype, gen):
    """Random K/V for each sequence written through the reference into shuffled blocks; returns the cache and
    block tables."""
    key_cache, value_cache, scales = make_cache(num_blocks, block_size, kv_heads, dim, kv_dtype, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        blocks = [perm.pop() for _ in range(-(-s // block_size))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        pos = torch.arange(s)
        slots = (torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size).to(DEVICE)
        k = torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE, dtype)
        v = torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE, dtype)
        reference.write_kv(k, v, key_cache, value_cache, slots, *scales)
    return key_cache, value_cache, scales, tables.to(DEVICE)


def reference_attention(q, key_cache, value_cache, scales, tables, qsl, lens, scale, max_query_len):
    """The torch twin's output in fp32 for flat queries over the cache (INT8 K/V as stored, with their scales)."""
    int8 = key_cache.dtype == torch.int8
    return reference.paged_attention(
        q.float(),
        key_cache if int8 else key_cache.float(),
        value_cache if int8 else value_cache.float(),
        tables,
        qsl,
        lens,
        scale,
        max_query_len,
        int(lens.max()),
        *scales,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 128), (16, 2, 64), (8, 1, 64)])
def test_decode_attention(dtype, kv_int8, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads * dim + kv_int8)
    block_size = 16
    seq_lens = [1, 15, 16, 17, 100, 1100]  # odd, block-boundary, and longer than one split
    kv_dtype = torch.int8 if kv_int8 else dtype
    key_cache, value_cache, scales, tables = fill_sequences(
        seq_lens, block_size, 128, kv_heads, dim, dtype, kv_dtype, gen
    )
    q = torch.randn(len(seq_lens), heads, dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = reference_attention(q, key_cache, value_cache, scales, tables, qsl, lens, dim**-0.5, 1)
    for num_seqs in (len(seq_lens), 64):  # the small-batch split size (finer) and the large-batch one
        split = split_size_for(2048, num_seqs, kv_int8, block_size)
        out = paged_decode_attention(q, key_cache, value_cache, tables, lens, dim**-0.5, max(seq_lens), split, *scales)
        assert rel_err(out, ref) < TOL[dtype]
        # A grid sized for a longer max length (as under CUDA-graph capture) gives the same result.
        wide = paged_decode_attention(q, key_cache, value_cache, tables, lens, dim**-0.5, 2048, split, *scales)
        assert torch.equal(wide, out)


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_decode_attention_block_sizes(kv_int8, block_size):
    """Tiles are read as whole cache blocks: block sizes below, equal to and above the tile."""
    gen = torch.Generator().manual_seed(block_size + kv_int8)
    seq_lens = [1, 9, 130, 300]
    kv_dtype = torch.int8 if kv_int8 else torch.float16
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    key_cache, value_cache, scales, tables = fill_sequences(
        seq_lens, block_size, num_blocks, 2, 64, torch.float16, kv_dtype, gen
    )
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(DEVICE, torch.float16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = reference_attention(q, key_cache, value_cache, scales, tables, qsl, lens, 0.125, 1)
    split = split_size_for(512, len(seq_lens), kv_int8, block_size)
    out = paged_decode_attention(q, key_cache, value_cache, tables, lens, 0.125, max(seq_lens), split, *scales)
    assert rel_err(out, ref) < TOL[torch.float16]
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, key_cache, value_cache, tables, qsl, lens, 0.125, 1, *scales)
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 128)])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm+rope"])
def test_decode_attention_rotates_new_tokens(dtype, kv_int8, heads, kv_heads, dim, qk_norm):
    """With NewTokens the decode kernel rotates the queries and stores the new keys and values itself: the same
    output and cache as the RoPE + KV-write kernel followed by the decode kernel, and as the torch reference."""
    from pagellm.config import RopeConfig
    from pagellm.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(heads * dim + kv_int8 + qk_norm)
    block_size = 16
    seq_lens = [1, 16, 17, 100, 300]  # the new token alone, at a block's end and start, in a later split
    kv_dtype = torch.int8 if kv_int8 else dtype
    key_cache, value_cache, scales, tables = fill_sequences(
        seq_lens, block_size, 64, kv_heads, dim, dtype, kv_dtype, gen
    )
    cos_sin = RotaryEmbedding(dim, 4096, RopeConfig(theta=10000.0)).cos_sin_cache.to(DEVICE)
    qkv = torch.randn(len(seq_lens), (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * dim].view(-1, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(-1, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(-1, kv_heads, dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    positions = (lens - 1).long()
    slots = tables.gather(1, (positions // block_size)[:, None].long())[:, 0] * block_size + positions % block_size
    slots[2] = -1  # a padding row: rotated, not stored
    norms = tuple((1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    norms = norms if qk_norm else (None, None)
    new = NewTokens(k, v, positions, slots, cos_sin, *norms, eps=1e-6)
    split = split_size_for(2048, len(seq_lens), kv_int8, block_size)
    q_before = q.clone()

    def decode(q, cache, max_seq_len, new_tokens=None):
        return paged_decode_attention(
            q, *cache[:2], tables, lens, dim**-0.5, max_seq_len, split, *cache[2:], new_tokens=new_tokens
        )

    fused_cache, separate_cache = (
        [x if x is None else x.clone() for x in (key_cache, value_cache, *scales)] for _ in "ab"
    )
    out = decode(q, fused_cache, max(seq_lens), new)
    assert torch.equal(q, q_before)
    # The torch reference over the cache the kernel wrote (equal to the KV-write kernel's: below).
    ref_q = q.float()
    if qk_norm:
        ref_q = reference.rms_norm(q, norms[0], 1e-6)[0].float()
    ref_q, _ = reference.apply_rope(ref_q, ref_q[:, :1], positions, cos_sin)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    key, value = (x if kv_int8 else x.float() for x in fused_cache[:2])
    ref = reference.paged_attention(ref_q, key, value, tables, qsl, lens, dim**-0.5, 1, max(seq_lens), *fused_cache[2:])
    assert rel_err(out, ref) < TOL[dtype]

    rotated_q = q.clone()
    rope_and_write_kv(
        rotated_q, k, v, positions, cos_sin, *separate_cache[:2], slots, *separate_cache[2:], *norms, 1e-6
    )
    # Bit for bit in the interpreter. On the GPU the two paths are compiled apart, and their last bits differ (on
    # the H100 in fp16 and fp32 cases, 2026-12-07; not traced further: fused multiply-adds or sum orders, likely).
    same = torch.equal if DEVICE == "cpu" else lambda a, b: rel_err(a, b) < TOL[dtype]
    assert same(out, decode(rotated_q, separate_cache, max(seq_lens)))
    for fused_part, separate_part in zip(fused_cache, separate_cache):
        assert fused_part is None or same(fused_part, separate_part)
    # A grid sized for a longer max length, as under CUDA-graph capture (the new tokens stored again; more splits
    # merged, whose sum may round differently on the GPU than `out`'s).
    assert same(decode(q, fused_cache, 2048, new), decode(rotated_q, separate_cache, 2048))


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize(
    "query_lens",
    [[1], [1, 1, 1], [1, 1, 7]],
    ids=["decode-1 (RoPE kernel)", "decode-3 (RoPE in the decode kernel)", "decodes beside a chunk"],
)
def test_triton_backend_step_equals_the_torch_backend(kv_int8, query_lens):
    """A layer's whole attention step through the Triton backend (which picks where the RoPE and the KV write run)
    against the torch backend: the same output and cache."""
    from pagellm.config import RopeConfig
    from pagellm.model.attention import AttentionMetadata, LayerKVCache, Rotation, get_backend
    from pagellm.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(len(query_lens) + sum(query_lens) + kv_int8)
    heads, kv_heads, dim, block_size = 4, 2, 64, 16
    seq_lens = [20, 5, 40][: len(query_lens)]
    kv_dtype = torch.int8 if kv_int8 else torch.float32
    key_cache, value_cache, scales, tables = fill_sequences(
        seq_lens, block_size, 16, kv_heads, dim, torch.float32, kv_dtype, gen
    )
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, query_lens)]).to(DEVICE)
    seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(query_lens)).to(DEVICE)
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    tokens = sum(query_lens)
    metadata = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=sum(1 for n in query_lens if n == 1),
    )
    cos_sin = RotaryEmbedding(dim, 4096, RopeConfig(theta=10000.0)).cos_sin_cache.to(DEVICE)
    norms = [(1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE) for _ in range(2)]
    rotation = Rotation(positions, cos_sin, *norms, eps=1e-6)
    q, k, v = (torch.randn(tokens, n, dim, generator=gen).to(DEVICE) for n in (heads, kv_heads, kv_heads))
    outs, caches = [], []
    for name in ("triton", "torch"):
        backend = get_backend(name, block_size, 128)
        cache = LayerKVCache(*(x if x is None else x.clone() for x in (key_cache, value_cache, *scales)))
        outs.append(backend.forward(q.clone(), k, v, rotation, cache, backend.build_metadata(metadata), dim**-0.5))
        caches.append(cache)
    assert rel_err(outs[0], outs[1]) < (2e-3 if kv_int8 else TOL[torch.float32])
    for name in ("key", "value"):  # INT8 may round a value the other way at a .5 boundary
        diff = (getattr(caches[0], name).float() - getattr(caches[1], name).float()).abs()
        assert diff.max() <= (1 if kv_int8 else 1e-5) and (diff > 0).float().mean() < 1e-2
    if kv_int8:
        for name in ("key_scale", "value_scale"):
            assert torch.allclose(getattr(caches[0], name), getattr(caches[1], name), rtol=1e-5, atol=0)


def check_prefill_attention(seqs, block_size, heads, kv_heads, dim, dtype, kv_int8, gen):
    """The prefill kernel against the torch twin on sequences of (query_len, seq_len) in shuffled cache blocks."""
    seq_lens = [s for _, s in seqs]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    kv_dtype = torch.int8 if kv_int8 else dtype
    key_cache, value_cache, scales, tables = fill_sequences(
        seq_lens, block_size, num_blocks, kv_heads, dim, dtype, kv_dtype, gen
    )
    q_lens = [q for q, _ in seqs]
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(DEVICE, dtype)
    qsl = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = reference_attention(q, key_cache, value_cache, scales, tables, qsl, lens, dim**-0.5, max(q_lens))
    out = paged_prefill_attention(q, key_cache, value_cache, tables, qsl, lens, dim**-0.5, max(q_lens), *scales)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 128), (8, 1, 64), (9, 3, 64)])
def test_prefill_attention(dtype, kv_int8, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads + dim + kv_int8)
    # (query_len, seq_len): whole prompts, chunks after a cached prefix (the last long enough for key tiles that
    # every query of a tile sees), decode rows mixed in; groups of 1, 4, 8 and 3 query heads (a group padded).
    seqs = [(7, 7), (33, 33), (20, 52), (1, 40), (16, 16), (70, 90), (150, 300)]
    check_prefill_attention(seqs, 16, heads, kv_heads, dim, dtype, kv_int8, gen)


@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_prefill_attention_block_sizes(kv_int8, block_size):
    """Chunks over cache blocks below, equal to and above the key tile: key tiles that every query sees (unmasked),
    tiles across the diagonal, and a sequence ending inside a block."""
    gen = torch.Generator().manual_seed(block_size + kv_int8)
    seqs = [(150, 300), (70, 90), (33, 33), (1, 40)]
    check_prefill_attention(seqs, block_size, 8, 2, 64, torch.float16, kv_int8, gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_int8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (4, 4, 32), (2, 1, 64), (6, 3, 80)])
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk-norm+rope"])
def test_rope_and_write_kv(dtype, kv_int8, heads, kv_heads, dim, rope_type, qk_norm):
    from pagellm.config import RopeConfig
    from pagellm.model.layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(dim + heads + kv_int8)
    rope = RopeConfig(theta=500000.0, rope_type=rope_type, factor=8.0, original_max_position_embeddings=256)
    cos_sin = RotaryEmbedding(dim, 4096, rope).cos_sin_cache.to(DEVICE)
    tokens = 19
    # Strided views, as the model passes slices of the fused qkv output.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    k_before = k.clone()
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens].to(DEVICE)
    slots[5] = -1  # padding: rotated, not stored
    norms = (None, None)
    ref_q, ref_k = q.float(), k.float()
    if qk_norm:  # Qwen3: each head RMS-normalized with its own weight, then rotated
        norms = tuple((1 + 0.1 * torch.randn(dim, generator=gen)).to(DEVICE, dtype) for _ in range(2))
        ref_q, ref_k = (reference.rms_norm(x, w, 1e-6)[0].float() for x, w in zip((q, k), norms))
    ref_q, ref_k = reference.apply_rope(ref_q, ref_k, positions, cos_sin)
    kv_dtype = torch.int8 if kv_int8 else dtype
    ref_cache = make_cache(8, 16, kv_heads, dim, kv_dtype, gen)
    reference.write_kv(ref_k, v, ref_cache[0], ref_cache[1], slots, *ref_cache[2])
    out_cache = make_cache(8, 16, kv_heads, dim, kv_dtype, gen)
    rope_and_write_kv(q, k, v, positions, cos_sin, *out_cache[:2], slots, *out_cache[2], *norms, eps=1e-6)
    assert rel_err(q, ref_q) < TOL[dtype] and torch.equal(k, k_before)
    if kv_int8:
        (key_scale, value_scale), (ref_key_scale, ref_value_scale) = out_cache[2], ref_cache[2]
        dequantized_keys = out_cache[0].float() * key_scale[..., None]
        assert rel_err(dequantized_keys, ref_cache[0].float() * ref_key_scale[..., None]) < 2e-2
        assert torch.allclose(value_scale, ref_value_scale, rtol=1e-6, atol=0)
        # Quantized values agree except where division rounding lands within an ulp of a .5 boundary.
        diff = (ref_cache[1].int() - out_cache[1].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    else:
        assert rel_err(out_cache[0], ref_cache[0]) < TOL[dtype] and torch.equal(out_cache[1], ref_cache[1])
    untouched = make_cache(8, 16, kv_heads, dim, kv_dtype, gen)  # the padding token's rows were never written
    written = torch.zeros(8 * 16, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    for out, blank in zip(out_cache[:2], untouched[:2]):
        assert torch.equal(out.flatten(0, 1)[~written.to(DEVICE)], blank.flatten(0, 1)[~written.to(DEVICE)])


def rms_norm_inputs(
    hidden: int, dtype: torch.dtype, with_residual: bool, row_scale: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """13 rows of x (times row_scale), a residual where asked for, and a norm weight near 1; seeded by the width."""
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(13, hidden, generator=gen) * row_scale).to(DEVICE, dtype)
    residual = torch.randn(13, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    x, residual, weight = rms_norm_inputs(hidden, dtype, with_residual)
    ref_out, ref_res = reference.rms_norm(x, weight, 1e-5, residual)
    out, res = rms_norm(x, weight, 1e-5, residual)
    assert rel_err(out, ref_out) < TOL[dtype]
    assert torch.equal(res, ref_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 64), (7, 1000), (3, 3072)])
def test_silu_and_mul(dtype, tokens, intermediate):
    gen = torch.Generator().manual_seed(intermediate)
    x = (2 * torch.randn(tokens, 2 * intermediate, generator=gen)).to(DEVICE, dtype)
    assert rel_err(silu_and_mul(x), reference.silu_and_mul(x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n,k,tiles",
    [
        (37, 300, None),  # whole rows (small weights), ragged
        (1000, 64, None),
        (5, 5000, None),  # whole rows, one per program
        (300, 1100, Tiles(8, 512, 4, 4)),  # streamed in tiles (large weights), ragged
        (16400, 520, None),  # the wide-N (LM head) config
    ],
)
def test_gemv(dtype, n, k, tiles):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    out = gemv(x, weight, tiles)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, x.double() @ weight.double().T) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, FEW_ROWS])
@pytest.mark.parametrize("n,k,tiles", [(37, 300, None), (1000, 64, Tiles(16, 128, 4, 3, swap_ab=True))])
def test_few_rows_matmul(dtype, m, n, k, tiles):
    """Ragged rows, columns and tiles, with the weight as either operand of the dot; x a strided view."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, 2 * k, generator=gen).to(DEVICE, dtype)[:, :k]
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    out = few_rows_matmul(x, weight, tiles)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, x.double() @ weight.double().T) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(37, 300), (1000, 64), (16400, 520)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv(dtype, n, k, with_residual):
    """The norm fused into the GEMV's loads against the twin's two steps: normalize (x + residual), multiply."""
    gen = torch.Generator().manual_seed(n + k + with_residual)
    x = (3 * torch.randn(1, k, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    normed, ref_residual = reference.rms_norm(x, norm_weight, 1e-5, residual)
    out, new_residual = rms_norm_gemv(x, residual, norm_weight, 1e-5, weight)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, normed.double() @ weight.double().T) < TOL[dtype]
    assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(37, 300), (1000, 64), (16400, 520)])
def test_silu_and_mul_gemv(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = (2 * torch.randn(1, 2 * k, generator=gen)).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    out = silu_and_mul_gemv(x, weight)
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_err(out, reference.silu_and_mul(x).double() @ weight.double().T) < TOL[dtype]


def test_few_rows_matmul_rejects_more_rows():
    with pytest.raises(ValueError, match=f"1 to {FEW_ROWS} rows, got {FEW_ROWS + 1}"):
        few_rows_matmul(torch.zeros(FEW_ROWS + 1, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 4096 + 33])
def test_apply_token_bitmask(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(DEVICE, dtype)
    rows = torch.tensor([4, 1, 2], dtype=torch.int32, device=DEVICE)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, -(-vocab // 32)), generator=gen, dtype=torch.int32).to(DEVICE)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    out = logits.clone()
    apply_token_bitmask(out, bitmask, rows)
    assert torch.equal(out, expected)
    # The twin against the layout itself: bit t % 32 of word t // 32.
    words = bitmask.cpu().tolist()
    for i, row in enumerate(rows.tolist()):
        allowed = torch.tensor([(words[i][t // 32] >> (t % 32)) & 1 == 1 for t in range(vocab)])
        assert torch.equal(expected[row].cpu()[allowed], logits[row].cpu()[allowed])
        assert torch.all(expected[row].cpu()[~allowed] == float("-inf"))
    untouched = [r for r in range(6) if r not in rows.tolist()]
    assert torch.equal(expected[untouched], logits[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_ops_apply_token_bitmask_matches_the_twin(dtype):
    """The CPU path masks through xgrammar's kernel; the constrained rows come in any order, the others stay."""
    from pagellm.kernels.ops import TorchOps

    gen = torch.Generator().manual_seed(1)
    vocab = 4096 + 33
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    rows = torch.tensor([4, 1, 2], dtype=torch.int32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, -(-vocab // 32)), generator=gen, dtype=torch.int32)
    expected = logits.clone()
    reference.apply_token_bitmask(expected, bitmask, rows)
    out = logits.clone()
    TorchOps().apply_token_bitmask(out, bitmask, rows)
    assert torch.equal(out, expected)
    assert torch.equal(out[[0, 3, 5]], logits[[0, 3, 5]])
