"""Offline throughput on the GPU, the standard workload: N requests with input and output lengths uniform in
[100, 1024], random token ids, EOS ignored, dummy weights. HF transformers `generate` runs the same prompts in the
same process as the peer (on the first --hf-requests of them, batched with left padding). Several KV-cache dtypes or
weight formats run one after the other in the same process, each a row of one results file (same-run ratios), with
the hardware's bound on the workload (benchmarks/roofline.py, at the GPU's measured rates) and the share of it
reached.

    python benchmarks/throughput.py --models Qwen3-0.6B Llama-3.1-8B
    python benchmarks/throughput.py --models Llama-3.1-8B --quantization none fp8 awq --hf-requests 0
    python benchmarks/throughput.py --models Qwen3-0.6B --kv-cache-dtype auto int8 --hf-requests 0
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from pathlib import Path

import matplotlib
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_bound_arguments, bound_rates, environment, markdown_table, write_results  # noqa: E402
from benchmarks.models import SHAPES, model_dir  # noqa: E402
from benchmarks.roofline import standard_workload_bound  # noqa: E402
from pagellm import LLM, SamplingParams  # noqa: E402


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    in_lens = torch.randint(100, 1025, (n,), generator=gen).tolist()
    out_lens = torch.randint(100, 1025, (n,), generator=gen).tolist()
    prompts = [torch.randint(0, 30000, (n_in,), generator=gen).tolist() for n_in in in_lens]
    return prompts, out_lens


def run_pagellm(path: str, prompts: list[list[int]], out_lens: list[int], **kwargs) -> dict:
    llm = LLM(path, load_format="dummy", quiet=True, **kwargs)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(out_lens)
    stats = llm.engine.stats()
    result = {
        "elapsed_s": elapsed,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + sum(map(len, prompts))) / elapsed,
        "kv_blocks": stats.num_blocks,
        "preemptions": stats.num_preemptions,
    }
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def run_hf(name: str, prompts: list[list[int]], out_lens: list[int], batch: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in SHAPES[name].items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    generated, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, lens = prompts[i : i + batch], out_lens[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(chunk):  # left padding
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=ids.cuda(),
                attention_mask=mask.cuda(),
                max_new_tokens=max(lens),
                do_sample=True,
                temperature=0.8,
                top_p=0.95,
                pad_token_id=0,
            )
        generated += sum(lens)  # only the tokens each request asked for count
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"hf_requests": len(prompts), "hf_elapsed_s": elapsed, "hf_output_tok_s": generated / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["Qwen3-0.6B", "Llama-3.1-8B"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="auto, int8: a row each")
    parser.add_argument(
        "--quantization", nargs="+", default=["none"], help="none, fp8, awq or gptq (dummy weights): a row each"
    )
    add_bound_arguments(parser)
    args = parser.parse_args()
    bandwidth, flops = bound_rates(args)
    prompts, out_lens = workload(args.num_requests)
    rows = []
    for name, kv_dtype, quantization in itertools.product(args.models, args.kv_cache_dtype, args.quantization):
        path = model_dir(name)
        row = {"model": name, "requests": args.num_requests, "kv_cache_dtype": kv_dtype, "quantization": quantization}
        row.update(
            run_pagellm(
                path,
                prompts,
                out_lens,
                max_model_len=4096,
                kv_cache_dtype=kv_dtype,
                quantization=None if quantization == "none" else quantization,
            )
        )
        if name in SHAPES:  # a named shape (not a directory of the caller's)
            in_lens = list(map(len, prompts))
            bound = standard_workload_bound(SHAPES[name], in_lens, out_lens, quantization, kv_dtype, bandwidth, flops)
            row["bound_tok_s"] = bound["bound_tok_s"]
            row["%_of_bound"] = 100 * row["output_tok_s"] / bound["bound_tok_s"]
        if args.hf_requests and quantization == "none" and kv_dtype == "auto":  # HF runs bf16 weights only
            row.update(run_hf(name, prompts[: args.hf_requests], out_lens[: args.hf_requests], args.hf_batch))
            row["speedup_vs_hf"] = row["output_tok_s"] / row["hf_output_tok_s"]
        rows.append(row)
        print(row, flush=True)
    columns = [
        "model",
        "requests",
        "kv_cache_dtype",
        "quantization",
        "output_tok_s",
        "bound_tok_s",
        "%_of_bound",
        "total_tok_s",
        "elapsed_s",
        "preemptions",
        "hf_requests",
        "hf_output_tok_s",
        "speedup_vs_hf",
    ]
    table = markdown_table(rows, columns)
    variants = [v for v in (*args.kv_cache_dtype, *args.quantization) if v not in ("auto", "none")]
    path = write_results(
        "-".join(["throughput", *args.models, *variants]),
        {
            "environment": environment(),
            "rows": rows,
            "workload": "input/output uniform [100, 1024], random ids, ignore_eos, temperature 0.8, top_p 0.95",
            "bound_bandwidth": bandwidth,
            "bound_flops": flops,
        },
        table,
    )
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [
        " ".join(v for v in (r["model"], r["kv_cache_dtype"], r["quantization"]) if v not in ("auto", "none"))
        for r in rows
    ]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["output_tok_s"] for r in rows], 0.4, label="pagellm")
    ax.bar([i + 0.2 for i in x], [r.get("hf_output_tok_s", 0) for r in rows], 0.4, label="HF generate")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(table)


if __name__ == "__main__":
    main()
