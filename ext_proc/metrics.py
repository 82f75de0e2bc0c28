"""Prometheus metrics, on a registry of their own so several servers can share a process.

Per-endpoint gauges are read from the endpoint registry at scrape time (a custom collector),
so the request path never touches them; counters and the histograms use pre-bound children, and the
histograms observed per request are :class:`~ext_proc.histograms.LoopHistogram` values (the same samples
at a tenth of prometheus_client's cost per observation), the counters counted per request (decisions,
streams, serving endpoints) :class:`~ext_proc.histograms.LoopCounter` values (the same samples at a
quarter of its cost per count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ext_proc.affinity import Estimate
from ext_proc.histograms import Count, LoopCounter, LoopHistogram, Observations
from ext_proc.pool_signals import PoolSignal
from ext_proc.registry import EndpointState

DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2)
SCRAPE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ESTIMATE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Seconds: ``auto``'s estimates, from a short in-group transfer to a queue several seconds deep."""
HIT_BUCKETS = (0, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
"""Tokens: a prefix-cache hit, from none to a long context held whole."""
TOKENIZE_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5)
"""Seconds: one prompt's tokenization, from a cached conversation to a long cold prompt behind others."""
LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0)


class _EndpointLoadCollector(Collector):
    def __init__(self, endpoints: Callable[[], Iterable[EndpointState]]) -> None:
        self._endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "group", "endpoint"]
        tokens = GaugeMetricFamily(
            "pd_extproc_endpoint_active_tokens",
            "In-flight tokens charged to the endpoint, by this gateway replica and its peers",
            labels=labels,
        )
        requests = GaugeMetricFamily(
            "pd_extproc_endpoint_active_requests",
            "In-flight requests routed to the endpoint, by this gateway replica and its peers",
            labels=labels,
        )
        peer_tokens = GaugeMetricFamily(
            "pd_extproc_endpoint_peer_tokens",
            "In-flight tokens the peer gateway replicas charged to the endpoint (shared_state; included in "
            "active_tokens)",
            labels=labels,
        )
        peer_requests = GaugeMetricFamily(
            "pd_extproc_endpoint_peer_requests",
            "In-flight requests the peer gateway replicas routed to the endpoint (included in "
            "active_requests)",
            labels=labels,
        )
        served = GaugeMetricFamily(
            "pd_extproc_endpoint_model_info",
            "1 for each model the endpoint serves (declared or listed by its engine; none: every model), "
            "with its parent (an adapter's base model, else empty)",
            labels=[*labels, "model", "parent"],
        )
        blended = GaugeMetricFamily(
            "pd_extproc_endpoint_blended_tokens",
            "Tokens the decision reads for the endpoint: local in-flight tokens blended with the engine's "
            "own load (equal to active_tokens without a fresh engine sample)",
            labels=labels,
        )
        for state in self._endpoints():
            values = [state.role.value, state.group, state.address]
            tokens.add_metric(values, state.active_tokens)
            requests.add_metric(values, state.active_requests)
            blended.add_metric(values, state.blended_tokens)
            peer_tokens.add_metric(values, state.peer_tokens)
            peer_requests.add_metric(values, state.peer_requests)
            for model in state.models() or ():
                served.add_metric([*values, model.name, model.parent or ""], 1)
        yield tokens
        yield requests
        yield blended
        yield peer_tokens
        yield peer_requests
        yield served


class _EngineScrapeCollector(Collector):
    def __init__(self, ages: Callable[[], dict[str, float]], stale: Callable[[], int]) -> None:
        self._ages = ages
        self._stale = stale

    def collect(self) -> Iterator[GaugeMetricFamily]:
        ages = GaugeMetricFamily(
            "pd_extproc_engine_sample_age_seconds",
            "Seconds since the engine's last good /metrics sample",
            labels=["endpoint"],
        )
        for address, age in self._ages().items():
            ages.add_metric([address], age)
        yield ages
        yield GaugeMetricFamily(
            "pd_extproc_engine_stale_endpoints",
            "Pickable endpoints without a fresh engine sample (their load is local accounting alone)",
            value=self._stale(),
        )


class _KvEventsCollector(Collector):
    def __init__(self, blocks: Callable[[], dict[str, dict[str, int]]], stale: Callable[[], int]) -> None:
        self._blocks = blocks
        self._stale = stale

    def collect(self) -> Iterator[GaugeMetricFamily]:
        blocks = GaugeMetricFamily(
            "pd_extproc_kv_index_blocks",
            "Blocks the engine reported holding (kv-events prefix source), by endpoint and tier",
            labels=["endpoint", "tier"],
        )
        for address, tiers in self._blocks().items():
            for tier, count in tiers.items():
                blocks.add_metric([address, tier], count)
        yield blocks
        yield GaugeMetricFamily(
            "pd_extproc_kv_events_stale_publishers",
            "Engines subscribed to that published nothing within kv_events.stale_after_seconds "
            "(routed as holding nothing)",
            value=self._stale(),
        )


class Metrics:
    """The server's metrics. ``registry`` is what ``/metrics`` exposes."""

    def __init__(self, endpoints: Callable[[], Iterable[EndpointState]]) -> None:
        self.registry = CollectorRegistry()
        self._decisions = LoopCounter(
            "pd_extproc_route_decisions_total",
            "Routing decisions by affinity mode and where the KV cache travels",
            ["mode", "locality"],
            registry=self.registry,
        )
        self._rejected = Counter(
            "pd_extproc_rejected_total",
            "Requests answered with an error instead of routed",
            ["reason"],
            registry=self.registry,
        )
        self._decision_seconds = LoopHistogram(
            "pd_extproc_decision_seconds",
            "Time spent in the affinity decision (choose) of one routed request, in seconds",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self._auto = tuple(
            LoopHistogram(
                f"pd_extproc_auto_{name}_seconds",
                f"affinity auto: {what}, in seconds, by the chosen decode's locality",
                ["locality"],
                buckets=ESTIMATE_BUCKETS,
                registry=self.registry,
            )
            for name, what in (
                ("transfer", "estimated KV transfer time from the prefill to the chosen decode"),
                ("wait", "estimated wait at the chosen decode (its load)"),
                (
                    "margin",
                    "the best decode of the other locality's estimated delay minus the chosen one's "
                    "(the delay crossing, or staying in the group, saved)",
                ),
            )
        )
        self._auto_children: dict[str, tuple[Observations, Observations, Observations]] = {}
        self._auto_prefill = LoopHistogram(
            "pd_extproc_auto_prefill_seconds",
            "affinity auto: estimated queue and compute time at the chosen prefill, in seconds",
            buckets=ESTIMATE_BUCKETS,
            registry=self.registry,
        )
        self._predicted_hits = LoopHistogram(
            "pd_extproc_prefix_predicted_hit_tokens",
            "Prompt tokens the prefix index predicted the chosen endpoint holds, per decision, by role",
            ["role"],
            buckets=HIT_BUCKETS,
            registry=self.registry,
        )
        self._predicted_tokens = Counter(
            "pd_extproc_prefix_predicted_tokens",
            "Prompt tokens this gateway placed on the endpoint (kind=placed) and the hit tokens its prefix "
            "index predicted there (kind=hit)",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self._engine_tokens = Counter(
            "pd_extproc_prefix_engine_tokens",
            "Prompt tokens the engine reports it looked up in its prefix cache (kind=queried, "
            "vllm:prefix_cache_queries) and found (kind=hit, vllm:prefix_cache_hits), all traffic",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self._index_scale = Gauge(
            "pd_extproc_prefix_index_scale",
            "Share of the endpoint's KV capacity the prefix index keeps for it (self-correction; 1 = all)",
            ["endpoint"],
            registry=self.registry,
        )
        self._prefix_children: dict[tuple[str, str], tuple[Counter, Counter, Observations]] = {}
        self._kv_received = Counter(
            "pd_extproc_kv_events_received_total",
            "KV-event messages received from the engine (kv-events prefix source)",
            ["endpoint"],
            registry=self.registry,
        )
        self._kv_decoded = Counter(
            "pd_extproc_kv_events_decoded_total",
            "KV-cache events decoded, by endpoint and kind (BlockStored, BlockRemoved, AllBlocksCleared)",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self._kv_dropped = Counter(
            "pd_extproc_kv_events_dropped_total",
            "KV-event messages (reason garbled, duplicate) or events (unknown_type, lora, block_size, "
            "orphan, full) not applied to the index, by endpoint and reason",
            ["endpoint", "reason"],
            registry=self.registry,
        )
        self._kv_replays = Counter(
            "pd_extproc_kv_events_replays_total",
            "Replays asked of the engine's replay socket after a sequence gap, by outcome (ok, failed)",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self._kv_resets = Counter(
            "pd_extproc_kv_events_resets_total",
            "Times the index dropped an engine's entries, by reason (restart, gap)",
            ["endpoint", "reason"],
            registry=self.registry,
        )
        self._shared_sent = Counter(
            "pd_extproc_shared_messages_sent_total",
            "Shared-state messages this replica sent, by kind (batch, sync_request, sync_answer)",
            ["kind"],
            registry=self.registry,
        )
        self._shared_sent_bytes = Counter(
            "pd_extproc_shared_sent_bytes_total",
            "Bytes of shared-state messages sent",
            registry=self.registry,
        )
        self._shared_received = Counter(
            "pd_extproc_shared_messages_received_total",
            "Shared-state messages from peer replicas applied, by kind (batch, sync_request, index)",
            ["kind"],
            registry=self.registry,
        )
        self._shared_dropped = Counter(
            "pd_extproc_shared_messages_dropped_total",
            "Shared-state messages (or parts) not applied or not sent, by reason",
            ["reason"],
            registry=self.registry,
        )
        self._shared_sync_requests = Counter(
            "pd_extproc_shared_sync_requests_total",
            "Peers' sync requests by outcome: answered at once, coalesced into the next answer, refused "
            "(too many waiting)",
            ["outcome"],
            registry=self.registry,
        )
        self._shared_lag = Histogram(
            "pd_extproc_shared_sync_lag_seconds",
            "From a peer's batch being stamped to its being applied here (peer's wall clock to this one's)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=self.registry,
        )
        self._slot_wait = Histogram(
            "pd_extproc_decision_slot_wait_seconds",
            "Time a request waited for this replica's decision slot before it was routed "
            "(shared_state.decision_slot_ms on, peers heard from), in seconds",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=self.registry,
        )
        self._shared_connected = Gauge(
            "pd_extproc_shared_connected",
            "1 while the shared-state bus is connected, 0 otherwise (shared_state kind nats)",
            registry=self.registry,
        )
        self._prefill_legs = Counter(
            "pd_extproc_prefill_leg_total",
            "Prefill legs sent by the gateway (handoffs kv-transfer-params, sglang-bootstrap), by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self._prefill_leg_seconds = Histogram(
            "pd_extproc_prefill_leg_seconds",
            "Duration of prefill legs that got an HTTP answer, in seconds",
            buckets=LEG_BUCKETS,
            registry=self.registry,
        )
        self._kv_transfer_failures = Counter(
            "pd_extproc_kv_transfer_failures_total",
            "Decodes that could not pull the KV cache of their prefill leg (answered as kv_transfer_failed), "
            "by whether the answer was streamed",
            ["stream"],
            registry=self.registry,
        )
        self._decode_engine_dead = Counter(
            "pd_extproc_decode_engine_dead_total",
            "Decodes of a KV handoff that answered vLLM's dead engine core (answered as decode_engine_dead), "
            "by whether the answer was streamed",
            ["stream"],
            registry=self.registry,
        )
        self._no_kv_transfer_params = Counter(
            "pd_extproc_prefill_no_kv_transfer_params_total",
            "Prefill legs (kv-transfer-params) answered without kv_transfer_params, by prefill endpoint: "
            "each such request was prefilled again by its decode",
            ["endpoint"],
            registry=self.registry,
        )
        self._bootstrap_queries = Counter(
            "pd_extproc_bootstrap_queries_total",
            "Queries of a prefill's Mooncake bootstrap server for its engine ids (vllm-mooncake), by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self._prefill_fallbacks = Counter(
            "pd_extproc_prefill_fallback_total",
            "Requests whose prefill legs all failed, by what followed (decode-only or error)",
            ["action"],
            registry=self.registry,
        )
        self._envoy_health_changes = Counter(
            "pd_extproc_envoy_health_changes_total",
            "Endpoints Envoy marked as failed (change=ejected, no candidate any more) or took back "
            "(change=returned), as seen in its admin /clusters, by role",
            ["role", "change"],
            registry=self.registry,
        )
        self._envoy_health_polls = Counter(
            "pd_extproc_envoy_health_polls_total",
            "Polls of Envoy's admin /clusters (envoy_health), by outcome (ok or the failure's reason)",
            ["outcome"],
            registry=self.registry,
        )
        self._prefill_ejections = Counter(
            "pd_extproc_prefill_ejections_total",
            "Prefill endpoints left out of the candidates after a failed prefill leg (by the leg's "
            "outcome) or a decode's failed pull of its KV (kv_transfer_failed)",
            ["outcome"],
            registry=self.registry,
        )
        self._decode_ejections = Counter(
            "pd_extproc_decode_ejections_total",
            "Decode endpoints left out of the candidates after a failure, by outcome (decode_engine_dead)",
            ["outcome"],
            registry=self.registry,
        )
        self._discovery_errors = Counter(
            "pd_extproc_discovery_errors_total",
            "Failed exchanges of a discovery source with where it learns endpoints, by source and reason",
            ["source", "reason"],
            registry=self.registry,
        )
        self._discovery_synced = Gauge(
            "pd_extproc_discovery_last_sync_timestamp_seconds",
            "Unix time at which the discovery source last confirmed its whole endpoint view current",
            ["source"],
            registry=self.registry,
        )
        self._inferencepool_usable = Gauge(
            "pd_extproc_inferencepool_usable",
            "1 while the InferencePool of discovery.source inferencepool exists and is usable, else 0",
            registry=self.registry,
        )
        self._xds_responses = Counter(
            "pd_extproc_xds_responses_total", "EDS responses sent to Envoy over ADS", registry=self.registry
        )
        self._xds_replies = Counter(
            "pd_extproc_xds_replies_total",
            "Envoy's replies to EDS responses: ack (applied) or nack (rejected, error logged)",
            ["result"],
            registry=self.registry,
        )
        self.xds_streams = Gauge(
            "pd_extproc_xds_streams", "ADS streams open (Envoys connected)", registry=self.registry
        )
        self.xds_version = Gauge(
            "pd_extproc_xds_version", "Current EDS version_info served (0: none yet)", registry=self.registry
        )
        self.xds_pending = Gauge(
            "pd_extproc_xds_pending_endpoints",
            "Endpoints published to Envoy but not yet pickable by the router (waiting for ACKs)",
            registry=self.registry,
        )
        self._config_reloads = Counter(
            "pd_extproc_config_reloads_total",
            "Changes of the configuration file seen by the running server, by outcome (applied, rejected)",
            ["outcome"],
            registry=self.registry,
        )
        self._inflight = Gauge(
            "pd_extproc_inflight_requests",
            "Requests admitted and routed whose ext_proc stream has not ended (limits.max_inflight_requests)",
            registry=self.registry,
        )
        self._engine_scrapes = Counter(
            "pd_extproc_engine_scrapes_total",
            "Scrapes of engines' /metrics by outcome: ok, or the error (timeout, connect, status, too_large, "
            "parse, missing)",
            ["outcome"],
            registry=self.registry,
        )
        self._model_polls = Counter(
            "pd_extproc_engine_model_polls_total",
            "Polls of engines' GET /v1/models (engine_metrics.models_interval_seconds) by outcome: ok, or "
            "the error (timeout, connect, status, too_large, parse)",
            ["outcome"],
            registry=self.registry,
        )
        self._engine_scrape_seconds = Histogram(
            "pd_extproc_engine_scrape_seconds",
            "Duration of one scrape of an engine's /metrics (fetch and parse), in seconds",
            buckets=SCRAPE_BUCKETS,
            registry=self.registry,
        )
        self._served = LoopCounter(
            "pd_extproc_served_endpoint_total",
            "Responses whose serving endpoint the data plane reported (envoy.lb "
            "x-gateway-destination-endpoint-served), by outcome: chosen (the decode pd-extproc charged), "
            "moved (a retry walked to another decode: the charge moved), unknown (not a known decode)",
            ["outcome"],
            registry=self.registry,
        )
        self._served_children = {o: self._served.labels(o) for o in ("chosen", "moved", "unknown")}
        self._streams = LoopCounter(
            "pd_extproc_ext_proc_streams_total",
            "ext_proc streams by the request body mode Envoy stated (buffered, full_duplex_streamed)",
            ["body_mode"],
            registry=self.registry,
        )
        self._stream_children = {m: self._streams.labels(m) for m in ("buffered", "full_duplex_streamed")}
        self._tokenize_seconds = Histogram(
            "pd_extproc_tokenize_seconds",
            "Time from asking the gateway tokenizer for a prompt's tokens to the answer (its queue "
            "included), in seconds",
            buckets=TOKENIZE_BUCKETS,
            registry=self.registry,
        )
        self._tokenize_tokens = Counter(
            "pd_extproc_tokenize_tokens_total",
            "Prompt tokens the gateway tokenizer answered, by where they came from (cache: a recently "
            "tokenized prefix; tokenizer: tokenized now)",
            ["source"],
            registry=self.registry,
        )
        self._tokenize_children = {s: self._tokenize_tokens.labels(s) for s in ("cache", "tokenizer")}
        self._tokenizer_encoder = Gauge(
            "pd_extproc_tokenizer_encoder",
            "The gateway tokenizer's encoder: 1 for the one in use (tiktoken, when checked equal to the "
            "folder's tokenizer; else tokenizers), 0 for the other; all 0 without a tokenizer",
            ["encoder"],
            registry=self.registry,
        )
        self._untokenized = Counter(
            "pd_extproc_tokenize_fallbacks_total",
            "Prompts the gateway tokenizer could not put in the engine's tokens, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.registry.register(_EndpointLoadCollector(endpoints))
        self._decision_children: dict[tuple[str, str], Count] = {}
        self._models = LoopCounter(
            "pd_extproc_model_requests_total",
            "Requests routed, by the model they name (empty: none, or one that no endpoint names: those "
            "serving every model took it); bounded by the endpoints' model lists",
            ["model"],
            registry=self.registry,
        )
        self._model_children: dict[str, Count] = {}
        self._lora = LoopCounter(
            "pd_extproc_lora_placements_total",
            "Requests for a LoRA adapter placed, by role and whether the chosen endpoint's engine reported "
            "holding the adapter (held, lacking, unknown: no fresh report)",
            ["role", "held"],
            registry=self.registry,
        )
        self._lora_children: dict[tuple[str, str], Count] = {}
        self._rejected_children: dict[str, Counter] = {}

    def decided(self, mode: str, locality: str, seconds: float) -> None:
        """Count one decision and record ``seconds``, the time of the decision alone.

        Parsing, subset filtering, charging and building the answer are not included."""
        key = (mode, locality)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self._decisions.labels(mode, locality)
        child.inc()
        self._decision_seconds.observe(seconds)

    def model_routed(self, model: str) -> None:
        """Count one request routed for ``model`` (a bounded label: :meth:`Registry.model_label`)."""
        child = self._model_children.get(model)
        if child is None:
            child = self._model_children[model] = self._models.labels(model)
        child.inc()

    def lora_placed(self, role: str, held: str) -> None:
        """Count one adapter request placed on a ``role`` endpoint: ``held`` is held, lacking or unknown."""
        child = self._lora_children.get((role, held))
        if child is None:
            child = self._lora_children[(role, held)] = self._lora.labels(role, held)
        child.inc()

    def estimated(self, locality: str, estimate: Estimate) -> None:
        """Record the parts of one ``auto`` decision's estimate (a margin only when there is one)."""
        children = self._auto_children.get(locality)
        if children is None:
            transfer, wait, margin = (h.labels(locality) for h in self._auto)
            children = self._auto_children[locality] = (transfer, wait, margin)
        self._auto_prefill.observe(estimate.prefill_s)
        children[0].observe(estimate.transfer_s)
        children[1].observe(estimate.wait_s)
        if estimate.margin_s is not None:
            children[2].observe(estimate.margin_s)

    def prefix_predicted(self, role: str, address: str, placed: int, hit: int) -> None:
        """Count one placement on ``address`` as ``role``.

        ``placed`` prompt tokens, ``hit`` of them predicted to be in its prefix cache."""
        key = (role, address)
        children = self._prefix_children.get(key)
        if children is None:
            children = self._prefix_children[key] = (
                self._predicted_tokens.labels(address, "placed"),
                self._predicted_tokens.labels(address, "hit"),
                self._predicted_hits.labels(role),
            )
        children[0].inc(placed)
        children[1].inc(hit)
        children[2].observe(hit)

    def prefix_engine(self, address: str, queries: float, hits: float, scale: float) -> None:
        """Count an engine's prefix-cache lookups since its last sample, and its index's new scale.

        The engine at ``address`` looked up ``queries`` prompt tokens and found ``hits``; the prefix
        index now keeps ``scale`` of its capacity."""
        self._engine_tokens.labels(address, "queried").inc(queries)
        self._engine_tokens.labels(address, "hit").inc(hits)
        self._index_scale.labels(address).set(scale)

    def count_inflight(self, count: Callable[[], float]) -> None:
        """Report ``count()`` as ``pd_extproc_inflight_requests``, read at scrape time.

        ``count()`` is the router's requests in flight."""
        self._inflight.set_function(count)

    def watch_engine_scrapes(self, ages: Callable[[], dict[str, float]], stale: Callable[[], int]) -> None:
        """Expose ``ages()`` and ``stale()``, read at scrape time.

        ``ages()``: seconds since each engine's last good sample, by address; ``stale()``: the pickable
        endpoints without a fresh one."""
        self.registry.register(_EngineScrapeCollector(ages, stale))

    def watch_kv_events(
        self, blocks: Callable[[], dict[str, dict[str, int]]], stale: Callable[[], int]
    ) -> None:
        """Expose ``blocks()`` (per endpoint and tier) and ``stale()`` (stale publishers).

        Both are read at scrape time."""
        self.registry.register(_KvEventsCollector(blocks, stale))

    def kv_events_received(self, endpoint: str) -> None:
        """Count one KV-event message from ``endpoint``."""
        self._kv_received.labels(endpoint).inc()

    def kv_events_decoded(self, endpoint: str, kind: str, count: int) -> None:
        """Count ``count`` decoded events of ``kind`` from ``endpoint``."""
        self._kv_decoded.labels(endpoint, kind).inc(count)

    def kv_events_dropped(self, endpoint: str, reason: str, count: int = 1) -> None:
        """Count ``count`` messages or events from ``endpoint`` not applied, by ``reason``."""
        self._kv_dropped.labels(endpoint, reason).inc(count)

    def kv_events_replay(self, endpoint: str, outcome: str) -> None:
        """Count one replay asked of ``endpoint``, by ``outcome``."""
        self._kv_replays.labels(endpoint, outcome).inc()

    def kv_events_reset(self, endpoint: str, reason: str) -> None:
        """Count one drop of ``endpoint``'s entries, by ``reason``."""
        self._kv_resets.labels(endpoint, reason).inc()

    def shared_sent(self, kind: str, size: int) -> None:
        """Count one shared-state message of ``kind`` and ``size`` bytes sent."""
        self._shared_sent.labels(kind).inc()
        self._shared_sent_bytes.inc(size)

    def shared_received(self, kind: str, size: int, lag_seconds: float | None) -> None:
        """Count one peer message of ``kind`` applied; ``lag_seconds`` from its stamp (batches only)."""
        self._shared_received.labels(kind).inc()
        if lag_seconds is not None:
            self._shared_lag.observe(lag_seconds)

    def decision_slot_waited(self, seconds: float) -> None:
        """Record one request's wait for its decision slot (0 when it came within the slot)."""
        self._slot_wait.observe(seconds)

    def shared_dropped(self, reason: str) -> None:
        """Count one shared-state message (or placement) not applied or not sent, by ``reason``."""
        self._shared_dropped.labels(reason).inc()

    def shared_sync_request(self, outcome: str) -> None:
        """Count one peer's sync request by ``outcome`` (``answered``, ``coalesced``, ``refused``)."""
        self._shared_sync_requests.labels(outcome).inc()

    def shared_connection(self, state: str) -> None:
        """The shared-state bus is ``connected``, ``connecting`` or ``disconnected``."""
        self._shared_connected.set(1 if state == "connected" else 0)

    def watch_peers(self, count: Callable[[], float]) -> None:
        """Report ``count()`` as the peer replicas heard from within the timeout at each scrape."""
        Gauge(
            "pd_extproc_shared_peers",
            "Peer gateway replicas whose bookings this replica holds (heard from within the timeout)",
            registry=self.registry,
        ).set_function(count)

    def engine_scrape(self, outcome: str, seconds: float) -> None:
        """Count one scrape of an engine's ``/metrics`` by ``outcome`` and record its ``seconds``."""
        self._engine_scrapes.labels(outcome).inc()
        self._engine_scrape_seconds.observe(seconds)

    def engine_models_polled(self, outcome: str) -> None:
        """Count one poll of an engine's ``GET /v1/models`` by ``outcome``."""
        self._model_polls.labels(outcome).inc()

    def rejected(self, reason: str) -> None:
        """Count one request answered with an error, by machine-readable reason."""
        child = self._rejected_children.get(reason)
        if child is None:
            child = self._rejected_children[reason] = self._rejected.labels(reason)
        child.inc()

    def served(self, outcome: str) -> None:
        """Count one reported serving endpoint by ``outcome`` (chosen, moved, unknown)."""
        self._served_children[outcome].inc()

    def stream_started(self, body_mode: str) -> None:
        """Count one ext_proc stream by its request ``body_mode`` (buffered, full_duplex_streamed)."""
        self._stream_children[body_mode].inc()

    def kv_transfer_failed(self, stream: bool) -> None:
        """Count one decode that could not pull its prefill's KV cache."""
        self._kv_transfer_failures.labels("true" if stream else "false").inc()

    def decode_engine_dead(self, stream: bool) -> None:
        """Count one decode of a KV handoff that answered vLLM's dead engine core."""
        self._decode_engine_dead.labels("true" if stream else "false").inc()

    def prefill_leg(self, outcome: str, seconds: float | None) -> None:
        """Count one prefill leg by outcome; ``seconds`` when it got an HTTP answer."""
        self._prefill_legs.labels(outcome).inc()
        if seconds is not None:
            self._prefill_leg_seconds.observe(seconds)

    def prefill_without_kv_transfer_params(self, endpoint: str) -> None:
        """Count one prefill leg to ``endpoint`` answered without ``kv_transfer_params``."""
        self._no_kv_transfer_params.labels(endpoint).inc()

    def bootstrap_query(self, outcome: str) -> None:
        """Count one ``GET /query`` of a Mooncake bootstrap server by ``outcome`` (``ok`` or a failure)."""
        self._bootstrap_queries.labels(outcome).inc()

    def prefill_fallback(self, action: str) -> None:
        """Count one request whose prefill legs all failed, by ``action`` (decode-only / error)."""
        self._prefill_fallbacks.labels(action).inc()

    def envoy_health_changed(self, role: str, change: str, count: int) -> None:
        """Count ``count`` endpoints of ``role`` Envoy ``ejected`` or ``returned`` since the last poll."""
        self._envoy_health_changes.labels(role, change).inc(count)

    def envoy_health_polled(self, outcome: str) -> None:
        """Count one poll of Envoy's ``/clusters`` by ``outcome`` (``ok`` or a failure reason)."""
        self._envoy_health_polls.labels(outcome).inc()

    def ejected(self, role: str, outcome: str) -> None:
        """Count one endpoint of ``role`` (prefill, decode) ejected after a failure's ``outcome``.

        For ``handoff.eject_failed_prefill_seconds``."""
        (self._prefill_ejections if role == "prefill" else self._decode_ejections).labels(outcome).inc()

    def discovery_error(self, source: str, reason: str) -> None:
        """Count one failed exchange of discovery ``source`` (e.g. ``kubernetes``), by ``reason``."""
        self._discovery_errors.labels(source, reason).inc()

    def discovery_synced(self, source: str, timestamp: float) -> None:
        """Record that ``source``'s whole view was current at ``timestamp`` (Unix seconds)."""
        self._discovery_synced.labels(source).set(timestamp)

    def inferencepool_usable(self, usable: bool) -> None:
        """Record whether the InferencePool exists and is usable (``discovery.source: inferencepool``)."""
        self._inferencepool_usable.set(1 if usable else 0)

    def xds_response(self) -> None:
        """Count one EDS response sent over ADS."""
        self._xds_responses.inc()

    def xds_reply(self, accepted: bool) -> None:
        """Count one ACK (``accepted``) or NACK of an EDS response."""
        self._xds_replies.labels("ack" if accepted else "nack").inc()

    def config_reload(self, outcome: str) -> None:
        """Count one change of the configuration file: ``applied`` or ``rejected`` (invalid)."""
        self._config_reloads.labels(outcome).inc()

    def tokenized(self, seconds: float, tokens: int, cached: int) -> None:
        """Record one prompt's tokenization: ``seconds`` waited, ``tokens`` ids, ``cached`` of them reused."""
        self._tokenize_seconds.observe(seconds)
        self._tokenize_children["cache"].inc(cached)
        self._tokenize_children["tokenizer"].inc(tokens - cached)

    def tokenizer_encoder(self, encoder: str | None) -> None:
        """Mark ``encoder`` (``fastokens``, ``tiktoken``, ``tokenizers``) as in use; ``None``: none."""
        for name in ("fastokens", "tiktoken", "tokenizers"):
            self._tokenizer_encoder.labels(name).set(1 if name == encoder else 0)

    def untokenized(self, reason: str) -> None:
        """Count one prompt the gateway tokenizer could not tokenize, by reason."""
        self._untokenized.labels(reason).inc()

    # Operations signals (docs/operations.md "Autoscaling signals", "Dashboard and alerts").

    def watch_pools(self, pools: Callable[[], Iterable[PoolSignal]]) -> None:
        """Expose ``pools()``, each role's pools by group (:mod:`ext_proc.pool_signals`), at scrape time."""
        self.registry.register(_PoolCollector(pools))

    def watch_engine_ttft(self, first_tokens: Callable[[], Iterable[tuple[str, str, float, float]]]) -> None:
        """Expose each engine's time-to-first-token histogram, read at scrape time.

        ``first_tokens()`` gives (role, address, seconds, count) of each as last sampled."""
        self.registry.register(_EngineTtftCollector(first_tokens))


class _PoolCollector(Collector):
    def __init__(self, pools: Callable[[], Iterable[PoolSignal]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "group"]
        families = {
            "healthy": GaugeMetricFamily(
                "pd_extproc_pool_healthy_endpoints",
                "Endpoints of the role and group the router may pick",
                labels=labels,
            ),
            "capacity_tokens": GaugeMetricFamily(
                "pd_extproc_pool_capacity_tokens",
                "Declared token_capacity of the role and group's pickable endpoints, summed, in tokens",
                labels=labels,
            ),
            "booked_tokens": GaugeMetricFamily(
                "pd_extproc_pool_booked_tokens",
                "Tokens this replica booked on the role and group's endpoints and has not released (prefill: "
                "prompts not yet prefilled; decode: prompt plus output budget); sum over replicas",
                labels=labels,
            ),
            "booked_requests": GaugeMetricFamily(
                "pd_extproc_pool_booked_requests",
                "Requests this replica routed to the role and group's endpoints and has not released; sum "
                "over replicas",
                labels=labels,
            ),
            "headroom_tokens": GaugeMetricFamily(
                "pd_extproc_pool_headroom_tokens",
                "Capacity minus the load the decision reads on the role and group's pickable endpoints, in "
                "tokens (negative: overbooked)",
                labels=labels,
            ),
        }
        queued = GaugeMetricFamily(
            "pd_extproc_pool_queued_requests",
            "Requests the role and group's engines report waiting, from their fresh samples (engine_metrics)",
            labels=labels,
        )
        healthy = dict.fromkeys(("prefill", "decode"), 0)
        with_queue = False
        for pool in self._pools():
            values = [pool.role.value, pool.group]
            for field, family in families.items():
                family.add_metric(values, getattr(pool, field))
            healthy[pool.role.value] += pool.healthy
            if pool.queued_requests is not None:
                with_queue = True
                queued.add_metric(values, pool.queued_requests)
        roles = GaugeMetricFamily(
            "pd_extproc_healthy_endpoints",
            "Endpoints of the role the router may pick (0 when none: nothing of that role to route to)",
            labels=["role"],
        )
        for role, count in healthy.items():
            roles.add_metric([role], count)
        yield roles
        yield from families.values()
        if with_queue:
            yield queued


class _EngineTtftCollector(Collector):
    def __init__(self, first_tokens: Callable[[], Iterable[tuple[str, str, float, float]]]) -> None:
        self._first_tokens = first_tokens

    def collect(self) -> Iterator[SummaryMetricFamily]:
        ttft = SummaryMetricFamily(
            "pd_extproc_engine_ttft_seconds",
            "The engine's own time to first token (vllm:/sglang:time_to_first_token_seconds sum and count, "
            "as last scraped), by the role it serves: rate(_sum) / rate(_count) is its mean",
            labels=["role", "endpoint"],
        )
        for role, address, seconds, count in self._first_tokens():
            ttft.add_metric([role, address], count_value=count, sum_value=seconds)
        yield ttft
