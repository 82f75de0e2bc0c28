"""Run a simulated cluster in a child process, so the engines get a CPU (and a GIL) of their own.

The parent starts it with :func:`spawn_cluster`, which returns once every engine listens and the
EDS files (``prefill`` and ``decode`` clusters, with each engine's KV capacity as
``token_capacity``, each prefill engine's HTTP port as its SGLang ``bootstrap_port`` and, when the
engines publish KV-cache events, each one's PUB port as ``kv_events_port``) are written. It can
then stop single engines (a node dying) and the whole cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from ext_proc.discovery.eds import write_eds_file
from ext_proc.endpoints import EndpointSpec
from sim.cluster import EngineSpec, bootstrap_port, start_cluster, stop_cluster
from sim.config import KvConfig, KvEventsConfig, TimingConfig
from sim.server import RunningEngine


@dataclass(frozen=True)
class EngineInfo:
    """One started engine as the parent sees it.

    One started engine as the parent sees it (``bootstrap_port``: :func:`sim.cluster.bootstrap_port`;
    ``kv_events_port``: where it publishes its KV-cache events, ``None`` when it does not;
    ``kv_events_replay_port``: its replay socket, ``None`` when it has none; ``data_parallel_size``: its
    data-parallel ranks, a real engine's; ``models``: the one model it serves, refusing others, ``None``:
    any, as :attr:`sim.cluster.EngineSpec.model` says)."""

    address: str
    role: str
    group: str
    token_capacity: int
    bootstrap_port: int | None = None
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    data_parallel_size: int = 1
    models: tuple[str, ...] | None = None


def _endpoint(info: EngineInfo, healthy: bool = True) -> EndpointSpec:
    status = "HEALTHY" if healthy else "UNHEALTHY"
    return EndpointSpec(
        info.address,
        info.group,
        float(info.token_capacity),
        healthy,
        status,
        info.bootstrap_port,
        kv_events_port=info.kv_events_port,
        kv_events_replay_port=info.kv_events_replay_port,
        data_parallel_size=info.data_parallel_size,
        models=info.models,
    )


def write_cluster_eds(
    engines: list[EngineInfo], prefill_path: Path, decode_path: Path, removed: frozenset[str] = frozenset()
) -> None:
    """Write both EDS files from ``engines``; addresses in ``removed`` are left out."""
    live = [e for e in engines if e.address not in removed]
    write_eds_file(prefill_path, "prefill", [_endpoint(e) for e in live if e.role in ("prefill", "both")])
    write_eds_file(decode_path, "decode", [_endpoint(e) for e in live if e.role in ("decode", "both")])


@dataclass(frozen=True)
class _Setup:
    """What the child process starts: :func:`sim.cluster.start_cluster`'s arguments."""

    specs: list[EngineSpec]
    eds: list[str]
    timing: TimingConfig
    kv: KvConfig
    kv_events: KvEventsConfig | None


async def _serve(setup: _Setup, conn: Connection) -> None:
    engines: list[RunningEngine] = await start_cluster(
        setup.specs, setup.eds, timing=setup.timing, kv=setup.kv, kv_events=setup.kv_events
    )
    by_address = {e.address: e for e in engines}
    conn.send(
        [
            EngineInfo(
                e.address,
                e.engine.config.role,
                e.engine.config.group,
                e.engine.config.timing.kv_capacity_tokens,
                bootstrap_port(e),
                e.kv_events_port,
                e.kv_events_replay_port,
                models=(e.engine.config.model,) if e.engine.config.strict_model else None,
            )
            for e in engines
        ]
    )
    loop = asyncio.get_running_loop()
    try:
        while True:
            ready = asyncio.Event()
            loop.add_reader(conn.fileno(), ready.set)
            try:
                await ready.wait()
            finally:
                loop.remove_reader(conn.fileno())
            command, address = conn.recv()
            if command == "stop_engine":
                engine = by_address.pop(address, None)
                if engine is not None:
                    await engine.kill()
                conn.send("ok")
            elif command == "exit":
                break
    finally:
        await stop_cluster(by_address.values())


def _child(setup: _Setup, conn: Connection) -> None:
    with contextlib.suppress(KeyboardInterrupt, EOFError):
        asyncio.run(_serve(setup, conn))


@dataclass
class ClusterProcess:
    """A simulated cluster running in a child process."""

    process: multiprocessing.process.BaseProcess
    conn: Connection
    engines: list[EngineInfo]

    def stop_engine(self, address: str) -> None:
        """Kill one engine like a crashed node (EDS is left to the caller)."""
        self.conn.send(("stop_engine", address))
        self.conn.recv()

    def stop(self) -> None:
        """Stop every engine and the child process."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(("exit", ""))
            self.process.join(10)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(5)
        self.conn.close()


def spawn_cluster(
    specs: list[EngineSpec],
    prefill_eds: Path,
    decode_eds: Path,
    timing: TimingConfig | None = None,
    kv: KvConfig | None = None,
    timeout: float = 30.0,
    kv_events: KvEventsConfig | None = None,
) -> ClusterProcess:
    """Start the engines in a child process and write the EDS files.

    Return when all listen (``kv_events``: every engine publishes its KV-cache events so)."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    eds = [str(prefill_eds), str(decode_eds)]
    process = multiprocessing.get_context("spawn").Process(
        target=_child,
        args=(_Setup(specs, eds, timing or TimingConfig(), kv or KvConfig(), kv_events), child),
        daemon=True,
        name="pd-sim-cluster",
    )
    process.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"the simulated cluster did not start within {timeout:.0f} s")
        engines = parent.recv()
    except (EOFError, RuntimeError) as exc:
        process.terminate()
        process.join(5)
        raise RuntimeError(
            f"the simulated cluster failed to start (exit code {process.exitcode}): {exc}"
        ) from None
    write_cluster_eds(engines, prefill_eds, decode_eds)
    return ClusterProcess(process, parent, engines)
