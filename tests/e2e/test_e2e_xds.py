"""pd-extproc serving EDS to the real Envoy (``envoy/envoy-ads.yaml``): endpoints added, made unhealthy,
healthy again, moved to another pdGroupID and removed in the files pd-extproc reads change where
requests land within 1 s, and Envoy never has to send a request anywhere but where the router said.

Two checks run through every change, and a control shows that each can fail:
- every request is served by the first decode the router named (Envoy only serves another one, or
  uses its fallback policy, when it does not know that address);
- a sampler compares the router's pickable endpoints (``/debug/endpoints``) with Envoy's healthy
  hosts (admin ``/clusters``): whatever the router held before and after a look at Envoy, Envoy had.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from builders import endpoint
from e2e_harness import Gatewayed, gateway_over
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import json_format
from polling import DEADLINE

from ext_proc.discovery.eds import parse_cluster_load_assignment, write_eds_file
from ext_proc.endpoints import EndpointSpec
from standins.backends import EchoBackend, start_backend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "where do I land?"}], "max_tokens": 4}
LANDING_SECONDS = 1.0
"""The issue's bound: a change at the source changes where requests land within this time."""
BATCH = 6
"""Requests per look: with two prefill groups in round robin, every group is asked several times."""


@dataclass(frozen=True)
class Landing:
    """Where one request went: the prefill and decodes the router named, the decode that served."""

    prefill: str
    named: tuple[str, ...]
    served: str


@dataclass
class Watch:
    """Sends requests and checks both invariants; ``violations`` lists every breach seen."""

    g: Gatewayed
    session: aiohttp.ClientSession
    violations: list[str] = field(default_factory=list)
    samples: int = 0

    async def send(self, count: int = BATCH) -> list[Landing]:
        landings = []
        for _ in range(count):
            async with self.session.post(f"{self.g.gateway.url}/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200, await response.text()
                await response.read()
                headers = response.headers
            named = tuple(headers["x-seen-destination"].split(","))
            landing = Landing(headers["x-seen-prefiller"], named, headers["x-served-by"])
            if landing.served != named[0]:
                self.violations.append(f"router named {named[0]}, Envoy sent the request to {landing.served}")
            landings.append(landing)
        return landings

    async def pickable(self) -> set[tuple[str, str]]:
        """The router's pickable endpoints, as (cluster, address)."""
        async with self.session.get(f"{self.g.admin_url}/debug/endpoints") as response:
            return {(row["role"], row["address"]) for row in await response.json() if row["pickable"]}

    async def envoy_healthy(self) -> set[tuple[str, str]]:
        """Envoy's healthy hosts of the prefill and decode clusters, as (cluster, address) (JSON leaves
        out the default status, UNKNOWN, which counts as healthy as in pd-extproc)."""
        async with self.session.get(f"{self.g.gateway.admin_url}/clusters?format=json") as response:
            statuses = (await response.json())["cluster_statuses"]
        return {
            (cluster["name"], f"{socket['address']}:{socket['port_value']}")
            for cluster in statuses
            if cluster["name"] in ("prefill", "decode")
            for host in cluster.get("host_statuses", ())
            if host["health_status"].get("eds_health_status", "UNKNOWN") in ("HEALTHY", "UNKNOWN")
            for socket in [host["address"]["socket_address"]]
        }

    async def sample(self) -> None:
        """Forever: router, Envoy, router again; what the router held both times, Envoy must have had."""
        while True:
            before = await self.pickable()
            envoy = await self.envoy_healthy()
            held = before & await self.pickable()
            if missing := held - envoy:
                self.violations.append(f"the router could pick {sorted(missing)}, unknown to Envoy")
            self.samples += 1

    async def lands(self, check: Callable[[list[Landing]], bool], since: float) -> float:
        """Send batches until one passes ``check``; return how long after ``since`` that batch ended
        (an upper bound of when requests moved; one more batch must pass too: the change holds)."""
        end = time.monotonic() + DEADLINE
        while True:
            batch = await self.send()
            if check(batch):
                landed = time.monotonic() - since
                assert check(await self.send()), "requests went back to where they landed before"
                return landed
            assert time.monotonic() < end, f"requests did not land as expected within {DEADLINE} s"


Change = tuple[str, Callable[[], None], Callable[[list[Landing]], bool]]
"""One step of a scenario: its name, what it changes at the source, and how requests land after it."""


async def timed_changes(watch: Watch, changes: list[Change]) -> dict[str, float]:
    """Apply each change in turn and wait until requests land as it says; return, per change, how long
    after it that happened (seconds)."""
    timings = {}
    for name, change, check in changes:
        since = time.monotonic()
        change()
        timings[name] = await watch.lands(check, since)
    return timings


def assert_moved_in_time(timings: dict[str, float]) -> None:
    """Every change moved requests within :data:`LANDING_SECONDS`."""
    slow = {change: f"{seconds:.2f} s" for change, seconds in timings.items() if seconds > LANDING_SECONDS}
    assert not slow, f"requests moved later than {LANDING_SECONDS} s after the change: {slow}"


@contextlib.asynccontextmanager
async def watched(g: Gatewayed) -> AsyncIterator[Watch]:
    async with aiohttp.ClientSession() as session:
        watch = Watch(g, session)
        sampler = asyncio.create_task(watch.sample())
        try:
            yield watch
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler


@contextlib.asynccontextmanager
async def backends(count: int) -> AsyncIterator[list[EchoBackend]]:
    started = [await start_backend() for _ in range(count)]
    try:
        yield started
    finally:
        for backend in started:
            await backend.stop()


def spec(
    backend: EchoBackend, group: str, health: str = "HEALTHY", bootstrap_port: int | None = None
) -> EndpointSpec:
    return endpoint(backend.address, group, 10_000.0, health, bootstrap_port)


async def envoy_endpoints(watch: Watch) -> dict[str, set[EndpointSpec]]:
    """The prefill and decode endpoints Envoy holds, with health and metadata (admin config dump)."""
    async with watch.session.get(f"{watch.g.gateway.admin_url}/config_dump?include_eds") as response:
        configs = (await response.json())["configs"]
    dump = next(c for c in configs if c["@type"].endswith("EndpointsConfigDump"))
    held = {}
    for entry in dump["static_endpoint_configs"]:
        document = {k: v for k, v in entry["endpoint_config"].items() if k != "@type"}
        cla = json_format.ParseDict(document, endpoint_pb2.ClusterLoadAssignment())
        if cla.cluster_name in ("prefill", "decode"):
            held[cla.cluster_name] = set(parse_cluster_load_assignment(cla, "pd", "envoy").endpoints)
    return held


async def test_endpoints_added_unhealthy_healthy_regrouped_and_removed_move_requests_within_a_second(
    tmp_path: Path,
) -> None:
    async with backends(6) as (pa, pb, pc, d1, d2, d3):
        prefills = [spec(pa, "a", bootstrap_port=7001), spec(pb, "b", bootstrap_port=7002)]
        decodes = [spec(d1, "a"), spec(d2, "b")]
        async with (
            gateway_over(tmp_path, prefills, decodes, {"affinity.mode": "strict"}, ads=True) as g,
            watched(g) as watch,
        ):
            assert {x.served for x in await watch.send()} == {d1.address, d2.address}
            decodes = [spec(d1, "a"), spec(d3, "b")]

            def files(prefill: list[EndpointSpec] | None, decode: list[EndpointSpec]) -> Callable[[], None]:
                def write() -> None:
                    if prefill is not None:
                        write_eds_file(g.prefill_eds, "prefill", prefill)
                    write_eds_file(g.decode_eds, "decode", decode)

                return write

            timings = await timed_changes(
                watch,
                [
                    (
                        "added",  # a decode in group a and a prefill in group b
                        files([*prefills, spec(pc, "b")], [spec(d1, "a"), spec(d2, "b"), spec(d3, "a")]),
                        lambda batch: (
                            any(x.served == d3.address for x in batch)
                            and any(x.prefill == pc.address for x in batch)
                        ),
                    ),
                    (
                        "unhealthy",  # group a's requests all go to d3
                        files(None, [spec(d1, "a", "UNHEALTHY"), spec(d2, "b"), spec(d3, "a")]),
                        lambda batch: all(x.served != d1.address for x in batch),
                    ),
                    (
                        "healthy again",
                        files(None, [spec(d1, "a"), spec(d2, "b"), spec(d3, "a")]),
                        lambda batch: any(x.served == d1.address for x in batch),
                    ),
                    (
                        "relabelled",  # d3 moves to group b
                        files(None, [spec(d1, "a"), spec(d2, "b"), spec(d3, "b")]),
                        lambda batch: (
                            any(x.served == d3.address and x.prefill != pa.address for x in batch)
                            and all(x.served == d1.address for x in batch if x.prefill == pa.address)
                        ),
                    ),
                    (
                        "removed",  # d2 and the prefill pc
                        files(prefills, decodes),
                        lambda batch: all(x.served != d2.address and x.prefill != pc.address for x in batch),
                    ),
                ],
            )

            assert await envoy_endpoints(watch) == {"prefill": set(prefills), "decode": set(decodes)}
        assert watch.violations == [], watch.violations
        assert watch.samples >= 10, watch.samples
        assert_moved_in_time(timings)


async def test_the_checks_catch_an_envoy_that_lacks_an_endpoint_the_router_picks(tmp_path: Path) -> None:
    """The control: Envoy reads endpoint files that lag behind pd-extproc's (the file setup's two
    writers), so the router names a decode Envoy does not have."""
    async with backends(2) as (d1, d2):
        envoy_decodes = tmp_path / "envoy-decode.json"
        write_eds_file(envoy_decodes, "decode", [spec(d1, "a")])

        def lagging(bootstrap: dict) -> None:
            decode = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "decode")
            decode["eds_cluster_config"]["eds_config"]["path_config_source"]["path"] = str(envoy_decodes)

        async with (
            gateway_over(tmp_path, [], [spec(d1, "a"), spec(d2, "a")], edit=lagging) as g,
            watched(g) as watch,
        ):
            await watch.send()
            end = time.monotonic() + DEADLINE
            while watch.samples < 3 and time.monotonic() < end:
                await asyncio.sleep(0.05)
        assert any("Envoy sent the request to" in v for v in watch.violations), watch.violations
        assert any("unknown to Envoy" in v for v in watch.violations), watch.violations
