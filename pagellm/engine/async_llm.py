"""AsyncLLM: the engine loop on a background thread, streaming outputs to asyncio consumers.

Only the engine thread touches the Engine. Callers validate requests on their own thread (the input processor
reads only state fixed at start-up), then hand the validated, plain request over through a command queue; outputs
come back to each request's stream on its event loop, once a step (the newest only, if the consumer lags). A
stream whose consumer goes away (client hang-up, cancellation) aborts its request, which frees its KV blocks on
the engine thread's next turn.

Why a thread and not a process: torch releases the GIL inside its kernels, so on the GPU the Python work of
the HTTP side overlaps the engine step, and a thread shares the tokenizer and needs no serialization of outputs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pagellm.config import EngineConfig
from pagellm.distributed.data_parallel import DataParallelEngine
from pagellm.distributed.executor import TensorParallelExecutor
from pagellm.engine.engine import EngineStats, make_engine
from pagellm.engine.input_processor import InputProcessor, ProcessedRequest
from pagellm.errors import InvalidParameter
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    """One request's outputs on their way to its consumer, touched only on the consumer's event loop. Outputs are
    cumulative, so only the newest is kept: a consumer that falls behind the engine (the HTTP side under load)
    gets fewer, longer updates instead of a backlog of one per step, as vLLM's output collector does."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if not (isinstance(self._latest, RequestOutput) and self._latest.finished):  # nothing replaces the end
            self._latest = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        return item


def _deliver(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put(item)


RATE_WINDOW_S = 5.0
RANK_DEATH_GRACE_S = 1.0  # for the error answers to reach the clients


@dataclass(frozen=True)
class LiveStats:
    """What the engine thread publishes after each step (read by /metrics and the demo page)."""

    engine: EngineStats  # all replicas together under data parallelism
    recent: tuple[tuple[float, int], ...] = ()  # (time, generation_tokens_total) after the steps of the window
    replicas: tuple[EngineStats, ...] = ()  # each replica's (one entry without data parallelism)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens/s over the last RATE_WINDOW_S seconds up to now, so it falls to 0 once idle."""
        now = time.time()
        points = [(t, n) for t, n in self.recent if now - t <= RATE_WINDOW_S]
        if len(points) < 2:
            return 0.0
        (t0, n0), (_, n1) = points[0], points[-1]
        return (n1 - n0) / max(now - t0, 1e-3)


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.engine = make_engine(config or EngineConfig(**kwargs))
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        stats, replicas = self._engine_stats()
        self.stats = LiveStats(stats, (), replicas)
        self.error: BaseException | None = None
        if isinstance(self.engine, DataParallelEngine):
            self.engine.on_replica_death = self._on_rank_death
        elif isinstance(self.engine.runner, TensorParallelExecutor):
            self.engine.runner.on_rank_death = self._on_rank_death
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        """Validation and tokenization, safe on any thread."""
        return self.engine.input_processor

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ---- caller side ----------------------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream the RequestOutputs of one request (all its n samples) until it finishes; leaving early aborts
        it. Bad input raises InvalidParameter at the first iteration, before anything is queued."""
        processed = self.input_processor.process(prompt, params, request_id or uuid.uuid4().hex)
        async with aclosing(self.stream(processed)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, processed: ProcessedRequest) -> AsyncIterator[RequestOutput]:
        """`generate` for a request its caller validated already (`input_processor.process`)."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error!r}")
        request_id = processed.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidParameter("request_id", f"request_id={request_id!r} is already in use")
            self._streams[request_id] = stream
        self._commands.put(("add", processed))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine stopped: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    # ---- engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._publish(outputs)
        except BaseException as exc:  # a bug in the engine: fail every stream rather than hang them
            logger.exception("engine loop died")
            self._fail_streams(exc)

    def _fail_streams(self, exc: BaseException) -> None:
        self.error = exc
        with self._lock:
            streams = list(self._streams.values())
        self._hand_over([(stream, exc) for stream in streams])

    def _on_rank_death(self, reason: str) -> None:
        """Another tensor-parallel rank (or a data-parallel replica) died: the engine cannot go on. Every caller
        gets the error (the server answers 5xx), then the process exits with an error, as a server without its
        model should."""
        logger.error("%s: failing every request and exiting", reason)
        self._fail_streams(RuntimeError(reason))
        threading.Timer(RANK_DEATH_GRACE_S, os._exit, args=(1,)).start()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "add":
                self.engine.enqueue(arg)
            elif kind == "abort":
                self.engine.abort(arg)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        stats, replicas = self._engine_stats()
        self.stats = LiveStats(stats, self.stats.recent, replicas)

    def _engine_stats(self) -> tuple[EngineStats, tuple[EngineStats, ...]]:
        """(all together, each replica's): a data-parallel engine combines its replicas' itself."""
        stats = self.engine.stats()
        replicas = self.engine.replica_stats() if isinstance(self.engine, DataParallelEngine) else [stats]
        return stats, tuple(replicas)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        stats, replicas = self._engine_stats()
        recent = tuple((t, n) for t, n in self.stats.recent if now - t <= RATE_WINDOW_S)
        self.stats = LiveStats(stats, (*recent, (now, stats.generation_tokens_total)), replicas)
        with self._lock:
            targets = [(stream, out) for out in outputs if (stream := self._streams.get(out.request_id)) is not None]
        self._hand_over(targets)

    @staticmethod
    def _hand_over(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
        """One wake-up of each consumer loop per step, not one per output: each costs the loop a write to its
        self-pipe and a callback."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver, batch)
