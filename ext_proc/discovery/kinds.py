"""The discovery seam: the :class:`Source` protocol and its kinds, one module each (``discovery.source``).

A new kind is a module with its source and a builder of :class:`SourceBuilder`'s shape, and one line in
:data:`KINDS`. The Kubernetes sources import the client library only when built.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from ext_proc.discovery import SourceKind
from ext_proc.discovery.eds_watch import Available, EdsFileSource, Publish

if TYPE_CHECKING:
    from ext_proc.discovery.config import DiscoveryConfig
    from ext_proc.metrics import Metrics

log = logging.getLogger(__name__)


class Source(Protocol):
    """A discovery source: publishes endpoint sets from :meth:`run` until cancelled."""

    async def run(self) -> None:
        """Publish endpoint sets as they change, until cancelled."""
        ...


class SourceBuilder(Protocol):
    """Builds one kind of source of the ``discovery`` section.

    A source that can lose its whole set (the InferencePool deleted) says so through ``available``;
    the others never call it."""

    async def __call__(
        self, discovery: DiscoveryConfig, publish: Publish, available: Available, metrics: Metrics
    ) -> Source: ...


async def files_source(
    discovery: DiscoveryConfig, publish: Publish, available: Available, metrics: Metrics
) -> Source:
    """The EDS files, read once before returning (their endpoints are published at once)."""
    source = EdsFileSource(
        discovery.eds_files, discovery.metadata_namespace, publish, discovery.poll_interval_seconds
    )
    if not source.poll():
        log.warning(
            "no valid EDS file loaded yet: readiness is NOT_SERVING and requests get 503 until one is"
        )
    return source


async def kubernetes_source(
    discovery: DiscoveryConfig, publish: Publish, available: Available, metrics: Metrics
) -> Source:
    """The pods of the Kubernetes API; nothing is published before :meth:`Source.run` listed them."""
    from ext_proc.discovery.kubernetes import KubernetesSource  # the client library loads only if used

    return await KubernetesSource.connect(discovery, publish, metrics)


async def inferencepool_source(
    discovery: DiscoveryConfig, publish: Publish, available: Available, metrics: Metrics
) -> Source:
    """The pods of an InferencePool; unavailable while the pool is absent or not usable."""
    from ext_proc.discovery.inferencepool import InferencePoolSource  # the client library, if used

    return await InferencePoolSource.connect(discovery, publish, available, metrics)


KINDS: dict[SourceKind, SourceBuilder] = {
    SourceKind.FILES: files_source,
    SourceKind.KUBERNETES: kubernetes_source,
    SourceKind.INFERENCEPOOL: inferencepool_source,
}
"""How to build each kind of discovery source (``discovery.source``)."""
