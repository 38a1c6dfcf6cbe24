"""GPU engine checks (skipped without CUDA): the Triton path against the CPU reference path, CUDA graphs against
eager mode, no kernel compiled after start-up, INT8 KV against bf16 KV (both against an fp32 run)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.runner.input_batch import HostBatch

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 1024, (int(torch.randint(1, 300, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]


def test_gpu_fp32_greedy_equals_cpu_path(model_dir):
    ps = prompts(6)
    cpu = tokens(LLM(str(model_dir), device="cpu", dtype="float32", quiet=True), ps)
    gpu = tokens(LLM(str(model_dir), device="cuda", dtype="float32", quiet=True, max_num_batched_tokens=128), ps)
    assert gpu == cpu


def test_logit_bias_on_the_gpu_equals_the_cpu_path(model_dir):
    ps = prompts(4, seed=2)
    free = tokens(LLM(str(model_dir), device="cpu", dtype="float32", quiet=True), ps)
    bias = {free[0][0]: -100.0, 5: 3.0, 9: -2.5}
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=bias), GREEDY] * 2
    cpu = tokens(LLM(str(model_dir), device="cpu", dtype="float32", quiet=True), ps, params)
    gpu = tokens(LLM(str(model_dir), device="cuda", dtype="float32", quiet=True), ps, params)
    assert gpu == cpu
    assert cpu[0][0] != free[0][0] and cpu[1] == free[1]  # the bias moved its own rows only


def test_cuda_graphs_equal_eager(model_dir):
    ps = prompts(20, seed=1)
    eager = LLM(str(model_dir), device="cuda", dtype="bfloat16", enforce_eager=True, quiet=True)
    graphs = LLM(str(model_dir), device="cuda", dtype="bfloat16", quiet=True)
    assert graphs.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    assert tokens(graphs, ps) == tokens(eager, ps)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=32, ignore_eos=True)
    assert tokens(graphs, ps, sampled) == tokens(eager, ps, sampled)


def eager_and_graphed(model_dir, record: Callable[[HostBatch], object], **kwargs) -> tuple[LLM, LLM, list]:
    """An eager LLM and one that replays graphs, built alike; what `record` returns for each batch the second one
    replays, None aside, is appended to the returned list."""
    kwargs = dict(device="cuda", dtype="bfloat16", quiet=True, **kwargs)
    eager, graphed = LLM(str(model_dir), enforce_eager=True, **kwargs), LLM(str(model_dir), **kwargs)
    step_graphs = graphed.engine.runner.graphs
    recorded, run = [], step_graphs.run

    def recording_run(batch, input_ids=None):
        if (value := record(batch)) is not None:
            recorded.append(value)
        return run(batch, input_ids)

    step_graphs.run = recording_run
    return eager, graphed, recorded


def assert_same_samples(got: list, want: list) -> None:
    """Equal tokens, and their logprobs (logprobs=0) equal within bf16's rounding."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        g_lp = [next(iter(d.values())).logprob for d in g.outputs[0].logprobs]
        w_lp = [next(iter(d.values())).logprob for d in w.outputs[0].logprobs]
        assert g_lp == pytest.approx(w_lp, abs=0.05)


def test_prefill_graphs_equal_eager(model_dir):
    """Steps of at most four prefill chunks of at most 512 tokens replay graphs: lone prompts of every bucket,
    several prompts together, a prompt whose prefix is cached and a chunked prompt (its later chunks attend to the
    cache), all as eager mode computes them."""
    eager, graphs, replayed_prefills = eager_and_graphed(
        model_dir, lambda batch: None if batch.is_decode_only else batch.num_tokens, max_num_batched_tokens=256
    )
    gen = torch.Generator().manual_seed(5)

    def fresh(*lengths: int) -> list[list[int]]:
        return [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lengths]

    lone = fresh(5, 16, 17, 100, 128, 255, 600)
    cached = lone[5][:200] + [7, 8, 9]  # after lone[5] ran: its first 12 blocks (192 tokens) are cached
    groups = [[p] for p in lone] + [fresh(5, 40), fresh(17, 100, 128), [cached], fresh(3, 4, 5, 6, 7)]
    few = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    for group in groups:
        assert_same_samples(graphs.generate(group, few, use_tqdm=False), eager.generate(group, few, use_tqdm=False))
    # Every lone prompt (the 600-token one in chunks of 256, 256 and 88), the pair, the triple and the cached
    # prompt's 11 new tokens; five prompts together are one sequence too many.
    assert sorted(replayed_prefills) == sorted([5, 16, 17, 100, 128, 255, 256, 256, 88, 45, 245, 11])


def test_mixed_steps_replay_two_graphs_as_eager_computes(model_dir):
    """Prompts of many lengths at once, 256 tokens a step: their chunks run beside the decodes of those started,
    and such steps (at most four chunks of at most 512 tokens) replay a decode graph and a prefill graph."""
    eager, graphs, mixed = eager_and_graphed(
        model_dir,
        lambda batch: batch.num_decodes if batch.num_decodes and not batch.is_decode_only else None,
        max_num_batched_tokens=256,
        max_num_seqs=24,
    )
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (3, 40, 90, 200, 7, 300, 15, 60) * 2]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    assert_same_samples(
        graphs.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)
    )
    assert len(mixed) >= 3, mixed


SERVE_AFTER_START_UP = """
import sys, torch
from triton import knobs
from pagellm import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", dtype="bfloat16", max_num_seqs=24, max_num_batched_tokens=256, quiet=True)
misses = []
knobs.runtime.jit_cache_hook = lambda *, fn, **_: misses.append(fn.name)  # every launch not compiled yet
gen = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (1, 3, 17, 40, 300, 555, 5, 9) * 3]
for params in (SamplingParams(temperature=0, max_tokens=20), SamplingParams(top_p=0.8, max_tokens=20, logprobs=3),
               SamplingParams(temperature=0.7, presence_penalty=0.5, max_tokens=20, prompt_logprobs=1)):
    llm.generate(prompts[:1], params, use_tqdm=False)  # one row a step: launched with PDL on sm90
    llm.generate(prompts, params, use_tqdm=False)
print("MISSES", sorted(set(misses)))
"""


def test_serving_compiles_no_kernel_after_start_up(model_dir):
    # A fresh process: this one's kernels were compiled by the tests before. Chunked prefills, decode batches of
    # every size up to 24 (graphs, and eager steps mixed with prefills) and of one request alone, greedy, top-p,
    # logprobs and penalties.
    out = subprocess.run(
        [sys.executable, "-c", SERVE_AFTER_START_UP, str(model_dir)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "MISSES []", out.stdout[-2000:]


def prompt_logprobs(llm: LLM, ps: list[list[int]]) -> torch.Tensor:
    """Teacher-forced logprob of every prompt token after the first: no divergence cascades, unlike greedy text."""
    outs = llm.generate(ps, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([pos[tok].logprob for o, p in zip(outs, ps) for pos, tok in zip(o.prompt_logprobs[1:], p[1:])])


def test_int8_kv_holds_twice_the_tokens_at_bf16_accuracy(model_dir):
    # max_num_seqs so large that the pool is sized by memory alone (no graphs: too many sizes to capture).
    kwargs = dict(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=100_000, enforce_eager=True, quiet=True)
    bf16 = LLM(str(model_dir), dtype="bfloat16", **kwargs)
    int8 = LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype="int8", **kwargs)
    ratio = int8.engine.stats().num_blocks / bf16.engine.stats().num_blocks
    assert 1.6 < ratio < 2.0  # head_dim 32: the fp32 scales cost 4 bytes per 32 int8 values
    ps = prompts(8, seed=2)
    exact = prompt_logprobs(LLM(str(model_dir), dtype="float32", **kwargs), ps)
    bf16_err = (prompt_logprobs(bf16, ps) - exact).abs().mean()
    int8_err = (prompt_logprobs(int8, ps) - exact).abs().mean()
    # The bf16 model's own rounding dominates; quantizing its K/V to INT8 may add a little on top.
    assert int8_err < 1.5 * bf16_err, (int8_err, bf16_err)


def test_int8_kv_perplexity_on_real_text(carried_smollm2_gguf):
    """The bf16 Triton path on SmolLM2 reading prose: INT8 KV perplexity within 1% of bf16 KV. Chunks of 32
    tokens, so later chunks attend to earlier ones through the (quantized) cache with the prefill kernel."""
    from tests.test_int8_kv import perplexity

    smollm2_gguf = carried_smollm2_gguf
    common = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=32, gpu_memory_utilization=0.3, quiet=True)
    bf16 = perplexity(LLM(smollm2_gguf, kv_cache_dtype="bfloat16", **common))
    int8 = perplexity(LLM(smollm2_gguf, kv_cache_dtype="int8", **common))
    print(f"SmolLM2 perplexity on the GPU: bf16 KV {bf16:.4f}, INT8 KV {int8:.4f}")
    assert abs(int8 - bf16) / bf16 < 0.01, (bf16, int8)
    assert 2 < bf16 < 60
