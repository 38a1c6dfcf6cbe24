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
