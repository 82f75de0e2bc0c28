"""Assemble and run the server: discovery (→ EDS publisher) → registry → router → gRPC + admin endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from aiohttp import web

from ext_proc.admin import build_admin_app
from ext_proc.config import Config, ConfigSource
from ext_proc.discovery import ClusterEndpoints, EdsFileSource, SourceKind
from ext_proc.discovery.eds_watch import Available, Publish
from ext_proc.engine_load import EngineScraper
from ext_proc.envoy_health import EnvoyHealth
from ext_proc.handoff import (
    DecodeRoute,
    Handoff,
    HandoffMode,
    KvTransferParamsHandoff,
    PrefillClient,
    SglangBootstrapHandoff,
    SidecarHandoff,
    VllmMooncakeHandoff,
)
from ext_proc.health import Health
from ext_proc.metrics import Metrics
from ext_proc.registry import Registry
from ext_proc.reload import RELOAD_INTERVAL_SECONDS, ConfigWatcher
from ext_proc.router import Router
from ext_proc.server import start_grpc, start_health_grpc
from ext_proc.tls import server_credentials, tls_mode
from ext_proc.xds import EdsPublisher

log = logging.getLogger(__name__)


def _split(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class RunningServer:
    """A started server. Ports are the bound ones (useful when the config asked for port 0);
    ``health_port`` is 0 without ``health_listen``.

    ``config`` is the configuration it started with; ``reloads`` watches the configuration file
    (``None`` without one) and holds the configuration in force.
    """

    config: Config
    router: Router
    grpc_port: int
    admin_port: int
    health_port: int
    publisher: EdsPublisher | None
    reloads: ConfigWatcher | None
    _grpc: tuple[grpc.aio.Server, ...]
    _admin: web.AppRunner
    _watchers: tuple[asyncio.Task[None], ...]

    async def stop(self, grace: float = 1.0) -> None:
        """Stop the discovery source and the config watcher, end the ADS streams, stop accepting
        streams, let live ones finish for ``grace`` seconds, then stop the handoff's background
        prefill legs."""
        for watcher in self._watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if self.publisher is not None:
            self.publisher.close()
        await asyncio.gather(*(server.stop(grace) for server in self._grpc))
        await self.router.handoff.close()
        await self._admin.cleanup()


class Source(Protocol):
    """A discovery source: publishes endpoint sets from :meth:`run` until cancelled."""

    async def run(self) -> None: ...


async def _files_source(config: Config, publish: Publish, available: Available, metrics: Metrics) -> Source:
    """The EDS files, read once before returning (their endpoints are published at once)."""
    discovery = config.discovery
    source = EdsFileSource(
        discovery.eds_files, discovery.metadata_namespace, publish, discovery.poll_interval_seconds
    )
    if not source.poll():
        log.warning(
            "no valid EDS file loaded yet: readiness is NOT_SERVING and requests get 503 until one is"
        )
    return source


async def _kubernetes_source(
    config: Config, publish: Publish, available: Available, metrics: Metrics
) -> Source:
    """The pods of the Kubernetes API; nothing is published before :meth:`Source.run` listed them."""
    from ext_proc.discovery.kubernetes import KubernetesSource  # the client library loads only if used

    return await KubernetesSource.connect(config.discovery, publish, metrics)


async def _inferencepool_source(
    config: Config, publish: Publish, available: Available, metrics: Metrics
) -> Source:
    """The pods of an InferencePool; unavailable while the pool is absent or not usable."""
    from ext_proc.discovery.inferencepool import InferencePoolSource  # the client library, if used

    return await InferencePoolSource.connect(config.discovery, publish, available, metrics)


SOURCES: dict[SourceKind, Callable[[Config, Publish, Available, Metrics], Awaitable[Source]]] = {
    SourceKind.FILES: _files_source,
    SourceKind.KUBERNETES: _kubernetes_source,
    SourceKind.INFERENCEPOOL: _inferencepool_source,
}
"""How to build each kind of discovery source (``discovery.source``). A source that can lose its
whole set (the InferencePool deleted) says so through ``available``; the others never call it."""


def build_handoff(config: Config, metrics: Metrics) -> Handoff:
    """The handoff protocol ``config.handoff.mode`` names."""
    routing, handoff = config.routing, config.handoff
    if handoff.mode is HandoffMode.SIDECAR:
        return SidecarHandoff(routing.destination_header, routing.prefill_header)
    client = PrefillClient(handoff.prefill_via, routing.destination_header, handoff.prefill_timeout_seconds)
    route = DecodeRoute(routing.destination_header, routing.prefill_header)
    if handoff.mode is HandoffMode.KV_TRANSFER_PARAMS:
        return KvTransferParamsHandoff(
            route,
            client,
            metrics,
            handoff.on_prefill_failure,
            handoff.prefill_timeout_seconds,
            handoff.watch_streamed_answers,
        )
    if handoff.mode is HandoffMode.VLLM_MOONCAKE:
        return VllmMooncakeHandoff(
            route,
            client,
            metrics,
            handoff.on_prefill_failure,
            handoff.default_bootstrap_port,
            handoff.watch_streamed_answers,
        )
    return SglangBootstrapHandoff(
        route, client, metrics, handoff.default_bootstrap_port, handoff.watch_streamed_answers
    )


async def start_server(
    config: Config, source: ConfigSource | None = None, reload_interval: float = RELOAD_INTERVAL_SECONDS
) -> RunningServer:
    """Build the discovery source (files: loaded once here), start the gRPC server and the admin
    endpoint, then the source's watcher (and, with ``engine_metrics.enabled``, the engine scraper).
    Raises :class:`~ext_proc.checks.ConfigError` when a TLS file
    cannot be read or the source cannot be set up, ``OSError`` when an address cannot be bound.

    With ``xds.serve_eds`` the source's endpoints go through an :class:`EdsPublisher` (Envoy
    first, then the router) and its ADS service runs on the gRPC port. Readiness (:mod:`ext_proc.health`,
    on ``listen`` and ``health_listen``) is SERVING while the source is available (always, but for
    an InferencePool that is absent or not usable) and the router's view has held the source's whole
    set (with EDS served: once Envoy has it) since it became available.
    ``source`` is where ``config`` came from: when it names a file, the file is watched every
    ``reload_interval`` seconds and a changed affinity section is applied live (:mod:`ext_proc.reload`).
    """
    credentials = server_credentials(config.tls)
    discovery = config.discovery
    registry = Registry(
        discovery.prefill_cluster, discovery.decode_cluster, config.load.default_token_capacity
    )
    metrics = Metrics(registry.endpoints)
    health = Health()
    await health.start()
    loaded, usable = False, True

    def apply(clusters: list[ClusterEndpoints], settled: bool) -> None:
        nonlocal loaded
        registry.update(clusters)
        if settled and not loaded:
            loaded = True
            health.set_ready(usable)

    def available(now: bool) -> None:
        nonlocal loaded, usable
        if now != usable:
            usable, loaded = now, False  # available again: ready once the new set is loaded
            health.set_ready(False)

    publisher: EdsPublisher | None = None
    if config.xds.serve_eds:
        clusters = (discovery.prefill_cluster, discovery.decode_cluster)
        publisher = EdsPublisher(
            clusters, discovery.metadata_namespace, apply, config.xds.no_envoy_delay_seconds, metrics
        )
    publish = publisher.publish if publisher is not None else functools.partial(apply, settled=True)
    endpoints = await SOURCES[discovery.source](config, publish, available, metrics)
    policy = config.affinity.policy(config.routing.fallback_count)
    handoff = build_handoff(config, metrics)
    router = Router(
        registry,
        policy,
        handoff,
        metrics,
        config.load.default_max_tokens,
        config.routing.pd_threshold_tokens,
        config.limits.max_inflight_requests,
        config.limits.retry_after_seconds,
        config.handoff.eject_failed_prefill_seconds,
        config.affinity.prefix.settings(),
    )
    grpc_server, grpc_port = await start_grpc(
        router, config.listen, health, publisher.ads if publisher is not None else None, credentials
    )
    servers = [grpc_server]

    async def abandon() -> None:
        """Stop what was started, when a later port cannot be bound."""
        if publisher is not None:
            publisher.close()
        await asyncio.gather(*(server.stop(None) for server in servers))

    health_port = 0
    if config.health_listen:
        try:
            health_server, health_port = await start_health_grpc(health, config.health_listen)
        except OSError:
            await abandon()
            raise
        servers.append(health_server)
    scraper = (
        EngineScraper(registry, config.engine_metrics, metrics, router.engine_sampled)
        if config.engine_metrics.enabled
        else None
    )
    admin = build_admin_app(
        registry, metrics, config.admin.debug_endpoints, scraper.describe if scraper is not None else None
    )
    runner = web.AppRunner(admin, access_log=None)
    await runner.setup()
    host, port = _split(config.metrics_listen)
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await abandon()
        await runner.cleanup()
        raise OSError(f"cannot listen on {config.metrics_listen} for metrics and admin: {exc}") from exc
    admin_port = runner.addresses[0][1]
    watchers = [asyncio.create_task(endpoints.run(), name="discovery")]
    if scraper is not None:
        watchers.append(asyncio.create_task(scraper.run(), name="engine-metrics"))
    if config.envoy_health.admin_url:
        envoy_health = EnvoyHealth(
            config.envoy_health,
            {discovery.prefill_cluster: router.ejections, discovery.decode_cluster: router.decode_ejections},
            {discovery.prefill_cluster: "prefill", discovery.decode_cluster: "decode"},
            metrics,
        )
        watchers.append(asyncio.create_task(envoy_health.run(), name="envoy-health"))
    reloads = None
    if source is not None and source.path is not None:
        reloads = ConfigWatcher(source, config, router, metrics, reload_interval)
        watchers.append(asyncio.create_task(reloads.run(), name="config-watcher"))
    log.info(
        "pd-extproc serving ext_proc on %s (port %d, %s), gRPC health also on %s, admin on port %d; "
        "affinity %s bonus %.2f; "
        "handoff %s%s; EDS served to Envoy: %s; engine metrics: %s; Envoy host health: %s; "
        "%d prefill and %d decode endpoints healthy",
        config.listen,
        grpc_port,
        tls_mode(config.tls),
        f"port {health_port}" if health_port else "no other port",
        admin_port,
        policy.mode.value,
        policy.bonus,
        config.handoff.mode.value,
        f" via {config.handoff.prefill_via}" if config.handoff.prefill_via else "",
        "yes" if publisher is not None else "no",
        f"every {config.engine_metrics.interval_seconds:g} s" if scraper is not None else "off",
        config.envoy_health.admin_url or "off",
        len(registry.prefills),
        len(registry.decodes),
    )
    return RunningServer(
        config,
        router,
        grpc_port,
        admin_port,
        health_port,
        publisher,
        reloads,
        tuple(servers),
        runner,
        tuple(watchers),
    )


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
