"""gRPC health (``grpc.health.v1.Health``) as kubelet, Envoy and GIE's gateways probe an endpoint picker.

One servicer, served on the ext_proc port (``listen``) and, with ``health_listen``, on a second,
plaintext port that serves nothing else (GIE's endpoint picker has one, ``--grpc-health-port``; both
started by :mod:`ext_proc.server`).
Service names:

- ``liveness``: ``SERVING`` while the process runs.
- ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor``, ``inference-extension`` (the name
  GIE's lightweight endpoint picker and its chart's probes use) and ``""`` (overall health, which GIE
  reads as readiness: a load balancer should send traffic only to a ready picker): ``SERVING`` while
  :meth:`Health.set_ready` says so, else ``NOT_SERVING``.
- any other name: ``NOT_FOUND`` (the gRPC health protocol).
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS, INFERENCE_EXTENSION = "liveness", "readiness", "inference-extension"
READY_SERVICES = (READINESS, SERVICE_NAME, INFERENCE_EXTENSION, "")
"""The service names that answer readiness."""
_STATUS = {True: health_pb2.HealthCheckResponse.SERVING, False: health_pb2.HealthCheckResponse.NOT_SERVING}


class Health:
    """The health servicer and the server's readiness (``NOT_SERVING`` until :meth:`set_ready`).

    Construct and use it in the server's event loop. :meth:`set_ready` may be called from
    synchronous code (discovery callbacks); the servicer follows it in order, and always ends on the
    last value set. ``ready`` is the value the servicer answers now.
    """

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.ready = False
        self._wanted = False
        self._lock = asyncio.Lock()
        self._updates: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Set every service's status, before the first server starts.

        Until then the servicer's own default answers ``""`` ``SERVING``."""
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._apply()

    def set_ready(self, ready: bool) -> None:
        """Make the readiness services answer ``ready`` (applied in a task of the running loop)."""
        self._wanted = ready
        task = asyncio.get_running_loop().create_task(self._apply())
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)

    async def settled(self) -> None:
        """Wait until the servicer answers the last value :meth:`set_ready` was given."""
        while self._updates:
            await asyncio.gather(*self._updates)

    async def _apply(self) -> None:
        async with self._lock:  # level-triggered: whoever gets the lock applies the latest value
            wanted = self._wanted
            for service in READY_SERVICES:
                await self.servicer.set(service, _STATUS[wanted])
            self.ready = wanted
