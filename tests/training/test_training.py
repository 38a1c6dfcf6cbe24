"""Model preparation: the reader on every published layout, a tiny Llama that learns, exact resume, and an
export that HF transformers and pagellm both load with identical greedy tokens."""

from __future__ import annotations

import pytest
import torch

from pagellm.training.corpus import generate_stories, write_corpus
from pagellm.training.data import PackedStream, read_stories
from pagellm.training.train import TrainConfig, Trainer

STORIES = generate_stories(400, seed=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "TinyStories-train.txt", STORIES)


@pytest.mark.parametrize("name", ["TinyStories-train.txt", "data.jsonl", "data00.json", "train.parquet"])
def test_reader_every_layout(tmp_path, name):
    path = write_corpus(tmp_path / name, STORIES[:150])
    assert list(read_stories(path)) == STORIES[:150]
    assert list(read_stories(tmp_path)) == STORIES[:150]  # a directory of such files


def test_txt_reader_streams_across_chunk_boundaries(tmp_path, monkeypatch):
    import pagellm.training.data as data

    monkeypatch.setattr(data, "_READ_CHUNK", 37)  # separators and stories split across reads
    path = write_corpus(tmp_path / "t.txt", STORIES[:30])
    assert list(read_stories(path)) == STORIES[:30]


def test_packed_stream_resumes_exactly(corpus):
    encode = lambda s: [ord(c) for c in s]  # noqa: E731
    full = PackedStream(corpus, encode, 0, 64, "train", 20)
    rows = [full.next_row() for _ in range(4000)]  # several epochs
    half = PackedStream(corpus, encode, 0, 64, "train", 20)
    first = [half.next_row() for _ in range(1900)]
    resumed = PackedStream(corpus, encode, 0, 64, "train", 20, PackedStream.state_from_dict(half.state_dict()))
    assert first + [resumed.next_row() for _ in range(2100)] == rows
    assert full.state.epoch >= 2


def config(corpus, out, **kw) -> TrainConfig:
    base = dict(
        data=str(corpus),
        output=str(out),
        preset="tiny",
        max_steps=300,
        batch_size=16,
        lr=3e-3,
        warmup_steps=20,
        eval_every=100,
        save_every=100,
        eval_batches=4,
        vocab_size=512,
        device="cpu",
        quiet=True,
    )
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("tiny")
    history = Trainer(config(corpus, out)).train()
    return out, history


def test_tiny_model_learns(trained):
    out, history = trained
    first, last = history["val"][0][1], history["val"][-1][1]
    assert last < 0.5 * first, (first, last)
    assert (out / "loss.png").exists() and (out / "checkpoint.pt").exists()


def test_resume_continues_the_same_curve(corpus, tmp_path):
    cfg = dict(max_steps=60, save_every=100, eval_every=20)
    straight = Trainer(config(corpus, tmp_path / "a", **cfg)).train()
    Trainer(config(corpus, tmp_path / "b", **cfg)).train(until=30)  # interrupted after step 30
    resumed = Trainer(config(corpus, tmp_path / "b", **cfg), resume=True).train()
    assert resumed["train"] == straight["train"]
    assert resumed["val"] == straight["val"]


def test_export_loads_in_hf_and_pagellm_with_identical_greedy_tokens(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagellm import LLM, SamplingParams

    out, _ = trained
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    llm = LLM(str(out), device="cpu", dtype="float32", quiet=True)
    prompts = ["Once upon a time, there was a", "One day, Lily went to the", "Tom had a"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    for prompt, out_ in zip(prompts, outs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out_.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        ref_tokens = ref[0, ids.shape[1] :].tolist()
        got = out_.outputs[0].token_ids
        assert got == ref_tokens[: len(got)]  # both stop at EOS
        assert len(got) == len(ref_tokens)
    assert "named" in outs[0].outputs[0].text or "." in outs[0].outputs[0].text


def test_convert_checkpoint_cli(trained, tmp_path):
    from pagellm.cli import main

    assert main(["convert", "--checkpoint", str(trained[0]), "--output", str(tmp_path / "hf")]) == 0
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
