"""The real-engine suite (``make test-vllm``): one cluster of real vLLM engines for the module using it.

Two pdGroups, ``rack-a`` and ``rack-b``, each a NixlConnector prefill and decode (4 engines,
:mod:`rig.cluster`), ``rack-a``'s also serving the LoRA adapter :data:`ADAPTER`, every engine exporting
its traced requests' spans to one loopback OTLP port (nothing listens there but the tracing test's
collector), every pair warmed up before the first test that asks for it (``vllm_stack``) and
stopped after the module's last. The tests route through the shipped Envoy bootstrap and
``pd-extproc serve --handoff kv-transfer-params`` started by :meth:`sim.stack.Stack.route_with`. A
test that kills an engine starts it again before it ends, so every such test begins with four live,
warmed-up engines. A module that needs other engines (``test_vllm_kv_events.py``) starts its own,
once these are stopped: the machine's two cores do not run six.

The fixture prints, with the start-up times, the engines' dtype and the attention kernels vLLM
runs for it on this CPU (:mod:`rig.attention`).

Not collected by ``make test`` (``norecursedirs``): the engines need the cached vLLM environment
(``make vllm-env``) and about 10.5 GiB of memory. Without the environment the suite fails with the
command that installs it; without the memory, with how much it needs.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from rig.cluster import VllmCluster, start_vllm_stack
from sim.gateway import free_port
from sim.stack import Stack

GROUPS = ["rack-a", "rack-b"]
ADAPTER = "ad1"
ADAPTER_GROUP = "rack-a"
"""The LoRA adapter the engines of :data:`ADAPTER_GROUP` serve besides the model (the others do not)."""


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI timeout, a stopped job) ends the run as Ctrl-C does: the fixtures are
    torn down, so the engines stop and their files go (the engines would die with the run anyway)."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.fixture(scope="module")
def vllm_stack() -> Iterator[Stack]:
    """The module's cluster as a :class:`~sim.stack.Stack` (no gateway until a test routes)."""
    started = time.monotonic()
    traces = f"http://127.0.0.1:{free_port()}"  # the tracing test's collector listens there
    stack = asyncio.run(
        start_vllm_stack(GROUPS, adapters={ADAPTER_GROUP: (ADAPTER,)}, otlp_traces_endpoint=traces)
    )
    cluster = stack.cluster
    assert isinstance(cluster, VllmCluster)
    print(
        f"\nvLLM cluster: {len(cluster.running)} engines ready and every pair warmed up in "
        f"{time.monotonic() - started:.0f} s (start-up "
        + ", ".join(f"{e.spec.name} {e.ready_seconds:.0f} s" for e in cluster.running.values())
        + "); warm-up attempts per (prefill, decode) pair: "
        + ", ".join(f"{p}->{d} {n}" for (p, d), n in cluster.warm_up_attempts.items())
        + "; PSS "
        + ", ".join(f"{e.pss_bytes() / 2**30:.2f} GiB" for e in cluster.running.values())
        + f"\nvLLM engines: {cluster.attention.describe()}",
        flush=True,
    )
    try:
        yield stack
    finally:
        stack.stop()


LOG_LINES = 40
"""The lines of each engine's and gateway's log a failed test's report ends with."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that failed with a real cluster ends its report with the end of every running engine's
    log and of every pd-extproc's (the run's folder, which holds them, goes with the cluster)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Stack) and isinstance(value.cluster, VllmCluster):
            for engine in value.cluster.running.values():
                report.sections.append((f"log of {engine.spec.name}", engine.log_tail(LOG_LINES)))
            for index, replica in enumerate(value.replicas):
                if replica.log is not None and replica.log.exists():
                    lines = replica.log.read_text(errors="replace").splitlines()[-LOG_LINES:]
                    report.sections.append((f"log of pd-extproc {index}", "\n".join(lines)))


@pytest.fixture(autouse=True)
def live_engines(request: pytest.FixtureRequest) -> None:
    """Before a test of the four-engine cluster: start the engines an earlier test killed again (same
    ports, new NIXL engine ids) and warm up their pairs (tests without ``vllm_stack`` do not start it)."""
    if "vllm_stack" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("vllm_stack").cluster
    assert isinstance(cluster, VllmCluster)
    if cluster.dead:
        asyncio.run(_restart(cluster))


async def _restart(cluster: VllmCluster) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await cluster.restart(list(cluster.dead), session)
