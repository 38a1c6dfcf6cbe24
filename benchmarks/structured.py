"""Structured outputs: output tokens/s of a batch of JSON-schema requests against the same batch unconstrained
(the same prompts and the same output lengths), grammar compile time per schema, and the per-step bitmask time.

    python benchmarks/structured.py                              # CPU: SmolLM2 (the embedded model), batch 16
    python benchmarks/structured.py --model DIR --load-format dummy --batch 64 --device cuda --dtype bfloat16

DIR needs a tokenizer (grammars are compiled against its vocabulary): on the GPU, SmolLM2's config and tokenizer
with dummy weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from pagellm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagellm.engine.structured_outputs import StructuredOutputs  # noqa: E402

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


def timed_bitmasks() -> list[float]:
    """Records the seconds of every StructuredOutputs.bitmask call from now on."""
    times: list[float] = []
    original = StructuredOutputs.bitmask

    def bitmask(self, step, vocab_size):
        start = time.perf_counter()
        out = original(self, step, vocab_size)
        if out is not None:
            times.append(time.perf_counter() - start)
        return out

    StructuredOutputs.bitmask = bitmask
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
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
    masks = timed_bitmasks()
    start = time.perf_counter()
    outs = llm.chat(messages, constrained, use_tqdm=False)
    constrained_s = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = sum(_is_valid(o.outputs[0].text) for o in outs)
    # The same prompts, each run to its constrained run's length, unconstrained.
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    llm.chat(messages[:2], free[:2], use_tqdm=False)
    start = time.perf_counter()
    llm.chat(messages, free, use_tqdm=False)
    free_s = time.perf_counter() - start
    # Half of them constrained, half not: what the unconstrained rows of a mixed batch pay.
    half = args.batch // 2
    start = time.perf_counter()
    mixed = llm.chat(messages, constrained[:half] + free[half:], use_tqdm=False)
    mixed_s = time.perf_counter() - start
    mixed_tokens = sum(len(o.outputs[0].token_ids) for o in mixed)

    generated = sum(lengths)
    row = {
        "batch": args.batch,
        "output tokens": generated,
        "schema-valid (the rest cut by max_tokens)": f"{valid}/{args.batch}",
        "unconstrained tok/s": generated / free_s,
        "constrained tok/s": generated / constrained_s,
        "ratio": free_s / constrained_s,
        "half constrained tok/s": mixed_tokens / mixed_s,
        "bitmask ms/step": 1e3 * sum(masks) / max(len(masks), 1),
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
        "bitmask_steps": len(masks),
    }
    path = write_results(f"{args.name}-{args.device}", payload, table)
    print(table)
    print(f"wrote {path}")
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
