"""Poll Envoy's admin ``/clusters`` and leave the hosts Envoy marks as failed out of the candidates.

Envoy sees every answer of every engine; pd-extproc sees none of the decode's (its response phase is
skipped). Envoy's outlier detection (``outlier_detection`` on the decode and prefill clusters) ejects a
host after consecutive gateway failures, but the override_host policy still forwards to a host
pd-extproc names, ejected or not (Envoy 1.40: it looks the name up without checking health). So a
decode that fails at once (garbage, refused connections) would keep getting most of the traffic: it
never carries load. This poller closes the loop: every ``interval_seconds`` it reads which hosts of
the two clusters Envoy marks as failed (outlier check, active health check, EDS unhealthy) and hands
them to the router's :class:`ext_proc.ejection.Ejections` of the role (``hold``), which leaves them
out of the candidates until Envoy takes them back (never all of them). Each change is logged and
counted (``pd_extproc_envoy_health_changes_total``). A failed poll drops the held set (pd-extproc's
own view alone: an Envoy that cannot be read is no reason to avoid hosts) and is logged once until a
poll succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from ext_proc.ejection import Ejections
from ext_proc.endpoints import endpoint_address
from ext_proc.envoy_health_config import EnvoyHealthConfig
from ext_proc.metrics import Metrics

log = logging.getLogger(__name__)


FAILED_FLAGS = ("failed_outlier_check", "failed_active_health_check", "failed_eds_health")
"""Boolean fields of a host's ``health_status`` in ``/clusters?format=json`` that make it no candidate."""

UNHEALTHY_EDS = frozenset({"UNHEALTHY", "DRAINING", "TIMEOUT"})
"""Values of ``health_status.eds_health_status`` that make a host no candidate."""


class EnvoyHealthError(Exception):
    """A poll failed; ``reason`` is the metric label (``connect``, ``timeout``, ``status``, ``parse``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def failed_hosts(clusters: Any, cluster: str) -> frozenset[str]:
    """The ``ip:port`` of the hosts of ``cluster`` that Envoy marks as failed (IPv6: ``[ip]:port``).

    Read from a decoded ``/clusters?format=json`` document; raises :class:`EnvoyHealthError` if it is
    malformed."""
    try:
        out = set()
        for status in clusters.get("cluster_statuses", ()):
            if status["name"] != cluster:
                continue
            for host in status.get("host_statuses", ()):
                health = host.get("health_status", {})
                if any(health.get(flag) for flag in FAILED_FLAGS) or (
                    health.get("eds_health_status") in UNHEALTHY_EDS
                ):
                    socket = host["address"]["socket_address"]
                    out.add(endpoint_address(socket["address"], socket["port_value"]))
        return frozenset(out)
    except (AttributeError, KeyError, TypeError) as exc:
        raise EnvoyHealthError("parse", f"unexpected /clusters document: {exc!r}") from None


class EnvoyHealth:
    """The polls of Envoy's host health for one server, on the server's event loop.

    ``ejections`` maps a cluster name to the router's :class:`Ejections` of its role (role names for
    logs and metrics in ``roles``)."""

    def __init__(
        self,
        config: EnvoyHealthConfig,
        ejections: Mapping[str, Ejections],
        roles: Mapping[str, str],
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._ejections = ejections
        self._roles = roles
        self._metrics = metrics
        self._error: str | None = None

    async def run(self) -> None:
        """Poll every ``interval_seconds`` until cancelled.

        Each poll opens and closes its own loopback connection: no descriptor is held between polls
        (the fault bench counts them)."""
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_seconds)
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while True:
                await self.poll(session)
                await asyncio.sleep(self._config.interval_seconds)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """One poll: hold what Envoy marks as failed now, or nothing if Envoy cannot be read."""
        try:
            document = await self._fetch(session)
            failed = {cluster: failed_hosts(document, cluster) for cluster in self._ejections}
        except EnvoyHealthError as exc:
            self._metrics.envoy_health_polled(exc.reason)
            if self._error is None:
                log.warning(
                    "envoy_health: %s; Envoy's host health is ignored until a poll succeeds "
                    "(logged once until then)",
                    exc,
                )
            self._error = str(exc)
            failed = dict.fromkeys(self._ejections, frozenset())
        else:
            self._metrics.envoy_health_polled("ok")
            if self._error is not None:
                log.info("envoy_health: reading Envoy's host health again")
            self._error = None
        for cluster, hosts in failed.items():
            self._apply(cluster, hosts)

    def _apply(self, cluster: str, hosts: frozenset[str]) -> None:
        ejections = self._ejections[cluster]
        before = ejections.held
        if hosts == before:
            return
        role = self._roles[cluster]
        for address in sorted(hosts - before):
            log.warning("%s %s: Envoy marks it failed; no candidate until Envoy takes it back", role, address)
        for address in sorted(before - hosts):
            log.info("%s %s: Envoy takes it back; a candidate again", role, address)
        self._metrics.envoy_health_changed(role, "ejected", len(hosts - before))
        self._metrics.envoy_health_changed(role, "returned", len(before - hosts))
        ejections.hold(hosts)

    async def _fetch(self, session: aiohttp.ClientSession) -> Any:
        url = f"{self._config.admin_url}/clusters?format=json"
        try:
            async with session.get(url) as response:
                if response.status != 200:
                    raise EnvoyHealthError("status", f"HTTP {response.status} from {url}")
                return await response.json(content_type=None)
        except TimeoutError:
            raise EnvoyHealthError(
                "timeout", f"{url}: no answer within {self._config.timeout_seconds} s"
            ) from None
        except ValueError as exc:
            raise EnvoyHealthError("parse", f"{url}: not JSON: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise EnvoyHealthError("connect", f"{url}: {exc}") from None
