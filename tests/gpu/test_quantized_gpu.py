"""Quantized checkpoints on the GPU (skipped without CUDA): the Triton weight-only matmuls (decode rows), the
dequantize + cuBLAS path (long prefills) and FP8 x FP8 tensor cores, against the CPU path's dequantized fp32
run of the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.kernels import quant_matmul
from pagellm.kernels.ops import QuantizedWeight, TritonOps, _Composed
from tests.quant_checkpoints import fp8_at_load_weights, hf_model_with, write_awq, write_fp8, write_gptq_act_order

pytestmark = pytest.mark.gpu

WRITERS = {
    "awq": lambda src, out: write_awq(src, out, group=64),
    "gptq-act-order": lambda src, out: write_gptq_act_order(src, out, bits=4, group=64),
    "fp8-channel": lambda src, out: write_fp8(src, out, per_channel=True),
}


def prompt_logprobs(llm: LLM, ps: list[list[int]]) -> torch.Tensor:
    """Teacher-forced logprob of every prompt token after the first."""
    outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([pos[tok].logprob for o, p in zip(outs, ps) for pos, tok in zip(o.prompt_logprobs[1:], p[1:])])


def save_dense(model_dir, state: dict[str, torch.Tensor], out) -> str:
    """A full-precision checkpoint of the weights a quantized one stands for."""
    hf_model_with(model_dir, state).save_pretrained(out)
    return str(out)


# FP8 prefills also quantize the activations (per token, e4m3): more rounding than bf16 alone.
ERROR_BOUND = {"awq": 1.5, "gptq-act-order": 1.5, "fp8-channel": 8.0, "fp8-at-load": 8.0}


@pytest.mark.parametrize("fmt", [*WRITERS, "fp8-at-load"])
def test_quantized_gpu_matches_cpu(model_dir, tmp_path, fmt):
    """The GPU's bf16 run of a quantized checkpoint is as close to the CPU's fp32 run of it (the dequantized
    weights, exactly) as a bf16 run of those weights stored in full precision is."""
    if fmt == "fp8-at-load":
        path, quantization = str(model_dir), "fp8"
        dense = fp8_at_load_weights(model_dir)
    else:
        dense = WRITERS[fmt](model_dir, tmp_path / fmt)
        path, quantization = str(tmp_path / fmt), None
    dense_dir = save_dense(model_dir, dense, tmp_path / "dense")
    gen = torch.Generator().manual_seed(0)
    # 300-token prompts: the prefill paths (dequantize + cuBLAS, FP8 x FP8); 40 and 20-token ones: decode-sized
    # rows (INT4 at 17-64 rows: the weights scaled before the dot).
    ps = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (300, 40, 20, 20, 7)]
    exact = prompt_logprobs(LLM(path, quantization=quantization, device="cpu", dtype="float32", quiet=True), ps)
    gpu = LLM(path, quantization=quantization, device="cuda", dtype="bfloat16", max_num_batched_tokens=16, quiet=True)
    assert gpu.engine.runner.model.layers[0].mlp.down_proj.method is not None  # still quantized on the GPU
    quant_err = (prompt_logprobs(gpu, ps) - exact).abs().mean()
    bf16 = LLM(dense_dir, device="cuda", dtype="bfloat16", max_num_batched_tokens=16, quiet=True)
    bf16_err = (prompt_logprobs(bf16, ps) - exact).abs().mean()
    assert quant_err < ERROR_BOUND[fmt] * bf16_err, (quant_err, bf16_err)
    # Prefills in one step: more rows than the fused matmuls take (300), and 40 rows.
    whole = LLM(path, quantization=quantization, device="cuda", dtype="bfloat16", quiet=True)
    start = 0
    for prompt in ps[:2]:
        end = start + len(prompt) - 1
        assert (prompt_logprobs(whole, [prompt]) - exact[start:end]).abs().mean() < ERROR_BOUND[fmt] * bf16_err
        start = end
    # Decode steps of 1 and 16 rows under CUDA graphs produce tokens (no fault, no NaN).
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for batch in (ps[2:3], [ps[2]] * 16):
        assert all(len(o.outputs[0].token_ids) == 16 for o in whole.generate(batch, params, use_tqdm=False))


def fp8_weight(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()  # no NaN
    return QuantizedWeight(weight, (torch.rand(n, generator=gen) * 1e-3).cuda(), None, 8, 0)


def test_fp8_rows_leave_norm_and_swiglu_quantized(monkeypatch):
    """Rows bound for FP8 tensor cores come out of RMSNorm's and SwiGLU's kernels quantized: the same outputs as
    each op, then `fp8_quantize_rows`, then the matmul, with no quantizing launch of its own."""
    ops, gen = TritonOps(), torch.Generator().manual_seed(0)
    x, residual = (torch.randn(64, 256, generator=gen).cuda().bfloat16() for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(256, generator=gen)).cuda().bfloat16()
    gate_up, down = fp8_weight(1024, 256, gen), fp8_weight(256, 512, gen)
    expected_gate_up, expected_sum = _Composed.quantized_rms_norm_linear(ops, x, residual, norm_weight, 1e-6, gate_up)
    expected_down = _Composed.quantized_silu_and_mul_linear(ops, expected_gate_up, down)
    monkeypatch.setattr(quant_matmul, "fp8_quantize_rows", None)  # a call would fail
    out_gate_up, out_sum = ops.quantized_rms_norm_linear(x, residual, norm_weight, 1e-6, gate_up)
    assert torch.equal(out_gate_up, expected_gate_up) and torch.equal(out_sum, expected_sum)
    assert torch.equal(ops.quantized_silu_and_mul_linear(out_gate_up, down), expected_down)


def test_one_row_steps_match_cpu(model_dir, tmp_path):
    """Steps of one row run INT4 through the integer kernel (x as two int8 parts per 32 columns). Teacher-forced a
    token a step, its logprobs are as close to the CPU's exact run as bf16's one-row GEMV's are."""
    dense_dir = save_dense(model_dir, WRITERS["awq"](model_dir, tmp_path / "awq"), tmp_path / "dense")
    path = str(tmp_path / "awq")
    gen = torch.Generator().manual_seed(1)
    ps = [torch.randint(0, 1024, (48,), generator=gen).tolist()]
    exact = prompt_logprobs(LLM(path, device="cpu", dtype="float32", quiet=True), ps)
    one_row = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=1, quiet=True)
    quant_err = (prompt_logprobs(LLM(path, **one_row), ps) - exact).abs().mean()
    bf16_err = (prompt_logprobs(LLM(dense_dir, **one_row), ps) - exact).abs().mean()
    print(f"one-row mean |logprob error|: INT4 {quant_err:.4g}, bf16 {bf16_err:.4g}")
    assert quant_err < ERROR_BOUND["awq"] * bf16_err, (quant_err, bf16_err)


def test_gguf_q4_perplexity_on_real_text_one_row_a_step(carried_smollm2_gguf):
    """SmolLM2's Q4_1 blocks as stored on the GPU, a token a step (the one-row integer kernel) and 32 a step (the
    tile kernel): perplexity within 0.5% of the CPU's exact fp32 run of the dequantized weights."""
    from tests.test_int8_kv import perplexity

    exact = perplexity(LLM(carried_smollm2_gguf, device="cpu", dtype="float32", quiet=True))
    for tokens_a_step in (1, 32):
        common = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, quiet=True)
        gpu = LLM(carried_smollm2_gguf, max_num_batched_tokens=tokens_a_step, **common)
        assert gpu.engine.runner.model.layers[0].mlp.down_proj.method is not None  # still quantized on the GPU
        ppl = perplexity(gpu)
        print(f"SmolLM2 Q4_1 perplexity: GPU {tokens_a_step} token(s) a step {ppl:.4f}, CPU fp32 {exact:.4f}")
        assert abs(ppl - exact) / exact < 0.005, (tokens_a_step, ppl, exact)
