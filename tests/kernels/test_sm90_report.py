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


# Each fused GEMV variant launched once with bf16 tensors on the CPU, compiled for sm_90 instead of run: the
# interpreter runs kernels that the compiler refuses (a global that is not a constexpr, say).
FUSED_GEMV_LAUNCHES = """
import json, sys
from unittest import mock
import torch
from triton.runtime.jit import JITFunction
sys.path.insert(0, sys.argv[1])
from benchmarks.sm90_report import compile_for_sm90, resources
from pagellm.kernels import gemv

reports = []
def intercept(self, *args, grid, warmup, **kwargs):
    reports.append(resources(compile_for_sm90(self, args, kwargs)))

w = torch.zeros(4096, 1024, dtype=torch.bfloat16)
norm = torch.zeros(1024, dtype=torch.bfloat16)
x = torch.zeros(1, 1024, dtype=torch.bfloat16)
with mock.patch.object(JITFunction, "run", intercept):
    gemv.gemv(x, w)
    gemv.rms_norm_gemv(x, None, norm, 1e-6, w)
    gemv.rms_norm_gemv(x, x.clone(), norm, 1e-6, w)
    gemv.silu_and_mul_gemv(torch.zeros(1, 2048, dtype=torch.bfloat16), w)
print(json.dumps(reports))
"""


def test_fused_gemv_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-c", FUSED_GEMV_LAUNCHES, str(ROOT)]
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True)
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(reports) == 4
    assert all(report["spilled_bytes"] == 0 for report in reports)
