"""Structured outputs: output tokens/s of a batch of JSON-schema requests against the same batch unconstrained
(the same prompts and the same output lengths), grammar compile time per schema, and the per-step bitmask fill
time. Each batch runs --repeats times, interleaved with the others; the medians are reported.

    python benchmarks/structured.py                              # CPU: SmolLM2 (the embedded model), batch 16
    python benchmarks/structured.py --model DIR --load-format dummy --batch 64 --device cuda --dtype bfloat16
    python benchmarks/structured.py --engine vllm --model DIR --load-format dummy --batch 64 --dtype bfloat16

DIR needs a tokenizer (grammars are compiled against its vocabulary): on the GPU, SmolLM2's config and tokenizer
with dummy weights. Two batches are timed: chat requests for a list of records (outputs end when the model
closes the list), and "steady": token-id prompts each decoding --steady-tokens tokens under a schema that cannot
end that soon (an array of at least 1,000 records), so that both runs decode the same steps at a full batch.
--engine vllm runs the same batches on vLLM (its defaults, xgrammar backend); the compile and fill timings are
pagellm's own and left out there. --combine then writes one table of both engines from the same machine:

    python benchmarks/structured.py --combine PAGELLM.json VLLM.json

Only the steady batch compares across engines (the same prompts and lengths); dummy weights differ between
engines, so the records batch's outputs (and lengths) do, and only its constrained/unconstrained ratio carries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pagellm  # noqa: E402
from benchmarks.common import environment, markdown_table, write_results  # noqa: E402

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
ENDLESS_RECORDS = {"type": "array", "items": SCHEMA["properties"]["items"]["items"], "minItems": 1000}
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
    import jsonschema  # here, not at the top: profile_step imports this module's schemas on a GPU machine without it

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


def open_engine(args: argparse.Namespace):
    """The engine's LLM and its SamplingParams and StructuredOutputsParams (vLLM's have the same fields)."""
    if args.engine == "vllm":
        import vllm
        from vllm.sampling_params import StructuredOutputsParams

        llm = vllm.LLM(
            args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=4096
        )
        return llm, vllm.SamplingParams, StructuredOutputsParams
    llm = pagellm.LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, quiet=True)
    return llm, pagellm.SamplingParams, pagellm.StructuredOutputsParams


def engine_version(engine: str) -> str:
    if engine == "vllm":
        import vllm

        return f"vllm {vllm.__version__}"
    return "pagellm"


def compile_times(llm) -> dict[str, float]:
    """Milliseconds to compile each schema of COMPILE_SCHEMAS the first time (pagellm's compiler, uncached)."""
    compiler = llm.engine.input_processor.grammar_compiler
    compiler.compile(pagellm.StructuredOutputsParams(regex="a"))  # builds the compiler: reads the vocabulary once
    compile_ms = {}
    for name, schema in COMPILE_SCHEMAS.items():
        start = time.perf_counter()
        compiler.compile(pagellm.StructuredOutputsParams(json=schema))
        compile_ms[name] = 1e3 * (time.perf_counter() - start)
    return compile_ms


def timed_runs(run, kinds: dict, repeats: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Output tokens/s of `run(params)` (which returns its outputs) for each kind's params, from the median of
    `repeats` runs interleaved so that a slow stretch of the machine hits every kind alike; and the seconds."""
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, params in kinds.items():
            start = time.perf_counter()
            outs = run(params)
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outs)
    return {name: tokens[name] / statistics.median(seconds[name]) for name in kinds}, seconds


def records_batch(llm, sampling, structured, args: argparse.Namespace) -> tuple[dict, dict]:
    """Chat requests for records: constrained, unconstrained to the same lengths, and half of each."""
    messages = [
        [{"role": "user", "content": f"List {i % 7 + 3} things in a room as JSON records."}] for i in range(args.batch)
    ]
    constrained = [
        sampling(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=structured(json=SCHEMA))
        for i in range(args.batch)
    ]
    llm.chat(messages[:2], constrained[:2], use_tqdm=False)  # warm-up
    fills = timed_fills() if args.engine == "pagellm" else []
    outs = llm.chat(messages, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = sum(_is_valid(o.outputs[0].text) for o in outs)
    # The same prompts, each run to its constrained run's length, unconstrained; and half of them constrained,
    # half not (what the unconstrained rows of a mixed batch pay). Each run seeds its samples alike, so the
    # constrained runs repeat the first one's lengths.
    free = [sampling(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    half = args.batch // 2
    kinds = {"constrained": constrained, "unconstrained": free, "half constrained": constrained[:half] + free[half:]}
    llm.chat(messages[:2], free[:2], use_tqdm=False)
    tok_s, seconds = timed_runs(lambda params: llm.chat(messages, params, use_tqdm=False), kinds, args.repeats)
    row = {
        "batch": args.batch,
        "output tokens": sum(lengths),
        "schema-valid (the rest cut by max_tokens)": f"{valid}/{args.batch}",
        "unconstrained tok/s": tok_s["unconstrained"],
        "constrained tok/s": tok_s["constrained"],
        "ratio": tok_s["constrained"] / tok_s["unconstrained"],
        "half constrained tok/s": tok_s["half constrained"],
    }
    if fills:
        row["bitmask fill ms/step (median)"] = 1e3 * statistics.median(fills)
    return row, seconds


def steady_batch(llm, sampling, structured, args: argparse.Namespace) -> tuple[dict, dict]:
    """Token-id prompts each decoding exactly --steady-tokens tokens, under the endless schema or unconstrained."""
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 30000, (40,), generator=gen).tolist()} for _ in range(args.batch)
    ]
    grammar = structured(json=ENDLESS_RECORDS)
    kinds = {
        kind: [
            sampling(temperature=1.0, seed=i, max_tokens=args.steady_tokens, ignore_eos=True, structured_outputs=so)
            for i in range(args.batch)
        ]
        for kind, so in (("constrained", grammar), ("unconstrained", None))
    }
    for params in kinds.values():  # warm-up, and a check that every row decodes the whole length
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.steady_tokens for o in outs)
    tok_s, seconds = timed_runs(lambda params: llm.generate(prompts, params, use_tqdm=False), kinds, args.repeats)
    row = {
        "batch": args.batch,
        "output tokens": args.batch * args.steady_tokens,
        "unconstrained tok/s": tok_s["unconstrained"],
        "constrained tok/s": tok_s["constrained"],
        "ratio": tok_s["constrained"] / tok_s["unconstrained"],
    }
    return row, seconds


def results_name(args: argparse.Namespace) -> str:
    model = Path(args.model).name if args.model else "smollm2"
    return f"{args.name}-{model}-{args.engine}-{'cuda' if args.engine == 'vllm' else args.device}"


def combine(pagellm_json: Path, vllm_json: Path) -> None:
    """One results file holding both engines' runs of the same batches, and pagellm's ratios to vLLM."""
    runs = {engine: json.loads(path.read_text()) for engine, path in (("pagellm", pagellm_json), ("vllm", vllm_json))}
    rows = [
        {
            "engine": run["environment"]["engine"],
            "steady unconstrained tok/s": run["steady"]["unconstrained tok/s"],
            "steady constrained tok/s": run["steady"]["constrained tok/s"],
            "steady ratio": run["steady"]["ratio"],
            "records ratio": run["records"]["ratio"],
        }
        for run in runs.values()
    ]
    ours, peer = rows
    rows.append(
        {"engine": "pagellm / vLLM"}
        | {key: ours[key] / peer[key] for key in ("steady unconstrained tok/s", "steady constrained tok/s")}
    )
    model = Path(runs["pagellm"]["args"]["model"] or "smollm2").name
    batch, tokens = runs["pagellm"]["args"]["batch"], runs["pagellm"]["args"]["steady_tokens"]
    table = f"{model}, batch {batch}, steady: {tokens} tokens a row (the same prompts and lengths on both)\n\n"
    table += markdown_table(rows, list(rows[0]))
    payload = {"environment": runs["pagellm"]["environment"], "rows": rows, "runs": runs}
    path = write_results(f"structured-peers-{model}", payload, table)
    print(table)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["pagellm", "vllm"], default="pagellm")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 (pagellm only)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu", help="pagellm's device (vLLM's is the GPU)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--steady-tokens", type=int, default=64, help="each row's output length in the steady batch")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each batch, interleaved; medians reported")
    parser.add_argument("--name", default="structured")
    parser.add_argument("--combine", nargs=2, type=Path, metavar=("PAGELLM_JSON", "VLLM_JSON"))
    args = parser.parse_args()
    if args.combine:
        combine(*args.combine)
        return

    llm, sampling, structured = open_engine(args)
    compile_ms = compile_times(llm) if args.engine == "pagellm" else {}
    records, records_seconds = records_batch(llm, sampling, structured, args)
    steady, steady_seconds = steady_batch(llm, sampling, structured, args)
    table = "Records (chat, outputs end with the list):\n\n" + markdown_table([records], list(records))
    table += f"\n\nSteady ({args.steady_tokens} tokens a row, endless schema):\n\n" + markdown_table(
        [steady], list(steady)
    )
    if compile_ms:
        table += "\n\nGrammar compile (first time, uncached), ms:\n\n" + markdown_table(
            [{k: round(v, 2) for k, v in compile_ms.items()}], list(compile_ms)
        )
    payload = {
        "environment": environment()
        | {"engine": engine_version(args.engine), "model": args.model or "SmolLM2-135M-Instruct (embedded)"},
        "args": vars(args),
        "records": records,
        "steady": steady,
        "compile_ms": compile_ms,
        "seconds": {"records": records_seconds, "steady": steady_seconds},
    }
    path = write_results(results_name(args), payload, table)
    print(table)
    print(f"wrote {path}")
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
