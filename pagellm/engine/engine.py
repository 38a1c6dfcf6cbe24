"""Engine: requests in, RequestOutputs out. Start-up builds the pieces; one `step()` schedules, runs the model,
hands the sampled tokens to the scheduler (which owns request state) and the output processor (text, stop strings,
outputs), and stops what a stop string ended."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.config import EngineConfig, ModelConfig
from pagellm.core.request import Request, RequestStatus
from pagellm.core.step import SchedulerOutput
from pagellm.distributed.executor import RankLaunched, TensorParallelExecutor
from pagellm.engine.core_client import EngineCoreClient
from pagellm.engine.frontend import ModelFrontend
from pagellm.engine.input_processor import ProcessedRequest
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.scheduler import Scheduler, SchedulerStats
from pagellm.engine.structured_outputs import StructuredOutputs
from pagellm.errors import InvalidParameter
from pagellm.outputs import RequestOutput
from pagellm.runner.heap import freeze_start_up_heap
from pagellm.runner.model_runner import LaunchedStep, ModelRunner
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    from pagellm.core.step import GrammarBitmask

logger = logging.getLogger(__name__)


@dataclass
class EngineStats(SchedulerStats):
    generation_tokens_total: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Engine(ModelFrontend):
    def __init__(self, config: EngineConfig) -> None:
        self.find_model(config)
        # Seconds spent in each start-up phase, logged and kept for benchmarks.
        self.startup_seconds: dict[str, float] = {}
        # The tokenizer loads on a thread of its own meanwhile (mostly while this one waits on weights or kernels).
        with ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenizer") as loader:
            tokenizer_loaded = loader.submit(self.load_tokenizer)
            with self._phase("load_model"):
                self.runner = make_runner(self.model_config, config, self.model_dir, self.max_model_len)
            with self._phase("compile_kernels"):
                self.runner.compile_kernels()  # started before the weights loaded: what their loading did not hide
            with self._phase("profile_memory"):
                num_blocks = self.runner.determine_num_blocks()
            with self._phase("kv_cache_and_cuda_graphs"):
                self.runner.allocate_kv_cache(num_blocks)
            with self._phase("freeze_heap"):  # while the tokenizer may still load: its few objects stay unfrozen
                freeze_start_up_heap()
            with self._phase("tokenizer"):  # what the rest did not hide
                tokenizer_loaded.result()
        if not config.quiet:
            logger.info(
                "KV cache: %d blocks of %d tokens; start-up %s",
                num_blocks,
                config.block_size,
                ", ".join(f"{name} {secs:.1f} s" for name, secs in self.startup_seconds.items()),
            )
        self.scheduler = Scheduler(
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching),
            config.max_num_seqs,
            config.token_budget,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_outputs = StructuredOutputs(
            self.model_config.vocab_size,
            pin_memory=config.resolve_device().type == "cuda",
            stop_token_ids=self.input_processor.grammar_compiler.stop_token_ids,
        )
        self._ids = itertools.count()
        self._in_flight: _InFlight | None = None  # the launched step whose tokens have not come back yet
        # The step after it, already launched: a constrained look-ahead step's successor (see `step`).
        self._launched_next: _InFlight | None = None

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.startup_seconds[name] = time.perf_counter() - start

    # ---- requests in ----------------------------------------------------------------------------------------

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue a request (n samples of it when params.n > 1). Raises InvalidParameter (a
        ValueError), queueing nothing, on bad input."""
        request_id = request_id or str(next(self._ids))
        if self.output_processor.has_request(request_id):
            raise InvalidParameter("request_id", f"request_id={request_id!r} is already in use")
        self.enqueue(self.input_processor.process(prompt, params, request_id))
        return request_id

    def enqueue(self, processed: ProcessedRequest) -> None:
        """Queue a request validated by `input_processor` (possibly on another thread, or in another process:
        then its grammar, which does not pickle, is compiled again here, from the cache after the first time)."""
        grammar = processed.grammar
        structured = processed.samples[0].params.structured_outputs
        if grammar is None and structured is not None:
            grammar = self.input_processor.grammar_compiler.compile(structured)
        self.output_processor.add_request(processed)
        for sample in processed.samples:
            if grammar is not None:
                self.structured_outputs.add(sample.request_id, grammar)
            self.scheduler.add_request(
                Request(sample.request_id, processed.prompt_token_ids, sample.params, sample.max_tokens)
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request at once and free its blocks. Unknown or finished ids are ignored."""
        running, output = self.output_processor.abort(request_id)
        self.scheduler.finish_requests(running, RequestStatus.FINISHED_ABORTED)
        self.structured_outputs.remove(running)
        return output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or self._launched_next is not None

    # ---- one step -------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for every request that got a new token or finished
        (only finished ones for requests with output_kind FINAL_ONLY).

        With async_scheduling, a pure-decode step's successor is launched before this step's tokens come back
        (its input tokens stay on the device), so the host's bookkeeping overlaps the GPU's work instead of
        leaving it idle. A request that turns out to have stopped wastes its row of the successor. A successor
        with constrained rows (structured outputs) runs its forward pass meanwhile and samples once this step's
        tokens have advanced the grammars; its own successor is then launched at once, before this call returns,
        so that the device does not wait for the host's scheduling between the sampling and the next forward pass
        (a request arriving meanwhile joins the step after)."""
        if self._in_flight is None:
            step = self.scheduler.schedule()
            if step.is_empty:
                return []
            self._in_flight = self._launch(step)
            self._sample_constrained(self._in_flight)
        current, self._in_flight = self._in_flight, self._launched_next
        self._launched_next = None
        if self._in_flight is None and self.config.async_scheduling:
            self._in_flight = self._launch_ahead(current)
        updates = self.scheduler.update_from_output(current.step, self.runner.collect(current.launched))
        self.structured_outputs.accept(updates)
        # The look-ahead step's constrained rows wait for their bitmask, filled on its own thread while this one
        # processes the outputs. A row of a request that the output processor finds stopped is wasted, like any
        # look-ahead row of a stopped request.
        fill = self._start_bitmask(self._in_flight)
        outputs, stopped = self.output_processor.process(updates)
        if fill is not None:
            self.runner.sample_constrained(self._in_flight.launched, fill.result())
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.structured_outputs.remove(stopped)
        if fill is not None:
            self._launched_next = self._launch_ahead(self._in_flight)
        return outputs

    def _launch_ahead(self, in_flight: _InFlight) -> _InFlight | None:
        """The step after `in_flight`, launched before its tokens are back, when the scheduler can tell it."""
        ahead = self.scheduler.schedule_ahead(in_flight.step)
        return self._launch(ahead) if ahead is not None else None

    def _launch(self, step: SchedulerOutput) -> _InFlight:
        return _InFlight(step, self.runner.launch(step))

    def _sample_constrained(self, in_flight: _InFlight) -> None:
        fill = self._start_bitmask(in_flight)
        if fill is not None:
            self.runner.sample_constrained(in_flight.launched, fill.result())

    def _start_bitmask(self, in_flight: _InFlight | None) -> Future[GrammarBitmask | None] | None:
        """The bitmask of a step whose constrained rows wait for it, being filled; None if it waits for none."""
        if in_flight is None or not in_flight.launched.awaits_bitmask:
            return None
        return self.structured_outputs.start_bitmask(in_flight.step)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (they also stop when this process exits)."""
        if isinstance(self.runner, TensorParallelExecutor):
            self.runner.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(
            **vars(self.scheduler.stats()), generation_tokens_total=self.output_processor.generation_tokens_total
        )


def make_engine(config: EngineConfig) -> Engine | EngineCoreClient:
    """One engine in this process, or data_parallel_size replicas, each in its own process, behind one client."""
    if config.data_parallel_size == 1:
        return Engine(config)
    return EngineCoreClient(config)


def make_runner(
    model_config: ModelConfig, config: EngineConfig, model_dir, max_model_len: int
) -> ModelRunner | TensorParallelExecutor:
    if config.tensor_parallel_size == 1:
        return ModelRunner(model_config, config, model_dir, max_model_len)
    return TensorParallelExecutor(model_config, config, model_dir, max_model_len)


@dataclass
class _InFlight:
    step: SchedulerOutput
    launched: LaunchedStep | RankLaunched
