"""Envoy's Aggregated Discovery Service (state of the world), serving ``ClusterLoadAssignment``\\ s.

Contract, per ADS stream (one Envoy):
- The stream subscribes with its first ``ClusterLoadAssignment`` request; ``resource_names`` are
  the clusters it wants (empty: every served cluster), and every later request restates them.
- It is answered with the current version as soon as one is published (nothing before), then on
  every :meth:`AdsServer.publish` and every change of its resource names. Each response carries
  the whole set of wanted clusters that exist, ``version_info`` (the publish counter: "1", "2",
  ...) and a nonce of its own.
- A request naming the nonce of the stream's last response answers it: an ACK (no
  ``error_detail``) records that the stream holds that version of the clusters the response
  carried; a NACK (``error_detail`` set) is logged and counted, leaves the stream on its last
  ACKed version, and the rejected version is not sent again (the next publish is). A request
  naming an older nonce is stale and ignored; requests for other resource types are ignored.
- ``on_change`` runs after every ACK, every new subscription and every stream end: the moments
  :meth:`AdsServer.acked_version` can change.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Final

import grpc
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2

from ext_proc.discovery.eds import CLA_TYPE_URL
from ext_proc.metrics import Metrics

log = logging.getLogger(__name__)

_PUSH: Final = object()
"""Queue item: a new version was published."""


class _Subscriber:
    """One ADS stream's EDS state. ``names`` is ``None`` until the first request, then the wanted
    cluster names (empty: all); ``acked`` maps a cluster to the last version the stream ACKed of it."""

    __slots__ = ("acked", "names", "peer", "sent_clusters", "sent_names", "sent_nonce", "sent_version")

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.names: frozenset[str] | None = None
        self.sent_version = 0
        self.sent_nonce = ""
        self.sent_names: frozenset[str] | None = None
        self.sent_clusters: tuple[str, ...] = ()
        self.acked: dict[str, int] = {}

    def wants(self, cluster: str) -> bool:
        return self.names is not None and (not self.names or cluster in self.names)


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Serves the clusters last given to :meth:`publish` to every connected Envoy.

    ``on_change`` is called synchronously (see the module docstring for when). Not thread-safe:
    owned by the server's event loop.
    """

    def __init__(self, metrics: Metrics, on_change: Callable[[], None]) -> None:
        self._metrics = metrics
        self._on_change = on_change
        self._resources: dict[str, any_pb2.Any] = {}
        self._streams: dict[_Subscriber, asyncio.Queue[object]] = {}
        self._nonces = itertools.count(1)
        self.version = 0

    def publish(self, clusters: Mapping[str, endpoint_pb2.ClusterLoadAssignment]) -> int:
        """Serve ``clusters`` (name → assignment) instead of every cluster served; return the new version.

        The new version is pushed to every subscribed stream."""
        resources = {}
        for name, assignment in clusters.items():
            resources[name] = packed = any_pb2.Any()
            packed.Pack(assignment)
        self._resources = resources
        self.version += 1
        self._metrics.xds_version.set(self.version)
        for queue in self._streams.values():
            queue.put_nowait(_PUSH)
        return self.version

    def acked_version(self, cluster: str) -> int | None:
        """The lowest version of ``cluster`` ACKed by the streams subscribed to it.

        0 if one of them has ACKed none yet; ``None`` when no stream is subscribed to it."""
        versions = [s.acked.get(cluster, 0) for s in self._streams if s.wants(cluster)]
        return min(versions, default=None)

    def close(self) -> None:
        """End every stream (Envoy reconnects to whoever serves the port next)."""
        for queue in self._streams.values():
            queue.put_nowait(None)

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        """Serve one Envoy's ADS stream until it ends or :meth:`close`."""
        subscriber = _Subscriber(context.peer())
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._streams[subscriber] = queue
        self._metrics.xds_streams.set(len(self._streams))
        reader = asyncio.create_task(_read(request_iterator, queue, subscriber.peer))
        try:
            while (item := await queue.get()) is not None:
                if item is _PUSH:
                    response = self._respond(subscriber)
                else:
                    assert isinstance(item, discovery_pb2.DiscoveryRequest)
                    response = self._handle(subscriber, item)
                if response is not None:
                    yield response
        finally:
            reader.cancel()
            del self._streams[subscriber]
            self._metrics.xds_streams.set(len(self._streams))
            log.info("ADS stream from %s ended", subscriber.peer)
            if subscriber.names is not None:
                self._on_change()

    def _handle(
        self, subscriber: _Subscriber, request: discovery_pb2.DiscoveryRequest
    ) -> discovery_pb2.DiscoveryResponse | None:
        if request.type_url != CLA_TYPE_URL:
            log.warning(
                "ignoring an ADS request for %s from %s: only EDS is served",
                request.type_url,
                subscriber.peer,
            )
            return None
        first = subscriber.names is None
        if first:
            if request.node.id:
                subscriber.peer = f"{request.node.id} ({subscriber.peer})"
            names = list(request.resource_names) or "*"
            log.info("ADS stream from %s subscribed to EDS %s", subscriber.peer, names)
        acked = False
        if subscriber.sent_nonce and request.response_nonce == subscriber.sent_nonce:
            if request.HasField("error_detail"):
                self._metrics.xds_reply(accepted=False)
                log.error(
                    "Envoy %s rejected EDS version %d (it keeps its last accepted one): %s",
                    subscriber.peer,
                    subscriber.sent_version,
                    request.error_detail.message,
                )
            else:
                self._metrics.xds_reply(accepted=True)
                for cluster in subscriber.sent_clusters:
                    subscriber.acked[cluster] = subscriber.sent_version
                acked = True
        elif subscriber.sent_nonce and request.response_nonce:
            return None  # stale: answers an older response than the stream's last one
        subscriber.names = frozenset(request.resource_names)
        response = self._respond(subscriber)
        if first or acked:
            self._on_change()
        return response

    def _respond(self, subscriber: _Subscriber) -> discovery_pb2.DiscoveryResponse | None:
        """The current version for ``subscriber``, unless it was already sent for the same names."""
        if subscriber.names is None or self.version == 0:
            return None
        if subscriber.sent_version == self.version and subscriber.sent_names == subscriber.names:
            return None
        clusters = tuple(name for name in self._resources if subscriber.wants(name))
        nonce = str(next(self._nonces))
        subscriber.sent_version, subscriber.sent_nonce = self.version, nonce
        subscriber.sent_names, subscriber.sent_clusters = subscriber.names, clusters
        self._metrics.xds_response()
        return discovery_pb2.DiscoveryResponse(
            version_info=str(self.version),
            resources=[self._resources[name] for name in clusters],
            type_url=CLA_TYPE_URL,
            nonce=nonce,
        )


async def _read(
    requests: AsyncIterator[discovery_pb2.DiscoveryRequest], queue: asyncio.Queue[object], peer: str
) -> None:
    """Move a stream's requests into its queue; ``None`` once the stream ends."""
    try:
        async for request in requests:
            queue.put_nowait(request)
    except grpc.RpcError as exc:
        log.info("ADS stream from %s broke: %s", peer, exc)
    finally:
        queue.put_nowait(None)
