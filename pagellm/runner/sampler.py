"""Batched sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Everything runs on the logits' device; the only host transfer is the final one of sampled ids and logprobs.
A seeded request draws its noise from its own generator, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    generators: list[torch.Generator | None]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenScore | None]  # per row, when logprobs were asked for


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        want_logprobs = [p.logprobs for p in batch.params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        logits = apply_penalties(logits, batch)
        logits = mask_stop_tokens_before_min(logits, batch)
        token_ids = self._sample(logits, batch)
        logprobs = gather_logprobs(raw_logprobs, token_ids, want_logprobs)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)
        params = batch.params
        if all(p.greedy for p in params):  # decided on the host: no device sync
            return token_ids
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        probs = filtered_probs(logits, params)
        if any(p.top_p < 1 for p in params):
            sampled = self._sample_nucleus(probs, params, batch.generators)
        else:
            sampled = (probs / self._exponential_noise(probs, batch.generators)).argmax(dim=-1)
        return torch.where(greedy, token_ids, sampled)

    def _sample_nucleus(self, probs: torch.Tensor, params: list[SamplingParams],
                        generators: list[torch.Generator | None]) -> torch.Tensor:
        """Top-p sampling by rejection, without sorting the vocabulary: draw from the whole distribution and keep
        the token when the mass of the tokens more likely than it is below top_p (it is in the nucleus).
        Conditioned on acceptance the draw follows the renormalized nucleus exactly. A rejected token bounds the
        nucleus from below, so the next round draws only from tokens more likely than it. Later rounds run on
        the rejected rows alone (a few percent of them; finding them costs a host sync), and rows still rejected
        after NUCLEUS_ROUNDS rounds take the sorting path."""
        top_p = torch.tensor([p.top_p for p in params], device=probs.device)[:, None]
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


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """OpenAI presence/frequency penalties on generated tokens; the repetition penalty (CTRL) on prompt and
    generated tokens: positive logits divided by it, negative ones multiplied."""
    params = batch.params
    if all(p.repetition_penalty == 1 and p.presence_penalty == 0 and p.frequency_penalty == 0 for p in params):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    counts = _token_counts(batch.output_token_ids, vocab, device)
    seen = counts > 0
    seen |= _token_counts(batch.prompt_token_ids, vocab, device) > 0
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
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


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax(logits / T) without the tokens below min_p times the top probability, then only the top-k;
    renormalized. Top-p is left to the draw (vLLM's order: temperature, min-p, top-k, top-p)."""
    device = logits.device
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)[:, None]
    logits = logits / temperature
    if any(p.min_p > 0 for p in params):
        # probs < min_p * max_prob  <=>  logit < max_logit + log(min_p)
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        logits = logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + min_p.log(), float("-inf"))
    if any(p.top_k for p in params):
        logits = _apply_top_k(logits, params)
    return torch.softmax(logits, dim=-1)


def _apply_top_k(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep each row's top_k logits (all of them where top_k = 0): a partial top-k, not a sort of the vocabulary."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)[:, None]
    largest = logits.topk(int(top_k.max()), dim=-1).values
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


def gather_logprobs(raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor,
                    want: list[int | None]) -> list[TokenScore | None]:
    if raw_logprobs is None:
        return [None] * len(want)
    scores = score_tokens(raw_logprobs, token_ids, [n or 0 for n in want])
    return [None if n is None else score for n, score in zip(want, scores)]


def score_tokens(logprobs: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]) -> list[TokenScore]:
    """For each row: the token's logprob, its rank (1 = most likely) and the row's top-N (token, logprob)."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(max(max(top_ns), 1), dim=-1)
    chosen, top_vals, top_ids = chosen[:, 0].tolist(), top_vals.tolist(), top_ids.tolist()
    return [(chosen[r], ranks[r], list(zip(top_ids[r][:n], top_vals[r][:n]))) for r, n in enumerate(top_ns)]
