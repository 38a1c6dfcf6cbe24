"""vLLM 0.26.0's batch-1 and batch-16 decode on quantized dummy weights, the peer of `latency.py --quantization`:
`none` (bf16), `fp8` (vLLM's FP8 on the fly from the bf16 config) and `awq` (the config given an AWQ
quantization_config, group 128, with zero points, which vLLM runs with its Marlin kernels on Hopper). Each method in
a fresh process (vLLM frees its GPU memory only at exit); the decode measure is the peers' own (`vllm_bench.py`'s
fixed_batch: greedy, 128-token prompts, 512 new tokens, decode time without the first token).

Needs the vLLM bundle installed (../shared/peers/vllm_bundle.sh, its header: two device calls), then, on the GPU:

    PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/vllm_quant_latency.py \\
        --peer-dir .peer --methods none fp8 awq --out /tmp/vllm-quant.json
    python benchmarks/latency.py --models Llama-3.1-8B --quantization none fp8 awq --skip-cold-start \\
        --peer /tmp/vllm-quant.json       # one results file, both engines' figures and the ratios
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
MODELS = {"Llama-3.1-8B": "llama8b", "Qwen3-0.6B": "qwen3"}  # latency.py's names -> vllm_bench.py's keys


def measure_one(peer_dir: Path, model: str, method: str) -> dict:
    """In this process: load vLLM on the dummy model in `method`'s format, time batches 1 and 16."""
    sys.path.insert(0, str(peer_dir))
    import vllm
    import vllm_bench  # the peers' workloads, so that these figures are measured as peers.py's are
    from vllm import LLM

    config = dict(vllm_bench.CONFIGS[MODELS[model]]["config"])
    if method == "awq":
        config["quantization_config"] = AWQ_CONFIG
    path = tempfile.mkdtemp(prefix=f"vllm-{method}-")
    Path(path, "config.json").write_text(json.dumps(config))
    llm = LLM(
        model=path,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=0.9,
        seed=0,
        quantization="fp8" if method == "fp8" else None,  # AWQ: read from the config, as for a real checkpoint
    )
    return {
        "model": model,
        "quantization": method,
        "vllm_version": vllm.__version__,
        "quant_method_used": str(llm.llm_engine.vllm_config.model_config.quantization),
        "settings": vllm_bench.engine_settings(llm),
        "batch1": vllm_bench.fixed_batch(llm, 1),
        "batch16": vllm_bench.fixed_batch(llm, 16),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-dir", type=Path, default=Path(".peer"), help="where vllm_bench.py is")
    parser.add_argument("--model", choices=list(MODELS), default="Llama-3.1-8B")
    parser.add_argument("--methods", nargs="+", choices=["none", "fp8", "awq"], default=["none", "fp8", "awq"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one method
    args = parser.parse_args()
    if args.one is not None:
        args.out.write_text(json.dumps(measure_one(args.peer_dir, args.model, args.one)))
        return
    runs = []
    for method in args.methods:
        out = args.out.with_suffix(f".{method}.json")
        cmd = [sys.executable, __file__, "--one", method, "--model", args.model]
        cmd += ["--peer-dir", str(args.peer_dir), "--out", str(out)]
        done = subprocess.run(cmd, env=os.environ)
        if done.returncode == 0 and out.exists():
            runs.append(json.loads(out.read_text()))
        else:
            runs.append({"model": args.model, "quantization": method, "error": f"exit code {done.returncode}"})
        print(json.dumps(runs[-1].get("error") or {k: runs[-1][k] for k in ("quantization", "quant_method_used")}))
    args.out.write_text(json.dumps({"engine": "vllm", "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
