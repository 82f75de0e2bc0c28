"""Publish the discovery source's endpoints to Envoy first, and to the router only once Envoy has them.

:class:`EdsPublisher` sits between the discovery source and the registry when pd-extproc serves
EDS. Its invariant: the router only picks an endpoint that every Envoy subscribed to its cluster
holds as healthy, so Envoy always knows the address the router names.

- **Withdraw first.** An endpoint the source removed or no longer reports healthy leaves the
  router's view (the registry) before the version without it is published.
- **Publish, then admit.** An endpoint that becomes healthy (new, or healthy again) is published
  at once but joins the router's view only when every stream subscribed to its cluster has ACKed
  a version at least as new as the one it became healthy in (each version is the whole set, so
  that version holds it); while no Envoy subscribes to its cluster, ``no_envoy_delay`` seconds
  after it was published instead. A NACK admits nothing: the endpoint waits for the next version.
- Any other change (the metadata of a pickable endpoint: group, capacity, bootstrap port) reaches
  the router and Envoy at once: Envoy already has the address.

Envoy is served exactly the source's endpoints of the prefill and decode clusters (merged and
de-duplicated as the registry does); the router's view is that set minus the endpoints waiting
for ACKs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ext_proc.discovery.eds import cluster_load_assignment
from ext_proc.endpoints import ClusterEndpoints, merge_clusters
from ext_proc.metrics import Metrics
from ext_proc.xds.ads import AdsServer

log = logging.getLogger(__name__)

Apply = Callable[[list[ClusterEndpoints], bool], None]
"""Receives the router's view and whether it is settled (no endpoint waits for Envoy)."""
Key = tuple[str, str]
"""``(cluster_name, address)``."""


class EdsPublisher:
    """Serves the endpoints over :attr:`ads` first, then hands the router's view to ``apply``.

    ``clusters``: the prefill and decode cluster names; :meth:`publish` is the discovery source's
    callback.

    ``no_envoy_delay`` is in seconds. Construct it in the server's running event loop, which owns
    it (not thread-safe); after :meth:`close` it hands nothing over any more.
    """

    def __init__(
        self, clusters: tuple[str, ...], namespace: str, apply: Apply, no_envoy_delay: float, metrics: Metrics
    ) -> None:
        self._names = clusters
        self._namespace = namespace
        self._apply = apply
        self._delay = no_envoy_delay
        self._metrics = metrics
        self._loop = asyncio.get_running_loop()
        self._source: dict[str, ClusterEndpoints] = {}
        self._admitted: set[Key] = set()
        self._pending: dict[Key, tuple[int, float]] = {}  # → (version it became healthy in, loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.ads = AdsServer(metrics, self.settle)

    def publish(self, clusters: list[ClusterEndpoints]) -> None:
        """Take the source's new endpoint set: withdraw, publish, then admit as Envoy ACKs."""
        self._source = merge_clusters(clusters)
        served = {name: self._source.get(name, ClusterEndpoints(name, (), "")) for name in self._names}
        healthy = {(name, s.address) for name, c in served.items() for s in c.endpoints if s.healthy}
        self._admitted &= healthy
        self._pending = {key: since for key, since in self._pending.items() if key in healthy}
        self._hand_over()
        version = self.ads.publish(
            {name: cluster_load_assignment(c, self._namespace) for name, c in served.items()}
        )
        now = self._loop.time()
        for key in healthy - self._admitted - self._pending.keys():
            self._pending[key] = (version, now)
        self.settle()

    def settle(self) -> None:
        """Admit the waiting endpoints Envoy now has (see the module docstring).

        Re-arm the timer for those whose cluster has no subscriber."""
        if self._closed:
            return
        now = self._loop.time()
        acked = {name: self.ads.acked_version(name) for name in self._names}
        admitted = [
            key
            for key, (version, since) in self._pending.items()
            if (now - since >= self._delay if acked[key[0]] is None else acked[key[0]] >= version)
        ]
        for key in admitted:
            del self._pending[key]
            self._admitted.add(key)
        if admitted:
            log.info("the router may pick %d more endpoint(s): Envoy has them", len(admitted))
            self._hand_over()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waits = [
            since + self._delay - now for key, (_, since) in self._pending.items() if acked[key[0]] is None
        ]
        if waits:
            self._timer = self._loop.call_later(max(min(waits), 0.0), self.settle)
        self._metrics.xds_pending.set(len(self._pending))

    def close(self) -> None:
        """Stop the timer and end every ADS stream."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.ads.close()

    def _hand_over(self) -> None:
        """Give the router the source's set minus the healthy endpoints not admitted yet; it is
        settled when nothing was held back."""
        view: list[ClusterEndpoints] = []
        held = False
        for name, cluster in self._source.items():
            if name in self._names:
                kept = tuple(
                    s for s in cluster.endpoints if not s.healthy or (name, s.address) in self._admitted
                )
                held = held or len(kept) < len(cluster.endpoints)
                cluster = ClusterEndpoints(name, kept, cluster.source)
            view.append(cluster)
        self._apply(view, not held)
