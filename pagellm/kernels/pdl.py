"""Programmatic dependent launch (PDL, sm90 and newer) for the kernels of batch-1 decode steps.

A batch-1 decode step is some 230 kernels of a few microseconds each, and between two of them the GPU idles while
the second one's programs are placed and started. Launched with PDL, a kernel's programs may start while the kernel
before it is still running, and wait in `wait_for_inputs` until that kernel has finished and its writes are
visible; right after waiting, each lets the kernel after it launch in turn, so one kernel at a time overlaps the one
before. Every program of a PDL kernel waits first, before it reads or writes anything and before any early return:
a kernel that finished without waiting would let its successor run ahead of the kernel it follows.

Kernels launched without PDL (cuBLAS, torch's own, and these at more than one token) start when the kernel before
them ends, and a PDL kernel after one of them starts when it ends, as without PDL.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def launch_early(t: torch.Tensor, tokens: int) -> bool:
    """Whether a launch over `tokens` tokens (rows) of `t` uses PDL: one token on a CUDA device of sm90 or newer.
    On the H100 PDL made batch-1 decode 13% faster (Qwen3-0.6B), but batch 16 8-22% slower, also with the
    multi-row matmuls launched as before (results/ab-pdl-*-2026-12-06). The interpreter runs CPU tensors and has
    no grid dependency control."""
    if tokens != 1 or not t.is_cuda:
        return False
    return _sm90_or_newer(t.device.index if t.device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm90_or_newer(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible, then let the next kernel's
    programs launch (no-ops in a kernel launched without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
