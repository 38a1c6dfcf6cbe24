"""Batched sampling: logit bias, allowed tokens, bad words, penalties, min_tokens, temperature, top-k, top-p, min-p,
per-request seeds, logprobs.

`prepare(rows)` builds the per-row inputs (their host-to-device copies overlap the forward pass) and
`sample(logits, inputs)` only enqueues device work, so the engine can launch the next step before this one's tokens
are known. Every row is drawn by one algorithm, `ops.sample_rows`: the Triton kernel on CUDA and its torch twin
(`kernels/reference.py`) elsewhere, so CPU tests of the sampler test the kernel's law. A seeded request's noise is
keyed by its seed and the index of the token it draws, so its tokens do not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.core.step import SamplingRow
from pagellm.kernels.ops import Ops
from pagellm.runner.transfers import to_device_async
from pagellm.sampling_params import SamplingParams


@dataclass
class SamplingInputs:
    """What `sample` needs of N rows, prepared on the host and sent to the device."""

    rows: list[SamplingRow]
    want_logprobs: list[int | None]
    plain: bool  # temperature and top-p only: drawn from the model's logits as they are, temperature in the draw
    all_greedy: bool
    inv_temperature: torch.Tensor | None  # [N] fp32; 1 where the logits are scaled before the draw
    greedy: torch.Tensor | None  # [N] int32
    top_p: torch.Tensor | None  # [N] fp32
    seeds: torch.Tensor | None  # [N] int64


@dataclass
class ScoreTensors:
    """Logprob scores of N rows: chosen logprob [N], rank [N], top-N values and ids [N, max N]."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


@dataclass
class SampledTokens:
    """What `Sampler.sample` leaves on the device (or, copied, on the host)."""

    token_ids: torch.Tensor  # [N] int64
    scores: ScoreTensors | None  # when some row asked for logprobs
    want_logprobs: list[int | None]


def row_values(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One value per row, on the device."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


def request_seed(seed: int, draw_index: int) -> int:
    """The noise key of a seeded request's draw_index-th token (Python hashes ints the same in every process)."""
    return hash((seed, draw_index)) & (2**62 - 1)


class Sampler:
    def __init__(self, seed: int, device: torch.device, ops: Ops) -> None:
        self.device = device
        self.ops = ops
        self.seed_generator = torch.Generator().manual_seed(seed)  # the keys of unseeded rows

    def prepare(self, rows: list[SamplingRow]) -> SamplingInputs:
        params = [row.params for row in rows]
        plain = all(_temperature_and_top_p_only(p) for p in params)
        all_greedy = all(p.greedy for p in params)
        inputs = SamplingInputs(rows, [p.logprobs for p in params], plain, all_greedy, None, None, None, None)
        if not all_greedy:
            device = self.device
            # Outside the plain path the logits are divided by the temperature before the draw.
            inputs.inv_temperature = row_values(
                [1.0 if p.greedy or not plain else 1.0 / p.temperature for p in params], device
            )
            inputs.greedy = row_values([p.greedy for p in params], device, torch.int32)
            inputs.top_p = row_values([p.top_p for p in params], device)
            inputs.seeds = self._row_seeds(rows)
        return inputs

    def _row_seeds(self, rows: list[SamplingRow]) -> torch.Tensor:
        seeds = torch.randint(0, 2**62, (len(rows),), generator=self.seed_generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                seeds[i] = request_seed(row.params.seed, row.draw_index)
        return to_device_async(seeds, self.device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, inputs: SamplingInputs) -> SampledTokens:
        want = inputs.want_logprobs
        if inputs.plain:
            # The common case reads the model's logits as they are: no fp32 copy, temperature in the draw.
            return SampledTokens(self._draw(logits, inputs), None, want)
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want) else None
        logits = apply_logit_bias(logits, inputs.rows)
        logits = mask_disallowed_tokens(logits, inputs.rows)
        logits = apply_penalties(logits, inputs.rows)
        logits = mask_stop_tokens_before_min(logits, inputs.rows)
        if inputs.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = self._draw(scaled_and_masked(logits, [row.params for row in inputs.rows]), inputs)
        scores = None
        if raw_logprobs is not None:
            scores = score_tensors(raw_logprobs, token_ids, max(n or 0 for n in want))
        return SampledTokens(token_ids, scores, want)

    def _draw(self, logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
        logits = logits.contiguous()
        if inputs.all_greedy:
            return self.ops.argmax_rows(logits)
        return self.ops.sample_rows(logits, inputs.inv_temperature, inputs.greedy, inputs.top_p, inputs.seeds)


def _temperature_and_top_p_only(params: SamplingParams) -> bool:
    return (
        params.logprobs is None
        and not params.has_penalties
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and params.min_tokens == 0
        and params.min_p == 0
        and not params.top_k
    )


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (a new tensor: the model's stays as it was)."""
    row_ids, cols, biases = [], [], []
    for i, row in enumerate(rows):
        for token, bias in row.params.logit_bias.items():
            row_ids.append(i)
            cols.append(token)
            biases.append(bias)
    if not row_ids:
        return logits
    device = logits.device
    index = (row_values(row_ids, device, torch.int64), row_values(cols, device, torch.int64))
    return logits.index_put(index, row_values(biases, device), accumulate=True)


def mask_disallowed_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's allowed_token_ids (every other token -inf) and bad_words: the last token of a bad word's sequence is
    -inf where the tokens generated so far end with the rest of it (a one-token word is always banned)."""
    allowed_rows, allowed_cols, banned_rows, banned_cols = [], [], [], []
    for i, row in enumerate(rows):
        params = row.params
        if params.allowed_token_ids is not None:
            allowed_rows += [i] * len(params.allowed_token_ids)
            allowed_cols += params.allowed_token_ids
        output = row.output_token_ids
        for ids in params.bad_words_token_ids:
            prefix = ids[:-1]
            if not prefix or (len(output) >= len(prefix) and output[-len(prefix) :] == prefix):
                banned_rows.append(i)
                banned_cols.append(ids[-1])
    if not allowed_rows and not banned_rows:
        return logits
    device = logits.device
    if allowed_rows:
        restricted = sorted(set(allowed_rows))
        keep = torch.ones_like(logits, dtype=torch.bool)
        keep[row_values(restricted, device, torch.int64)] = False
        keep[row_values(allowed_rows, device, torch.int64), row_values(allowed_cols, device, torch.int64)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    if banned_rows:
        index = (row_values(banned_rows, device, torch.int64), row_values(banned_cols, device, torch.int64))
        logits = logits.index_put(index, torch.tensor(float("-inf"), device=device))
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI presence/frequency penalties on generated tokens; the repetition penalty (CTRL) on prompt and
    generated tokens: positive logits divided by it, negative ones multiplied."""
    params = [row.params for row in rows]
    if not any(p.has_penalties for p in params):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    counts = _token_counts([row.output_token_ids for row in rows], vocab, device)
    seen = counts > 0
    seen |= _token_counts([row.prompt_token_ids for row in rows], vocab, device) > 0
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


def mask_stop_tokens_before_min(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Until min_tokens are generated, EOS and stop_token_ids cannot be sampled."""
    row_ids, cols = [], []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            stops = p.all_stop_token_ids | set(p.stop_token_ids)
            row_ids += [i] * len(stops)
            cols += list(stops)
    if row_ids:
        logits = logits.clone()
        logits[torch.tensor(row_ids), torch.tensor(cols)] = float("-inf")
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


def score_tensors(logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> ScoreTensors:
    """Per row: the token's logprob, its rank (1 = most likely) and the row's top_n (values, ids)."""
    chosen = logprobs.gather(-1, token_ids[:, None])
    top_values, top_ids = logprobs.topk(max(top_n, 1), dim=-1)
    return ScoreTensors(chosen[:, 0], (logprobs > chosen).sum(dim=-1) + 1, top_values, top_ids)
