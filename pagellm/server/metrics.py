"""Prometheus metrics for the server, in their own registry (several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagellm.engine.async_llm import LiveStats
from pagellm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self.ttft = self._metric(
            Histogram, "time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS
        )
        self.tpot = self._metric(
            Histogram, "time_per_output_token_seconds", "Time per output token after the first", buckets=_TPOT_BUCKETS
        )
        self.e2e = self._metric(
            Histogram, "e2e_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS
        )
        # Per engine (a data-parallel replica is one: label engine="0", "1", ...).
        self.running = self._engine_gauge("num_requests_running", "Requests in the running batch")
        self.waiting = self._engine_gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = self._engine_gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use")
        self.prefix_hit_rate = self._engine_gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache")
        self.preemptions = self._engine_gauge("num_preemptions", "Preemptions since start")
        self.prompt_tokens = self._metric(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = self._metric(Counter, "generation_tokens", "Generated tokens of finished requests")
        self._requests = Counter(
            "pagellm:request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def _metric(self, kind: type, name: str, documentation: str, **kwargs):
        """A `pagellm:<name>` metric of this registry, labelled with the served model's name."""
        return kind(f"pagellm:{name}", documentation, ["model_name"], registry=self.registry, **kwargs).labels(
            self._model_name
        )

    def _engine_gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(f"pagellm:{name}", documentation, ["model_name", "engine"], registry=self.registry)

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None:
                self.e2e.observe(m.finished_time - m.arrival_time)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        for choice in out.outputs:
            self.generation_tokens.inc(len(choice.token_ids))
            self._requests.labels(self._model_name, choice.finish_reason or "unknown").inc()
        n = len(out.outputs[0].token_ids)
        if m is not None and m.first_token_time and m.last_token_time and n > 1:
            self.tpot.observe((m.last_token_time - m.first_token_time) / (n - 1))

    def render(self, stats: LiveStats) -> bytes:
        for index, e in enumerate(stats.replicas):
            labels = (self._model_name, str(index))
            self.running.labels(*labels).set(e.num_running)
            self.waiting.labels(*labels).set(e.num_waiting)
            self.kv_usage.labels(*labels).set(e.kv_cache_usage)
            self.prefix_hit_rate.labels(*labels).set(e.prefix_cache_hit_rate)
            self.preemptions.labels(*labels).set(e.num_preemptions)
        return generate_latest(self.registry)
