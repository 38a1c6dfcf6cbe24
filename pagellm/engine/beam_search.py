"""Beam search over the engine (vLLM's `LLM.beam_search`): each round asks every live beam for one greedy token
with the log-probabilities of its 2 x beam_width likeliest next tokens, extends each beam by each of them, and keeps
the beam_width likeliest extensions of each prompt; an extension ending in EOS is a finished hypothesis. A round's
prompts extend the round before's, so prefix caching recomputes only the tokens past their last full block. After
max_tokens rounds (or when no beam is left) the finished hypotheses and the live beams are ranked by their
cumulative log-probability over generated_length ** length_penalty (the EOS not counted), as in HF transformers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

from pagellm.errors import invalid_value
from pagellm.outputs import Logprob, RequestOutput
from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each round asks for 2 x beam_width log-probabilities


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0  # > 0 favours longer hypotheses, < 0 shorter ones

    def __post_init__(self) -> None:
        checks = [
            (
                "beam_width",
                isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
                f"an integer in [1, {MAX_BEAM_WIDTH}]",
            ),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            (
                "length_penalty",
                isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty),
                "a finite number",
            ),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise invalid_value(name, getattr(self, name), allowed)


@dataclass
class BeamSearchSequence:
    """One hypothesis: the prompt's tokens and the generated ones, each generated token's log-probabilities (the
    token's own and the other candidates of its round), their sum, and the text of the generated tokens."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    text: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best first, at most beam_width


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    generate: Callable[[list[list[int]], SamplingParams], list[RequestOutput]],
    eos_token_ids: frozenset[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
) -> list[BeamSearchOutput]:
    """`search_rounds` run by `generate(prompts, params)` (LLM.generate), one round at a time."""
    rounds = search_rounds(prompts, params, eos_token_ids, max_model_len, decode)
    try:
        asked = next(rounds)
        while True:
            asked = rounds.send(generate(asked, round_params(params)))
    except StopIteration as finished:
        return finished.value


def round_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam of a round asks for: one greedy token and the 2 x beam_width likeliest next tokens."""
    return SamplingParams(temperature=0, max_tokens=1, logprobs=2 * params.beam_width, ignore_eos=True)


def search_rounds(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
) -> Generator[list[list[int]], list[RequestOutput], list[BeamSearchOutput]]:
    """The search, whoever runs it: yields each round's prompts (token ids), takes back their finished outputs
    under `round_params`, and returns the best hypotheses of each prompt (validated token ids, each shorter than
    max_model_len); `decode` turns generated tokens into text."""
    width = params.beam_width
    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        for beams, finished in zip(live, done):  # a beam at the context's end can grow no more
            finished += [_ended(b, "length") for b in beams if len(b.tokens) >= max_model_len]
            beams[:] = [b for b in beams if len(b.tokens) < max_model_len]
        asked = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not asked:
            break
        outputs = yield [beam.tokens for _, beam in asked]
        extensions: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), output in zip(asked, outputs, strict=True):
            candidates = output.outputs[0].logprobs[0]
            for token, logprob in candidates.items():
                grown = BeamSearchSequence(
                    beam.tokens + [token], beam.logprobs + [candidates], beam.cum_logprob + logprob.logprob
                )
                if token in eos_token_ids and not params.ignore_eos:
                    done[i].append(_ended(grown, "stop"))
                else:
                    extensions[i].append(grown)
        # Every extension of a round has the same length, so the likeliest are also the best scored.
        live = [sorted(grown, key=lambda b: b.cum_logprob, reverse=True)[:width] for grown in extensions]
    results = []
    for prompt, beams, finished in zip(prompts, live, done):
        ranked = finished + [_ended(b, "length") for b in beams]
        ranked.sort(key=lambda b: _score(b, len(prompt), params.length_penalty), reverse=True)
        for beam in ranked[:width]:
            beam.text = decode(beam.tokens[len(prompt) :]) if decode is not None else None
        results.append(BeamSearchOutput(ranked[:width]))
    return results


def _ended(beam: BeamSearchSequence, reason: str) -> BeamSearchSequence:
    beam.finish_reason = reason
    return beam


def _score(beam: BeamSearchSequence, prompt_len: int, length_penalty: float) -> float:
    generated = len(beam.tokens) - prompt_len - (beam.finish_reason == "stop")  # an ending EOS is not counted
    return beam.cum_logprob / max(generated, 1) ** length_penalty
