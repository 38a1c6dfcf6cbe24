"""Batched sampling: penalties, min_tokens, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Everything runs on the logits' device; the only host transfer is the final one of sampled ids and logprobs.
A seeded request draws its noise from its own generator, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.sampling_params import SamplingParams

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
        if all(p.greedy for p in batch.params):  # decided on the host: no device sync
            return token_ids
        greedy = torch.tensor([p.greedy for p in batch.params], device=logits.device)
        probs = filtered_probs(logits, batch.params)
        noise = self._exponential_noise(probs, batch.generators)
        sampled = (probs / noise).argmax(dim=-1)  # exponential race: same law as torch.multinomial
        return torch.where(greedy, token_ids, sampled)

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        return noise


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
    """softmax(logits / T), keeping the top-k, then the top-p nucleus of what remains, then tokens with at
    least min_p times the top probability; renormalized."""
    device = logits.device
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)[:, None]
    logits = logits / temperature
    if any(p.top_k or p.top_p < 1 for p in params):
        logits = _apply_top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None]
    top_k = torch.tensor([p.top_k if p.top_k else vocab for p in params], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # The top token always stays (its mass_before is 0); top_p = 1 filters nothing, whatever the rounding.
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p) & (top_p < 1), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


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
