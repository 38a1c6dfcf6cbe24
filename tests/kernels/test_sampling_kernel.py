"""The Triton sampling kernel's law against the distribution each parameter specifies (as tests/test_sampler.py
does for the torch path). The interpreter is slow per row, so CPU runs draw fewer rows under wider bounds."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pagellm import SamplingParams
from pagellm.kernels import reference, sampling
from pagellm.kernels.sampling import argmax_rows, sample_rows
from pagellm.runner.sampler import scaled_and_masked

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N = 40_000 if DEVICE == "cuda" else 400
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def draw(params: SamplingParams, seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens as the sampler draws them: with min-p or top-k the masks need scaled logits, so the sampler scales
    them first; otherwise the kernel applies the temperature to the logits as they are (fp16 here)."""
    rows = N if seeds is None else seeds.numel()
    if params.min_p or params.top_k:
        logits, inv_temperature = scaled_and_masked(LOGITS.expand(rows, -1).clone(), [params] * rows), 1.0
    else:
        logits, inv_temperature = LOGITS.expand(rows, -1).half(), 1.0 / (params.temperature or 1.0)
    greedy = torch.full((rows,), int(params.greedy), dtype=torch.int32, device=DEVICE)
    top_p = torch.full((rows,), params.top_p, device=DEVICE)
    if seeds is None:
        seeds = torch.randint(0, 2**62, (rows,), generator=torch.Generator().manual_seed(0))
    inv_t = torch.full((rows,), inv_temperature, device=DEVICE)
    return sample_rows(logits.contiguous().to(DEVICE), inv_t, greedy, top_p, seeds.to(DEVICE)).cpu()


def assert_law(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=len(probs)).float() / len(tokens)
    tol = 4.5 * torch.sqrt(probs * (1 - probs) / len(tokens)) + 1e-9
    assert torch.all((freq - probs).abs() <= tol), (freq, probs)
    assert torch.all(freq[probs == 0] == 0), (freq, probs)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    keep = (probs.cumsum(0) - probs) < top_p  # LOGITS are sorted: the nucleus is a prefix
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(temperature):
    assert_law(draw(SamplingParams(temperature=temperature)), torch.softmax(LOGITS / temperature, 0))


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_keeps_the_smallest_nucleus(top_p):
    # 0.3: only the top token, reached after rejections; 0.95: most draws accepted at once.
    assert_law(draw(SamplingParams(top_p=top_p)), nucleus(torch.softmax(LOGITS, 0), top_p))


def test_min_p_then_top_k_then_top_p():
    probs = torch.softmax(LOGITS / 0.7, 0)
    probs = torch.where(probs >= 0.1 * probs.max(), probs, torch.zeros_like(probs))
    probs[5:] = 0
    assert_law(draw(SamplingParams(temperature=0.7, min_p=0.1, top_k=5, top_p=0.8)), nucleus(probs / probs.sum(), 0.8))


def test_greedy_rows_take_the_argmax():
    assert torch.all(draw(SamplingParams(temperature=0), torch.arange(16)) == 0)


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_draws_across_chunks(monkeypatch, top_p):
    """LOGITS scattered over a vocabulary of several kernel chunks, one chunk masked out entirely and the last one
    partial: the chunk-then-token draw and the nucleus passes follow the same law as in one chunk."""
    monkeypatch.setattr(sampling, "CHUNK", 16)
    spread = torch.tensor([0, 15, 16, 50, 51, 64, 70, 71])  # chunk 2 (tokens 32..47) holds none of them
    logits = torch.full((N, 72), float("-inf"))
    logits[:, spread] = LOGITS
    seeds = torch.randint(0, 2**62, (N,), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(N, device=DEVICE)
    tokens = sample_rows(
        logits.half().to(DEVICE), ones, torch.zeros(N, dtype=torch.int32, device=DEVICE), ones * top_p, seeds.to(DEVICE)
    ).cpu()
    assert torch.isin(tokens, spread).all()
    assert_law(torch.searchsorted(spread, tokens), nucleus(torch.softmax(LOGITS, 0), top_p))


def test_argmax_rows_match_torch(monkeypatch):
    """The greedy-only launch (first kernel, then no draw) over several chunks, one of them masked out entirely."""
    monkeypatch.setattr(sampling, "CHUNK", 16)
    gen = torch.Generator().manual_seed(2)
    logits = torch.stack([torch.randperm(72, generator=gen) for _ in range(6)]).half()  # distinct: no ties
    logits[0, 32:48] = float("-inf")
    logits[1, :64] = float("-inf")
    assert torch.equal(argmax_rows(logits.to(DEVICE)).cpu(), logits.float().argmax(dim=-1))


def test_seeds_reproduce_draws():
    seeds = torch.arange(64)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    first, again, other = draw(params, seeds), draw(params, seeds), draw(params, seeds + 1000)
    assert torch.equal(first, again) and not torch.equal(first, other)


@triton.jit(do_not_specialize=["offset"])  # the kernel passes a runtime round, never a constant
def _rand_kernel(seeds_ptr, out_ptr, offset):
    row = tl.program_id(0)
    tl.store(out_ptr + row, tl.rand(tl.load(seeds_ptr + row), offset))


@pytest.mark.parametrize("offset", [0, 1, 31])
def test_philox_twin_is_triton_rand(offset):
    seeds = torch.cat(
        [
            torch.tensor([0, 1, 2**32 - 1, 2**32, 2**62 - 1]),
            torch.randint(0, 2**62, (59,), generator=torch.Generator().manual_seed(offset)),
        ]
    )
    out = torch.empty(seeds.numel(), device=DEVICE)
    _rand_kernel[(seeds.numel(),)](seeds.to(DEVICE), out, offset)
    assert torch.equal(out.cpu(), torch.from_numpy(reference.philox_uniform(seeds.numpy(), offset)))


def test_kernel_draws_the_twins_tokens():
    """Same logits, temperatures, top-p and seeds: the kernel and its torch twin (the CPU sampler) pick the same
    token in every row, greedy rows, rejection rounds and several chunks included."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 64, 40
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[:8, 30:] = float("-inf")  # masked tokens (top-k, min-p) are never drawn
    inv_t = torch.rand(rows, generator=gen) + 0.5
    greedy = (torch.arange(rows) % 7 == 0).int()
    top_p = torch.where(torch.arange(rows) % 3 == 0, 1.0, torch.rand(rows, generator=gen) * 0.9 + 0.05)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen)
    twin = reference.sample_rows(logits, inv_t, greedy, top_p, seeds)
    sampling.CHUNK, chunk = 16, sampling.CHUNK  # several chunks: round 0 picks a chunk, then a token in it
    try:
        kernel = sample_rows(
            logits.to(DEVICE), inv_t.to(DEVICE), greedy.to(DEVICE), top_p.to(DEVICE), seeds.to(DEVICE)
        ).cpu()
    finally:
        sampling.CHUNK = chunk
    assert torch.equal(kernel, twin)
    assert (twin[:8] < 30).all() and torch.equal(twin[greedy == 1], logits.argmax(-1)[greedy == 1])
