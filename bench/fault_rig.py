"""The fault campaign's rig: engines, pd-extproc as a process and the real Envoy on loopback.

- a client that classifies what it gets;
- after-the-fact checks: load left, RSS, file descriptors, and every address the router named against
  the set discovered when it decided, read from Envoy's access log;
- Envoy runs from the shipped bootstrap with two changes only: an access log on both listeners (per
  request: when it began, when its upstream request was sent, the routing header pd-extproc set and
  the host Envoy used), and the stream and route idle timeouts shortened from 300 s to
  :data:`IDLE_TIMEOUT_S`, so that a stalled request is answered within the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.common import rss_mib
from sim.cluster import EngineSpec
from sim.cluster_process import ClusterProcess, EngineInfo, spawn_cluster, write_cluster_eds
from sim.config import TimingConfig
from sim.gateway import (
    SHIPPED_ADS_BOOTSTRAP,
    SHIPPED_BOOTSTRAP,
    Gateway,
    free_port,
    render_bootstrap,
    start_gateway,
    start_router_process,
    terminate,
    wait_router_ready,
)

IDLE_TIMEOUT_S = 3.0
"""Envoy's stream and route idle timeouts in the campaign (shipped: 300 s)."""
MESSAGE_TIMEOUT_S = 5.0
"""The ext_proc filter's ``message_timeout`` as shipped: the longest Envoy waits for a routing answer."""
HUNG_MARGIN_S = 3.0
"""A client that saw no byte for the longer of the two timeouts above plus this margin is hung."""
SETTLE_S = 10.0
"""How long the rig waits, after the last client ended, for the router's load to drain (seconds)."""
LOG_FORMAT = (
    "%START_TIME(%s.%3f)% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:ms)% %DURATION% "
    "%REQ(X-GATEWAY-DESTINATION-ENDPOINT)% %UPSTREAM_HOST% %RESPONSE_CODE%\n"
)
"""After the listener's name: the request's start (Unix seconds, ms), milliseconds from it to the
upstream request's start (``-``: none) and to its end, the addresses pd-extproc named, the host Envoy
connected to and the status."""
DISCOVERY_LAG_S = 1.0
"""How long after an address left the discovered set a decision may still name it, or Envoy connect
to it: the time pd-extproc and Envoy take to read a change (pd-extproc polls EDS files every 0.25 s)."""


@dataclass(frozen=True)
class Outcome:
    """What one client saw, as a ``label`` (one of a fixed set).

    ``label`` is ``"200"`` (a complete answer: ``[DONE]`` for a stream), ``"200 cut"`` (the answer started and
    was cut), ``"<status> <error code>"`` (``non-json`` when the body is no JSON error), ``"conn-error"`` (no
    answer at all), ``"hung"`` or ``"aborted"`` (the client gave up on purpose)."""

    label: str
    seconds: float


def idle_read_timeout() -> float:
    """Seconds without a byte after which a client counts as hung."""
    return max(IDLE_TIMEOUT_S, MESSAGE_TIMEOUT_S) + HUNG_MARGIN_S


async def request(session: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]) -> Outcome:
    """POST ``body`` to ``url`` and classify the answer (see :class:`Outcome`)."""
    started = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=idle_read_timeout())
    answered = False
    try:
        async with session.post(url, json=body, headers=headers, timeout=timeout) as response:
            answered = True
            if response.status != 200:
                raw = await response.read()
                try:
                    code = json.loads(raw)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = "non-json"
                return Outcome(f"{response.status} {code}", time.monotonic() - started)
            done = not body.get("stream")
            async for line in response.content:
                done = done or line.strip() == b"data: [DONE]"
            await response.read()
            label = "200" if done else "200 cut"
    except TimeoutError:
        label = "hung"
    except aiohttp.ClientPayloadError:
        label = "200 cut"
    except aiohttp.ClientError:
        label = "200 cut" if answered else "conn-error"
    return Outcome(label, time.monotonic() - started)


def chat_body(max_tokens: int, prompt_words: int = 200) -> dict:
    """A streaming chat request of about ``prompt_words`` prompt tokens and ``max_tokens`` output tokens."""
    words = " ".join(random.choice(("alpha", "beta", "gamma", "delta")) for _ in range(prompt_words))
    return {
        "model": "m",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": words}],
    }


async def run_load(
    url: str,
    requests: int,
    rate: float,
    body: Callable[[], dict],
    faults: list[tuple[float, Callable[[], Awaitable[None]]]] = (),  # type: ignore[assignment]
) -> list[Outcome]:
    """Send ``requests`` chat requests to ``url`` at ``rate`` per second, injecting the faults.

    Each request goes on its own connection when needed; each ``(at, fault)`` runs ``at`` seconds
    after the first request. Returns every outcome, in sending order."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def fault_at(at: float, fault: Callable[[], Awaitable[None]]) -> None:
            await asyncio.sleep(at)
            await fault()

        fault_tasks = [asyncio.create_task(fault_at(at, fault)) for at, fault in faults]
        tasks = []
        for _ in range(requests):
            tasks.append(asyncio.create_task(request(session, f"{url}/v1/chat/completions", body(), {})))
            await asyncio.sleep(1 / rate)
        outcomes = await asyncio.gather(*tasks)
        await asyncio.gather(*fault_tasks)
    return list(outcomes)


async def until_ok(url: str, body: dict, deadline: float = 30.0) -> None:
    """Send ``body`` until one answer is a complete 200 (the gateway routes end to end)."""
    end = time.monotonic() + deadline
    async with aiohttp.ClientSession() as session:
        while True:
            outcome = await request(session, f"{url}/v1/chat/completions", body, {})
            if outcome.label == "200":
                return
            if time.monotonic() > end:
                raise RuntimeError(f"the gateway did not serve within {deadline:.0f} s: {outcome.label}")
            await asyncio.sleep(0.1)


async def open_fds(pid: int) -> int:
    """File descriptors process ``pid`` holds open (the least of 10 counts over half a second).

    The least count, so that the connection of the rig's own last ``/debug/endpoints`` poll, closed by
    the client and not yet by pd-extproc, is not counted (a leak persists, and shows in every count)."""
    counts = []
    for _ in range(10):
        counts.append(len(os.listdir(f"/proc/{pid}/fd")))
        await asyncio.sleep(0.05)
    return min(counts)


async def usage(pid: int) -> dict[str, float]:
    """``rss`` (MiB) and ``fds`` (:func:`open_fds`) of process ``pid``."""
    return {"rss": rss_mib(pid), "fds": await open_fds(pid)}


@dataclass(frozen=True)
class Listing:
    """A discovered set of engine ``addresses`` and when it was in force.

    In force from ``since`` (Unix seconds, before its files were written) until ``until`` (the next set's
    files written; ``inf``: still in force)."""

    since: float
    until: float
    addresses: frozenset[str]


def listed(listings: Sequence[Listing], address: str, start: float, end: float) -> bool:
    """Whether ``address`` was discovered at some moment from ``start`` to ``end`` (Unix seconds)."""
    return any(x.since <= end and x.until >= start and address in x.addresses for x in listings)


def names_outside(line: str, listings: Sequence[Listing]) -> bool:
    """Whether access-log ``line`` names an address not discovered when the request was decided.

    ``line``: :data:`LOG_FORMAT`, after the listener's name. An address counts when the line names it
    or shows Envoy connected to it; "when decided" spans from :data:`DISCOVERY_LAG_S` before the
    request began to when its upstream request was sent (or it ended)."""
    began, to_upstream, to_end, named, upstream, _ = line.split(" ")
    start = float(began)
    decided = start + (float(to_upstream if to_upstream != "-" else to_end) + 2) / 1000  # ms, truncated
    addresses = {a for a in named.split(",") if a != "-"} | ({upstream} - {"-"})
    return not all(listed(listings, a, start - DISCOVERY_LAG_S, decided) for a in addresses)


@dataclass
class Measured:
    """One run as measured: outcomes, load, usage and access-log lines.

    Every client's outcome; pd-extproc's load after it settled (``None``: it had exited) and its :func:`usage`
    before and after (``None`` values: exited); the gateway listener's access-log lines (one per request) and
    the lines of both listeners that name an address outside the discovered set (:func:`names_outside`)."""

    outcomes: list[Outcome]
    load: tuple[int, float] | None
    before: dict[str, float]
    after: dict[str, float | None]
    lines: int
    outside: int


def table_row(
    name: str, expectation: str, allowed: frozenset[str], run: Measured, failures: list[str]
) -> dict:
    """A row of the fault table: counts, measurements, ``failures`` and ``passed``.

    ``failures``: ``failures`` given, plus outcomes not in ``allowed``, pd-extproc exited, load left, fewer
    access-log lines than requests, addresses outside the set; ``passed`` when there are none."""
    counts = Counter(o.label for o in run.outcomes)
    failures = [f"{n} x {label}" for label, n in counts.items() if label not in allowed] + failures
    if run.load is None:
        failures.append("pd-extproc exited")
    elif run.load != (0, 0):
        failures.append(f"load left {run.load[0]} requests / {run.load[1]:g} tokens")
    if run.lines < len(run.outcomes):
        failures.append(f"{run.lines} gateway access-log lines for {len(run.outcomes)} requests")
    if run.outside:
        failures.append(f"{run.outside} access-log lines name an address outside the discovered set")
    return {
        "scenario": name,
        "expectation": expectation,
        "requests": len(run.outcomes),
        "outcomes": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
        "hung": counts["hung"],
        "load_left_requests": None if run.load is None else run.load[0],
        "load_left_tokens": None if run.load is None else run.load[1],
        "rss_mib_before": run.before["rss"],
        "rss_mib_after": run.after["rss"],
        "fds_before": run.before["fds"],
        "fds_after": run.after["fds"],
        "access_log_lines": run.lines,
        "outside_discovered": run.outside,
        "passed": not failures,
        "failures": failures,
    }


def _edit(bootstrap: dict, access_log: Path) -> None:
    """Add the access log to both listeners; shorten the gateway's idle timeouts to :data:`IDLE_TIMEOUT_S`."""
    idle = f"{IDLE_TIMEOUT_S:g}s"
    for listener in bootstrap["static_resources"]["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(access_log),
                    "log_format": {
                        "text_format_source": {"inline_string": f"{listener['name']} {LOG_FORMAT}"}
                    },
                },
            }
        ]
        if listener["name"] == "gateway":
            hcm["stream_idle_timeout"] = idle
            for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
                if "route" in route:
                    route["route"]["idle_timeout"] = idle


@dataclass
class Rig:
    """One scenario's stack. ``listings`` are the engine sets discovered (EDS files or pods), in order."""

    workdir: Path
    router_args: tuple[str, ...] = ()
    ads: bool = False
    cluster: ClusterProcess | None = None
    router: subprocess.Popen | None = None
    gateway: Gateway | None = None
    listings: list[Listing] = field(default_factory=list)
    grpc_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    envoy_admin_port: int = field(default_factory=free_port)
    prefill_leg_port: int = field(default_factory=free_port)
    restarts: int = 0

    @property
    def prefill_eds(self) -> Path:
        """The EDS file listing the prefill engines."""
        return self.workdir / "prefill.json"

    @property
    def decode_eds(self) -> Path:
        """The EDS file listing the decode engines."""
        return self.workdir / "decode.json"

    @property
    def admin_url(self) -> str:
        """pd-extproc's admin URL (``http://127.0.0.1:<admin_port>``)."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def access_log(self) -> Path:
        """The file Envoy writes its access log to."""
        return self.workdir / "access.log"

    @property
    def url(self) -> str:
        """The gateway's URL (Envoy must be running)."""
        assert self.gateway is not None
        return self.gateway.url

    def start_cluster(self, specs: list[EngineSpec], timing: TimingConfig | None = None) -> None:
        """Start simulated engines in a child process; they are written to the EDS files."""
        since = time.time()
        self.cluster = spawn_cluster(specs, self.prefill_eds, self.decode_eds, timing)
        self._listed(since, self.cluster.engines)

    def engines(self, role: str) -> list[EngineInfo]:
        """The simulated engines of ``role`` (``prefill`` or ``decode``)."""
        assert self.cluster is not None
        return [e for e in self.cluster.engines if e.role == role]

    def write_eds(self, engines: list[EngineInfo]) -> None:
        """Write both EDS files with exactly ``engines``."""
        since = time.time()
        write_cluster_eds(engines, self.prefill_eds, self.decode_eds)
        self._listed(since, engines)

    def _listed(self, since: float, engines: list[EngineInfo]) -> None:
        """``engines`` discovered from ``since``; the set before them until now."""
        if self.listings:
            self.listings[-1] = dataclasses.replace(self.listings[-1], until=time.time())
        self.listings.append(Listing(since, math.inf, frozenset(e.address for e in engines)))

    async def kill_engine(self, address: str) -> None:
        """Kill one simulated engine like a crashed node (it stays in EDS)."""
        assert self.cluster is not None
        await asyncio.to_thread(self.cluster.stop_engine, address)

    async def start_router(self) -> None:
        """Start pd-extproc (on the same ports as any earlier one) and wait until it has decodes."""
        eds = [] if self.ads else [str(self.prefill_eds), str(self.decode_eds)]
        log = self.workdir / f"router-{self.restarts}.log"
        args = (
            *self.router_args,
            "--prefill-via",
            f"http://127.0.0.1:{self.prefill_leg_port}",
            "--envoy-admin-url",  # as the chart ships it: Envoy's ejections reach the routing
            f"http://127.0.0.1:{self.envoy_admin_port}",
        )
        self.router = start_router_process(self.grpc_port, self.admin_port, eds, log, args)
        self.restarts += 1
        await wait_router_ready(self.router, self.admin_port)

    async def start_gateway(self) -> None:
        """Start Envoy from the shipped bootstrap (``envoy-ads.yaml`` if :attr:`ads`), with :func:`_edit`."""
        listen, admin = free_port(), self.envoy_admin_port
        bootstrap = render_bootstrap(
            listen_port=listen,
            admin_port=admin,
            extproc_port=self.grpc_port,
            prefill_leg_port=self.prefill_leg_port,
            decode_eds_path=str(self.decode_eds),
            prefill_eds_path=str(self.prefill_eds),
            template=SHIPPED_ADS_BOOTSTRAP if self.ads else SHIPPED_BOOTSTRAP,
        )
        _edit(bootstrap, self.access_log)
        # Access-log lines are flushed every 100 ms (Envoy's default: 10 s).
        flush = ("--file-flush-interval-msec", "100")
        self.gateway = await start_gateway(bootstrap, listen, admin, extra_args=flush)

    async def endpoints(self) -> list[dict]:
        """The running pd-extproc's ``/debug/endpoints`` rows."""
        url = f"{self.admin_url}/debug/endpoints"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return await response.json()

    async def load(self) -> tuple[int, float]:
        """(active requests, active tokens) over every endpoint, as the running pd-extproc counts them."""
        rows = await self.endpoints()
        return sum(r["active_requests"] for r in rows), sum(r["active_tokens"] for r in rows)

    async def settle(self) -> tuple[int, float]:
        """Wait up to :data:`SETTLE_S` for the router's load to reach zero; the load then."""
        end = time.monotonic() + SETTLE_S
        while (load := await self.load()) != (0, 0) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return load

    async def named_outside(self, requests: int, wait: float = 5.0) -> tuple[int, int]:
        """The gateway's access-log lines, and those naming an address outside the discovered sets.

        Returns (the gateway listener's lines, the lines of both listeners where pd-extproc named, or
        Envoy used, an address outside :attr:`listings` when it decided: :func:`names_outside`). Waits
        up to ``wait`` seconds for the gateway's lines to reach ``requests``; no log reads as no line."""
        end = time.monotonic() + wait
        while True:
            lines = self.access_log.read_text().splitlines() if self.access_log.exists() else []
            gateway = sum(line.startswith("gateway ") for line in lines)
            if gateway >= requests or time.monotonic() > end:
                break
            await asyncio.sleep(0.2)
        outside = sum(names_outside(line.partition(" ")[2], self.listings) for line in lines)
        return gateway, outside

    def stop(self) -> None:
        """Tear everything down (idempotent)."""
        if self.gateway is not None:
            self.gateway.stop()
        if self.router is not None:
            terminate(self.router)
        if self.cluster is not None:
            self.cluster.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def new_rig(router_args: tuple[str, ...] = (), ads: bool = False) -> Rig:
    """A rig in a fresh temporary folder; nothing is started."""
    return Rig(Path(tempfile.mkdtemp(prefix="pd-faults-")), router_args, ads)
