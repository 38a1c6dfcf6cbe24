"""Structured outputs' bitmask fill on the host: xgrammar's matchers one at a time (what StructuredOutputs does
below BATCH_FILL_ROWS rows) against its BatchGrammarMatcher on 2, 4 and 8 threads, at several batch sizes. The
matchers walk the benchmark schema of structured.py by random allowed tokens (restarting when one finishes), so
their states are as varied as a batch's.

    python benchmarks/bitmask_fill.py --model DIR      # DIR: a tokenizer (SmolLM2's on the GPU host)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import xgrammar
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from benchmarks.structured import SCHEMA  # noqa: E402
from pagellm.engine.structured_outputs import MAX_WHITESPACE  # noqa: E402

THREADS = (2, 4, 8)


def fill_ms(grammar: xgrammar.CompiledGrammar, batch: int, vocab: int, steps: int, gen: torch.Generator) -> dict:
    matchers = [xgrammar.GrammarMatcher(grammar) for _ in range(batch)]
    bitmask = xgrammar.allocate_token_bitmask(batch, vocab)
    batched = {k: xgrammar.BatchGrammarMatcher(max_threads=k) for k in THREADS}
    seconds = dict.fromkeys(["one at a time", *(f"{k} threads" for k in THREADS)], 0.0)
    bits = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        matchers = [m if not m.is_terminated() else xgrammar.GrammarMatcher(grammar) for m in matchers]
        start = time.perf_counter()
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        seconds["one at a time"] += time.perf_counter() - start
        for k, batch_matcher in batched.items():
            start = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            seconds[f"{k} threads"] += time.perf_counter() - start
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].float()
        for matcher, token in zip(matchers, torch.multinomial(allowed, 1, generator=gen).flatten().tolist()):
            matcher.accept_token(token)
    return {"batch": batch, **{k: 1e3 * v / steps for k, v in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a directory with the tokenizer")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab = len(tokenizer)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    grammar = xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE
    )
    gen = torch.Generator().manual_seed(0)
    rows = [fill_ms(grammar, batch, vocab, args.steps, gen) for batch in args.batches]
    table = "ms per step:\n\n" + markdown_table(rows, list(rows[0]))
    payload = {"environment": environment() | {"cpu_count": os.cpu_count()}, "args": vars(args), "rows": rows}
    path = write_results("bitmask-fill", payload, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
