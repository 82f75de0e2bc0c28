"""The handoff seam: the :class:`Handoff` protocol and its kinds, one module each (``handoff.mode``).

A new kind is a module with its handoff and a builder of :class:`HandoffBuilder`'s shape, and one line
in :data:`KINDS`. What a handoff receives and produces is in :mod:`ext_proc.handoff.base`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ext_proc.handoff import kv_transfer, mooncake, sglang, sidecar
from ext_proc.handoff.base import HandoffMode, Rerouter
from ext_proc.outcome import HandoffJob, PendingAnswer, Placement, Routed

if TYPE_CHECKING:
    from ext_proc.handoff.config import HandoffConfig
    from ext_proc.handoff.routing import RoutingConfig
    from ext_proc.metrics import Metrics


class Handoff(Protocol):
    """Turns a :class:`~ext_proc.outcome.Placement` into what Envoy and the engines need.

    ``routing_headers`` names every request header the handoff owns: clients may not supply them.
    ``hands_kv``: the handoff tells decodes to pull a KV cache (the response headers are sent to
    pd-extproc: its :class:`~ext_proc.outcome.Routed` carries a watcher for a failed pull,
    :mod:`ext_proc.handoff.kv_failure`). ``pins_ranks``: the handoff pins the engine requests to the
    data-parallel ranks of the :class:`~ext_proc.outcome.Placement` (``X-data-parallel-rank`` on the
    prefill leg it sends and on the decode request); without, an engine of several ranks is credited
    no prefix-cache hit (:mod:`ext_proc.prefix.ranks`).
    """

    routing_headers: tuple[str, ...]
    hands_kv: bool
    pins_ranks: bool

    def hand_off(self, job: HandoffJob, placement: Placement, router: Rerouter) -> Routed | PendingAnswer:
        """Answer at once, or return the :class:`~ext_proc.outcome.PendingAnswer` that will."""
        ...

    async def close(self) -> None:
        """Stop background work and release connections (server shutdown)."""
        ...


class HandoffBuilder(Protocol):
    """Builds one kind of handoff from the ``routing`` and ``handoff`` configuration sections."""

    def __call__(self, routing: RoutingConfig, settings: HandoffConfig, metrics: Metrics) -> Handoff: ...


KINDS: dict[HandoffMode, HandoffBuilder] = {
    HandoffMode.SIDECAR: sidecar.build,
    HandoffMode.KV_TRANSFER_PARAMS: kv_transfer.build,
    HandoffMode.SGLANG_BOOTSTRAP: sglang.build,
    HandoffMode.VLLM_MOONCAKE: mooncake.build,
}
"""How to build each kind of handoff (``handoff.mode``)."""
