"""Structured outputs: output tokens/s of a batch of JSON-schema requests against the same batch unconstrained
(the same prompts and the same output lengths), grammar compile time per schema, and the per-step bitmask fill
time. Each batch runs --repeats times, interleaved with the others; the medians are reported.

    python benchmarks/structured.py                              # CPU: SmolLM2 (the embedded model), batch 16
    python benchmarks/structured.py --model DIR --load-format dummy --batch 64 --device cuda --dtype bfloat16

DIR needs a tokenizer (grammars are compiled against its vocabulary): on the GPU, SmolLM2's config and tokenizer
with dummy weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from pagellm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

LABEL = {"type": "string", "maxLength": 12}
SCHEMA = {  # long outputs: a list of up to 40 records
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "label": LABEL},
                "required": ["id", "label"],
            },
            "maxItems": 40,
        }
    },
    "required": ["items"],
}
COMPILE_SCHEMAS = {
    "records (above)": SCHEMA,
    "flat object": {"type": "object", "properties": {"a": LABEL, "b": {"type": "integer"}}, "required": ["a", "b"]},
    "enum": {"enum": ["red", "green", "blue"]},
    "nested $defs": {
        "$defs": {"node": {"type": "object", "properties": {"name": LABEL, "child": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    },
    "pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
}


def _is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def timed_fills() -> list[float]:
    """Records the seconds of every bitmask fill (xgrammar's batch fill, on the engine's fill thread) from now on."""
    import xgrammar

    times: list[float] = []
    original = xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def fill(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        times.append(time.perf_counter() - start)
        return out

    xgrammar.BatchGrammarMatcher.batch_fill_next_token_bitmask = fill
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each batch, interleaved; medians reported")
    parser.add_argument("--name", default="structured")
    args = parser.parse_args()

    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, quiet=True)
    compiler = llm.engine.input_processor.grammar_compiler
    compiler.compile(StructuredOutputsParams(regex="a"))  # builds the compiler: reads the vocabulary once
    compile_ms = {}
    for name, schema in COMPILE_SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        compile_ms[name] = 1e3 * (time.perf_counter() - start)

    messages = [
        [{"role": "user", "content": f"List {i % 7 + 3} things in a room as JSON records."}] for i in range(args.batch)
    ]
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
        for i in range(args.batch)
    ]
    llm.chat(messages[:2], constrained[:2], use_tqdm=False)  # warm-up
    fills = timed_fills()
    outs = llm.chat(messages, constrained, use_tqdm=False)
    fill_ms = 1e3 * statistics.median(fills)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = sum(_is_valid(o.outputs[0].text) for o in outs)
    # The same prompts, each run to its constrained run's length, unconstrained; and half of them constrained,
    # half not (what the unconstrained rows of a mixed batch pay). Each run seeds its samples alike, so the
    # constrained runs repeat the first one's lengths.
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    half = args.batch // 2
    runs = {"constrained": constrained, "unconstrained": free, "half constrained": constrained[:half] + free[half:]}
    llm.chat(messages[:2], free[:2], use_tqdm=False)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved, so that a slow stretch of the machine hits every kind alike
        for name, params in runs.items():
            start = time.perf_counter()
            done = llm.chat(messages, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            if name == "half constrained":
                mixed_tokens = sum(len(o.outputs[0].token_ids) for o in done)
    constrained_s, free_s, mixed_s = (statistics.median(seconds[name]) for name in runs)

    generated = sum(lengths)
    row = {
        "batch": args.batch,
        "output tokens": generated,
        "schema-valid (the rest cut by max_tokens)": f"{valid}/{args.batch}",
        "unconstrained tok/s": generated / free_s,
        "constrained tok/s": generated / constrained_s,
        "ratio": free_s / constrained_s,
        "half constrained tok/s": mixed_tokens / mixed_s,
        "bitmask fill ms/step (median)": fill_ms,
    }
    table = markdown_table([row], list(row))
    table += "\n\nGrammar compile (first time, uncached), ms:\n\n" + markdown_table(
        [{k: round(v, 2) for k, v in compile_ms.items()}], list(compile_ms)
    )
    payload = {
        "environment": environment() | {"model": args.model or "SmolLM2-135M-Instruct (embedded)"},
        "args": vars(args),
        "result": row,
        "compile_ms": compile_ms,
        "seconds": seconds,
    }
    path = write_results(f"{args.name}-{args.device}", payload, table)
    print(table)
    print(f"wrote {path}")
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
