"""A whole gateway stack on loopback: simulated cluster, pd-extproc, and the real Envoy.

Each piece runs in its own process (the machine has two cores; a shared GIL would distort
timings): the cluster in a child process, ``pd-extproc serve`` as a subprocess restarted per
affinity setting, Envoy from the shipped bootstrap. :meth:`Stack.route_with` switches the
affinity mode; :meth:`Stack.round_robin` gives the plain-Envoy baseline on the same cluster.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ext_proc.gateway import (
    Gateway,
    GatewayError,
    free_port,
    render_bootstrap,
    start_gateway,
    start_router_process,
    terminate,
    wait_router_ready,
)
from sim.cluster import EngineSpec
from sim.cluster_process import ClusterProcess, spawn_cluster, write_cluster_eds
from sim.config import KvConfig, TimingConfig


class StackError(RuntimeError):
    """A piece of the stack failed to start; the message says which and why."""


@dataclass
class Stack:
    """The running stack. ``url`` is the current gateway's base URL (``None`` before routing)."""

    cluster: ClusterProcess
    workdir: Path
    prefill_eds: Path
    decode_eds: Path
    grpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    prefill_leg_port: int = field(default_factory=free_port)
    server: subprocess.Popen | None = None
    gateway: Gateway | None = None
    removed: set[str] = field(default_factory=set)
    gateway_routed: bool = False

    @property
    def url(self) -> str:
        if self.gateway is None:
            raise StackError("no gateway is running")
        return self.gateway.url

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def decode_capacities(self) -> dict[str, float]:
        """Decode engines still in EDS → their KV capacity in tokens (what EDS declares)."""
        return {
            e.address: float(e.token_capacity)
            for e in self.cluster.engines
            if e.role in ("decode", "both") and e.address not in self.removed
        }

    def _stop_server(self) -> None:
        if self.server is not None:
            terminate(self.server, grace=10.0)
        self.server = None

    def _stop_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.gateway = None

    async def _start_gateway(self, extproc: bool) -> None:
        self._stop_gateway()
        listen, admin = free_port(), free_port()
        bootstrap = render_bootstrap(
            listen_port=listen,
            admin_port=admin,
            extproc_port=self.grpc_port if extproc else None,
            decode_eds_path=str(self.decode_eds),
            prefill_eds_path=str(self.prefill_eds),
            prefill_leg_port=self.prefill_leg_port,
            round_robin=not extproc,
        )
        self.gateway = await start_gateway(bootstrap, listen, admin, concurrency=1)
        self.gateway_routed = extproc

    async def route_with(
        self,
        mode: str,
        bonus: float = 0.3,
        handoff: str = "sidecar",
        via_envoy: bool = True,
        pd_threshold_tokens: int | None = None,
        config: dict[str, object] | None = None,
    ) -> str:
        """(Re)start pd-extproc with ``mode``/``bonus``/``handoff``/``pd_threshold_tokens`` (``None``:
        pd-extproc's default) (prefill legs through Envoy's prefill-leg listener, or straight to the
        engine without ``via_envoy``), with ``config`` as its configuration file (e.g. the
        ``affinity.auto`` keys; the flags above take precedence), and the routed Envoy; return the
        gateway URL."""
        self._stop_server()
        via = f"http://127.0.0.1:{self.prefill_leg_port}" if via_envoy else ""
        name = (
            f"pd-extproc-{mode}-{bonus}-{handoff}-{'envoy' if via_envoy else 'direct'}-{pd_threshold_tokens}"
        )
        config_args: tuple[str, ...] = ()
        if config is not None:
            path = self.workdir / f"{name}-{len(list(self.workdir.glob('*.config.json')))}.config.json"
            path.write_text(json.dumps(config), encoding="utf-8")  # JSON is YAML
            config_args = ("--config", str(path))
        self.server = start_router_process(
            self.grpc_port,
            self.admin_port,
            [str(self.prefill_eds), str(self.decode_eds)],
            self.workdir / f"{name}.log",
            (
                *("--affinity-mode", mode, "--affinity-bonus", str(bonus)),
                *("--handoff", handoff, "--prefill-via", via),
                *config_args,
                *(() if pd_threshold_tokens is None else ("--pd-threshold-tokens", str(pd_threshold_tokens))),
            ),
        )
        try:
            await wait_router_ready(self.server, self.admin_port)
        except GatewayError as exc:
            raise StackError(f"{exc}; see {self.workdir}") from None
        if self.gateway is None or not self.gateway_routed:
            await self._start_gateway(extproc=True)
        return self.url

    async def round_robin(self) -> str:
        """Stop pd-extproc and run plain Envoy (round robin over the decodes); return its URL."""
        self._stop_server()
        await self._start_gateway(extproc=False)
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
        self._stop_gateway()
        self._stop_server()
        self.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_stack(
    specs: list[EngineSpec], timing: TimingConfig | None = None, kv: KvConfig | None = None
) -> Stack:
    """Start the simulated cluster and write its EDS files; gateways start on demand."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-stack-"))
    prefill_eds, decode_eds = workdir / "prefill.json", workdir / "decode.json"
    try:
        cluster = spawn_cluster(specs, prefill_eds, decode_eds, timing, kv)
    except RuntimeError as exc:
        shutil.rmtree(workdir, ignore_errors=True)
        raise StackError(str(exc)) from None
    return Stack(cluster, workdir, prefill_eds, decode_eds)
