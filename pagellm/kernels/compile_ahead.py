"""Compile the Triton kernels that a block of code launches all at once, in the background, before running them.

Triton compiles a kernel specialization the first time it is launched, and then loads it and builds its launcher
(a C stub compiled with the host compiler, on a fresh cache), one kernel after another: a model's forward pass and
sampler at start-up meet some twenty of them, and on a fresh cache this was most of the engine's cold start.
Inside `compile_ahead()` a launch of a specialization not yet compiled is only noted, through Triton's
`jit_cache_hook`: it neither compiles nor runs, so its outputs keep whatever their memory held. On leaving the block
the noted specializations start compiling together on a thread pool (`JITFunction.preload` under Triton's
`AsyncCompileMode`; the compiler releases the GIL for much of its work, ptxas and the host compiler included) into
each kernel's in-memory cache, their binaries are loaded and launchers built the same way, and the caller goes on
(loading weights, say) until `Compilation.wait()`; after it, the same launches run at once. The block must
therefore not use a kernel's output where garbage could fault: as an index, a size, or a value read on the host.

The hook is process-wide: while the block runs, other threads' first launches are only noted too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from triton import knobs
from triton.runtime._async_compile import AsyncCompileMode, FutureKernel
from triton.runtime.jit import JITFunction, JitFunctionInfo


class Compilation:
    """The kernels a `compile_ahead()` block noted, compiling in the background once the block is left."""

    def __init__(self) -> None:
        self._done: Future[None] | None = None

    def wait(self) -> None:
        """Block until every noted kernel is compiled, loaded and launchable; raise what compiling raised."""
        if self._done is not None:
            self._done.result()


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[Compilation]:
    """Note the block's uncompiled Triton launches instead of running them; on exit, start compiling them."""
    pending: dict[tuple[int, str], tuple[JITFunction, str]] = {}  # (kernel, key) -> kernel, specialization

    def note(*, key: str, fn: JitFunctionInfo, compile: dict, **_) -> bool:
        pending.setdefault((id(fn.jit_function), key), (fn.jit_function, compile["specialization_data"]))
        return True  # skip this launch's compile and the launch itself

    compilation = Compilation()
    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, note
    try:
        yield compilation
    finally:
        knobs.runtime.jit_cache_hook = previous
    if pending:
        # One driver thread, so that the caller's thread is free; torch's current device is per thread.
        driver = ThreadPoolExecutor(1, thread_name_prefix="compile_ahead")
        compilation._done = driver.submit(
            _compile_and_load,
            list(pending.values()),
            torch.cuda.current_device(),
            workers or min(len(pending), os.cpu_count() or 1),
        )
        driver.shutdown(wait=False)


def _compile_and_load(kernels: list[tuple[JITFunction, str]], device: int, workers: int) -> None:
    def load(future: FutureKernel) -> None:
        with torch.cuda.device(device):
            future.result()._init_handles()  # what the first launch would do: load the binary, build the launcher

    with torch.cuda.device(device), ThreadPoolExecutor(workers) as pool:
        with AsyncCompileMode(pool):
            compiled = [kernel.preload(specialization) for kernel, specialization in kernels]
            # Queued behind every compile, so a load waiting for its kernel never holds a worker a compile needs.
            loaded = [pool.submit(load, future) for future in compiled]
        for future in loaded:
            future.result()
