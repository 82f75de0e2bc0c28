"""Assemble and run the server: discovery (→ EDS publisher) → registry → router → gRPC + admin endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from aiohttp import web

from ext_proc.admin import build_admin_app
from ext_proc.config import Config, ConfigSource
from ext_proc.discovery.kinds import KINDS as DISCOVERY_SOURCES
from ext_proc.discovery.kinds import Source
from ext_proc.endpoints import ClusterEndpoints
from ext_proc.engine_load.kinds import KINDS as LOAD_SIGNALS
from ext_proc.engine_load.kinds import LoadSignal, LoadSignalKind
from ext_proc.envoy_health import EnvoyHealth
from ext_proc.explain import EXPLAIN_BODY_LIMIT_BYTES
from ext_proc.explain import handler as explain_handler
from ext_proc.flow.control import FlowControl
from ext_proc.handoff.kinds import KINDS as HANDOFFS
from ext_proc.handoff.kinds import Handoff
from ext_proc.health import Health
from ext_proc.kv_subscribers import KvEventSubscribers
from ext_proc.live import LiveParts
from ext_proc.metrics import Metrics
from ext_proc.pool_signals import pool_signals
from ext_proc.prefix import blocks
from ext_proc.registry import Registry
from ext_proc.reload import RELOAD_INTERVAL_SECONDS, ConfigWatcher
from ext_proc.router import Router, RouterSettings
from ext_proc.server import server_credentials, start_grpc, start_health_grpc
from ext_proc.shared.config import SharedStateKind
from ext_proc.shared.kinds import SharedState, build_shared_state
from ext_proc.tls import tls_mode
from ext_proc.tracing import Tracing
from ext_proc.xds.publisher import EdsPublisher

log = logging.getLogger(__name__)


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class RunningServer:
    """A started server: its servers, bound ports, tasks and configuration.

    Ports are the bound ones (useful when the config asked for port 0); ``health_port`` is 0 without
    ``health_listen``.

    ``config`` is the configuration it started with; ``reloads`` watches the configuration file
    (``None`` without one) and holds the configuration in force; ``live``: the prefix source, gateway
    tokenizer and shared state in force (:mod:`ext_proc.live`); ``tracing`` exports the requests' spans
    (``None``: off).
    """

    config: Config
    router: Router
    grpc_port: int
    admin_port: int
    health_port: int
    publisher: EdsPublisher | None
    reloads: ConfigWatcher | None
    live: LiveParts
    tracing: Tracing | None
    flow: FlowControl | None
    _grpc: tuple[grpc.aio.Server, ...]
    _admin: web.AppRunner
    _watchers: tuple[asyncio.Task[None], ...]

    async def stop(self, grace: float = 1.0) -> None:
        """Stop everything, letting live streams finish for ``grace`` seconds.

        Stop the discovery source and the config watcher, end the ADS streams, stop accepting streams,
        let live ones finish for ``grace`` seconds, then stop the shared state, the gateway tokenizer's
        thread and the handoff's background prefill legs, and export the spans still batched."""
        for watcher in self._watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if self.publisher is not None:
            self.publisher.close()
        await asyncio.gather(*(server.stop(grace) for server in self._grpc))
        if self.flow is not None:
            await self.flow.close()
        await self.live.stop()
        await self.router.handoff.close()
        await self._admin.cleanup()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)

    @property
    def shared(self) -> SharedState:
        """The shared state in force (``shared_state``)."""
        return self.live.shared


class Readiness:
    """Readiness as discovery drives it: SERVING once the router holds the source's whole set.

    SERVING while the source is available (always, but for an InferencePool that is absent or not
    usable) and the router's view has held the source's whole set since it became available.
    ``retain`` is told every endpoint known after each change (:meth:`LiveParts.retain`)."""

    def __init__(self, registry: Registry, health: Health, retain: Callable[[Iterable[str]], None]) -> None:
        self._registry = registry
        self._health = health
        self._retain = retain
        self._loaded = False
        self._usable = True

    def apply(self, clusters: list[ClusterEndpoints], settled: bool) -> None:
        """The router's view is now ``clusters``.

        ``settled``: the source's whole set (with EDS served: once Envoy has it)."""
        self._registry.update(clusters)
        self._retain(state.address for state in self._registry.endpoints())
        if settled and not self._loaded:
            self._loaded = True
            self._health.set_ready(self._usable)

    def publish(self, clusters: list[ClusterEndpoints]) -> None:
        """A source's whole set, straight to the router (EDS not served)."""
        self.apply(clusters, settled=True)

    def available(self, now: bool) -> None:
        """Whether the source has a set to serve at all.

        Available again: ready once the new set is loaded."""
        if now != self._usable:
            self._usable, self._loaded = now, False
            self._health.set_ready(False)


def build_publisher(config: Config, readiness: Readiness, metrics: Metrics) -> EdsPublisher | None:
    """The EDS publisher between the source and the router, or ``None`` without ``xds.serve_eds``.

    With ``xds.serve_eds`` the publisher updates Envoy first, then the router."""
    if not config.xds.serve_eds:
        return None
    discovery = config.discovery
    clusters = (discovery.prefill_cluster, discovery.decode_cluster)
    delay = config.xds.no_envoy_delay_seconds
    return EdsPublisher(clusters, discovery.metadata_namespace, readiness.apply, delay, metrics)


async def build_source(
    config: Config, readiness: Readiness, publisher: EdsPublisher | None, metrics: Metrics
) -> Source:
    """The discovery source ``discovery.source`` names, publishing through ``publisher`` if any."""
    publish = publisher.publish if publisher is not None else readiness.publish
    build = DISCOVERY_SOURCES[config.discovery.source]
    return await build(config.discovery, publish, readiness.available, metrics)


def build_handoff(config: Config, metrics: Metrics) -> Handoff:
    """The handoff protocol ``config.handoff.mode`` names."""
    return HANDOFFS[config.handoff.mode](config.routing, config.handoff, metrics)


def build_router(config: Config, registry: Registry, metrics: Metrics, live: LiveParts) -> Router:
    """The router over ``registry`` with the configured policy, handoff and limits, reading ``live``."""
    settings = RouterSettings(
        default_max_tokens=config.load.default_max_tokens,
        pd_threshold_tokens=config.routing.pd_threshold_tokens,
        max_inflight_requests=config.limits.max_inflight_requests,
        retry_after_seconds=config.limits.retry_after_seconds,
        eject_seconds=config.handoff.eject_failed_prefill_seconds,
    )
    return Router(
        settings,
        registry=registry,
        policy=config.affinity.policy(config.routing.fallback_count),
        handoff=build_handoff(config, metrics),
        metrics=metrics,
        live=live,
    )


def build_load_signal(
    config: Config, registry: Registry, metrics: Metrics, live: LiveParts
) -> LoadSignal | None:
    """The engine metrics scraper with ``engine_metrics.enabled``, else ``None`` (local accounting alone)."""
    if not config.engine_metrics.enabled:
        return None
    build = LOAD_SIGNALS[LoadSignalKind.ENGINE_METRICS]
    return build(registry, config.engine_metrics, metrics, live.engine_sampled)


def build_flow(
    config: Config, router: Router, metrics: Metrics, load_signal: LoadSignal | None
) -> tuple[FlowControl, float] | None:
    """Flow control and the wait Envoy is asked for while it queues a request; ``None`` when off.

    Flow control takes the router's in-flight slots and reads the engines' samples. The wait is
    ``max_queue_seconds`` plus the longest a handoff's answer may then take (a prefill leg and its
    retry: 2 x ``handoff.prefill_timeout_seconds`` + 5 s): Envoy extends one message's wait once."""
    flow = config.flow_control
    if not flow.enabled:
        return None
    if not config.limits.max_inflight_requests and load_signal is None:
        log.warning(
            "flow_control.enabled, but nothing can saturate the pool: set limits.max_inflight_requests or "
            "engine_metrics.enabled, or no request ever waits"
        )
    interval = config.engine_metrics.interval_seconds
    control = FlowControl(
        flow, router.admission, metrics, config.limits.retry_after_seconds, load_signal, poll_seconds=interval
    )
    return control, flow.max_queue_seconds + 2 * config.handoff.prefill_timeout_seconds + 5.0


async def _abandon(publisher: EdsPublisher | None, servers: list[grpc.aio.Server]) -> None:
    """Stop what was started, when a later port cannot be bound."""
    if publisher is not None:
        publisher.close()
    await asyncio.gather(*(server.stop(None) for server in servers))


async def start_grpc_servers(
    config: Config,
    router: Router,
    health: Health,
    publisher: EdsPublisher | None,
    credentials: grpc.ServerCredentials | None,
    tracing: Tracing | None = None,
    flow: tuple[FlowControl, float] | None = None,
) -> tuple[list[grpc.aio.Server], int, int]:
    """Start the ext_proc gRPC server and, with ``health_listen``, the health-only one.

    The ext_proc server listens on ``listen`` (with the ADS service when EDS is served; one span per
    request with ``tracing``). Returns
    ``(servers, grpc port, health port or 0)``; when the health port cannot be bound, what was started
    is stopped."""
    ads = publisher.ads if publisher is not None else None
    grpc_server, grpc_port = await start_grpc(router, config.listen, health, ads, credentials, tracing, flow)
    servers = [grpc_server]
    if not config.health_listen:
        return servers, grpc_port, 0
    try:
        health_server, health_port = await start_health_grpc(health, config.health_listen)
    except OSError:
        await _abandon(publisher, servers)
        raise
    return [*servers, health_server], grpc_port, health_port


async def start_admin(
    config: Config,
    router: Router,
    load_signal: LoadSignal | None,
    shared: SharedState,
    subscribers: KvEventSubscribers,
    flow: FlowControl | None = None,
) -> tuple[web.AppRunner, int]:
    """Start the metrics and admin endpoint on ``metrics_listen``: ``(runner, port)``.

    ``flow``: flow control, shown at ``/debug/queue`` (``None``: off).

    ``OSError`` says where when it cannot be bound."""
    describe = load_signal.describe if load_signal is not None else None
    admin = build_admin_app(
        router.registry,
        router.metrics,
        config.admin.debug_endpoints,
        describe,
        shared.describe,
        subscribers.report,
        explain_handler(router),
        EXPLAIN_BODY_LIMIT_BYTES + 1024,
        None if flow is None else flow.describe,
    )
    runner = web.AppRunner(admin, access_log=None)
    await runner.setup()
    host, port = _split(config.metrics_listen)
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"cannot listen on {config.metrics_listen} for metrics and admin: {exc}") from exc
    return runner, runner.addresses[0][1]


def start_watchers(
    config: Config,
    endpoints: Source,
    load_signal: LoadSignal | None,
    router: Router,
    live: LiveParts,
    metrics: Metrics,
    reload: tuple[ConfigSource | None, float],
    subscribers: KvEventSubscribers,
) -> tuple[list[asyncio.Task[None]], ConfigWatcher | None]:
    """Start the background tasks: ``(tasks, the configuration watcher or None)``.

    The tasks are the discovery source, the KV-event ``subscribers``, the load signal if any, Envoy's host
    health with ``envoy_health.admin_url``, and the configuration watcher when the configuration came
    from a file (``reload``: its source and interval)."""
    watchers = [asyncio.create_task(endpoints.run(), name="discovery")]
    watchers.append(asyncio.create_task(subscribers.run(), name="kv-events"))
    if load_signal is not None:
        watchers.append(asyncio.create_task(load_signal.run(), name="engine-metrics"))
    if config.envoy_health.admin_url:
        discovery = config.discovery
        envoy_health = EnvoyHealth(
            config.envoy_health,
            {discovery.prefill_cluster: router.ejections, discovery.decode_cluster: router.decode_ejections},
            {discovery.prefill_cluster: "prefill", discovery.decode_cluster: "decode"},
            metrics,
        )
        watchers.append(asyncio.create_task(envoy_health.run(), name="envoy-health"))
    source, interval = reload
    if source is None or source.path is None:
        return watchers, None
    reloads = ConfigWatcher(source, config, router, live, metrics, interval)
    watchers.append(asyncio.create_task(reloads.run(), name="config-watcher"))
    return watchers, reloads


def _log_started(server: RunningServer, registry: Registry, load_signal: LoadSignal | None) -> None:
    """The one INFO line that says what is serving where."""
    config, policy = server.config, server.router.policy
    log.info(
        "pd-extproc serving ext_proc on %s (port %d, %s), gRPC health also on %s, admin on port %d; "
        "affinity %s bonus %.2f; "
        "handoff %s%s; EDS served to Envoy: %s; engine metrics: %s; Envoy host health: %s; tracing: %s; "
        "%d prefill and %d decode endpoints healthy",
        config.listen,
        server.grpc_port,
        tls_mode(config.tls),
        f"port {server.health_port}" if server.health_port else "no other port",
        server.admin_port,
        policy.mode.value,
        policy.bonus,
        config.handoff.mode.value,
        f" via {config.handoff.prefill_via}" if config.handoff.prefill_via else "",
        "yes" if server.publisher is not None else "no",
        f"every {config.engine_metrics.interval_seconds:g} s" if load_signal is not None else "off",
        config.envoy_health.admin_url or "off",
        config.tracing.otlp_endpoint or "off",
        len(registry.prefills),
        len(registry.decodes),
    )


async def start_server(
    config: Config, source: ConfigSource | None = None, reload_interval: float = RELOAD_INTERVAL_SECONDS
) -> RunningServer:
    """Build and start the whole server: discovery, gRPC, admin endpoint and watchers.

    Build the discovery source (files: loaded once here), start the gRPC server and the admin
    endpoint, then the source's watcher (and, with ``engine_metrics.enabled``, the engine scraper).
    Raises :class:`~ext_proc.config.ConfigError` when a TLS file cannot be read, tracing's exporter
    cannot be loaded or the source cannot be set up, ``OSError`` when an address cannot be bound.

    With ``xds.serve_eds`` the source's endpoints go through an :class:`EdsPublisher` (Envoy
    first, then the router) and its ADS service runs on the gRPC port. Readiness (:mod:`ext_proc.health`,
    on ``listen`` and ``health_listen``) is SERVING as :class:`Readiness` says.
    ``source`` is where ``config`` came from: when it names a file, the file is watched every
    ``reload_interval`` seconds and a changed affinity section is applied live (:mod:`ext_proc.reload`).
    """
    credentials = server_credentials(config.tls)
    tracing = Tracing.of(config.tracing)  # before anything starts: its exporter may not load
    discovery = config.discovery
    registry = Registry(
        discovery.prefill_cluster, discovery.decode_cluster, config.load.default_token_capacity
    )
    metrics = Metrics(registry.endpoints)
    if config.shared_state.kind is not SharedStateKind.LOCAL:  # the peers' chains must compare with ours
        blocks.use_key(config.shared_state.nats.key())
    live = LiveParts(config.affinity.prefix.settings(), metrics)
    health = Health()
    await health.start()
    readiness = Readiness(registry, health, live.retain)
    publisher = build_publisher(config, readiness, metrics)
    endpoints = await build_source(config, readiness, publisher, metrics)
    router = build_router(config, registry, metrics, live)
    live.shared = build_shared_state(config.shared_state, registry, lambda: live.prefix, metrics)
    await live.start()  # the shared state learns the peers' state before the first request (bounded wait)
    load_signal = build_load_signal(config, registry, metrics, live)
    flow = build_flow(config, router, metrics, load_signal)
    try:
        servers, grpc_port, health_port = await start_grpc_servers(
            config, router, health, publisher, credentials, tracing, flow
        )
    except BaseException:
        await live.stop()
        if tracing is not None:
            tracing.shutdown()
        raise
    waiting = load_signal.waiting if load_signal is not None else None
    metrics.watch_pools(lambda: pool_signals(registry, waiting() if waiting is not None else None))
    subscribers = KvEventSubscribers(registry, live.events, metrics)  # idle unless the source is kv-events
    try:
        control = None if flow is None else flow[0]
        runner, admin_port = await start_admin(config, router, load_signal, live.shared, subscribers, control)
    except OSError:
        await _abandon(publisher, servers)
        await live.stop()
        if tracing is not None:
            tracing.shutdown()
        raise
    reload = (source, reload_interval)
    watchers, reloads = start_watchers(
        config, endpoints, load_signal, router, live, metrics, reload, subscribers
    )
    server = RunningServer(
        config,
        router,
        grpc_port,
        admin_port,
        health_port,
        publisher,
        reloads,
        live,
        tracing,
        None if flow is None else flow[0],
        tuple(servers),
        runner,
        tuple(watchers),
    )
    _log_started(server, registry, load_signal)
    return server


async def serve_forever(config: Config, source: ConfigSource | None = None) -> None:
    """Run until SIGINT/SIGTERM, then shut down gracefully; ``source``: as for :func:`start_server`."""
    server = await start_server(config, source)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await server.stop(grace=5.0)
