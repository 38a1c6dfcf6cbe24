"""CPU decode throughput: pagellm vs HF transformers `generate` on SmolLM2-135M-Instruct (fp32, or --dtype
bfloat16 for both), same prompts, same process. Batch 1 and batch 8, 64 new tokens each, greedy, EOS ignored; and
the time to the first token of one long prompt (--prefill-tokens random token ids; HF's forward computes the last
position's logits only).

    python benchmarks/cpu.py [--new-tokens 64] [--repeats 3] [--dtype bfloat16] [--prefill-tokens 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, markdown_table, write_results  # noqa: E402
from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.model.loader import default_model  # noqa: E402

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The history of the Roman Empire begins",
    "Write a short poem about autumn leaves:",
    "Explain how a computer processor works.",
    "The best way to learn a new language is",
    "In the year 2050, cities will",
    "A recipe for chocolate chip cookies:",
    "The theory of relativity states that",
]


def time_pagellm(llm: LLM, prompts: list[str], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
    return elapsed


def time_hf(model, tokenizer, prompts: list[str], new_tokens: int) -> float:
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
    return elapsed


def time_pagellm_prefill(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def time_hf_prefill(model, prompt: list[int]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        model(torch.tensor([prompt]), logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines'")
    parser.add_argument("--prefill-tokens", type=int, default=2000, help="the long prompt's length (0: skip)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(default_model())
    llm = LLM(str(gguf), device="cpu", dtype=args.dtype, quiet=True)
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # run to exactly new_tokens, like ignore_eos
    tokenizer = AutoTokenizer.from_pretrained(str(llm.engine.model_dir), padding_side="left")

    rows = []
    for batch_size in (1, 8):
        prompts = PROMPTS[:batch_size]
        time_pagellm(llm, prompts, 4)  # warm-up
        time_hf(hf, tokenizer, prompts, 4)
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            ours.append(time_pagellm(llm, prompts, args.new_tokens))
            theirs.append(time_hf(hf, tokenizer, prompts, args.new_tokens))
        tokens = batch_size * args.new_tokens
        row = {
            "batch": batch_size,
            "new_tokens": args.new_tokens,
            "pagellm_tok_s": tokens / statistics.median(ours),
            "hf_tok_s": tokens / statistics.median(theirs),
        }
        row["speedup"] = row["pagellm_tok_s"] / row["hf_tok_s"]
        rows.append(row)
    prefill_rows = []
    if args.prefill_tokens:
        ours, theirs = [], []
        for seed in range(args.repeats):  # a prompt of its own each time: pagellm would hit its prefix cache
            prompt = torch.randint(100, 40000, (args.prefill_tokens,), generator=torch.Generator().manual_seed(seed))
            prompt = prompt.tolist()
            ours.append(time_pagellm_prefill(llm, prompt))
            theirs.append(time_hf_prefill(hf, prompt))
        prefill_rows.append(
            {
                "prompt_tokens": args.prefill_tokens,
                "pagellm_ttft_s": statistics.median(ours),
                "hf_forward_s": statistics.median(theirs),
                "speedup": statistics.median(theirs) / statistics.median(ours),
            }
        )
    # The floor at batch 1: every weight a decode step multiplies by streams from memory once per token (packed
    # linear weights are buffers; the embedding table is only looked up, while the LM head, tied or not, packed or
    # not, streams a matrix of its size).
    model = llm.engine.runner.model
    decoder = [t for n, t in model.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))]
    decoder += [t for n, t in model.named_buffers() if n.endswith("weight") and not n.startswith("lm_head")]
    head = model.embed_tokens.weight
    weight_bytes = sum(t.numel() * t.element_size() for t in [*decoder, head])
    table = markdown_table(rows, ["batch", "new_tokens", "pagellm_tok_s", "hf_tok_s", "speedup"])
    if prefill_rows:
        table += "\n\n" + markdown_table(prefill_rows, ["prompt_tokens", "pagellm_ttft_s", "hf_forward_s", "speedup"])
    payload = {
        "environment": environment(),
        "model": f"SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to {args.dtype})",
        "weight_bytes": weight_bytes,
        "rows": rows,
        "prefill_rows": prefill_rows,
        "repeats": args.repeats,
    }
    path = write_results("cpu" if args.dtype == "float32" else f"cpu-{args.dtype}", payload, table)
    print(table)
    print(f"weights: {weight_bytes / 1e6:.0f} MB ({args.dtype}) streamed per decode step; results: {path}")


if __name__ == "__main__":
    main()
