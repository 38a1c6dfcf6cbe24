"""Batched sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

`sample` only enqueues device work and returns device tensors (the runner copies them to the host behind an event
and waits for that alone), so the engine can launch the next step before this one's tokens are known. On CUDA one
Triton kernel draws every row (kernels/sampling.py); on the CPU the same law runs as torch ops. A seeded request's
noise is keyed by its seed and the index of the token it draws, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.runner.transfers import to_device_async, to_host_async
from pagellm.sampling_params import SamplingParams

# Top-p draws from the whole vocabulary and rejects tokens outside the nucleus up to this many times, then sorts.
NUCLEUS_ROUNDS = 3

# A scored token: (its logprob, its rank, the top-N [(token, logprob)] of its row).
TokenScore = tuple[float, int, list[tuple[int, float]]]


@dataclass
class SamplingBatch:
    """Per-row sampling inputs for N rows of logits."""

    params: list[SamplingParams]
    output_token_ids: list[list[int]]  # tokens generated so far (penalties, min_tokens)
    prompt_token_ids: list[list[int]]  # for the repetition penalty, which counts the prompt too
    draw_indices: list[int]  # which output token of its request each row draws (keys a seeded row's noise)


@dataclass
class ScoreTensors:
    """Device side of TokenScores: chosen logprob [N], rank [N], top-N values and ids [N, max N]."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


@dataclass
class SampledTokens:
    """What `Sampler.sample` leaves on the device."""

    token_ids: torch.Tensor  # [N] int64
    scores: ScoreTensors | None  # when some row asked for logprobs
    want_logprobs: list[int | None]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenScore | None]  # per row, when logprobs were asked for


def row_values(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One value per row, on the device."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def request_seed(seed: int, draw_index: int) -> int:
    """The noise key of a seeded request's draw_index-th token (Python hashes ints the same in every process)."""
    return hash((seed, draw_index)) & (2**62 - 1)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)  # torch path: unseeded rows' noise
        self.seed_generator = torch.Generator().manual_seed(seed)  # Triton path: unseeded rows' keys

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return to_host(self.sample(logits, batch))

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        want_logprobs = [p.logprobs for p in batch.params]
        if logits.is_cuda and all(_temperature_and_top_p_only(p) for p in batch.params):
            # The common case reads the model's logits as they are: no fp32 copy, temperature in the kernel.
            return SampledTokens(self._draw(logits, batch, scaled=False), None, want_logprobs)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        logits = apply_penalties(logits, batch)
        logits = mask_stop_tokens_before_min(logits, batch)
        token_ids = self._sample(logits, batch)
        scores = None
        if raw_logprobs is not None:
            scores = score_tensors(raw_logprobs, token_ids, max(n or 0 for n in want_logprobs))
        return SampledTokens(token_ids, scores, want_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        if all(p.greedy for p in params):  # decided on the host
            return logits.argmax(dim=-1)
        logits = scaled_and_masked(logits, params)
        if logits.is_cuda:
            return self._draw(logits, batch, scaled=True)
        greedy = row_values([p.greedy for p in params], logits.device, torch.bool)
        token_ids = logits.argmax(dim=-1)
        probs = torch.softmax(logits, dim=-1)
        generators = [None if p.seed is None else torch.Generator(device=logits.device).manual_seed(
            request_seed(p.seed, k)) for p, k in zip(params, batch.draw_indices)]
        if any(p.top_p < 1 for p in params):
            sampled = self._sample_nucleus(probs, params, generators)
        else:
            sampled = (probs / self._exponential_noise(probs, generators)).argmax(dim=-1)
        return torch.where(greedy, token_ids, sampled)

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, scaled: bool) -> torch.Tensor:
        """The Triton kernel's draw; `scaled`: temperature is already applied to the logits."""
        from pagellm.kernels.sampling import argmax_rows, sample_rows

        params = batch.params
        if all(p.greedy for p in params):
            return argmax_rows(logits.contiguous())
        device = logits.device
        inv_temperature = row_values([1.0 if scaled or p.greedy else 1.0 / p.temperature for p in params], device)
        greedy = row_values([p.greedy for p in params], device, torch.int32)
        top_p = row_values([p.top_p for p in params], device)
        return sample_rows(logits.contiguous(), inv_temperature, greedy, top_p, self._row_seeds(batch))

    def _row_seeds(self, batch: SamplingBatch) -> torch.Tensor:
        seeds = torch.randint(0, 2**62, (len(batch.params),), generator=self.seed_generator)
        for row, (p, k) in enumerate(zip(batch.params, batch.draw_indices)):
            if p.seed is not None:
                seeds[row] = request_seed(p.seed, k)
        return to_device_async(seeds, self.generator.device)

    def _sample_nucleus(self, probs: torch.Tensor, params: list[SamplingParams],
                        generators: list[torch.Generator | None]) -> torch.Tensor:
        """Top-p sampling by rejection, without sorting the vocabulary: draw from the whole distribution and keep
        the token when the mass of the tokens more likely than it is below top_p (it is in the nucleus).
        Conditioned on acceptance the draw follows the renormalized nucleus exactly. A rejected token bounds the
        nucleus from below, so the next round draws only from tokens more likely than it. Later rounds run on
        the rejected rows alone (a few percent of them; finding them costs a host sync), and rows still rejected
        after NUCLEUS_ROUNDS rounds take the sorting path."""
        top_p = row_values([p.top_p for p in params], probs.device)[:, None]
        sampled = (probs / self._exponential_noise(probs, generators)).argmax(dim=-1)
        draw = sampled
        rows = list(range(probs.shape[0]))  # the rows still being drawn, and their draws this round
        candidates = probs
        for round_ in range(NUCLEUS_ROUNDS):
            if round_:
                draw = (candidates / self._exponential_noise(candidates, [generators[r] for r in rows])).argmax(-1)
                sampled[rows] = draw
            p_draw = probs.gather(-1, draw[:, None])
            mass_above = torch.where(probs > p_draw, probs, 0.0).sum(dim=-1, keepdim=True)
            rejected = (mass_above >= top_p) & (top_p < 1)
            still = rejected[:, 0].nonzero()[:, 0]
            if not still.numel():
                return sampled
            rows = [rows[i] for i in still.tolist()]
            probs, top_p = probs[still], top_p[still]
            candidates = candidates[still].masked_fill(probs <= p_draw[still], 0.0)
        nucleus = nucleus_probs(probs, top_p)
        sampled[rows] = (nucleus / self._exponential_noise(nucleus, [generators[r] for r in rows])).argmax(dim=-1)
        return sampled

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        # A zero draw would turn a zero probability into 0/0 = NaN, which argmax takes for the maximum.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _temperature_and_top_p_only(params: SamplingParams) -> bool:
    return (params.logprobs is None and not params.has_penalties and params.min_tokens == 0 and params.min_p == 0
            and not params.top_k)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """OpenAI presence/frequency penalties on generated tokens; the repetition penalty (CTRL) on prompt and
    generated tokens: positive logits divided by it, negative ones multiplied."""
    params = batch.params
    if not any(p.has_penalties for p in params):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    counts = _token_counts(batch.output_token_ids, vocab, device)
    seen = counts > 0
    seen |= _token_counts(batch.prompt_token_ids, vocab, device) > 0
    rep = row_values([p.repetition_penalty for p in params], device)[:, None]
    pres = row_values([p.presence_penalty for p in params], device)[:, None]
    freq = row_values([p.frequency_penalty for p in params], device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(token_lists), vocab, device=device)
    for row, ids in enumerate(token_lists):
        if ids:
            counts[row].index_add_(0, torch.tensor(ids, device=device), torch.ones(len(ids), device=device))
    return counts


def mask_stop_tokens_before_min(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Until min_tokens are generated, EOS and stop_token_ids cannot be sampled."""
    rows, cols = [], []
    for row, (p, out) in enumerate(zip(batch.params, batch.output_token_ids)):
        if len(out) < p.min_tokens:
            stops = p.all_stop_token_ids | set(p.stop_token_ids)
            rows += [row] * len(stops)
            cols += list(stops)
    if rows:
        logits = logits.clone()
        logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def scaled_and_masked(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits / T, with -inf for the tokens below min_p times the top probability, then for all but the top-k.
    Top-p is left to the draw (vLLM's order: temperature, min-p, top-k, top-p). Greedy rows stay unscaled."""
    device = logits.device
    temperature = row_values([p.temperature or 1.0 for p in params], device)[:, None]
    logits = logits / temperature
    if any(p.min_p > 0 for p in params):
        # probs < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        min_p = row_values([p.min_p for p in params], device)[:, None]
        logits = logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + min_p.log(), float("-inf"))
    if any(p.top_k for p in params):
        logits = _apply_top_k(logits, params)
    return logits


def _apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's top_k logits (all of them where top_k = 0): a partial top-k, not a sort of the vocabulary."""
    vocab = logits.shape[-1]
    ks = [min(p.top_k or vocab, vocab) for p in params]
    top_k = row_values(ks, logits.device, torch.int64)[:, None]
    largest = logits.topk(max(ks), dim=-1).values
    kth = largest.gather(-1, top_k - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def nucleus_probs(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p nucleus of each row, renormalized: tokens in descending order are kept while the mass before
    them is below top_p (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p = 1 filters nothing, whatever the rounding of the cumulative sum.
    sorted_probs = sorted_probs.masked_fill((mass_before >= top_p) & (top_p < 1), 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def score_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> ScoreTensors:
    """Per row: the token's logprob, its rank (1 = most likely) and the row's top_n (values, ids)."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    top_values, top_ids = logprobs.topk(max(top_n, 1), dim=-1)
    return ScoreTensors(chosen[:, 0], (logprobs > chosen).sum(dim=-1) + 1, top_values, top_ids)


def scores_to_host(scores: ScoreTensors, top_ns: list[int]) -> list[TokenScore]:
    chosen, ranks = scores.chosen.tolist(), scores.ranks.tolist()
    top_values, top_ids = scores.top_values.tolist(), scores.top_ids.tolist()
    return [(chosen[r], ranks[r], list(zip(top_ids[r][:n], top_values[r][:n]))) for r, n in enumerate(top_ns)]


def scores_copy_to_host(scores: ScoreTensors) -> ScoreTensors:
    return ScoreTensors(to_host_async(scores.chosen), to_host_async(scores.ranks), to_host_async(scores.top_values),
                        to_host_async(scores.top_ids))


def copy_to_host(sampled: SampledTokens) -> SampledTokens:
    scores = None if sampled.scores is None else scores_copy_to_host(sampled.scores)
    return SampledTokens(to_host_async(sampled.token_ids), scores, sampled.want_logprobs)


def to_host(sampled: SampledTokens) -> SamplerOutput:
    """The sampled ids and logprobs as Python values (waits for the device if they are still there)."""
    want = sampled.want_logprobs
    if sampled.scores is None:
        return SamplerOutput(sampled.token_ids.tolist(), [None] * len(want))
    scores = scores_to_host(sampled.scores, [n or 0 for n in want])
    return SamplerOutput(sampled.token_ids.tolist(), [None if n is None else sc for n, sc in zip(want, scores)])
