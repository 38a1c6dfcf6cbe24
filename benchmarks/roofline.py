"""The hardware's bound on the standard offline workload (benchmarks/throughput.py): no engine finishes it sooner
than the larger of the bytes it must move over HBM's bandwidth and the FLOPs it must do over the tensor cores' rate.

- Bytes: the weights once a step, over max(output length) steps (every request admitted at once: the fewest steps
  there can be), and each decode token's KV context (random prompts share no prefix).
- FLOPs: every prompt and output token's matmuls (the LM head only where a token is sampled) and attention.

Left out, so that it stays a bound: KV writes, activations, sampling, and any step that cannot overlap its bytes with
its FLOPs. The rates are what the GPU in use measured (`common.measured_limits`: the H200's 4.3 TB/s copy bandwidth
and 790 TFLOP/s bf16 where there is none); FP8 weights (W8A8) run their matmuls at twice that.

    python benchmarks/roofline.py    # the bound for the benchmark models, weight formats and KV dtypes
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_bound_arguments, bound_rates, environment, markdown_table, write_results  # noqa: E402
from benchmarks.models import SHAPES  # noqa: E402

# Stored bytes per weight of the quantized linears: AWQ/GPTQ add an fp16 scale and offset per group of 128.
WEIGHT_BYTES = {"none": 2.0, "fp8": 1.0, "awq": 0.5 + 4 / 128, "gptq": 0.5 + 4 / 128}
# Stored bytes per KV value: INT8 adds an fp32 scale per token and head (of 128 values).
KV_BYTES = {"auto": 2.0, "int8": 1.0 + 4 / 128}


class ModelCost(NamedTuple):
    """What a model moves and computes per token: its linears' and LM head's parameters, the weight bytes one step
    reads, the KV bytes of one context token, and the attention FLOPs per query token and key."""

    linear_params: int
    head_params: int
    step_bytes: float
    kv_token_bytes: float
    attention_flops_per_key: int


def model_cost(shape: dict, quantization: str, kv_cache_dtype: str) -> ModelCost:
    h, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    q_heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or h // q_heads
    linear_params = layers * (h * head_dim * 2 * (q_heads + kv_heads) + 3 * h * shape["intermediate_size"])
    head_params = vocab * h  # the LM head (tied or not) stays in the model's dtype
    return ModelCost(
        linear_params=linear_params,
        head_params=head_params,
        step_bytes=linear_params * WEIGHT_BYTES[quantization] + head_params * 2,
        kv_token_bytes=layers * 2 * kv_heads * head_dim * KV_BYTES[kv_cache_dtype],
        attention_flops_per_key=4 * layers * q_heads * head_dim,
    )


def standard_workload_bound(
    shape: dict,
    in_lens: list[int],
    out_lens: list[int],
    quantization: str,
    kv_cache_dtype: str,
    bandwidth: float,
    flops: float,
) -> dict[str, float]:
    """Seconds the workload needs at least (`bound_s`), its parts, and the output tokens/s that bound allows."""
    cost = model_cost(shape, quantization, kv_cache_dtype)
    # Output token j >= 2 of a request with a prompt of p tokens is fed at position p + j - 2: it attends p + j - 1
    # tokens (the first output token comes from the prefill, whose prompt position i attends i + 1).
    decode_keys = sum((o - 1) * p + (o - 1) * o // 2 for p, o in zip(in_lens, out_lens))
    prefill_keys = sum(p * (p + 1) // 2 for p in in_lens)
    fed_tokens = sum(p + o - 1 for p, o in zip(in_lens, out_lens))
    matmul_flops = 2 * cost.linear_params * fed_tokens + 2 * cost.head_params * sum(out_lens)
    attention_flops = cost.attention_flops_per_key * (decode_keys + prefill_keys)
    memory_s = (max(out_lens) * cost.step_bytes + cost.kv_token_bytes * decode_keys) / bandwidth
    compute_s = matmul_flops / (flops * (2 if quantization == "fp8" else 1)) + attention_flops / flops
    bound_s = max(memory_s, compute_s)
    return {
        "bound_s": bound_s,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "weight_tb": max(out_lens) * cost.step_bytes / 1e12,
        "kv_tb": cost.kv_token_bytes * decode_keys / 1e12,
        "bound_tok_s": sum(out_lens) / bound_s,
    }


def main() -> None:
    from benchmarks.throughput import workload  # torch's generator, as the benchmark draws the lengths

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--quantization", nargs="+", default=["none", "fp8", "awq"])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "int8"])
    add_bound_arguments(parser)
    args = parser.parse_args()
    bandwidth, flops = bound_rates(args)
    prompts, out_lens = workload(args.num_requests)
    in_lens = [len(p) for p in prompts]
    rows = []
    for name, quantization, kv_dtype in itertools.product(args.models, args.quantization, args.kv_cache_dtype):
        bound = standard_workload_bound(SHAPES[name], in_lens, out_lens, quantization, kv_dtype, bandwidth, flops)
        rows.append({"model": name, "quantization": quantization, "kv_cache_dtype": kv_dtype, **bound})
    columns = ["model", "quantization", "kv_cache_dtype", "bound_tok_s", "bound_s", "memory_s", "compute_s"]
    columns += ["weight_tb", "kv_tb"]
    table = markdown_table(rows, columns)
    write_results(
        "roofline",
        {
            "environment": environment(),
            "bandwidth": bandwidth,
            "flops": flops,
            "requests": args.num_requests,
            "rows": rows,
        },
        table,
    )
    print(table)


if __name__ == "__main__":
    main()
