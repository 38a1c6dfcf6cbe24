"""Compile the Triton kernels that a block of code launches all at once, on a thread pool, before running it.

Triton compiles a kernel specialization the first time it is launched, and then loads it and builds its launcher
(a C stub compiled with the host compiler, on a fresh cache), one kernel after another: a model's forward pass and
sampler at start-up meet some twenty of them, and on a fresh cache this was most of the engine's cold start.
Inside `compile_ahead()` a launch of a specialization not yet compiled is only noted, through Triton's
`jit_cache_hook`: it neither compiles nor runs, so its outputs keep whatever their memory held. On leaving the block
the noted specializations compile together (`JITFunction.preload` under Triton's `AsyncCompileMode`; the compiler
releases the GIL for much of its work, ptxas and the host compiler included) into each kernel's in-memory cache,
their launchers are built the same way, and the same launches afterwards run at once. The block must therefore
not use a kernel's output where garbage could fault: as an index, a size, or a value read on the host.

The hook is process-wide: while the block runs, other threads' first launches are only noted too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from triton import knobs
from triton.runtime._async_compile import AsyncCompileMode, FutureKernel
from triton.runtime.jit import JitFunctionInfo, JITFunction


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[None]:
    """Note the block's uncompiled Triton launches instead of running them; compile them in parallel on exit."""
    pending: dict[tuple[int, str], tuple[JITFunction, str]] = {}  # (kernel, key) -> kernel, specialization

    def note(*, key: str, fn: JitFunctionInfo, compile: dict, **_) -> bool:
        pending.setdefault((id(fn.jit_function), key), (fn.jit_function, compile["specialization_data"]))
        return True  # skip this launch's compile and the launch itself

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, note
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = previous
    if not pending:
        return
    device = torch.cuda.current_device()  # per thread in torch: the workers load the binaries onto this one

    def load(future: FutureKernel) -> None:
        with torch.cuda.device(device):
            future.result()._init_handles()  # what the first launch would do: load the binary, build the launcher

    with ThreadPoolExecutor(workers or min(len(pending), os.cpu_count() or 1)) as pool:
        with AsyncCompileMode(pool):
            compiled = [kernel.preload(specialization) for kernel, specialization in pending.values()]
        list(pool.map(load, compiled))
