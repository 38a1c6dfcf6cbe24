"""Triton: draw one token per row of logits, greedy or random with top-p, with no host sync.

One program per row streams the row: an online max and normalizer, then rounds of drawing. A draw is the argmax
of logit + Gumbel noise (a sample of softmax(logits)); with top_p < 1 a second pass keeps it when the mass of the
more likely tokens is below top_p (it is in the nucleus), which makes the kept draw an exact sample of the
renormalized nucleus. A rejected token bounds the nucleus from below, so later rounds draw only from tokens more
likely than it. Temperature is applied here, as a per-row scale on the loaded logits (any float dtype, so bf16
logits are read as they are); top-k and min-p, when asked for, are applied before (as -inf masks).

The noise is Philox, keyed by a per-row seed: the engine derives it from a request's own seed and its token count,
so seeded requests draw the same tokens whatever else is batched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
MAX_ROUNDS = 32  # each rejection raises the bound, so rounds are few; past this the top token is taken


@triton.jit
def _sample_kernel(logits_ptr, stride_l, inv_temperature_ptr, greedy_ptr, top_p_ptr, seeds_ptr, out_ptr, vocab,
                   MAX_ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row * stride_l
    inv_t = tl.load(inv_temperature_ptr + row)
    cols = tl.arange(0, BLOCK)
    # Pass 1: the row's max (and where, for greedy rows) and its softmax normalizer, online.
    m = tl.full([], float("-inf"), tl.float32)
    z = tl.zeros([], tl.float32)
    top = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32) * inv_t
        block_max = tl.max(x, axis=0)
        top = tl.where(block_max > m, start + tl.argmax(x, axis=0), top)
        m_new = tl.maximum(m, block_max)
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    token = top
    if tl.load(greedy_ptr + row) == 0:
        top_p = tl.load(top_p_ptr + row)
        seed = tl.load(seeds_ptr + row)
        lower = tl.full([], -1.0, tl.float32)  # candidates are the tokens with probability above this
        accepted = tl.zeros([], tl.int32)
        rounds = tl.zeros([], tl.int32)
        while (accepted == 0) & (rounds < MAX_ROUNDS):
            best_key = tl.full([], float("-inf"), tl.float32)
            draw = top
            for start in range(0, vocab, BLOCK):
                idx = start + cols
                x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
                p = tl.exp(x - m) / z
                u = tl.rand(seed, rounds * vocab + idx)
                key = tl.where((p > lower) & (x > float("-inf")), x - tl.log(-tl.log(u)), float("-inf"))
                block_best = tl.max(key, axis=0)
                draw = tl.where(block_best > best_key, start + tl.argmax(key, axis=0), draw)
                best_key = tl.maximum(best_key, block_best)
            p_draw = tl.exp(tl.load(base + draw).to(tl.float32) * inv_t - m) / z
            if top_p < 1.0:
                mass_above = tl.zeros([], tl.float32)
                for start in range(0, vocab, BLOCK):
                    x = tl.load(base + start + cols, mask=start + cols < vocab,
                                other=float("-inf")).to(tl.float32) * inv_t
                    p = tl.exp(x - m) / z
                    mass_above += tl.sum(tl.where(p > p_draw, p, 0.0), axis=0)
                accepted = (mass_above < top_p).to(tl.int32)
            else:
                accepted = 1
            token = tl.where(accepted == 1, draw, top)  # the top token is always in the nucleus
            lower = p_draw
            rounds += 1
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor) -> torch.Tensor:
    """Token ids [B] (int64) from logits [B, V] (masks applied) scaled by `inv_temperature` [B] (fp32): the argmax
    where `greedy`, else a top-p draw keyed by `seeds` [B] (int64)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](logits, logits.stride(0), inv_temperature, greedy, top_p, seeds, out, vocab,
                                MAX_ROUNDS=MAX_ROUNDS, BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
                                num_warps=16)
    return out
