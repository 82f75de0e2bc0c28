"""Gateway replicas as real ``pd-extproc serve`` processes sharing state over NATS, driven the way Envoy
drives them (tests/e2e/test_e2e_shared_state.py).

:class:`Replica` is one process on its own loopback ports, configured by a YAML file (``shared_state``
and whatever the test adds), logging at INFO to its own file; it can be SIGKILLed and started again on
the same ports. :func:`book` opens an ext_proc stream the way Envoy does for one request (request
headers, then the buffered body) and keeps it open, so the request's booking stays until the stream is
closed (:func:`release`). The admin views are read with :func:`rows` (``/debug/endpoints``),
:func:`samples` (``/metrics``) and :func:`shared_view` (``/debug/shared``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, destination, headers
from prometheus_client.parser import text_string_to_metric_families

from sim.gateway import free_port, terminate, wait_router_ready

READY_SECONDS = 60.0
"""How long a start may take: ~1 s of CPU (4 s with the prefix index's kernels to compile), which a
2-core machine shared with a dozen busy processes stretches tenfold."""


def nested(settings: dict[str, object]) -> dict[str, object]:
    """``{"a.b": 1}`` as ``{"a": {"b": 1}}`` (the YAML a config file holds)."""
    tree: dict[str, object] = {}
    for dotted, value in settings.items():
        *sections, key = dotted.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})  # type: ignore[assignment]
        node[key] = value
    return tree


class Replica:
    """One ``pd-extproc serve`` process (not started: :meth:`start`), with ``settings`` (dotted keys) on
    top of loopback ports of its own; its files (``<name>.yaml``, ``<name>.log``) in ``workdir``."""

    def __init__(self, workdir: Path, name: str, settings: dict[str, object]) -> None:
        self.name = name
        self.grpc_port, self.admin_port = free_port(), free_port()
        self.config = workdir / f"{name}.yaml"
        self.log = workdir / f"{name}.log"
        self.configure(settings)
        self.process: subprocess.Popen | None = None

    def configure(self, settings: dict[str, object]) -> None:
        """Write the configuration file: ``settings`` (dotted keys, kept as :attr:`settings`) and this
        replica's ports (the next start reads it)."""
        self.settings = dict(settings)
        config = {
            **settings,
            "listen": f"127.0.0.1:{self.grpc_port}",
            "metrics_listen": f"127.0.0.1:{self.admin_port}",
        }
        self.config.write_text(yaml.safe_dump(nested(config)), encoding="utf-8")

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def target(self) -> str:
        """The gRPC address Envoy (or a test's client) connects to."""
        return f"127.0.0.1:{self.grpc_port}"

    def spawn(self) -> None:
        """Start the process (its log appended to); :meth:`ready` waits until it routes."""
        assert self.process is None or self.process.poll() is not None, f"{self.name} is running"
        command = [sys.executable, "-m", "ext_proc.cli", "--log-level", "INFO", "serve", "--config"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PD_EXTPROC_")}  # the file alone
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [*command, str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    async def ready(self) -> None:
        """Wait until the process answers ``/healthz`` with its decodes (its gRPC port is open by then)."""
        assert self.process is not None
        await wait_router_ready(self.process, self.admin_port, timeout=READY_SECONDS)

    async def start(self) -> None:
        """:meth:`spawn`, then :meth:`ready`."""
        self.spawn()
        await self.ready()

    def kill(self) -> None:
        """SIGKILL the process (nothing said to its peers) and reap it."""
        assert self.process is not None and self.process.poll() is None, f"{self.name} is not running"
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        """SIGTERM the process (SIGKILL after 5 s) if it runs."""
        if self.process is not None:
            terminate(self.process)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def book(channel: grpc.aio.Channel, raw: bytes | None = None) -> tuple[grpc.aio.StreamStreamCall, str]:
    """One request's ext_proc stream as Envoy opens it (request headers, then the ``raw`` body, default
    a short completion), left open: the call (for :func:`release`) and the decode it was routed to."""
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(headers())
    await call.read()
    await call.write(body() if raw is None else body(raw))
    answer = await call.read()
    assert answer is not grpc.aio.EOF, "the stream ended without an answer"
    routed = destination(answer)
    assert routed, f"not routed: {answer}"
    return call, routed


async def release(call: grpc.aio.StreamStreamCall) -> None:
    """End the stream as Envoy does when its request is done (half-close, then read to its end)."""
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF


async def rows(session: aiohttp.ClientSession, replica: Replica) -> list[dict]:
    """``replica``'s ``/debug/endpoints`` rows."""
    async with session.get(f"{replica.admin_url}/debug/endpoints") as response:
        return await response.json()


async def shared_view(session: aiohttp.ClientSession, replica: Replica) -> dict:
    """``replica``'s ``/debug/shared``."""
    async with session.get(f"{replica.admin_url}/debug/shared") as response:
        return await response.json()


async def samples(session: aiohttp.ClientSession, replica: Replica) -> dict[tuple[str, str], float]:
    """``replica``'s ``/metrics``: each sample's value by (name, its labels as sorted JSON)."""
    async with session.get(f"{replica.admin_url}/metrics") as response:
        text = await response.text()
    return {
        (sample.name, json.dumps(sample.labels, sort_keys=True)): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(values: dict[tuple[str, str], float], name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        value
        for (sample, encoded), value in values.items()
        if sample == name and labels.items() <= json.loads(encoded).items()
    )
