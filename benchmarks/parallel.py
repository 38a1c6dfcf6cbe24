"""Tensor and data parallelism on the GPUs of one host, dummy weights, bf16: batch-1 and batch-16 decode and the
standard offline workload (256 requests per replica, in/out U[100, 1024]) at each size, against the
weight-bandwidth limit of the ranks together. One process per configuration (each spawns its ranks or replicas).
A configuration is MODEL:TP or MODEL:TP:DP.

    python benchmarks/parallel.py --configs Llama-3.1-8B:1 Llama-3.1-8B:2 Llama-3.1-70B:4 Llama-3.1-70B:8
    python benchmarks/parallel.py --configs Qwen3-0.6B:1:1 Qwen3-0.6B:1:8
    python benchmarks/parallel.py --configs Qwen3-0.6B:1 --no-throughput     # a dry run on one GPU

Keep NVLink multicast off on these machines: NCCL_NVLS_ENABLE=0 (set here for the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, markdown_table, measured_limits, write_results  # noqa: E402
from benchmarks.models import SHAPES, weight_bytes  # noqa: E402

SHAPES.setdefault(
    "Llama-3.1-70B",
    {
        **SHAPES["Llama-3.1-8B"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
)

CHILD = """
import json, sys, time
from benchmarks import parallel  # registers the 70B shape
from benchmarks.latency import decode_rate
from benchmarks.models import model_dir
from benchmarks.throughput import workload
from pagellm import LLM, SamplingParams
name, tp, dp, throughput = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
llm = LLM(model_dir(name), load_format="dummy", max_model_len=4096, tensor_parallel_size=tp,
          data_parallel_size=dp, quiet=True)
out = {}
if dp == 1:  # decode latency is one replica's
    out = {"b1_tok_s": decode_rate(llm, 1, 128, 256)[0], "b16_tok_s": decode_rate(llm, 16, 128, 256)[0]}
if throughput:
    prompts, out_lens = workload(256 * dp)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    out["throughput_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
llm.shutdown()
print("RESULT " + json.dumps(out))
"""


def measure(name: str, tp: int, dp: int, throughput: bool) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(tp), str(dp), "1" if throughput else "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} tp={tp} dp={dp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT ")[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["Llama-3.1-8B:1", "Llama-3.1-8B:2"], help="MODEL:TP")
    parser.add_argument("--no-throughput", action="store_true")
    args = parser.parse_args()
    bandwidth = measured_limits()[0]  # of one GPU
    rows = []
    for config in args.configs:
        name, tp, dp = (config.split(":") + ["1"])[:3]
        tp, dp = int(tp), int(dp)
        result = measure(name, tp, dp, not args.no_throughput)
        row = {"model": name, "tp": tp, "dp": dp, **result}
        if "b1_tok_s" in result:
            limit = bandwidth * tp / weight_bytes(name)  # batch-1 tokens/s if every rank streamed its weights
            row |= {"b1_limit_tok_s": limit, "b1_of_limit": result["b1_tok_s"] / limit}
        rows.append(row)
        print(row, flush=True)
    columns = ["model", "tp", "dp", "b1_tok_s", "b1_limit_tok_s", "b1_of_limit", "b16_tok_s"]
    columns += [] if args.no_throughput else ["throughput_tok_s"]
    table = markdown_table(rows, columns)
    write_results("parallel", {"environment": environment(), "rows": rows, "configs": args.configs}, table)
    print(table)


if __name__ == "__main__":
    main()
