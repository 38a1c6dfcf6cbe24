"""benchmarks/sm90_report.py compiles the decode kernel for the H200 on a CPU machine: what it reports must be the
code the GPU runs (tensor cores, INT8 tiles converted by byte permutes rather than slow int-to-float instructions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("int8", [False, True])
def test_decode_kernel_compiles_for_sm90(int8):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not interpreted
    args = [sys.executable, str(ROOT / "benchmarks" / "sm90_report.py"), "--context", "4096", "--json"]
    out = subprocess.run(args + ["--int8"] * int8, capture_output=True, text=True, env=env, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["spilled_bytes"] == 0
    assert report["programs_per_sm"] >= 2
    mix = report["loop_mix"]
    assert mix.get("HMMA", 0) > 0  # q @ k^T and p @ v on the tensor cores
    if int8:
        assert mix.get("PRMT", 0) > 0 and "I2F" not in mix


@pytest.mark.parametrize("heads, int8", [(16, False), (32, False), (16, True)])
def test_prefill_kernel_compiles_for_sm90(heads, int8):
    """Prefill attention over Qwen3-0.6B's (16 query heads) and Llama-3.1-8B's (32) head groups: Hopper's
    warpgroup MMA, base-2 exponentials (MUFU.EX2), no spills, and two programs an SM (at most 255 registers for
    two 4-warp programs: a change that holds more K/V in registers meets this bound first)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(ROOT / "benchmarks" / "sm90_report.py"), "--prefill", str(heads)]
    args += ["--batch", "4", "--context", "574", "--json"] + ["--int8"] * int8
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["spilled_bytes"] == 0
    assert report["programs_per_sm"] >= 2
    mix = report["loop_mix"]
    assert mix.get("HGMMA", 0) > 0 and mix.get("MUFU", 0) > 0, mix


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_int4_matmul_compiles_for_sm90(rows):
    """One INT4 row multiplies in integers (dp4a), 16 and 64 rows on the tensor cores (wgmma; 64 rows of gate|up
    with the weights scaled in packed bf16 pairs by inline PTX), none spilling."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(ROOT / "benchmarks" / "sm90_report.py"), "--quant", "int4", "--rows", str(rows)]
    args += ["--shape", "28672", "4096"] * (rows == 64)
    out = subprocess.run(args + ["--json"], capture_output=True, text=True, env=env, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["spilled_bytes"] == 0
    assert report["loop_mix"].get("IDP" if rows == 1 else "HGMMA", 0) > 0, report["loop_mix"]
    if rows == 64:
        assert report["loop_mix"].get("HFMA2", 0) > 0, report["loop_mix"]


# Launches on CPU tensors compiled for sm_90 instead of run (the interpreter runs kernels that the compiler refuses:
# a global that is not a constexpr, say), one report per launch. LAUNCHES is the body: it may use x, w and norm.
COMPILE_LAUNCHES = """
import json, sys
from unittest import mock
import torch
from triton.runtime.jit import JITFunction
sys.path.insert(0, sys.argv[1])
from benchmarks.sm90_report import compile_for_sm90, resources
from pagellm.kernels import activation, decode_attention, gemv, kv_write, quant_matmul, rmsnorm, sampling

reports = []
def intercept(self, *args, grid, warmup, **kwargs):
    compiled = compile_for_sm90(self, args, kwargs)
    ptx = compiled.asm["ptx"]
    reports.append({
        "kernel": self.fn.__name__,
        "pdl": compiled.metadata.launch_pdl,
        "waits": "griddepcontrol.wait" in ptx,
        "releases": "griddepcontrol.launch_dependents" in ptx,
        **resources(compiled),
    })

bf = torch.bfloat16
x, w, norm = torch.zeros(1, 1024, dtype=bf), torch.zeros(4096, 1024, dtype=bf), torch.zeros(1024, dtype=bf)
with mock.patch.object(JITFunction, "run", intercept):
LAUNCHES
print(json.dumps(reports))
"""


def compile_launches(launches: str) -> list[dict]:
    script = COMPILE_LAUNCHES.replace("LAUNCHES", "\n".join("    " + line for line in launches.splitlines()))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_fused_gemv_kernels_compile_for_sm90():
    """Each fused GEMV variant, as launched on GPUs without PDL."""
    reports = compile_launches(
        """gemv.gemv(x, w)
gemv.rms_norm_gemv(x, None, norm, 1e-6, w)
gemv.rms_norm_gemv(x, x.clone(), norm, 1e-6, w)
gemv.silu_and_mul_gemv(torch.zeros(1, 2048, dtype=bf), w)"""
    )
    assert len(reports) == 4
    assert all(report["spilled_bytes"] == 0 and not report["pdl"] for report in reports)


def test_fp8_output_kernels_compile_for_sm90_without_spills():
    """RMSNorm and SwiGLU quantizing their rows to FP8, at Llama-3.1-8B's widths (SwiGLU's whole 14,336-wide row
    in one program)."""
    reports = compile_launches(
        """rows, weight = torch.zeros(256, 4096, dtype=bf), torch.zeros(4096, dtype=bf)
rmsnorm.rms_norm_to_fp8(rows, weight, 1e-6, None)
rmsnorm.rms_norm_to_fp8(rows, weight, 1e-6, rows.clone())
activation.silu_and_mul_to_fp8(torch.zeros(256, 28672, dtype=bf))"""
    )
    assert [r["kernel"] for r in reports] == ["_rms_norm_kernel"] * 2 + ["_silu_and_mul_kernel"]
    assert all(report["spilled_bytes"] == 0 for report in reports), reports


def test_batch1_decode_kernels_compile_as_pdl_launches_for_sm90():
    """Every kernel of a batch-1 decode step as a PDL launch (what `pdl.launch_early` picks on an sm90 GPU): each
    program must wait for the kernel before it (griddepcontrol.wait), then release the next one."""
    reports = compile_launches(
        """modules = [activation, decode_attention, gemv, kv_write, quant_matmul, rmsnorm, sampling]
for module in modules:
    mock.patch.object(module, "launch_early", lambda t, tokens: tokens == 1).start()
q, k = torch.zeros(1, 16, 128, dtype=bf), torch.zeros(1, 8, 128, dtype=bf)
cache = torch.zeros(64, 16, 8, 128, dtype=bf)
words, scales = torch.zeros(4096, 128, dtype=torch.int32), torch.zeros(4096, 8, dtype=bf)
gemv.gemv(x, w)
gemv.rms_norm_gemv(x, x.clone(), norm, 1e-6, w)
quant_matmul.weight_only_matmul(x, words, scales, scales, 4, 128)
quant_matmul.weight_only_matmul(x, w.to(torch.float8_e4m3fn), torch.zeros(4096), None, 8, 0)
quant_matmul.rms_norm_weight_only_gemv(x, x.clone(), norm, 1e-6, words, scales, scales, 4, 128)
quant_matmul.silu_and_mul_weight_only_gemv(torch.zeros(1, 2048, dtype=bf), words, scales, scales, 4, 128)
quant_matmul.rms_norm_weight_only_gemv(x, None, norm, 1e-6, w.to(torch.float8_e4m3fn), torch.zeros(4096), None, 8, 0)
rmsnorm.rms_norm(x, norm, 1e-6, x)
activation.silu_and_mul(torch.zeros(1, 2048, dtype=bf))
position = torch.zeros(1, dtype=torch.long)
kv_write.rope_and_write_kv(
    q, k, k, position, torch.zeros(64, 128), cache, cache.clone(), position, None, None, norm[:128], norm[:128], 1e-6
)
decode_attention.paged_decode_attention(
    q, cache, cache, torch.zeros(1, 64, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1, 1024, 64
)
sampling.argmax_rows(torch.zeros(1, 32768, dtype=bf))"""
    )
    assert {r["kernel"] for r in reports} == {
        "_gemv_kernel",
        "_int4_gemv_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_rope_write_kv_kernel",
        "_decode_partial_kernel",
        "_decode_merge_kernel",
        "_chunk_stats_kernel",
        "_sample_kernel",
    }
    for report in reports:
        assert report["pdl"] and report["waits"] and report["releases"], report
        assert report["spilled_bytes"] == 0, report
