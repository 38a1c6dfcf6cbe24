"""Data parallelism: M engine replicas, each (possibly tensor-parallel) in its own process with its own GPUs,
behind one front end that validates requests, routes each to the replica with the fewest unfinished requests and
merges what comes back.

`DataParallelEngine` has the Engine's methods, so `LLM` and `AsyncLLM` drive it like one engine. A request whose
prompt starts like one routed before goes to that one's replica, where its prefix is likely cached, unless that
replica is busier than the least loaded by more than AFFINITY_SLACK requests. Requests cross to
a replica as the input processor's plain ProcessedRequest (its compiled grammar, which does not pickle, is
compiled again there); after each of its steps a replica sends back its outputs and stats.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.multiprocessing as mp

from pagellm.config import EngineConfig
from pagellm.distributed.executor import die_with_parent
from pagellm.engine.frontend import load_frontend
from pagellm.engine.input_processor import ProcessedRequest
from pagellm.errors import InvalidParameter
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPORT_WAIT_S = 0.005  # how long `step` waits for a replica's report (new requests wait at most this)
AFFINITY_SLACK = 4  # unfinished requests a replica may have beyond the least loaded and still get a prefix hit
PREFIXES_PER_REPLICA = 65536  # block-prefix hashes remembered per replica (least recently routed forgotten)


class PrefixAffinity:
    """Which replica was last sent each prompt prefix (in whole KV blocks): the routing's guess at which replica
    holds it in its prefix cache."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        hashes, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start : start + self.block_size])))
            hashes.append(parent)
        return hashes

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        seen, count = self._seen[replica], 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            count += 1
        return count

    def record(self, replica: int, hashes: list[int]) -> None:
        seen = self._seen[replica]
        for block_hash in hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > PREFIXES_PER_REPLICA:
            seen.popitem(last=False)


@dataclass
class _Report:
    replica: int
    outputs: list[RequestOutput]
    stats: Any  # EngineStats


class EngineReplica:
    """One replica's process and the two queues to it; a thread turns what it sends into reports."""

    def __init__(self, index: int, config: EngineConfig) -> None:
        """Starts the process; `wait_ready` waits for its engine."""
        self.index = index
        context = mp.get_context("spawn")
        self.inbox, self.outbox = context.Queue(), context.Queue()
        gpus = None
        if config.resolve_device().type == "cuda":  # replica i gets GPUs [i * tp, (i + 1) * tp)
            tp = config.tensor_parallel_size
            gpus = ",".join(str(g) for g in range(index * tp, (index + 1) * tp))
        self.process = context.Process(
            target=_replica_main,
            args=(config, gpus, self.inbox, self.outbox),
            name=f"pagellm-replica{index}",
            daemon=True,
        )
        self.process.start()
        self.stats: Any = None

    def wait_ready(self, reports: queue.Queue) -> None:
        while True:
            try:
                kind, payload = self.outbox.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():  # killed before its engine could say what went wrong
                    raise RuntimeError(
                        f"data-parallel replica {self.index} died while starting (exit code {self.process.exitcode})"
                    ) from None
        if kind == "error":
            raise RuntimeError(f"data-parallel replica {self.index} failed to start: {payload}")
        self.stats = payload
        reader = threading.Thread(target=self._read, args=(self.outbox, reports), name=f"{self.process.name}-reader")
        reader.daemon = True
        reader.start()

    def _read(self, outbox: Any, reports: queue.Queue) -> None:
        while True:
            try:
                kind, *payload = outbox.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    reports.put(
                        RuntimeError(f"data-parallel replica {self.index} died (exit code {self.process.exitcode})")
                    )
                    return
                continue
            if kind == "stopped":
                return
            if kind == "error":
                reports.put(RuntimeError(f"data-parallel replica {self.index} failed: {payload[0]}"))
                return
            outputs, stats = payload
            reports.put(_Report(self.index, outputs, stats))

    def send(self, *message: Any) -> None:
        self.inbox.put(message)

    def stop(self) -> None:
        if self.process.is_alive():
            self.send("stop")
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


def _replica_main(config: EngineConfig, gpus: str | None, inbox: Any, outbox: Any) -> None:
    """A replica's process: an Engine stepping whatever it has, taking requests and aborts between steps."""
    die_with_parent()
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    from pagellm.engine.engine import Engine  # after CUDA_VISIBLE_DEVICES

    try:
        engine = Engine(replace(config, data_parallel_size=1))
    except Exception as exc:
        outbox.put(("error", repr(exc)))
        return
    outbox.put(("ready", engine.stats()))
    try:
        while True:
            try:
                message = inbox.get(timeout=0.5) if not engine.has_unfinished() else inbox.get_nowait()
            except queue.Empty:
                message = None
            while message is not None:
                kind, *args = message
                if kind == "stop":
                    engine.shutdown()
                    outbox.put(("stopped",))
                    return
                if kind == "add":
                    engine.enqueue(args[0])
                else:
                    engine.abort(args[0])
                try:
                    message = inbox.get_nowait()
                except queue.Empty:
                    message = None
            if engine.has_unfinished():
                outbox.put(("step", engine.step(), engine.stats()))
    except Exception as exc:  # a bug in the engine: the front end fails what this replica ran
        logger.exception("replica engine died")
        outbox.put(("error", repr(exc)))


class DataParallelEngine:
    """The Engine's interface over M replicas."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        frontend = load_frontend(config)
        self.model_config, self.tokenizer = frontend.model_config, frontend.tokenizer
        self.max_model_len, self.input_processor = frontend.max_model_len, frontend.input_processor
        self.startup_seconds: dict[str, float] = {}
        check_data_parallel(config)
        self._reports: queue.Queue = queue.Queue()
        self.replicas = [EngineReplica(i, config) for i in range(config.data_parallel_size)]  # loading at once
        # The replicas stop with `shutdown`, when this object is collected (`del llm`), or at exit.
        self._stop = weakref.finalize(self, _stop_replicas, self.replicas)
        for replica in self.replicas:
            replica.wait_ready(self._reports)
        self._owner: dict[str, int] = {}  # unfinished request id -> its replica
        self._load = [0] * len(self.replicas)  # unfinished requests per replica
        self._stats = [replica.stats for replica in self.replicas]
        self._affinity = PrefixAffinity(len(self.replicas), config.block_size)
        self.on_replica_death: Callable[[str], None] | None = None  # AsyncLLM's; None: step() raises

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._owner:
            raise InvalidParameter("request_id", f"request_id={request_id!r} is already in use")
        self.enqueue(self.input_processor.process(prompt, params, request_id))
        return request_id

    def enqueue(self, processed: ProcessedRequest) -> None:
        """Route to the replica likely to hold the prompt's prefix, else to the one with the fewest unfinished
        requests."""
        index = self._route(processed.prompt_token_ids)
        self._owner[processed.request_id] = index
        self._load[index] += 1
        self.replicas[index].send("add", replace(processed, grammar=None))

    def _route(self, prompt_token_ids: list[int]) -> int:
        replicas = range(len(self.replicas))
        least = min(replicas, key=self._load.__getitem__)
        hashes = self._affinity.block_hashes(prompt_token_ids) if self.config.enable_prefix_caching else []
        matched = {i: self._affinity.matched_blocks(i, hashes) for i in replicas}
        best = max(replicas, key=lambda i: (matched[i], -self._load[i]))
        index = best if matched[best] and self._load[best] <= self._load[least] + AFFINITY_SLACK else least
        self._affinity.record(index, hashes)
        return index

    def abort(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        if index is not None:
            self._load[index] -= 1
            self.replicas[index].send("abort", request_id)

    def has_unfinished(self) -> bool:
        return bool(self._owner)

    def step(self) -> list[RequestOutput]:
        """The outputs of the next replica step to come back (none if none comes within REPORT_WAIT_S)."""
        try:
            report = self._reports.get(timeout=REPORT_WAIT_S)
        except queue.Empty:
            return []
        if isinstance(report, Exception):
            if self.on_replica_death is not None:
                self.on_replica_death(str(report))
            raise report
        self._stats[report.replica] = report.stats
        outputs = []
        for out in report.outputs:
            if out.request_id not in self._owner:  # aborted meanwhile
                continue
            if out.finished:
                del self._owner[out.request_id]
                self._load[report.replica] -= 1
            outputs.append(out)
        return outputs

    def stats(self):
        return combine_stats(self._stats)

    def replica_stats(self) -> list:
        return list(self._stats)

    def shutdown(self) -> None:
        self._stop()


def _stop_replicas(replicas: list[EngineReplica]) -> None:
    for replica in replicas:
        replica.stop()


def combine_stats(stats: list) -> Any:
    """One EngineStats for several replicas: counts summed, KV usage over all their blocks."""
    kind = type(stats[0])
    total = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(kind)}
    blocks = total["num_blocks"]
    total["kv_cache_usage"] = 1.0 - total["num_free_blocks"] / blocks if blocks else 0.0
    return kind(**total)


def check_data_parallel(config: EngineConfig) -> None:
    device = config.resolve_device()
    needed = config.data_parallel_size * config.tensor_parallel_size
    if device.type == "cuda" and needed > torch.cuda.device_count():
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size} x tensor_parallel_size={config.tensor_parallel_size} "
            f"needs {needed} GPUs; {torch.cuda.device_count()} are visible"
        )
