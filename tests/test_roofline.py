"""benchmarks/roofline.py's closed-form sums against a walk over every token of a small workload, and the measured
limits the benchmarks divide by."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks.common import MEASURED_LIMITS, bound_rates, measured_limits
from benchmarks.roofline import KV_BYTES, WEIGHT_BYTES, standard_workload_bound
from tests.conftest import TINY_SHAPES


@pytest.mark.parametrize("quantization,kv_dtype", [("none", "auto"), ("awq", "int8"), ("fp8", "auto")])
def test_the_bound_counts_each_tokens_bytes_and_flops(quantization, kv_dtype):
    in_lens, out_lens = [3, 5, 1], [4, 1, 2]
    bandwidth, flops = 1e9, 1e12
    shape = TINY_SHAPES
    h, inter, vocab, layers = (
        shape[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers")
    )
    q_heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = h // q_heads
    linear = layers * (2 * h * q_heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter)  # q o, k v, mlp
    kv_token = layers * 2 * kv_heads * head_dim * KV_BYTES[kv_dtype]
    kv_bytes = matmul = attention = 0.0
    for prompt, outputs in zip(in_lens, out_lens):
        for position in range(prompt + outputs - 1):  # every fed token attends the positions up to its own
            matmul += 2 * linear
            attention += 4 * layers * q_heads * head_dim * (position + 1)
            if position >= prompt:  # a decode token reads its context from the cache
                kv_bytes += kv_token * (position + 1)
        matmul += 2 * vocab * h * outputs  # the LM head, once per sampled token
    steps = max(out_lens)  # every request admitted at once
    weight_bytes = steps * (linear * WEIGHT_BYTES[quantization] + vocab * h * 2)
    matmul_rate = flops * (2 if quantization == "fp8" else 1)

    bound = standard_workload_bound(TINY_SHAPES, in_lens, out_lens, quantization, kv_dtype, bandwidth, flops)

    assert bound["memory_s"] == pytest.approx((weight_bytes + kv_bytes) / bandwidth)
    assert bound["compute_s"] == pytest.approx(matmul / matmul_rate + attention / flops)
    assert bound["bound_s"] == max(bound["memory_s"], bound["compute_s"])
    assert bound["bound_tok_s"] == pytest.approx(sum(out_lens) / bound["bound_s"])


def test_the_limits_are_those_measured_on_the_gpu_in_use(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert measured_limits() == MEASURED_LIMITS["H200"]  # the roofline's arithmetic, with no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert measured_limits() == (3.0e12, 790e12)
    given = argparse.Namespace(bandwidth=2.5e12, flops=None)
    assert bound_rates(given) == (2.5e12, 790e12)  # what is given stands, the rest is measured
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(SystemExit, match="A100.*pass them"):
        measured_limits()


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_step_costs_of_an_all_at_once_schedule_sum_to_the_workload_bound(quantization):
    # benchmarks/step_timeline.py's per-step arithmetic, summed over the schedule the workload bound assumes (every
    # prompt in one step, then every request's decodes together), against the workload's closed form. The bound
    # leaves the prefill's KV reads out: the steps count each prompt's context once.
    from benchmarks.roofline import model_cost
    from benchmarks.step_timeline import step_cost
    from pagellm.core.step import SamplingRow, SchedulerOutput, StepRow
    from pagellm.sampling_params import SamplingParams

    in_lens, out_lens = [3, 5, 1], [4, 1, 2]
    bandwidth, flops = 1e9, 1e12
    cost = model_cost(TINY_SHAPES, quantization, "auto")
    sampled = SamplingRow(SamplingParams(), 0, [], [])

    def row(start: int, n: int) -> StepRow:
        return StepRow("r", start, n, [0] * n, [], sampling=sampled)

    schedule = [SchedulerOutput([row(0, p) for p in in_lens])]
    for j in range(1, max(out_lens)):  # the decode feeding output token j of each request that has one
        schedule.append(SchedulerOutput([row(p + j - 1, 1) for p, o in zip(in_lens, out_lens) if j < o]))
    steps = [step_cost(step, cost, bandwidth, flops, quantization == "fp8") for step in schedule]

    bound = standard_workload_bound(TINY_SHAPES, in_lens, out_lens, quantization, "auto", bandwidth, flops)
    prefill_reads = cost.kv_token_bytes * sum(in_lens) / bandwidth
    assert sum(s.memory_s for s in steps) == pytest.approx(bound["memory_s"] + prefill_reads)
    assert sum(s.compute_s for s in steps) == pytest.approx(bound["compute_s"])
    assert [s.prefill for s in steps] == [True] + [False] * (len(steps) - 1)
