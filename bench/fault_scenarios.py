"""The fault campaign's scenarios: stacks, faults and allowed client outcomes.

- each scenario builds its stack, injects its faults when it says, and allows some client outcomes;
  the rest of the expectation is common (see ``bench/faults.py``);
- fault times are fractions of the load's duration (``requests / rate`` seconds), so ``--quick`` runs
  the same story with fewer requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.fault_rig import DISCOVERY_LAG_S, Rig, chat_body
from ext_proc.envoy_health_config import EnvoyHealthConfig
from sim.cluster import EngineSpec
from sim.cluster_process import EngineInfo
from standins.backends import start_broken_engine
from standins.fake_kube_api import FakeKubeApi
from standins.kube_objects import pod

Fault = tuple[float, Callable[[], Awaitable[None]]]
"""``(at, action)``: ``action`` runs ``at`` seconds after the first request is sent."""
RATE = 25.0
"""Requests per second the campaign sends (``bench/faults.py``), unless a scenario spreads its load."""
EJECTION_FAILURES = 3 + math.ceil(RATE * EnvoyHealthConfig().interval_seconds)
"""The most requests a decode failing at once may fail before it is left out: the 3 consecutive
failures Envoy's outlier detection ejects it after (``envoy/envoy.yaml``), then every request sent
until pd-extproc's next poll of Envoy's admin (``envoy_health.interval_seconds``) sees the ejection."""
BUSY_WAIT_S = 5.0
"""How long a kill waits for a request in flight on its engine."""


@dataclass
class Plan:
    """What a scenario's setup hands the runner: the faults and a final check.

    The final check runs after the load has settled: ``None`` when fine, else why not."""

    faults: list[Fault] = field(default_factory=list)
    check: Callable[[], Awaitable[str | None]] | None = None


Setup = Callable[[Rig, contextlib.AsyncExitStack, float], Awaitable[Plan]]


@dataclass(frozen=True)
class Scenario:
    """One row of the fault table: how it sets up and which outcomes it allows.

    ``setup(rig, cleanup, duration)`` starts the engines (and, when it must come first, pd-extproc) and
    returns the :class:`Plan`; ``allowed`` are the client outcome labels (:class:`fault_rig.Outcome`) the
    expectation accepts."""

    name: str
    expectation: str
    allowed: frozenset[str]
    setup: Setup
    router_args: tuple[str, ...] = ()
    body: Callable[[], dict] = field(default=lambda: chat_body(max_tokens=40))
    max_failed_share: float = 1.0
    """The most requests, as a share, whose outcome may be an allowed one other than ``200``."""
    min_seconds: float = 0.0
    """The load is spread over at least this long (seconds), whatever the size."""


def _cluster(prefills: int, decodes: int) -> list[EngineSpec]:
    return [EngineSpec("prefill", "a") for _ in range(prefills)] + [
        EngineSpec("decode", "a") for _ in range(decodes)
    ]


async def _router_sigkill(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
    rig.start_cluster(_cluster(1, 2))

    async def kill() -> None:
        assert rig.router is not None
        rig.router.send_signal(signal.SIGKILL)
        await asyncio.to_thread(rig.router.wait)

    async def restarted_routed() -> str | None:
        routed = sum((await _samples(rig, "pd_extproc_route_decisions_total")).values())
        return None if routed else "the restarted pd-extproc routed no request"

    return Plan([(0.25 * duration, kill), (0.4 * duration, rig.start_router)], restarted_routed)


async def _samples(rig: Rig, name: str) -> dict[str, float]:
    """The running pd-extproc's samples of metric ``name``, by their labels' values (joined by ``,``)."""
    async with aiohttp.ClientSession() as session, session.get(f"{rig.admin_url}/metrics") as response:
        text = await response.text()
    return {
        ",".join(s.labels.values()): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def _busy(rig: Rig, address: str) -> bool:
    """Whether pd-extproc counts a request in flight on ``address`` (for a prefill: a leg)."""
    return any(r["address"] == address and r["active_requests"] for r in await rig.endpoints())


def _kill_busy_engine(rig: Rig, role: str, at: float, wait: float = BUSY_WAIT_S) -> Plan:
    """Kill the first engine of ``role`` at ``at`` s, or as soon after as pd-extproc counts a request
    in flight on it (for a prefill, a leg). None within ``wait`` seconds: it is not killed, and the
    plan's check says so."""
    killed: list[str] = []
    address = rig.engines(role)[0].address

    async def kill() -> None:
        end = time.monotonic() + wait
        while not await _busy(rig, address):
            if time.monotonic() > end:
                return
            await asyncio.sleep(0.005)
        await rig.kill_engine(address)
        killed.append(address)

    async def hit() -> str | None:
        return None if killed else f"nothing in flight on the {role} {address} within {wait:g} s: not killed"

    return Plan([(at, kill)], hit)


async def _decode_killed(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
    rig.start_cluster(_cluster(1, 3))
    return _kill_busy_engine(rig, "decode", 0.4 * duration)


async def _prefill_killed(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
    rig.start_cluster(_cluster(3, 2))
    plan = _kill_busy_engine(rig, "prefill", 0.4 * duration)
    hit = plan.check
    assert hit is not None

    async def hit_and_legs_failed() -> str | None:
        failed = sum(
            n
            for outcome, n in (await _samples(rig, "pd_extproc_prefill_leg_total")).items()
            if outcome != "ok"
        )
        return await hit() or (None if failed else "no prefill leg failed: the kill hit no leg")

    plan.check = hit_and_legs_failed
    return plan


def left_out(attempts: int, max_attempts: int) -> str | None:
    """Whether a broken engine was left out in time: ``None`` when so, else why not.

    In time: the broken engine got at most ``max_attempts`` requests."""
    if attempts <= max_attempts:
        return None
    return f"the broken decode got {attempts} requests, more than {max_attempts}: it was not left out"


def _broken_decode(kind: str, max_attempts: int | None = None) -> Setup:
    """A third decode that is broken (``kind``, :func:`start_broken_engine`); with ``max_attempts`` the
    row fails when more requests than that reached it (it was not left out)."""

    async def setup(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
        rig.start_cluster(_cluster(1, 2))
        broken = await start_broken_engine(kind)
        cleanup.push_async_callback(broken.stop)
        assert rig.cluster is not None
        rig.write_eds([*rig.cluster.engines, EngineInfo(broken.address, "decode", "a", 262144)])

        async def check() -> str | None:
            return None if max_attempts is None else left_out(broken.requests, max_attempts)

        return Plan(check=check)

    return setup


def _eds_fault(change: Callable[[Rig], None]) -> Setup:
    async def setup(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
        rig.start_cluster(_cluster(1, 2))

        async def fault() -> None:
            change(rig)

        return Plan([(0.3 * duration, fault)])

    return setup


def _truncate(rig: Rig) -> None:
    content = rig.decode_eds.read_bytes()
    with rig.decode_eds.open("r+b") as file:  # in place, as a writer that crashed half-way leaves it
        file.truncate(len(content) // 2)


def _invalid_yaml(rig: Rig) -> None:
    tmp = rig.decode_eds.with_name(".invalid.tmp")
    tmp.write_text("resources: [{'@type': unclosed\n  - : :\n", encoding="utf-8")
    tmp.replace(rig.decode_eds)  # atomically, so Envoy (which watches renames) sees it too


FLAP_S, FLAP_PAUSE_S = 1.0, 2.0
"""``eds-flapping``: the decode enters and leaves every 100 ms for ``FLAP_S``, then stays out for
``FLAP_PAUSE_S``, longer than :data:`fault_rig.DISCOVERY_LAG_S`: naming it then fails the row."""


async def _eds_flapping(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
    rig.start_cluster(_cluster(1, 3))
    assert rig.cluster is not None
    full = rig.cluster.engines
    short = [e for e in full if e.address != rig.engines("decode")[-1].address]

    async def flap() -> None:
        end = time.monotonic() + duration
        while time.monotonic() < end:
            for i in range(round(FLAP_S / 0.1)):
                rig.write_eds(full if i % 2 == 0 else short)
                await asyncio.sleep(0.1)
            await asyncio.sleep(FLAP_PAUSE_S)
        rig.write_eds(full)

    return Plan([(0.0, flap)])


NAMESPACE = "engines"


async def _kube_watch_dropped(rig: Rig, cleanup: contextlib.AsyncExitStack, duration: float) -> Plan:
    rig.start_cluster(_cluster(1, 3))
    api = FakeKubeApi()
    await api.start()
    cleanup.push_async_callback(api.stop)
    kubeconfig = rig.workdir / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig(NAMESPACE))
    pods = {}
    for i, engine in enumerate(rig.engines("prefill") + rig.engines("decode")):
        ip, _, port = engine.address.rpartition(":")
        ports = {f"{engine.role}-port": int(port)}
        pods[engine.address] = lambda ready, e=engine, n=i, p=ports, h=ip: pod(
            f"{e.role}-{n}", e.role, h, group=e.group, namespace=NAMESPACE, ports=p, ready=ready
        )
        api.put(pods[engine.address]("True"))
    rig.ads = True
    rig.router_args = ("--discovery", "kubernetes", "--kubeconfig", str(kubeconfig), "--serve-eds")
    toggled = rig.engines("decode")[-1].address
    ready = {"state": "True"}

    async def drop_and_change() -> None:
        api.drop()
        ready["state"] = "False" if ready["state"] == "True" else "True"
        api.put(pods[toggled](ready["state"]))

    async def converged() -> str | None:
        rows = await rig.endpoints()
        pickable = {r["address"] for r in rows if r["role"] == "decode" and r["pickable"]}
        expected = {e.address for e in rig.engines("decode")} - (
            {toggled} if ready["state"] == "False" else set()
        )
        return None if pickable == expected else f"router's pickable decodes {pickable} != pods' {expected}"

    return Plan([(f * duration, drop_and_change) for f in (0.2, 0.45, 0.7)], converged)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "router-sigkill",
            "pd-extproc SIGKILLed under load and restarted: every stream routed before the kill completes, "
            "requests while it is down get 503 routing_unavailable, the restarted router serves and its "
            "load drains to zero",
            frozenset({"200", "503 routing_unavailable"}),
            _router_sigkill,
            body=lambda: chat_body(max_tokens=120),
            min_seconds=5.0,
        ),
        Scenario(
            "decode-killed",
            "a decode engine dies mid-stream (still in EDS): the streams in flight on it are cut (200 cut); "
            "new requests go to the fallback decodes (Envoy retries connect failures) or get 503 "
            "upstream_unavailable",
            frozenset({"200", "200 cut", "503 upstream_unavailable"}),
            _decode_killed,
            body=lambda: chat_body(max_tokens=100),
        ),
        Scenario(
            "prefill-killed-kv",
            "kv-transfer-params: a prefill engine dies with legs in flight: pd-extproc retries the leg on "
            "the other prefill or goes decode-only; every client gets a complete 200",
            frozenset({"200"}),
            _prefill_killed,
            router_args=("--handoff", "kv-transfer-params"),
            body=lambda: chat_body(max_tokens=20, prompt_words=1000),
        ),
        Scenario(
            "prefill-killed-sglang",
            "sglang-bootstrap: a prefill engine dies with requests in flight: the requests it was "
            "prefilling fail with the decode engine's own JSON 502 (the decode has them already), the "
            "failed legs eject it so at most 15% fail; nothing hangs",
            frozenset({"200", "502 502"}),
            _prefill_killed,
            router_args=("--handoff", "sglang-bootstrap"),
            max_failed_share=0.15,
            body=lambda: chat_body(max_tokens=20, prompt_words=1000),
        ),
        Scenario(
            "engine-hangs",
            "a decode accepts connections and never answers: its requests get 504 upstream_timeout after "
            "Envoy's idle timeout, the rest 200",
            frozenset({"200", "504 upstream_timeout"}),
            _broken_decode("hang"),
        ),
        Scenario(
            "engine-garbage",
            "a decode answers bytes that are not HTTP: Envoy retries each such answer on a fallback decode "
            "(the decode route of requests without a KV handoff retries resets), so every request 200; "
            f"Envoy's ejection and pd-extproc's next poll of Envoy's admin leave it out after at most "
            f"{EJECTION_FAILURES} attempts (3 failures, then a poll interval of requests)",
            frozenset({"200"}),
            _broken_decode("garbage", max_attempts=EJECTION_FAILURES),
        ),
        Scenario(
            "eds-truncated",
            "the decode EDS file truncated in place mid-run: pd-extproc and Envoy keep the last good "
            "endpoints; every request 200",
            frozenset({"200"}),
            _eds_fault(_truncate),
        ),
        Scenario(
            "eds-deleted",
            "the decode EDS file deleted mid-run: both keep the last good endpoints; every request 200",
            frozenset({"200"}),
            _eds_fault(lambda rig: rig.decode_eds.unlink()),
        ),
        Scenario(
            "eds-invalid-yaml",
            "the decode EDS file replaced (rename) by invalid YAML: both keep the last good endpoints; every "
            "request 200",
            frozenset({"200"}),
            _eds_fault(_invalid_yaml),
        ),
        Scenario(
            "eds-flapping",
            f"a decode enters and leaves the EDS file every 100 ms for {FLAP_S:g} s, then stays out "
            f"{FLAP_PAUSE_S:g} s, over and over: every request 200, and every address named was listed "
            f"when the request was decided (or within the {DISCOVERY_LAG_S:g} s before: the time "
            "pd-extproc and Envoy take to read the file)",
            frozenset({"200"}),
            _eds_flapping,
            min_seconds=6.0,
        ),
        Scenario(
            "kube-watch-dropped",
            "discovery from the (stand-in) Kubernetes API, EDS served to Envoy over ADS: the watch "
            "connection dropped three times, a decode's readiness changed after each drop: every request "
            "200, and the router's view ends equal to the pods'",
            frozenset({"200"}),
            _kube_watch_dropped,
        ),
    )
}
