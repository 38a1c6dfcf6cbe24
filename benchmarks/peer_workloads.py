"""pagellm on the peer workloads, measured as ../shared/peers/vllm_bench.py measures vLLM (same prompts from the
same seeds, same sampling, same timers, same JSON keys), one process per call so cold start is a real one.

    PEER_T0=$(date +%s.%N) python benchmarks/peer_workloads.py coldstart --model qwen3 --out X.json
    PEER_T0=$(date +%s.%N) python benchmarks/peer_workloads.py bench --model llama8b --out X.json

`benchmarks/peers.py` runs both engines in one device call and writes the side-by-side results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

T_SCRIPT = time.time()
T0 = float(os.environ.get("PEER_T0", T_SCRIPT))

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.models import model_dir  # noqa: E402

MODELS = {"qwen3": "Qwen3-0.6B", "llama8b": "Llama-3.1-8B"}
# The sequences of these workloads are at most 2,048 tokens (1,024 + 1,024).
MAX_MODEL_LEN = 4096


def log(*parts: object) -> None:
    print("[pagellm]", f"{time.time() - T0:8.2f}s", *parts, flush=True)


def coldstart(key: str) -> tuple[object, dict]:
    t_imp0 = time.time()
    import pagellm
    from pagellm import LLM, SamplingParams

    t_imp1 = time.time()
    llm = LLM(
        model_dir(MODELS[key]),
        load_format="dummy",
        dtype="bfloat16",
        gpu_memory_utilization=0.9,
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        quiet=True,
    )
    t_llm = time.time()
    outs = llm.generate([list(range(1000, 1008))], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    t_tok = time.time()
    assert len(outs[0].outputs[0].token_ids) == 1
    log("first token at", f"{t_tok - T0:.2f}s after process start")
    return llm, {
        "pagellm_version": getattr(pagellm, "__version__", "dev"),
        "t_process_start_to_script_s": T_SCRIPT - T0,
        "t_import_pagellm_s": t_imp1 - t_imp0,
        "t_llm_init_s": t_llm - t_imp1,
        "t_first_generate_s": t_tok - t_llm,
        "t_process_start_to_first_token_s": t_tok - T0,
    }


def ntok(outs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outs)


def throughput(llm, n: int = 256) -> dict:
    """vllm_bench.throughput: in/out lengths U[100, 1024], ids U[0, 30000), top-p 0.95 at temperature 0.8."""
    import torch

    from pagellm import SamplingParams

    g = torch.Generator().manual_seed(0)
    in_lens = torch.randint(100, 1025, (n,), generator=g).tolist()
    out_lens = torch.randint(100, 1025, (n,), generator=g).tolist()
    prompts = [torch.randint(0, 30000, (k,), generator=g).tolist() for k in in_lens]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=o, ignore_eos=True) for o in out_lens]
    warm = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, ignore_eos=True) for _ in range(8)]
    llm.generate(prompts[:8], warm, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tok = ntok(outs)
    res = {
        "requests": n,
        "input_tokens": sum(in_lens),
        "output_tokens": out_tok,
        "expected_output_tokens": sum(out_lens),
        "elapsed_s": elapsed,
        "output_tok_per_s": out_tok / elapsed,
        "total_tok_per_s": (out_tok + sum(in_lens)) / elapsed,
        "req_per_s": n / elapsed,
    }
    log("throughput", json.dumps(res))
    return res


def fixed_batch(llm, bs: int, reps: int = 3, out_len: int = 512, in_len: int = 128) -> dict:
    """vllm_bench.fixed_batch: greedy decode of `bs` fresh 128-token prompts (no prefix-cache hits)."""
    import torch

    from pagellm import SamplingParams

    g = torch.Generator().manual_seed(1000 + bs)

    def fresh() -> list[list[int]]:
        return [torch.randint(0, 30000, (in_len,), generator=g).tolist() for _ in range(bs)]

    full_params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(fresh(), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    ttfts, fulls, toks = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm.generate(fresh(), one, use_tqdm=False)
        ttfts.append(time.perf_counter() - t0)
        p = fresh()
        t0 = time.perf_counter()
        outs = llm.generate(p, full_params, use_tqdm=False)
        fulls.append(time.perf_counter() - t0)
        toks.append(ntok(outs))
    ttft, full = statistics.median(ttfts), statistics.median(fulls)
    res = {
        "batch": bs,
        "prompt_len": in_len,
        "max_tokens": out_len,
        "reps": reps,
        "generated_tokens": toks[0],
        "elapsed_s_median": full,
        "elapsed_s_all": fulls,
        "tok_per_s": toks[0] / full,
        "ttft_s_median": ttft,
        "ttft_s_all": ttfts,
        "decode_only_tok_per_s": bs * (out_len - 1) / (full - ttft),
        "decode_step_ms": (full - ttft) / (out_len - 1) * 1000,
    }
    log(f"batch{bs}", json.dumps(res))
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["coldstart", "bench"])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    res: dict = {"model": MODELS[args.model], "mode": args.mode, "max_model_len": MAX_MODEL_LEN}

    def save() -> None:
        Path(args.out).write_text(json.dumps(res, indent=1))

    try:
        llm, res["coldstart"] = coldstart(args.model)
        save()
        if args.mode == "bench":
            res["throughput"] = throughput(llm)
            save()
            res["batch1"] = fixed_batch(llm, 1)
            save()
            res["batch16"] = fixed_batch(llm, 16)
        res["ok"] = True
    except Exception as exc:  # the results so far are kept, with what broke
        import traceback

        traceback.print_exc()
        res["ok"], res["error"] = False, repr(exc)[:2000]
    save()
    log("wrote", args.out)
    sys.stdout.flush()
    os._exit(0 if res["ok"] else 1)  # no interpreter teardown: the next measured process starts on a free GPU


if __name__ == "__main__":
    main()
