"""The engine in processes of its own, as vLLM's engine core: `EngineCoreClient` validates requests in the caller's
process and sends them to data_parallel_size engine-core processes (each an `Engine`, tensor-parallel or not); a
reader thread per process takes its outputs back and hands them on.

Why processes: a server whose HTTP side and engine loop share one interpreter shares the GIL between them, and
under load the event loop's Python work (parsing, one SSE chunk per request per step) holds it while the engine
waits to launch its next step (SmolLM2-1.7B's shapes served at 64 requests/s: on an H100 a prototype of this cut
TPOT p50 from 5.6-6.0 to 4.7 ms; on an H200 the two ways were level within the noise, with lower tails in a
process: `benchmarks/results/serving-core-process-2026-12-06.md`).

Outputs cross as DELTA outputs, so what a step sends does not grow with what its requests have generated, and a
CUMULATIVE request's outputs are rebuilt here. Requests cross as the input processor's ProcessedRequest (its
compiled grammar, which does not pickle, is compiled again in the engine's process). With several processes
(data parallelism) a request goes to the one with the fewest unfinished requests, or to the one that was sent a
request with the same prompt prefix, where it is likely cached.

The client has the Engine's methods, so `LLM` drives it like one engine (`step` returns what came back); `AsyncLLM`
passes `on_outputs` instead, called on the reader threads.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing.util
import queue
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pagellm.config import EngineConfig
from pagellm.distributed.data_parallel import Router, check_data_parallel, combine_stats
from pagellm.engine.core_process import EngineCoreProcess
from pagellm.engine.frontend import ModelFrontend
from pagellm.engine.input_processor import ProcessedRequest
from pagellm.errors import InvalidParameter
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

REPORT_WAIT_S = 0.005  # how long `step` waits for a process's report (new requests wait at most this)


@dataclass
class _Tracked:
    """An unfinished request: its process, its id there, and for a CUMULATIVE one its output so far, rebuilt from
    deltas."""

    core: int
    wire_id: str
    cumulative: bool
    so_far: RequestOutput | None = None

    def add(self, output: RequestOutput) -> RequestOutput:
        if self.cumulative:
            self.so_far = output if self.so_far is None else self.so_far.merged(output)
            return self.so_far
        return output


class EngineCoreClient(ModelFrontend):
    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[list[RequestOutput], Any], None] | None = None,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        """Starts the processes and waits for their engines. `on_outputs(outputs, stats)` gets each step's outputs
        and the stats after it (all processes together); without it, `step` returns the outputs. Without
        `on_death`, `step` raises the error of a process that died."""
        self.find_model(config)
        self.startup_seconds: dict[str, float] = {}
        check_data_parallel(config)
        self._reports: queue.Queue = queue.Queue()  # what `step` returns, without `on_outputs`
        self._on_outputs = on_outputs
        self._on_death = on_death or self._reports.put  # a string: `step` raises it
        self._lock = threading.Lock()  # the callers' threads and the reader threads share the request table
        self._requests: dict[str, _Tracked] = {}
        # A request is known to its process by an id of its own (the caller's id, numbered): a caller's id used
        # again right after an abort never gets a late output of the aborted request.
        self._by_wire_id: dict[str, str] = {}
        self._wire_numbers = itertools.count()
        self._stopping = threading.Event()  # set before the processes are told to stop: their ends are no deaths
        self.cores = [EngineCoreProcess(i, config) for i in range(config.data_parallel_size)]  # loading at once
        # The processes stop with `shutdown`, when this object is collected (`del llm`), or at exit before
        # multiprocessing waits for them (exitpriority).
        self._stop = multiprocessing.util.Finalize(
            self, _stop_cores, args=(self.cores, self._stopping), exitpriority=10
        )
        try:
            self.load_tokenizer()  # while the processes start
            self._stats = [core.wait_ready() for core in self.cores]
        except BaseException:
            self._stop()
            raise
        self._router = Router(len(self.cores), config.block_size, config.enable_prefix_caching)
        for core in self.cores:  # a reader holds the client weakly: `del llm` still stops the processes
            reader = threading.Thread(target=_read, args=(weakref.ref(self), core), name=f"{core.process.name}-reader")
            reader.daemon = True
            reader.start()

    # ---- requests in ----------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidParameter("request_id", f"request_id={request_id!r} is already in use")
        self.enqueue(self.input_processor.process(prompt, params, request_id))
        return request_id

    def enqueue(self, processed: ProcessedRequest) -> None:
        cumulative = processed.samples[0].params.output_kind == RequestOutputKind.CUMULATIVE
        with self._lock:
            index = self._router.pick(processed.prompt_token_ids)
            wire_id = f"{processed.request_id}#{next(self._wire_numbers)}"
            self._requests[processed.request_id] = _Tracked(index, wire_id, cumulative)
            self._by_wire_id[wire_id] = processed.request_id
        wire = processed.renamed(wire_id)
        if cumulative:  # the process sends what is new, this side keeps the whole
            as_delta = [replace(s, params=replace(s.params, output_kind=RequestOutputKind.DELTA)) for s in wire.samples]
            wire = replace(wire, samples=as_delta)
        self.cores[index].send("add", replace(wire, grammar=None))

    def abort(self, request_id: str) -> None:
        with self._lock:
            tracked = self._requests.pop(request_id, None)
            if tracked is None:
                return
            del self._by_wire_id[tracked.wire_id]
            self._router.finished(tracked.core)
        self.cores[tracked.core].send("abort", tracked.wire_id)

    def has_unfinished(self) -> bool:
        """Requests unfinished, or finished with outputs (or a death) that `step` has yet to hand on."""
        with self._lock:
            return bool(self._requests) or not self._reports.empty()

    # ---- outputs back ---------------------------------------------------------------------------------------

    def _take(self, core: EngineCoreProcess, message: tuple | None) -> bool:
        """Handle a message from a process (None: its end of the pipe closed); False once no more will come."""
        if message is None:
            if not self._stopping.is_set():
                self._on_death(f"{core.name} died (exit code {core.exit_code()})")
            return False
        kind, *payload = message
        if kind == "stopped":
            return False
        if kind == "error":
            self._on_death(f"{core.name} failed: {payload[0]}")
            return False
        try:
            with self._lock:
                outputs = self._collect(core.index, *payload)
                if self._on_outputs is None:
                    # Queued as its finished requests leave the table: `has_unfinished` sees one or the other.
                    self._reports.put(outputs)
            if self._on_outputs is not None:
                self._on_outputs(outputs, self.stats())
        except Exception as exc:  # a bug on this side: outputs lost, so fail everything rather than hang
            logger.exception("reading %s's outputs failed", core.name)
            self._on_death(f"reading {core.name}'s outputs failed: {exc!r}")
            return False
        return True

    def _collect(self, index: int, outputs: list[RequestOutput], stats: Any) -> list[RequestOutput]:
        """A step's outputs under the caller's ids (called holding the lock)."""
        collected = []
        self._stats[index] = stats
        for output in outputs:
            request_id = self._by_wire_id.get(output.request_id)
            if request_id is None:  # aborted meanwhile
                continue
            tracked = self._requests[request_id]
            if output.finished:
                del self._requests[request_id], self._by_wire_id[output.request_id]
                self._router.finished(index)
            output.request_id = request_id  # unpickled here: this side's to change
            collected.append(tracked.add(output))
        return collected

    def step(self) -> list[RequestOutput]:
        """The outputs of the next step to come back (none if none comes within REPORT_WAIT_S)."""
        try:
            report = self._reports.get(timeout=REPORT_WAIT_S)
        except queue.Empty:
            return []
        if isinstance(report, str):
            raise RuntimeError(report)
        return report

    def stats(self) -> Any:
        """One EngineStats: all processes together."""
        return self._stats[0] if len(self._stats) == 1 else combine_stats(self._stats)

    def replica_stats(self) -> list:
        return list(self._stats)

    def shutdown(self) -> None:
        self._stop()


def _read(client_ref: weakref.ref, core: EngineCoreProcess) -> None:
    """A reader thread: one process's messages to the client, while both live."""
    while True:
        try:
            message = core.conn.recv()
        except (EOFError, OSError):
            message = None
        client = client_ref()
        if client is None or not client._take(core, message):
            return
        del client


def _stop_cores(cores: list[EngineCoreProcess], stopping: threading.Event) -> None:
    stopping.set()
    for core in cores:
        core.stop()
