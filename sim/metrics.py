"""vLLM-named Prometheus metrics of one simulated engine, in its own ``CollectorRegistry``.

All metrics carry vLLM's labels ``model_name`` and ``engine`` ("0"). Times are model seconds.
``vllm:time_per_output_token_seconds`` is observed once per finished request (its mean
inter-token time) rather than per token, to keep many engines cheap in one process. The prefix
cache's lookups are vLLM's counters ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``
(tokens; :meth:`EngineMetrics.add_counter`). The ``sim:*`` metrics are the simulator's own: KV
pulls by kind, remote prefills served, KV holds that expired, failed KV loads prefilled locally
(recomputes), and the gauges the engine and :mod:`sim.handoff` add (:meth:`EngineMetrics.add_gauge`):
requests whose KV is held for a remote decode, open SGLang bootstrap rooms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    """The metric set; ``running``, ``waiting`` and ``kv_usage`` are read at scrape time."""

    def __init__(
        self,
        model_name: str,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        names = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}
        self._values = values
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, names, registry=reg, buckets=buckets).labels(**values)

        self.add_gauge("vllm:num_requests_running", "Requests in the model execution batch.", running)
        self.add_gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled (incl. KV pulls).", waiting
        )
        self.add_gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", kv_usage)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed.", names, registry=reg
        ).labels(**values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", names, registry=reg
        ).labels(**values)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*names, "finished_reason"], registry=reg
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Mean time per output token.", _TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time waiting for admission.", _E2E_BUCKETS)
        kind = [*names, "kind"]
        self._kv_transfers = Counter("sim:kv_transfers", "KV-cache pulls by kind.", kind, registry=reg)
        self._kv_seconds = Counter("sim:kv_transfer_seconds", "Model seconds pulling KV.", kind, registry=reg)
        self.remote_prefills = Counter(
            "sim:remote_prefills", "Prefill-only requests served for a remote decode.", names, registry=reg
        ).labels(**values)
        self.kv_holds_expired = Counter(
            "sim:kv_holds_expired", "Held KV freed as no decode released it in time.", names, registry=reg
        ).labels(**values)
        self.kv_load_failures = Counter(
            "sim:kv_load_failures",
            "Failed KV loads that failed their request (kv_load_failure_policy fail).",
            names,
            registry=reg,
        ).labels(**values)
        self.kv_recomputes = Counter(
            "sim:kv_recomputes",
            "KV loads that failed (policy recompute) or had invalid params, prefilled locally instead.",
            names,
            registry=reg,
        ).labels(**values)

    def add_counter(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """Register a counter whose running total ``fn()`` is read at scrape time.

        Register a counter (rendered ``<name>_total``) with the usual labels whose running total
        ``fn()`` is read at scrape time (the engine keeps the count itself)."""
        self.registry.register(_FunctionCounter(name, doc, self._values, fn))

    def add_gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """Register a gauge with the usual labels whose value ``fn()`` is read at scrape time."""
        names = list(self._values)
        Gauge(name, doc, names, registry=self.registry).labels(**self._values).set_function(fn)

    def request_finished(self, reason: str) -> None:
        """Count one finished request (``reason`` is ``"length"``, ``"stop"`` or ``"abort"``)."""
        self._success.labels(**self._values, finished_reason=reason).inc()

    def kv_transfer(self, kind: str, model_seconds: float) -> None:
        """Count one KV pull of ``kind`` that took ``model_seconds``."""
        self._kv_transfers.labels(**self._values, kind=kind).inc()
        self._kv_seconds.labels(**self._values, kind=kind).inc(model_seconds)

    def render(self) -> bytes:
        """The registry in Prometheus text format (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)


class _FunctionCounter(Collector):
    """One counter series whose value a function returns at scrape time."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], fn: Callable[[], float]) -> None:
        self._name, self._doc, self._labels, self._fn = name, doc, labels, fn

    def collect(self) -> Any:
        family = CounterMetricFamily(self._name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), self._fn())
        yield family
