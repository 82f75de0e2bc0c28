"""Gateway replicas sharing their bookings over a real nats-server (``shared_state.kind: nats``): real
``pd-extproc serve`` processes, driven the way Envoy drives them (ext_proc streams held open, so each
request's booking stays until its stream closes), read through their ``/debug/endpoints``,
``/debug/shared``, ``/metrics`` and logs.

One nats-server (user and password, given in the replicas' URL) and three replicas a, b, c serve the
module; the ``live`` fixture hands each test the pool running the pool's settings, connected and with
no booking left, and restarts what a test killed or configured otherwise. The defaults of
``shared_state`` apply (heartbeat 1 s, peers silent 5 s forgotten). The endpoints are one prefill and
two decodes nobody connects to (the gRPC shell is driven directly); the last test puts two replicas
behind one real Envoy over real backends.

Every wait polls with a bound; the bounds that are the issue's promises (a vanished replica's bookings
dropped within 10 s, a restarted replica warm within 2 s of answering) are asserted as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import msgspec
import nats
import pytest
import pytest_asyncio
from builders import endpoint
from e2e_harness import wait_idle
from nats_server import NatsServer, nats_server
from polling import DEADLINE, until
from replica_processes import Replica, book, release, rows, samples, shared_view, total

from ext_proc.discovery.eds import write_eds_file
from ext_proc.shared import wire
from sim.gateway import free_port, render_bootstrap, start_gateway
from standins.backends import start_backend

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER, PASSWORD = "pool", "s3cret-pool-password"
PREFILL = "10.0.0.1:8000"
DECODES = ("10.0.1.1:8000", "10.0.1.2:8000")
PREFIX = "pd-extproc"
"""The default ``shared_state.nats.subject_prefix``: the subjects are ``pd-extproc.state`` and so on."""
DROPPED = "pd_extproc_shared_messages_dropped_total"
POLL_SECONDS = 0.05
"""Between two polls of the replicas' admin endpoints (each poll costs them CPU)."""


async def wait(condition: Callable[[], Awaitable[bool]], deadline: float = DEADLINE) -> None:
    """Poll ``condition`` every :data:`POLL_SECONDS` until it holds; fail after ``deadline`` s."""
    await until(condition, deadline, every=POLL_SECONDS)


@dataclass
class Pool:
    """The module's nats-server and replicas, and the settings (dotted keys) they run with."""

    nats: NatsServer
    replicas: dict[str, Replica]
    settings: dict[str, object]
    workdir: Path
    dropped_at_start: dict[str, float]
    """Each replica's dropped messages once all three had started (NATS's own status messages, such as
    the "no responders" to the first replica's sync request, are no peer's: none may be counted)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pool]:
    workdir = tmp_path_factory.mktemp("shared")
    write_eds_file(workdir / "prefill.json", "prefill", [endpoint(PREFILL, "a", 100_000.0)])
    write_eds_file(workdir / "decode.json", "decode", [endpoint(d, "a", 100_000.0) for d in DECODES])
    async with nats_server(workdir / "nats", user=USER, password=PASSWORD) as server:
        settings: dict[str, object] = {
            "discovery.eds_files": [str(workdir / "prefill.json"), str(workdir / "decode.json")],
            "routing.pd_threshold_tokens": 0,  # every prompt disaggregated: the prefill is booked too
            "shared_state.kind": "nats",
            "shared_state.nats.url": server.url,
        }
        replicas = {name: Replica(workdir, name, settings) for name in "abc"}
        try:
            for replica in replicas.values():
                replica.spawn()
            await asyncio.gather(*(r.ready() for r in replicas.values()))
            async with aiohttp.ClientSession() as session:
                await wait(lambda: _all_connected(session, replicas.values()), 20)
                dropped = {n: total(await samples(session, r), DROPPED) for n, r in replicas.items()}
            yield Pool(server, replicas, settings, workdir, dropped)
        finally:
            for replica in replicas.values():
                replica.stop()


async def _all_connected(session: aiohttp.ClientSession, replicas: Iterable[Replica]) -> bool:
    for replica in replicas:
        if not (await shared_view(session, replica))["connected"]:
            return False
    return True


@pytest_asyncio.fixture(loop_scope="module")
async def live(pool: Pool) -> AsyncIterator[Pool]:
    """``pool`` with nats-server and every replica running with the pool's settings (restarted if a test
    killed it or configured it otherwise), each connected, and no booking left anywhere; afterwards, no
    booking left on the replicas running."""
    if pool.nats.process is None or pool.nats.process.poll() is not None:
        await pool.nats.start()
    pool.nats.resume()  # if a test paused it
    for replica in pool.replicas.values():
        if replica.settings != pool.settings:
            replica.stop()
            replica.configure(pool.settings)
    dead = [r for r in pool.replicas.values() if r.process is None or r.process.poll() is not None]
    for replica in dead:
        replica.spawn()
    await asyncio.gather(*(r.ready() for r in dead))
    async with aiohttp.ClientSession() as session:
        await wait(lambda: _all_connected(session, pool.replicas.values()), 20)
        await wait(lambda: _idle(session, pool.replicas.values()), 20)
    yield pool
    running = [r for r in pool.replicas.values() if r.process is not None and r.process.poll() is None]
    async with aiohttp.ClientSession() as session:
        await wait(lambda: _idle(session, running), 20)


async def _idle(session: aiohttp.ClientSession, replicas: Iterable[Replica]) -> bool:
    for replica in replicas:
        if any(row["active_requests"] or row["active_tokens"] for row in await rows(session, replica)):
            return False
    return True


def completion(words: int = 10) -> bytes:
    """A completions body whose prompt no other request has: a random tag, then ``words`` words."""
    tag = uuid.uuid4().hex
    prompt = " ".join(f"{tag[i % 32]}{i}" for i in range(words))
    return json.dumps({"model": "m", "prompt": f"{tag} {prompt}", "max_tokens": 10}).encode()


async def decode_load(session: aiohttp.ClientSession, replica: Replica) -> tuple[int, int]:
    """``replica``'s (requests in flight on the decodes, of which its peers'), from ``/debug/endpoints``."""
    decodes = [row for row in await rows(session, replica) if row["role"] == "decode"]
    return sum(r["active_requests"] for r in decodes), sum(r["peer_requests"] for r in decodes)


@contextlib.asynccontextmanager
async def channel(replica: Replica) -> AsyncIterator[grpc.aio.Channel]:
    """A gRPC channel to ``replica`` (closing it cancels the streams still open on it)."""
    async with grpc.aio.insecure_channel(replica.target) as opened:
        yield opened


def new_lines(replica: Replica, since: int) -> str:
    """What ``replica`` logged after the first ``since`` characters of its log."""
    return replica.log_text()[since:]


async def _sees(session: aiohttp.ClientSession, replicas: tuple[Replica, ...], count: int) -> bool:
    for replica in replicas:
        if await decode_load(session, replica) != (count, count):
            return False
    return True


async def _all_disconnected(session: aiohttp.ClientSession, replicas: Iterable[Replica]) -> bool:
    for replica in replicas:
        if (await shared_view(session, replica))["connected"]:
            return False
    return True


async def _loads(session: aiohttp.ClientSession, expected: dict[str, tuple[int, int]], pool: Pool) -> bool:
    for name, load in expected.items():
        if await decode_load(session, pool.replicas[name]) != load:
            return False
    return True


async def test_three_replicas_see_each_others_bookings_until_the_streams_close(live: Pool) -> None:
    a, b = live.replicas["a"], live.replicas["b"]
    assert live.dropped_at_start == {"a": 0, "b": 0, "c": 0}
    own = {"a": 2, "b": 1, "c": 0}
    async with aiohttp.ClientSession() as session, channel(a) as to_a, channel(b) as to_b:
        calls = [(await book(to_a, completion()))[0] for _ in range(own["a"])]
        calls.append((await book(to_b, completion()))[0])

        await wait(lambda: _loads(session, {n: (3, 3 - mine) for n, mine in own.items()}, live))
        views = [await rows(session, r) for r in live.replicas.values()]
        per_endpoint = [{(x["role"], x["address"]): x["active_requests"] for x in view} for view in views]
        assert per_endpoint[0] == per_endpoint[1] == per_endpoint[2]  # one view of the pool's load
        assert per_endpoint[0][("prefill", PREFILL)] == 3
        for replica in live.replicas.values():
            metrics = await samples(session, replica)
            active = total(metrics, "pd_extproc_endpoint_active_requests", role="decode")
            peers = total(metrics, "pd_extproc_endpoint_peer_requests", role="decode")
            assert (active, peers) == (3, 3 - own[replica.name]), replica.name
            assert total(metrics, "pd_extproc_shared_peers") >= 2
            assert total(metrics, "pd_extproc_shared_messages_received_total", kind="batch") > 0
            assert total(metrics, "pd_extproc_shared_messages_sent_total", kind="batch") > 0
        for call in calls:
            await release(call)
        await wait(lambda: _idle(session, live.replicas.values()))
    assert all(c.process is not None and c.process.poll() is None for c in live.replicas.values())


async def test_nats_killed_and_restarted_routing_goes_on_and_sharing_resumes(live: Pool) -> None:
    a, b, c = live.replicas.values()
    logged = {r.name: len(r.log_text()) for r in live.replicas.values()}
    async with aiohttp.ClientSession() as session, channel(a) as to_a, channel(b) as to_b:
        before, _ = await book(to_a, completion())
        await wait(lambda: _sees(session, (b, c), 1))
        live.nats.kill()
        await wait(lambda: _all_disconnected(session, live.replicas.values()))
        for replica in live.replicas.values():
            assert total(await samples(session, replica), "pd_extproc_shared_connected") == 0
        assert await decode_load(session, c) == (1, 1)  # a's booking as last known (for 5 s)
        during, _ = await book(to_b, completion())  # routed on what b knows, NATS down
        for replica in live.replicas.values():
            assert "disconnected from NATS" in new_lines(replica, logged[replica.name]), replica.name
        await live.nats.start()
        await wait(lambda: _all_connected(session, live.replicas.values()))
        for replica in live.replicas.values():
            assert "reconnected to NATS" in new_lines(replica, logged[replica.name]), replica.name
            assert total(await samples(session, replica), "pd_extproc_shared_connected") == 1
        assert total(await samples(session, b), DROPPED, reason="disconnected") > 0  # the outage's batch
        # Sharing resumed by itself: each booking reaches the peers, the one made during the outage too.
        await wait(lambda: _loads(session, {"a": (2, 1), "b": (2, 1), "c": (2, 2)}, live))
        await release(before)
        await release(during)
        await wait(lambda: _idle(session, live.replicas.values()))


async def test_a_hung_nats_is_noticed_by_its_pings_and_routing_goes_on(live: Pool) -> None:
    """A nats-server that stops answering (SIGSTOP: a hang, or a partition) keeps its connections open:
    only the client's pings notice it (about 4 s); meanwhile and after, every replica routes."""
    a, b = live.replicas["a"], live.replicas["b"]
    async with aiohttp.ClientSession() as session, channel(a) as to_a:
        live.nats.pause()
        try:
            await wait(lambda: _all_disconnected(session, live.replicas.values()))
            call, _ = await book(to_a, completion())
        finally:
            live.nats.resume()
        await wait(lambda: _all_connected(session, live.replicas.values()))
        await wait(lambda: _sees(session, (b,), 1))  # shared once the server answers again
        await release(call)
    assert "disconnected from NATS" in b.log_text()


async def test_garbage_on_the_subjects_is_dropped_counted_logged_once_and_never_applied(live: Pool) -> None:
    a = live.replicas["a"]
    logged = {r.name: len(r.log_text()) for r in live.replicas.values()}
    async with aiohttp.ClientSession() as session:
        name_a = (await shared_view(session, a))["replica"]
        before = {r.name: await samples(session, r) for r in live.replicas.values()}
        client = await nats.connect(live.nats.url)
        try:
            state, sync, inbox = f"{PREFIX}.state", f"{PREFIX}.sync", f"{PREFIX}.inbox.{name_a}"
            flood = 2000
            for subject, payload in _garbage():
                await client.publish(subject, payload)
            for _ in range(flood):
                await client.publish(state, b"\x00garbage")
            await client.publish(sync, b"PDXS\x01\x02\xc1")  # a sync request that is no msgpack
            await client.publish(inbox, b"PDXS")  # to a alone
            await client.flush()
        finally:
            await client.close()
        everyone = {
            "garbled": 1 + flood,
            "version": 1,
            "malformed": 2,  # the truncated batch, the sync request
            "negative": 1,
            "absurd": 1,
            "too_large": 1,
            "hashing": 1,
        }

        async def counted() -> bool:
            for replica in live.replicas.values():
                metrics = await samples(session, replica)
                for reason, count in everyone.items():
                    extra = 1 if (replica is a and reason == "garbled") else 0
                    earlier = total(before[replica.name], DROPPED, reason=reason)
                    seen = total(metrics, DROPPED, reason=reason) - earlier
                    if seen != count + extra:
                        return False
            return True

        await wait(counted, deadline=20)
        for replica in live.replicas.values():
            assert replica.process is not None and replica.process.poll() is None
            view = await rows(session, replica)
            assert all(r["peer_requests"] == 0 and r["peer_tokens"] == 0 for r in view), json.dumps(view)
            lines = new_lines(replica, logged[replica.name])
            whole = replica.log_text()
            for reason in everyone:
                marker = f"a message dropped ({reason})"
                assert lines.count(marker) <= 1, (replica.name, reason)  # once per cause, not per message
                assert whole.count(marker) >= 1, (replica.name, reason)
        for replica in live.replicas.values():  # still routing
            async with channel(replica) as to_replica:
                call, _ = await book(to_replica, completion())
                await release(call)


async def test_a_flood_of_sync_requests_gets_each_replica_one_answer_per_window(live: Pool) -> None:
    """A peer asks for the replicas' state 1,000 times in a row on one reply subject: each replica answers
    the first at once (when no earlier request holds its window) and the others together, each time its
    0.25 s window is up, not 1,000 times."""
    sync, answers = "pd_extproc_shared_sync_requests_total", "pd_extproc_shared_messages_sent_total"
    flood = 1000
    async with aiohttp.ClientSession() as session:
        before = {r.name: await samples(session, r) for r in live.replicas.values()}
        client = await nats.connect(live.nats.url)
        try:
            got: list[bytes] = []
            inbox = f"{PREFIX}.inbox.flooder"

            async def heard(msg: nats.aio.msg.Msg) -> None:
                got.append(msg.data)

            await client.subscribe(inbox, cb=heard)
            request = wire.encode_sync_request(wire.SyncRequest("flooder"))
            started = time.monotonic()
            for _ in range(flood):
                await client.publish(f"{PREFIX}.sync", request, reply=inbox)
            await client.flush()

            async def asked() -> bool:
                for replica in live.replicas.values():
                    metrics = await samples(session, replica)
                    seen = total(metrics, sync) - total(before[replica.name], sync)
                    if seen != flood:
                        return False
                return True

            await wait(asked, deadline=20)
            flooded = time.monotonic() - started  # every replica had every request by then
            await asyncio.sleep(0.5)  # the last windows close: their coalesced answers go out
        finally:
            await client.close()
        windows = 2 + flooded / 0.25  # the first answer, one a window while the flood came in, the last
        for replica in live.replicas.values():
            metrics = await samples(session, replica)
            counted = {
                outcome: total(metrics, sync, outcome=outcome)
                - total(before[replica.name], sync, outcome=outcome)
                for outcome in ("answered", "coalesced", "refused")
            }
            # one asker: never refused; answered at once only when no earlier request holds the window
            assert counted["refused"] == 0 and counted["answered"] + counted["coalesced"] == flood, counted
            sent = total(metrics, answers, kind="sync_answer") - total(
                before[replica.name], answers, kind="sync_answer"
            )
            # a batch an answer (no prefix index), plus the peers' own requests that held the window, if any
            assert 1 <= sent <= windows + len(live.replicas) - 1, (replica.name, sent, flooded)
        assert len(got) <= len(live.replicas) * windows


def _garbage() -> list[tuple[str, bytes]]:
    """One message of each kind of garbage, on the state subject (every replica hears it)."""
    state = f"{PREFIX}.state"
    header = wire.MAGIC + bytes((wire.VERSION, wire.BATCH))
    load = [1, DECODES[0], 100, 1]

    def batch(loads: list, placements: list | None = None) -> bytes:
        body = ("intruder", 0, time.time(), True, 0, loads, placements or [])
        return header + msgspec.msgpack.encode(body)

    valid = batch([load])
    chain = (b"\x01" * 8) * 4
    return [
        (state, b"hello, world"),  # garbled
        (state, valid[: len(valid) // 2]),  # truncated: malformed
        (state, wire.MAGIC + bytes((2, wire.BATCH)) + valid[len(header) :]),  # another version
        (state, batch([[1, DECODES[0], -100, 1]])),  # negative
        (state, batch([[1, DECODES[0], 1 << 50, 1]])),  # absurd
        (state, header + b"\x00" * (1024 * 1024 - len(header))),  # 1 MiB: too large
        # Load and a placement on an endpoint nobody knows: the load is kept unapplied (discovery may be
        # late), the placement dropped (the replicas keep no prefix index: as one of another hashing).
        (state, batch([[1, "10.9.9.9:8000", 100, 1]], [[[["10.9.9.9:8000", 1000.0]], chain]])),
    ]


async def test_a_wrong_password_is_logged_clearly_and_the_replica_routes_on_its_own(live: Pool) -> None:
    wrong = live.nats.url.replace(PASSWORD, "not-the-password")
    settings = {**live.settings, "shared_state.nats.url": wrong}
    loner = Replica(live.workdir, "wrong-password", settings)
    try:
        await loner.start()
        async with aiohttp.ClientSession() as session:
            assert total(await samples(session, loner), "pd_extproc_shared_connected") == 0
            async with channel(loner) as to_loner:
                call, _ = await book(to_loner, completion())
                assert await decode_load(session, loner) == (1, 0)
                assert await decode_load(session, live.replicas["a"]) == (0, 0)  # not shared
                await release(call)
        text = loner.log_text()
        assert "cannot reach NATS at nats://***@127.0.0.1:" in text and "Authorization Violation" in text
        assert "not-the-password" not in text and PASSWORD not in text
    finally:
        loner.stop()


async def test_a_replica_sigkilled_with_bookings_is_forgotten_within_10_s_and_restarts_warm_within_2_s(
    live: Pool,
) -> None:
    """b crashes holding two bookings: a and c drop them within 10 s. b restarts with the prefix index
    on, beside a peer that has it on too (the pool's replicas run without it: its kernels compile at
    each start, seconds of CPU on a loaded machine). Within 2 s of answering, b holds its peers' live
    bookings and every index part the peer answered its sync request with; then it routes the peer's
    prompt knowing where it is held."""
    a, b = live.replicas["a"], live.replicas["b"]
    prefixed = {**live.settings, "affinity.prefix.enabled": True}
    peer = Replica(live.workdir, "prefix-peer", prefixed)
    prompt = completion(words=400)  # about 30 blocks of 16 tokens
    sent, received, hits = (
        "pd_extproc_shared_messages_sent_total",
        "pd_extproc_shared_messages_received_total",
        "pd_extproc_prefix_predicted_tokens_total",
    )
    try:
        async with aiohttp.ClientSession() as session:
            async with channel(b) as to_b:
                for _ in range(2):
                    await book(to_b, completion())
                await wait(lambda: _loads(session, {"a": (2, 2), "c": (2, 2)}, live))
                b.kill()
                peer.spawn()  # it starts meanwhile
                await wait(lambda: _loads(session, {"a": (0, 0), "c": (0, 0)}, live), deadline=10)
            for name in ("a", "c"):
                assert "their bookings are dropped" in live.replicas[name].log_text()
                view = await rows(session, live.replicas[name])
                assert all(r["peer_tokens"] == 0 and r["peer_requests"] == 0 for r in view), json.dumps(view)

            b.configure(prefixed)
            await peer.ready()
            async with channel(a) as to_a, channel(peer) as to_peer:
                held = [(await book(to_peer, prompt))[0], (await book(to_a, completion()))[0]]
                await wait(lambda: _loads(session, {"c": (2, 2)}, live))
                b.spawn()
                await b.ready()

                async def warm() -> bool:
                    answers = total(await samples(session, peer), sent, kind="sync_answer")  # batch, parts
                    parts = total(await samples(session, b), received, kind="index")
                    return answers > 1 and parts == answers - 1 and await decode_load(session, b) == (2, 2)

                await wait(warm, deadline=2)
                assert (await shared_view(session, b))["synced"] is True
                async with channel(b) as to_b:
                    before = total(await samples(session, b), hits, kind="hit")
                    call, _ = await book(to_b, prompt)  # the prompt the peer placed: b must know where
                    assert total(await samples(session, b), hits, kind="hit") > before
                    await release(call)
                for call in held:
                    await release(call)
    finally:
        peer.stop()


async def test_two_replicas_behind_one_envoy_route_and_see_each_others_bookings(tmp_path: Path) -> None:
    """Both replicas in Envoy's ext_proc cluster (it spreads the streams over them), a nats-server that
    wants a token (given as ``shared_state.nats.token``) and runs JetStream, echo backends as decodes."""
    decodes = [await start_backend() for _ in range(2)]
    for backend in decodes:
        backend.answering.clear()  # each request held until the test lets them answer
    prefill_eds, decode_eds = tmp_path / "prefill.yaml", tmp_path / "decode.yaml"
    write_eds_file(prefill_eds, "prefill", [])
    write_eds_file(decode_eds, "decode", [endpoint(b.address, "a") for b in decodes])
    gateway = None
    replicas: list[Replica] = []
    try:
        async with nats_server(tmp_path / "nats", token="pool-token", jetstream=True) as server:
            settings: dict[str, object] = {
                "discovery.eds_files": [str(prefill_eds), str(decode_eds)],
                "shared_state.kind": "nats",
                "shared_state.nats.url": server.address,
                "shared_state.nats.token": server.token,
            }
            replicas = [Replica(tmp_path, name, settings) for name in ("a", "b")]
            for replica in replicas:
                replica.spawn()
            await asyncio.gather(*(r.ready() for r in replicas))
            listen, admin = free_port(), free_port()
            bootstrap = render_bootstrap(
                listen_port=listen,
                admin_port=admin,
                extproc_port=replicas[0].grpc_port,
                prefill_leg_port=free_port(),
                decode_eds_path=str(decode_eds),
                prefill_eds_path=str(prefill_eds),
            )
            cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "pd_extproc")
            hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            second = {"address": "127.0.0.1", "port_value": replicas[1].grpc_port}
            hosts.append({"endpoint": {"address": {"socket_address": second}}})
            gateway = await start_gateway(bootstrap, listen, admin)
            count = 6
            async with aiohttp.ClientSession() as session:
                await wait(lambda: _all_connected(session, replicas))
                body = {"model": "m", "prompt": "hello " * 30, "max_tokens": 8}

                async def through_envoy() -> tuple[int, str, str]:
                    async with session.post(f"{gateway.url}/v1/completions", json=body) as response:
                        text = await response.text()
                        served = response.headers.get("x-served-by", "")
                        routed = response.headers.get("x-seen-destination", "").split(",")[0]
                        assert served == routed, text  # the replica's first choice
                        return response.status, served, text

                sent = [asyncio.create_task(through_envoy()) for _ in range(count)]
                await wait(lambda: sum(len(b.requests) for b in decodes) == count)

                async def shared() -> bool:
                    loads = [await decode_load(session, r) for r in replicas]
                    own = [active - peers for active, peers in loads]
                    return all(active == count for active, _ in loads) and all(own) and sum(own) == count

                await wait(shared)
                for backend in decodes:
                    backend.answering.set()
                answers = await asyncio.gather(*sent)
                assert [status for status, _, _ in answers] == [200] * count, answers
                assert {served for _, served, _ in answers} == {b.address for b in decodes}
                for replica in replicas:
                    assert await wait_idle(session, replica.admin_url) == []
                    assert await decode_load(session, replica) == (0, 0)
    finally:
        if gateway is not None:
            gateway.stop()
        for replica in replicas:
            replica.stop()
        for backend in decodes:
            await backend.stop()
