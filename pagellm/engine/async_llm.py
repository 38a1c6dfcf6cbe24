"""AsyncLLM: the engine in a process of its own (`EngineCoreClient`: why a process is said there), streaming
outputs to asyncio consumers.

Callers validate requests on their own thread (the input processor reads only state fixed at start-up) and hand
the validated, plain request to the engine's process; outputs come back on the client's reader thread and go to
each request's stream on its event loop, once a step: the newest only if the consumer lags (a DELTA request's
deltas merged into one). A stream whose consumer goes away (client hang-up, cancellation) aborts its request,
which frees its KV blocks between the engine's steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.core_client import EngineCoreClient
from pagellm.engine.engine import EngineStats
from pagellm.engine.input_processor import InputProcessor, ProcessedRequest
from pagellm.errors import InvalidParameter
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class _Stream:
    """One request's outputs on their way to its consumer, touched only on the consumer's event loop. Only the
    newest is kept (a DELTA request's merged with those not read yet): a consumer that falls behind the engine (the
    HTTP side under load) gets fewer, longer updates instead of a backlog of one per step, as vLLM's output
    collector does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delta: bool) -> None:
        self.loop = loop
        self._delta = delta
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        latest = self._latest
        if not (isinstance(latest, RequestOutput) and latest.finished):  # nothing replaces the end
            if self._delta and isinstance(latest, RequestOutput) and isinstance(item, RequestOutput):
                item = latest.merged(item)
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
ENGINE_DEATH_GRACE_S = 1.0  # for the error answers to reach the clients


@dataclass(frozen=True)
class LiveStats:
    """The engine's figures as of its last step, for /metrics and the demo page."""

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
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # the callers' threads and the client's reader threads share the streams
        self._recent: tuple[tuple[float, int], ...] = ()
        self.error: BaseException | None = None
        self.engine = EngineCoreClient(
            config or EngineConfig(**kwargs), on_outputs=self._publish, on_death=self._on_engine_death
        )

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
    def default_sampling(self) -> dict[str, Any]:
        """The model's sampling defaults (`generation_config`): SamplingParams fields a request leaves unset."""
        return self.engine.default_sampling

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def stats(self) -> LiveStats:
        """As of the engine's last step (read by /metrics and the demo page)."""
        with self._lock:
            recent = self._recent
        return LiveStats(self.engine.stats(), recent, tuple(self.engine.replica_stats()))

    def shutdown(self) -> None:
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
        delta = processed.samples[0].params.output_kind == RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), delta)
        with self._lock:
            if request_id in self._streams:
                raise InvalidParameter("request_id", f"request_id={request_id!r} is already in use")
            self._streams[request_id] = stream
        finished = False
        try:
            self.engine.enqueue(processed)
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
                self.engine.abort(request_id)

    # ---- the client's reader threads ------------------------------------------------------------------------

    def _publish(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        now = time.time()
        with self._lock:
            recent = (p for p in self._recent if now - p[0] <= RATE_WINDOW_S)
            self._recent = (*recent, (now, stats.generation_tokens_total))
            targets = [(stream, out) for out in outputs if (stream := self._streams.get(out.request_id)) is not None]
        self._hand_over(targets)

    def _fail_streams(self, exc: BaseException) -> None:
        self.error = exc
        with self._lock:
            streams = list(self._streams.values())
        self._hand_over([(stream, exc) for stream in streams])

    def _on_engine_death(self, reason: str) -> None:
        """The engine's process (or a replica's, or another tensor-parallel rank) died: the engine cannot go on.
        Every caller gets the error (the server answers 5xx), then the process exits with an error, as a server
        without its model should."""
        logger.error("%s: failing every request and exiting", reason)
        self._fail_streams(RuntimeError(reason))
        threading.Timer(ENGINE_DEATH_GRACE_S, os._exit, args=(1,)).start()

    @staticmethod
    def _hand_over(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
        """One wake-up of each consumer loop per step, not one per output: each costs the loop a write to its
        self-pipe and a callback."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_deliver, batch)
