"""Triton: draw one token per row of logits, greedy or random with top-p, with no host sync.

Two kernels. The first, grid (row, chunk), reduces each CHUNK of a row to its max, where the max is, and its
softmax normalizer relative to that max. The second, one program per row, combines them into the row's max and
normalizer and draws by inverse transform: one uniform u per round, and the token where the running probability
mass, in vocabulary order, first exceeds u. Round 0 knows each chunk's mass from the first kernel, so it reads a
single chunk. One uniform per draw, where a Gumbel-max draw needs one per token: per-token Philox made the kernel
compute-bound (results/kernels-2026-12-02).

With top_p < 1 a pass over the row keeps the draw when the mass of the more likely tokens is below top_p (it is in
the nucleus), which makes the kept draw an exact sample of the renormalized nucleus. A rejected token bounds the
nucleus from below, so later rounds draw only from the tokens more likely than it, whose mass that pass measured.
Temperature is applied here, as a per-row scale on the loaded logits (any float dtype, so bf16 logits are read as
they are); top-k and min-p, when asked for, are applied before (as -inf masks).

The uniforms are Philox, keyed by a per-row seed: the engine derives it from a request's own seed and its token
count, so seeded requests draw the same tokens whatever else is batched (the chunking depends on the vocabulary
alone). `reference.sample_rows` is the twin: the same algorithm and the same uniforms in torch, the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.pdl import launch_early, wait_for_inputs
from pagellm.kernels.reference import SAMPLE_MAX_ROUNDS as MAX_ROUNDS

CHUNK = 8192  # vocabulary entries per program of the first kernel


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,
    stride_l,
    inv_temperature_ptr,
    max_ptr,
    norm_ptr,
    argmax_ptr,
    vocab,
    num_chunks,
    CHUNK: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_l + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    if not ALL_GREEDY:
        x = x * tl.load(inv_temperature_ptr + row)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk masked out entirely has no mass, not NaN
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, m)
    tl.store(norm_ptr + out, tl.sum(tl.exp(x - m_safe), axis=0))
    tl.store(argmax_ptr + out, chunk * CHUNK + tl.argmax(x, axis=0))


@triton.jit
def _entry(values, chunks, k):
    """values[k] of a per-chunk vector (k a runtime index)."""
    return tl.sum(tl.where(chunks == k, values, 0), axis=0)


@triton.jit
def _probs(base, idx, hi, inv_t, m, inv_z, lower):
    """Probabilities of the tokens idx (zero at or past hi, and for tokens not above `lower`)."""
    x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32) * inv_t
    p = tl.exp(x - m) * inv_z
    return tl.where(p > lower, p, 0.0)


@triton.jit
def _inverse_transform(base, lo, hi, inv_t, m, inv_z, lower, mass_before, target, fallback, BLOCK: tl.constexpr):
    """The first token in lo..hi where the mass of the tokens above `lower`, counted from `mass_before`, exceeds
    `target`; `fallback` if rounding leaves it short. Stops at the block that holds it."""
    cols = tl.arange(0, BLOCK)
    token = fallback + tl.zeros([], tl.int32)
    cum = mass_before + tl.zeros([], tl.float32)
    found = tl.zeros([], tl.int32)
    start = lo + tl.zeros([], tl.int32)
    while (found == 0) & (start < hi):
        c = tl.cumsum(_probs(base, start + cols, hi, inv_t, m, inv_z, lower), axis=0) + cum
        before = tl.sum((c <= target).to(tl.int32), axis=0)  # the first c > target: a token of nonzero mass
        found = (before < BLOCK).to(tl.int32)
        token = tl.where(before < BLOCK, start + before, token)
        cum = tl.max(c, axis=0)
        start += BLOCK
    return token


@triton.jit
def _mass_above(base, vocab, inv_t, m, inv_z, threshold, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mass = tl.zeros([], tl.float32)
    for start in range(0, vocab, BLOCK):
        mass += tl.sum(_probs(base, start + cols, vocab, inv_t, m, inv_z, threshold), axis=0)
    return mass


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_l,
    inv_temperature_ptr,
    greedy_ptr,
    top_p_ptr,
    seeds_ptr,
    max_ptr,
    norm_ptr,
    argmax_ptr,
    out_ptr,
    vocab,
    num_chunks,
    MAX_ROUNDS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ALL_GREEDY: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    c_mask = chunks < num_chunks
    stats = row * num_chunks + chunks
    m_c = tl.load(max_ptr + stats, mask=c_mask, other=float("-inf"))
    chunk_top = tl.load(argmax_ptr + stats, mask=c_mask, other=0)
    m = tl.max(m_c, axis=0)
    top = _entry(chunk_top, chunks, tl.argmax(m_c, axis=0))
    token = top
    if not ALL_GREEDY:
        if tl.load(greedy_ptr + row) == 0:
            weight = tl.load(norm_ptr + stats, mask=c_mask, other=0.0) * tl.exp(m_c - m)
            token = _draw(
                logits_ptr + row * stride_l,
                vocab,
                tl.load(inv_temperature_ptr + row),
                tl.load(top_p_ptr + row),
                tl.load(seeds_ptr + row),
                m,
                top,
                weight,
                chunk_top,
                chunks,
                num_chunks,
                MAX_ROUNDS,
                CHUNK,
            )
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _draw(
    base,
    vocab,
    inv_t,
    top_p,
    seed,
    m,
    top,
    weight,
    chunk_top,
    chunks,
    num_chunks,
    MAX_ROUNDS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """A top-p draw from one row; `weight`, `chunk_top`: each chunk's normalizer (relative to the row's max `m`)
    and argmax."""
    inv_z = 1.0 / tl.sum(weight, axis=0)
    weight = weight * inv_z  # each chunk's probability mass
    rounds = tl.zeros([], tl.int32)
    lower = tl.full([], -1.0, tl.float32)  # candidates are the tokens with probability above this
    # Round 0: the chunk where the mass first exceeds u, then the token inside it.
    u = tl.rand(seed, rounds)
    cum_weight = tl.cumsum(weight, axis=0)
    k = tl.sum((cum_weight <= u).to(tl.int32), axis=0)
    k = tl.where(k < num_chunks, k, tl.max(tl.where(weight > 0, chunks, 0), axis=0))  # rounding at the end
    chunk_start = k * CHUNK
    draw = _inverse_transform(
        base,
        chunk_start,
        tl.minimum(chunk_start + CHUNK, vocab),
        inv_t,
        m,
        inv_z,
        lower,
        _entry(cum_weight - weight, chunks, k),
        u,
        _entry(chunk_top, chunks, k),
        CHUNK,
    )
    mass = tl.full([], 1.0, tl.float32)  # of the candidates
    token = top
    accepted = tl.zeros([], tl.int32)
    while (accepted == 0) & (rounds < MAX_ROUNDS):
        if rounds > 0:  # draw again among the tokens more likely than the last rejected one
            draw = _inverse_transform(
                base, 0, vocab, inv_t, m, inv_z, lower, 0.0, tl.rand(seed, rounds) * mass, top, CHUNK
            )
        p_draw = tl.exp(tl.load(base + draw).to(tl.float32) * inv_t - m) * inv_z
        accepted = 1
        if (top_p < 1.0) & (draw != top):  # the top token is always in the nucleus
            mass_above = _mass_above(base, vocab, inv_t, m, inv_z, p_draw, CHUNK)
            accepted = (mass_above < top_p).to(tl.int32)
            lower = p_draw
            mass = mass_above
        token = tl.where(accepted == 1, draw, top)
        rounds += 1
    return token


def sample_rows(
    logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """Token ids [B] (int64) from logits [B, V] (masks applied) scaled by `inv_temperature` [B] (fp32): the argmax
    where `greedy`, else a top-p draw keyed by `seeds` [B] (int64)."""
    return _launch(logits, (inv_temperature, greedy, top_p, seeds))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [B] (int64, the first on ties), spread over the GPU: torch's argmax reduces a short batch
    of long rows on few SMs (results/kernels-2026-12-02)."""
    return _launch(logits, None)


def _launch(logits: torch.Tensor, row_params: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    chunk = min(CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_norm = torch.empty_like(chunk_max)
    chunk_argmax = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    all_greedy = row_params is None
    inv_temperature, greedy, top_p, seeds = (logits,) * 4 if all_greedy else row_params  # unread when all greedy
    pdl = launch_early(logits, rows)
    _chunk_stats_kernel[(rows, num_chunks)](
        logits,
        logits.stride(0),
        inv_temperature,
        chunk_max,
        chunk_norm,
        chunk_argmax,
        vocab,
        num_chunks,
        CHUNK=chunk,
        ALL_GREEDY=all_greedy,
        PDL=pdl,
        num_warps=8,
        launch_pdl=pdl,
    )
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        inv_temperature,
        greedy,
        top_p,
        seeds,
        chunk_max,
        chunk_norm,
        chunk_argmax,
        out,
        vocab,
        num_chunks,
        MAX_ROUNDS=MAX_ROUNDS,
        CHUNK=chunk,
        BLOCK_C=triton.next_power_of_2(num_chunks),
        ALL_GREEDY=all_greedy,
        PDL=pdl,
        num_warps=16,
        launch_pdl=pdl,
    )
    return out
