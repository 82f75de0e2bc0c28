"""A whole gateway stack on loopback: simulated cluster, pd-extproc, and the real Envoy.

Each piece runs in its own process (the machine has two cores; a shared GIL would distort
timings): the cluster in a child process, ``pd-extproc serve`` as a subprocess restarted per
affinity setting, Envoy from the shipped bootstrap. :meth:`Stack.route_with` switches the
affinity mode (and runs one or several gateway replicas, each a pd-extproc behind its own Envoy);
:meth:`Stack.round_robin` gives the plain-Envoy baseline on the same cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sim.cluster import EngineSpec
from sim.cluster_process import EngineInfo, spawn_cluster, write_cluster_eds
from sim.config import KvConfig, KvEventsConfig, TimingConfig
from sim.gateway import (
    Gateway,
    GatewayError,
    free_port,
    render_bootstrap,
    start_gateway,
    start_router_process,
    terminate,
    wait_router_ready,
)


class StackError(RuntimeError):
    """A piece of the stack failed to start; the message says which and why."""


class Cluster(Protocol):
    """The engines a stack routes to.

    The simulated cluster (:class:`~sim.cluster_process.ClusterProcess`) or real vLLM engines
    (:class:`rig.cluster.VllmCluster`)."""

    engines: list[EngineInfo]

    def stop_engine(self, address: str) -> None:
        """Kill one engine like a crashed node (EDS is left to the caller)."""
        ...

    def stop(self) -> None:
        """Stop every engine."""
        ...


@dataclass
class Replica:
    """One gateway replica.

    A ``pd-extproc serve`` process and the Envoy in front of it, on ports of its own
    (``server``/``gateway`` are ``None`` while stopped; a plain-Envoy baseline has no server)."""

    grpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    prefill_leg_port: int = field(default_factory=free_port)
    server: subprocess.Popen | None = None
    gateway: Gateway | None = None
    gateway_routed: bool = False
    args: tuple[str, ...] = ()
    log: Path | None = None

    @property
    def admin_url(self) -> str:
        """This replica's pd-extproc admin base URL (``/metrics``, ``/debug/endpoints``)."""
        return f"http://127.0.0.1:{self.admin_port}"

    def stop_server(self) -> None:
        """Stop this replica's pd-extproc (SIGTERM, then SIGKILL after 10 s), if running."""
        if self.server is not None:
            terminate(self.server, grace=10.0)
        self.server = None

    def stop_gateway(self) -> None:
        """Stop this replica's Envoy, if running."""
        if self.gateway is not None:
            self.gateway.stop()
        self.gateway = None

    async def start_server(self, eds: list[str], log: Path, args: tuple[str, ...]) -> None:
        """(Re)start pd-extproc over the ``eds`` files with ``args`` and wait until it routes."""
        self.stop_server()
        self.args, self.log = args, log
        self.server = start_router_process(self.grpc_port, self.admin_port, eds, log, args)
        try:
            await wait_router_ready(self.server, self.admin_port)
        except GatewayError as exc:
            raise StackError(f"{exc}; see {log.parent}") from None

    async def start_gateway(self, prefill_eds: Path, decode_eds: Path, extproc: bool) -> None:
        """(Re)start Envoy: through this replica's pd-extproc, or plain round robin without ``extproc``."""
        self.stop_gateway()
        listen, admin = free_port(), free_port()
        bootstrap = render_bootstrap(
            listen_port=listen,
            admin_port=admin,
            extproc_port=self.grpc_port if extproc else None,
            decode_eds_path=str(decode_eds),
            prefill_eds_path=str(prefill_eds),
            prefill_leg_port=self.prefill_leg_port,
            round_robin=not extproc,
        )
        self.gateway = await start_gateway(bootstrap, listen, admin, concurrency=1)
        self.gateway_routed = extproc

    def failure(self) -> str | None:
        """Why this replica no longer routes.

        Its pd-extproc or its Envoy exited since it was started (the exit code and the end of its log);
        ``None`` while both run (or were stopped on purpose)."""
        if self.server is not None and self.server.poll() is not None:
            code, tail = self.server.returncode, _tail(self.log)
            return f"pd-extproc exited with code {code}; the end of its log:\n{tail}"
        if self.gateway is not None and self.gateway.process.poll() is not None:
            code, tail = self.gateway.process.returncode, self.gateway.log_tail()
            return f"Envoy exited with code {code}; the end of its log:\n{tail}"
        return None

    def stop(self) -> None:
        """Stop Envoy, then pd-extproc."""
        self.stop_gateway()
        self.stop_server()


def _tail(log: Path | None, lines: int = 30) -> str:
    """The last ``lines`` lines of ``log`` ("" when there is none or it cannot be read)."""
    with contextlib.suppress(OSError):
        if log is not None:
            return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass
class Stack:
    """The running stack.

    The cluster and one or more gateway replicas (``replicas[0]`` first). ``url`` is the first replica's
    gateway base URL, ``urls`` every replica's."""

    cluster: Cluster
    workdir: Path
    prefill_eds: Path
    decode_eds: Path
    replicas: list[Replica] = field(default_factory=lambda: [Replica()])
    removed: set[str] = field(default_factory=set)

    @property
    def url(self) -> str:
        """The first replica's Envoy base URL."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every replica's Envoy base URL; raises :class:`StackError` when one has no Envoy running."""
        if any(r.gateway is None for r in self.replicas):
            raise StackError("no gateway is running")
        return [r.gateway.url for r in self.replicas if r.gateway is not None]

    @property
    def admin_url(self) -> str:
        """The first replica's pd-extproc admin base URL."""
        return self.replicas[0].admin_url

    def failure(self) -> str | None:
        """Why the stack no longer routes.

        The first replica whose pd-extproc or Envoy exited (see :meth:`Replica.failure`; with several
        replicas, which one); ``None`` while all run."""
        for index, replica in enumerate(self.replicas):
            why = replica.failure()
            if why is not None:
                return why if len(self.replicas) == 1 else f"replica {index}: {why}"
        return None

    def decode_capacities(self) -> dict[str, float]:
        """Decode engines still in EDS → their KV capacity in tokens (what EDS declares)."""
        return {
            e.address: float(e.token_capacity)
            for e in self.cluster.engines
            if e.role in ("decode", "both") and e.address not in self.removed
        }

    def _scale(self, count: int) -> None:
        """Keep exactly ``count`` replicas (the first ones stay)."""
        for replica in self.replicas[count:]:
            replica.stop()
        self.replicas = self.replicas[:count] + [Replica() for _ in range(count - len(self.replicas))]

    async def route_with(
        self,
        mode: str,
        bonus: float = 0.3,
        handoff: str = "sidecar",
        via_envoy: bool = True,
        pd_threshold_tokens: int | None = None,
        replicas: int = 1,
        engine_metrics: float | None = None,
        config: dict[str, object] | None = None,
        prefill_via: str | None = None,
    ) -> str:
        """(Re)start the gateway replicas with the given routing; the first gateway's URL.

        (Re)start ``replicas`` pd-extprocs with ``mode``/``bonus``/``handoff``/``pd_threshold_tokens``
        (``None``: pd-extproc's default) (prefill legs through each Envoy's prefill-leg listener, or
        straight to the engine without ``via_envoy``), scraping the engines every ``engine_metrics``
        seconds when given, with ``config`` as their configuration file (e.g. the ``affinity.auto``
        keys; the flags above take precedence), each behind its own routed Envoy; return the first
        gateway's URL. ``prefill_via`` (one replica only) sends the legs to that URL instead (a
        test's interposer in front of the replica's prefill-leg listener)."""
        self._scale(replicas)
        eds = [str(self.prefill_eds), str(self.decode_eds)]
        config_args: tuple[str, ...] = ()
        if config is not None:
            path = self.workdir / f"config-{len(list(self.workdir.glob('*.config.json')))}.config.json"
            path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
            config_args = ("--config", str(path))
        for index, replica in enumerate(self.replicas):
            via = f"http://127.0.0.1:{replica.prefill_leg_port}" if via_envoy else ""
            if prefill_via is not None:
                via = prefill_via
            name = (
                f"pd-extproc-{mode}-{bonus}-{handoff}-{'envoy' if via_envoy else 'direct'}"
                f"-{pd_threshold_tokens}-{engine_metrics}-{index}"
            )
            args = (
                *("--affinity-mode", mode, "--affinity-bonus", str(bonus)),
                *("--handoff", handoff, "--prefill-via", via),
                *config_args,
                *(() if pd_threshold_tokens is None else ("--pd-threshold-tokens", str(pd_threshold_tokens))),
                *(
                    ()
                    if engine_metrics is None
                    else ("--engine-metrics", "--engine-metrics-interval", str(engine_metrics))
                ),
            )
            await replica.start_server(eds, self.workdir / f"{name}.log", args)
            if replica.gateway is None or not replica.gateway_routed:
                await replica.start_gateway(self.prefill_eds, self.decode_eds, extproc=True)
        return self.url

    async def restart_router(self, index: int) -> None:
        """Restart replica ``index``'s pd-extproc with the same arguments (its Envoy stays)."""
        replica = self.replicas[index]
        await replica.start_server(
            [str(self.prefill_eds), str(self.decode_eds)], self.workdir / f"restart-{index}.log", replica.args
        )

    async def round_robin(self) -> str:
        """Stop pd-extproc and run plain Envoy (round robin over the decodes); return its URL."""
        self._scale(1)
        self.replicas[0].stop_server()
        await self.replicas[0].start_gateway(self.prefill_eds, self.decode_eds, extproc=False)
        return self.url

    async def kill_engine(self, address: str) -> None:
        """A node dies: the engine resets its connections and refuses new ones (EDS still lists it).

        The child process answers once the engine is gone; waiting for that in a thread keeps
        this event loop (the workload's) running meanwhile."""
        await asyncio.to_thread(self.cluster.stop_engine, address)

    def remove_from_eds(self, address: str) -> None:
        """Discovery notices: the engine leaves both EDS files (atomic rename)."""
        self.removed.add(address)
        write_cluster_eds(self.cluster.engines, self.prefill_eds, self.decode_eds, frozenset(self.removed))

    def stop(self) -> None:
        """Tear everything down (idempotent)."""
        for replica in self.replicas:
            replica.stop()
        self.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_stack(
    specs: list[EngineSpec],
    timing: TimingConfig | None = None,
    kv: KvConfig | None = None,
    kv_events: KvEventsConfig | None = None,
) -> Stack:
    """Start the simulated cluster and write its EDS files.

    Gateways start on demand (``kv_events``: the engines publish their KV-cache events so, each on its own
    ports, named in EDS)."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-stack-"))
    prefill_eds, decode_eds = workdir / "prefill.json", workdir / "decode.json"
    try:
        cluster = spawn_cluster(specs, prefill_eds, decode_eds, timing, kv, kv_events=kv_events)
    except RuntimeError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        raise StackError(str(exc)) from None
    return Stack(cluster, workdir, prefill_eds, decode_eds)
