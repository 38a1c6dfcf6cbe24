"""Tensor-parallel execution on one host: rank 0 (the engine's process) and one spawned process per other rank,
each with its ModelRunner over its share of the model.

Rank 0 stands in for its runner (the same methods): each call is first sent to the other ranks (the plain step
data of `core/step.py` pickles) through a `step_channel` (shared memory when the ranks share rank 0's host, else
the gloo group), then run on every rank at once, so the ranks meet at the same collectives in the same order. Only
rank 0 samples; it broadcasts the tokens on the device, where a look-ahead step's inputs come from, so the other
ranks are sent no sampling inputs (the tokens so far that penalties read).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagellm.config import EngineConfig, ModelConfig
from pagellm.core.step import GrammarBitmask, RunnerOutput, SchedulerOutput
from pagellm.distributed.parallel import TensorParallel, check_tensor_parallel
from pagellm.distributed.step_channel import GlooChannel, ShmChannel, StepChannel, shared_memory_is_ordered
from pagellm.model.loader import load_config_dict
from pagellm.quantization.config import check_tensor_parallel_quantization, resolve_quantization
from pagellm.runner.heap import freeze_start_up_heap
from pagellm.runner.input_batch import HostBatch, build_host_batch
from pagellm.runner.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger(__name__)

# A rank that does not answer a collective within this is taken as dead (gloo's default is 30 minutes).
PR_SET_PDEATHSIG = 1
COLLECTIVE_TIMEOUT = timedelta(seconds=int(os.environ.get("PAGELLM_COLLECTIVE_TIMEOUT_S", "120")))
# Over gloo, an idle rank 0 sends a no-op this often, so that the other ranks' wait for the next call never times out.
KEEPALIVE_S = COLLECTIVE_TIMEOUT.total_seconds() / 4


@dataclass
class RankLaunched:
    """A step launched on every rank: its number (how the other ranks name it) and rank 0's own handle."""

    number: int
    local: LaunchedStep

    @property
    def awaits_bitmask(self) -> bool:
        return self.local.awaits_bitmask


def launched_by_torchrun() -> bool:
    """Started by torchrun (or anything that sets torch.distributed's env:// variables): the ranks exist already."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_rank(rank: int) -> int:
    """This rank's GPU on its host."""
    return int(os.environ.get("LOCAL_RANK", rank))


def step_data_in_shared_memory() -> bool:
    """Every rank runs on this host (spawned here, or torchrun's ranks all local), whose stores the ring can use."""
    same_host = not launched_by_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
    return same_host and shared_memory_is_ordered()


def init_ranks(rank: int, size: int, init_method: str, device: torch.device) -> tuple[TensorParallel, Any]:
    """Join the process group: NCCL for the model's collectives on CUDA (gloo on the CPU), and a gloo group for
    the step data either way."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(local_rank(rank))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD), control


class TensorParallelExecutor:
    """Rank 0's side: its runner, the other ranks' processes, and the calls it sends them."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig, model_dir: Path, max_model_len: int) -> None:
        size = config.tensor_parallel_size
        check_tensor_parallel(model_config, size)
        quantization = resolve_quantization(config, load_config_dict(model_dir))
        if quantization is not None:  # before any rank starts: a rank's error would only show as its exit
            check_tensor_parallel_quantization(quantization, size)
        device = config.resolve_device()
        if device.type == "cuda" and size > torch.cuda.device_count() and not launched_by_torchrun():
            raise ValueError(f"tensor_parallel_size={size} exceeds the {torch.cuda.device_count()} visible GPUs")
        if launched_by_torchrun():  # the other ranks run `pagellm worker` (or the same command), maybe elsewhere
            if int(os.environ["WORLD_SIZE"]) != size:
                raise ValueError(
                    f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']}"
                )
            init_method, self.workers = "env://", []
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            context = mp.get_context("spawn")
            self.workers = [
                context.Process(
                    target=run_worker,
                    args=(rank, size, init_method, model_config, config, model_dir, max_model_len),
                    name=f"pagellm-rank{rank}",
                    daemon=True,
                )
                for rank in range(1, size)
            ]
        for worker in self.workers:
            worker.start()
        shm = ShmChannel(size - 1) if step_data_in_shared_memory() else None
        stopped = threading.Event()
        # The ranks stop with `shutdown`, when this object is collected (`del llm`), or at exit, whichever is first.
        self._stop = weakref.finalize(self, _stop_ranks, self.workers, stopped, shm)
        # What to do when another rank dies: rank 0 would wait in its next collective for COLLECTIVE_TIMEOUT.
        self.on_rank_death: Callable[[str], None] = _exit_on_rank_death
        watch = threading.Thread(
            target=_watch_ranks, args=(weakref.ref(self), self.workers, stopped), name="pagellm-rank-watch"
        )
        watch.daemon = True
        watch.start()
        self.tp, self.control = init_ranks(0, size, init_method, device)
        # The other ranks learn the segment's name, or that there is none (gloo, then).
        dist.broadcast_object_list([shm.name if shm else None], src=0, group=self.control)
        self.channel: StepChannel = shm or GlooChannel(self.control)
        # One call at a time, so a keep-alive never lands between a call's message and the collectives it runs.
        self._lock = threading.Lock()
        self.runner = ModelRunner(model_config, config, model_dir, max_model_len, self.tp)
        self._launched = 0
        self._last_send = time.monotonic()
        if shm is None:
            keepalive = threading.Thread(
                target=_keep_alive, args=(weakref.ref(self), stopped), name="pagellm-rank-keepalive", daemon=True
            )
            keepalive.start()

    @property
    def graphs(self):
        return self.runner.graphs

    def _send(self, method: str, *args: Any) -> None:
        """Under self._lock."""
        self.channel.send((method, args))
        self._last_send = time.monotonic()

    def keep_alive(self) -> None:
        """A no-op to the other ranks if rank 0 has been quiet for KEEPALIVE_S."""
        with self._lock:
            if time.monotonic() - self._last_send >= KEEPALIVE_S:
                self._send("noop")

    def compile_kernels(self) -> None:
        with self._lock:
            self._send("compile_kernels")
            self.runner.compile_kernels()

    def determine_num_blocks(self) -> int:
        with self._lock:
            self._send("determine_num_blocks")
            return smallest_over_ranks(self.runner.determine_num_blocks(), self.control)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        with self._lock:
            self._send("allocate_kv_cache", num_blocks)
            self.runner.allocate_kv_cache(num_blocks)

    def launch(self, step: SchedulerOutput) -> RankLaunched:
        with self._lock:
            self._launched += 1
            batch = build_host_batch(step, self.runner.block_size)  # built once, here, for every rank
            self._send("launch", self._launched, for_other_ranks(batch))
            return RankLaunched(self._launched, self.runner.launch_batch(batch))

    def sample_constrained(self, launched: RankLaunched, grammar: GrammarBitmask | None) -> None:
        with self._lock:
            self._send("sample_constrained", launched.number, None)  # the other ranks do not sample: no mask
            self.runner.sample_constrained(launched.local, grammar)

    def collect(self, launched: RankLaunched) -> RunnerOutput:
        with self._lock:
            self._send("collect", launched.number)
            return self.runner.collect(launched.local)

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (idempotent)."""
        self._stop()


def _stop_ranks(workers: list, stopped: threading.Event, shm: ShmChannel | None) -> None:
    """The ranks are stopped, not asked to stop: this may run while they wait in a collective that rank 0 left
    (Ctrl-C mid-step), where a message would never be read. Under torchrun the other ranks see the group close."""
    stopped.set()
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    if shm is not None:
        shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _keep_alive(executor: weakref.ref, stopped: threading.Event) -> None:
    while not stopped.wait(KEEPALIVE_S / 2):
        owner = executor()
        if owner is None:
            return
        owner.keep_alive()
        del owner


def _watch_ranks(executor: weakref.ref, workers: list, stopped: threading.Event) -> None:
    while not stopped.wait(0.2):
        for worker in workers:
            if worker.exitcode is not None and not stopped.is_set():
                owner = executor()
                if owner is not None:
                    owner.on_rank_death(f"tensor-parallel {worker.name} died (exit code {worker.exitcode})")
                return


def _exit_on_rank_death(reason: str) -> None:
    """The ranks cannot go on without one of them: end the process with an error rather than hang."""
    logger.error("%s: stopping", reason)
    os._exit(1)


def for_other_ranks(batch: HostBatch) -> HostBatch:
    """The step's inputs as a rank that does not sample needs them: without the sampling rows, whose prompt and
    output token lists can be long (`constrained` still says whether sampling waits for a grammar's bitmask)."""
    return replace(batch, sampling_rows=[])


def smallest_over_ranks(value: int, group: Any) -> int:
    """The KV pool every rank can hold: the smallest of the ranks' counts."""
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def run_worker(
    rank: int,
    size: int,
    init_method: str,
    model_config: ModelConfig,
    config: EngineConfig,
    model_dir: Path,
    max_model_len: int,
) -> None:
    """Another rank's process: build its runner, then run what rank 0 sends, until rank 0 stops it (or goes)."""
    die_with_parent()
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    tp, control = init_ranks(rank, size, init_method, config.resolve_device())
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)  # the step channel's segment, or None: gloo
    spawned = not launched_by_torchrun()  # by rank 0's process, whose resource tracker this one shares
    channel: StepChannel = (
        ShmChannel(size - 1, box[0], reader=rank - 1, shares_tracker=spawned) if box[0] else GlooChannel(control)
    )
    runner = ModelRunner(model_config, config, model_dir, max_model_len, tp)
    launched: dict[int, LaunchedStep] = {}
    while True:
        method, args = channel.recv()
        if method == "noop":
            continue
        if method == "launch":
            number, batch = args
            launched[number] = runner.launch_batch(batch)
        elif method == "sample_constrained":
            number, grammar = args
            runner.sample_constrained(launched[number], grammar)
        elif method == "collect":
            runner.collect(launched.pop(args[0]))
        elif method == "determine_num_blocks":
            smallest_over_ranks(runner.determine_num_blocks(), control)
        else:
            getattr(runner, method)(*args)
            if method == "allocate_kv_cache":  # this rank's last start-up step
                freeze_start_up_heap()


def run_torchrun_worker(config: EngineConfig) -> None:
    """A rank other than 0 under torchrun: build this rank's share of the model `config` names and serve rank 0."""
    from pagellm.config import resolve_max_model_len
    from pagellm.model.loader import load_config_dict, resolve_model_dir

    model_dir = resolve_model_dir(config.model, quiet=True)
    model_config = ModelConfig.from_dict(load_config_dict(model_dir))
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} but torchrun started WORLD_SIZE={size}")
    run_worker(rank, size, "env://", model_config, config, model_dir, resolve_max_model_len(config, model_config))


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when rank 0's process goes, however it goes (no orphaned ranks)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not glibc: daemon processes still stop with a normal exit
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
