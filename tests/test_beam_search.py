"""LLM.beam_search against beam search written out in plain torch over HF transformers' log-probabilities of the same
random-weight model: the same hypotheses in the same order, with the same cumulative log-probabilities, EOS
endings and length penalties included."""

from __future__ import annotations

import collections
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagellm import LLM, BeamSearchParams
from pagellm.errors import InvalidParameter

PROMPTS = [[3, 14, 15, 92], [65, 35]]
WIDTH = 5


def hf_beam_search(model, prompt, width, max_tokens, eos, length_penalty, candidates=None):
    """(generated tokens, cumulative log-probability, ended by EOS) of the best `width` hypotheses: each round
    extends every live beam by its 2 x width likeliest tokens and keeps the width likeliest extensions; hypotheses
    are ranked by log-probability / generated length (without the EOS) ** length_penalty. `candidates`, a Counter,
    counts the tokens the rounds considered."""
    live, done = [([], 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, total in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.double(), -1).topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                (done if token in eos else grown).append((tokens + [token], total + value))
                if candidates is not None:
                    candidates[token] += 1
        live = sorted(grown, key=lambda beam: beam[1], reverse=True)[:width]
    ranked = [(t, s, True) for t, s in done] + [(t, s, False) for t, s in live]
    ranked.sort(key=lambda b: b[1] / max(len(b[0]) - b[2], 1) ** length_penalty, reverse=True)
    return ranked[:width]


@pytest.fixture(scope="module")
def eos_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model, its EOS made the token that PROMPTS' searches consider most often: hypotheses end at
    several lengths."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    candidates = collections.Counter()
    for prompt in PROMPTS:
        hf_beam_search(hf, prompt, 3, 5, set(), 1.0, candidates)
    eos = candidates.most_common(1)[0][0]
    path = tmp_path_factory.mktemp("eos_model")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"eos_token_id": eos}))
    return path, hf, eos


@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 2.0])
def test_beam_search_finds_what_plain_beam_search_finds(eos_model_dir, length_penalty):
    path, hf, eos = eos_model_dir
    llm = LLM(str(path), device="cpu", dtype="float32", quiet=True)
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty))
    mixed = False
    for prompt, output in zip(PROMPTS, outputs):
        expected = hf_beam_search(hf, prompt, 3, 5, {eos}, length_penalty)
        got = [(s.tokens[len(prompt) :], s.cum_logprob, s.finish_reason == "stop") for s in output.sequences]
        assert [(t, e) for t, _, e in got] == [(t, e) for t, _, e in expected]
        assert [s for _, s, _ in got] == pytest.approx([s for _, s, _ in expected], abs=1e-4)
        assert all(
            s.tokens[: len(prompt)] == prompt and len(s.logprobs) == len(s.tokens) - len(prompt)
            for s in output.sequences
        )
        mixed |= any(e for _, _, e in got) and not all(e for _, _, e in got)
    if length_penalty == 0.5:  # hypotheses that EOS ended rank among full-length ones: how lengths count decides
        assert mixed
    assert llm.engine.stats().num_free_blocks == llm.engine.stats().num_blocks


def test_ignore_eos_keeps_every_beam_growing(eos_model_dir):
    path, hf, eos = eos_model_dir
    llm = LLM(str(path), device="cpu", dtype="float32", quiet=True)
    output = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))[0]
    expected = hf_beam_search(hf, PROMPTS[0], 2, 4, set(), 1.0)
    assert [s.tokens[len(PROMPTS[0]) :] for s in output.sequences] == [t for t, _, _ in expected]
    assert all(s.finish_reason == "length" for s in output.sequences)


def test_beams_stop_at_the_context_end(eos_model_dir):
    """Past max_model_len no beam can grow: what max_tokens=10 finds in a context of 8 is what 4 rounds find."""
    path, hf, eos = eos_model_dir
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=8, quiet=True)
    output = llm.beam_search(PROMPTS[:1], BeamSearchParams(beam_width=2, max_tokens=10, length_penalty=0.0))[0]
    expected = hf_beam_search(hf, PROMPTS[0], 2, 4, {eos}, 0.0)
    assert [(s.tokens[4:], s.finish_reason == "stop") for s in output.sequences] == [(t, e) for t, _, e in expected]
    assert all(len(s.tokens) <= 8 for s in output.sequences)


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=11, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    ],
)
def test_bad_beam_search_params_name_the_field(fields, field):
    with pytest.raises(InvalidParameter, match=f"^{field}="):
        BeamSearchParams(**fields)
