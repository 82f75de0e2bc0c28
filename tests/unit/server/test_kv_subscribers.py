"""The KV-event subscribers over real ZeroMQ on loopback: live batches, a gap replayed, a restart, garbage."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import zmq
from builders import endpoint, kv_events_config
from polling import until

from ext_proc import kv_subscribers
from ext_proc.affinity import Policy
from ext_proc.app import start_server
from ext_proc.endpoints import ClusterEndpoints
from ext_proc.handoff import kv_transfer
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.routing import RoutingConfig
from ext_proc.handoff.sidecar import SidecarHandoff
from ext_proc.kv_subscribers import KvEventSubscribers, Target, targets
from ext_proc.live import LiveParts
from ext_proc.metrics import Metrics
from ext_proc.outcome import RequestMeta, Routed
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import ROOT
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from ext_proc.prefix.settings import KvEventsSettings, PrefixSettings
from ext_proc.registry import Registry
from ext_proc.router import Router, RouterSettings
from sim.config import KvEventEncoding
from sim.kv_events import Publisher

B = 16
ENGINE = "127.0.0.1:8000"


def tokens(block: int) -> tuple[int, ...]:
    return (block,) * B


def chain(*blocks: int) -> list[int]:
    return block_hashes([t for b in blocks for t in tokens(b)], B, 100, ROOT)


def stored(engine_hash: int, block: int, parent: int | None = None) -> BlockStored:
    return BlockStored((engine_hash,), parent, tokens(block), B, None, None)


def router_for(publisher: Publisher, replay_port: int | None = None, queue_batches: int = 10_000) -> Router:
    registry = Registry("prefill", "decode", 10_000.0)
    spec = endpoint(ENGINE, kv_events_port=publisher.port)  # not on 5557
    registry.update([ClusterEndpoints("prefill", (spec,), "p"), ClusterEndpoints("decode", (spec,), "d")])
    replay = publisher.replay_port if replay_port is None else replay_port
    kv = KvEventsSettings(replay_port=replay, queue_batches=queue_batches)
    metrics = Metrics(registry.endpoints)
    return Router(
        RouterSettings(100),
        registry=registry,
        policy=Policy(),
        handoff=SidecarHandoff("x-dest", "x-prefill"),
        metrics=metrics,
        live=LiveParts(PrefixSettings(B, 100, source="kv-events", kv_events=kv), metrics),
    )


def held(router: Router, *blocks: int) -> int:
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    return source.index.match(chain(*blocks), source.clock()).get(ENGINE, 0)


def sample(router: Router, name: str, **labels: str) -> float:
    return router.metrics.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def subscribed(router: Router, publisher: Publisher) -> AsyncIterator[None]:
    """The router's subscribers running (and the publisher's replay socket answering) for a block."""
    subscribers = KvEventSubscribers(router.registry, router.live.events, router.metrics, interval=0.05)
    tasks = [asyncio.create_task(subscribers.run())]
    if publisher.replay is not None:
        tasks.append(asyncio.create_task(publisher.serve_replays()))
    try:
        await connected(publisher, router)
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        publisher.close()


async def gap(publisher: Publisher) -> None:
    """Blocks 1, 2 and 3, each a prompt's first, the batch of 2 lost on the way."""
    publisher.publish(stored(1, 1))
    publisher.publish(stored(2, 2), send=False)
    publisher.publish(stored(3, 3))


async def connected(publisher: Publisher, router: Router, probe: int = 99) -> None:
    """Publish a probe block until the subscriber has seen it (a SUB socket misses what precedes its
    connection), then one more block until it is held: every live batch before it has been taken.

    The first probe heard asks a replay from 0 when earlier ones were missed; on a loaded machine
    probes published while it is answered come in again live, dropped as duplicates. The last block,
    published once a probe is held (the replay's answer is being applied), comes after the replay: held,
    it was applied live, so the duplicates were counted before."""
    for _ in range(200):
        publisher.publish(stored(900 + probe, probe))
        if held(router, probe):
            publisher.publish(stored(800 + probe, probe + 100))
            await until(lambda: held(router, probe + 100) == 1)
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the subscriber never connected")


@pytest.mark.parametrize("encoding", ["array", "map", "mixed"])
async def test_live_batches_a_replayed_gap_a_restart_and_garbage(encoding: KvEventEncoding) -> None:
    publisher = Publisher(encoding)
    router = router_for(publisher)
    async with subscribed(router, publisher):
        assert publisher.replays in ([], [0])  # joined at 0, or replayed from it
        publisher.publish(stored(1, 1))
        await until(lambda: held(router, 1) == 1)

        publisher.publish(stored(2, 2, parent=1), send=False)  # lost on the way: a gap
        publisher.publish(BlockRemoved((999,), None))
        await until(lambda: held(router, 1, 2) == 2 and held(router, 99) == 0)
        assert publisher.replays[-1] == publisher.sequence - 2
        assert sample(router, "pd_extproc_kv_events_replays_total", endpoint=ENGINE, outcome="ok") >= 1

        publisher.pub.send_multipart([b"", b"\x00", b"junk"])
        garbled = {"endpoint": ENGINE, "reason": "garbled"}
        await until(lambda: sample(router, "pd_extproc_kv_events_dropped_total", **garbled) == 1)

        publisher.restart()  # the engine restarted with an empty cache
        publisher.publish(stored(7, 7))
        await until(lambda: held(router, 7) == 1)
        assert held(router, 1) == 0
        assert sample(router, "pd_extproc_kv_events_resets_total", endpoint=ENGINE, reason="restart") == 1

        publisher.publish(AllBlocksCleared())
        await until(lambda: held(router, 7) == 0)
        decoded = sample(router, "pd_extproc_kv_events_decoded_total", endpoint=ENGINE, kind="BlockStored")
        assert decoded >= 3
        assert sample(router, "pd_extproc_kv_index_blocks", endpoint=ENGINE, tier="GPU") == 0


def expected(router: Router) -> int | None:
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    return source.index.expected(ENGINE)


async def test_live_batches_a_replay_covered_are_dropped_as_duplicates() -> None:
    publisher = Publisher()
    router = router_for(publisher)
    async with subscribed(router, publisher):
        duplicates = sample(router, "pd_extproc_kv_events_dropped_total", endpoint=ENGINE, reason="duplicate")
        publisher.publish(stored(1, 1), send=False)  # lost: the next batch asks a replay from here
        publisher.publish(stored(2, 2))
        publisher.publish(stored(3, 3))  # in the buffer when the replay is asked: it covers this one
        await until(lambda: held(router, 1) == held(router, 2) == held(router, 3) == 1)
        await until(
            lambda: (
                sample(router, "pd_extproc_kv_events_dropped_total", endpoint=ENGINE, reason="duplicate")
                == duplicates + 1
            )
        )
        assert expected(router) == publisher.sequence


async def test_an_engine_restarting_right_after_a_replay_from_0_is_heard() -> None:
    """The batches of an engine that restarts after a replay from 0 are new, not the replay's duplicates
    (a live batch numbered at most the one that asked the replay means the sequence went back)."""
    publisher = Publisher()
    router = router_for(publisher)
    async with subscribed(router, publisher):
        duplicates = sample(router, "pd_extproc_kv_events_dropped_total", endpoint=ENGINE, reason="duplicate")
        publisher.publish(stored(10, 10))
        publisher.publish(stored(11, 11))
        await until(lambda: expected(router) == publisher.sequence)  # 3 or more
        publisher.restart()
        publisher.publish(stored(1, 1), send=False)  # sequence 0, lost
        publisher.publish(stored(2, 2))  # 1: back, and not the first: a restart, replayed from 0
        await until(lambda: held(router, 1) == held(router, 2) == 1)
        assert publisher.replays[-1] == 0 and expected(router) == 2
        publisher.restart()  # again, before anything else was published
        publisher.publish(stored(3, 3))  # sequence 0, within the replay's numbers but new
        await until(lambda: held(router, 3) == 1)
        assert held(router, 1) == held(router, 2) == 0
        assert sample(router, "pd_extproc_kv_events_resets_total", endpoint=ENGINE, reason="restart") == 2
        assert (
            sample(router, "pd_extproc_kv_events_dropped_total", endpoint=ENGINE, reason="duplicate")
            == duplicates
        )  # the connection's own, if any


async def test_without_a_replay_socket_a_gap_drops_the_entries_and_routing_goes_on() -> None:
    publisher = Publisher(replay=False)
    router = router_for(publisher)
    async with subscribed(router, publisher):
        await gap(publisher)
        await until(lambda: held(router, 3) == 1)
        assert held(router, 1) == 0  # dropped at the gap
        assert sample(router, "pd_extproc_kv_events_resets_total", endpoint=ENGINE, reason="gap") == 1
        body = json.dumps({"model": "m", "prompt": list(tokens(3)) * 2}).encode()
        assert isinstance(router.route_body(body, RequestMeta("/v1/completions")), Routed)
        assert sample(router, "pd_extproc_prefix_predicted_hit_tokens_sum", role="prefill") == B


async def test_subscribers_follow_the_registry_and_the_source_kind() -> None:
    publisher = Publisher()
    router = router_for(publisher)
    subscribers = KvEventSubscribers(router.registry, router.live.events, router.metrics)
    subscribers.tick()
    assert subscribers.addresses == [ENGINE]
    router.registry.update([ClusterEndpoints("prefill", (), "p"), ClusterEndpoints("decode", (), "d")])
    subscribers.tick()
    assert subscribers.addresses == []
    router.registry.update([ClusterEndpoints("decode", (endpoint(ENGINE),), "d")])
    subscribers.tick()
    assert subscribers.addresses == [ENGINE]
    router.live.set_prefix(PrefixSettings())  # approximate: no subscriber
    subscribers.tick()
    assert subscribers.addresses == []
    publisher.close()


async def test_a_replay_that_never_answers_fails_drops_the_entries_and_backs_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_subscribers, "REPLAY_TIMEOUT_SECONDS", 0.2)
    publisher = Publisher(replay=False)
    silent = publisher.context.socket(zmq.ROUTER)  # a replay socket that never answers
    router = router_for(publisher, replay_port=silent.bind_to_random_port("tcp://127.0.0.1"))
    failed = {"endpoint": ENGINE, "outcome": "failed"}
    async with subscribed(router, publisher):
        await gap(publisher)
        await until(lambda: held(router, 3) == 1)
        assert held(router, 1) == 0
        assert sample(router, "pd_extproc_kv_events_replays_total", **failed) == 1
        publisher.publish(stored(4, 4), send=False)  # another gap: no replay asked (backing off)
        publisher.publish(stored(5, 5))
        await until(lambda: held(router, 5) == 1)
        assert sample(router, "pd_extproc_kv_events_replays_total", **failed) == 1
        assert sample(router, "pd_extproc_kv_events_resets_total", endpoint=ENGINE, reason="gap") >= 1


async def test_a_flooding_engine_is_bounded_and_the_loop_keeps_turning() -> None:
    """The engine floods from its own thread, as an engine publishes apart from the gateway's loop; the
    subscriber takes one message per turn of the loop, so a task that turns with it sees the messages
    received go up one at a time (counted in turns, not seconds: a loaded machine stretches seconds)."""
    publisher = Publisher(replay=False)
    router = router_for(publisher, queue_batches=100)
    received = [0, 0]  # messages received, the most in one turn of the loop
    block = BlockStored(tuple(range(1000, 1064)), None, tuple(range(64 * B)), B, None, None)
    count = router.metrics.kv_events_received

    def counted(endpoint: str) -> None:  # the metric, counted where a turn of the loop reads it cheaply
        received[0] += 1
        count(endpoint)

    router.metrics.kv_events_received = counted  # type: ignore[method-assign]

    def flood() -> None:
        for _ in range(5000):  # 64 blocks each: a flood, as fast as the PUB socket takes them
            publisher.publish(block, BlockRemoved(block.block_hashes, None))

    async def turner() -> None:
        last = 0
        while True:
            await asyncio.sleep(0)
            received[1] = max(received[1], received[0] - last)
            last = received[0]

    turning = asyncio.create_task(turner())
    try:
        async with subscribed(router, publisher):
            await asyncio.to_thread(flood)  # the only user of the PUB socket until it returns
            await connected(publisher, router, probe=8)  # the PUB socket drops what exceeds its own queue
            assert received[0] == sample(router, "pd_extproc_kv_events_received_total", endpoint=ENGINE)
            assert received[0] <= publisher.sequence
        assert received[0] > 100 and received[1] == 1  # many messages, one a turn
    finally:
        turning.cancel()


async def test_the_server_subscribes_to_its_engines_with_the_kv_events_source(tmp_path: Path) -> None:
    publisher = Publisher()
    spec = endpoint(ENGINE, kv_events_port=publisher.port)
    server = await start_server(kv_events_config(tmp_path, [spec]))
    try:
        await connected(publisher, server.router)  # two blocks: the probe and the last one
        assert sample(server.router, "pd_extproc_kv_index_blocks", endpoint=ENGINE, tier="GPU") == 2
    finally:
        await server.stop()
        publisher.close()


async def test_a_failed_subscriber_is_logged_and_started_again(caplog: pytest.LogCaptureFixture) -> None:
    publisher = Publisher()
    router = router_for(publisher)
    subscribers = KvEventSubscribers(router.registry, router.live.events, router.metrics)
    starts: list[str] = []

    async def broken(address: str, target: object) -> None:
        starts.append(address)
        raise RuntimeError("boom")

    subscribers._subscribe = broken  # type: ignore[method-assign]
    subscribers.tick()
    await asyncio.sleep(0)
    subscribers.tick()
    await asyncio.sleep(0)
    assert starts == [ENGINE, ENGINE]
    assert "the KV-event subscriber of 127.0.0.1:8000 failed (restarted)" in caplog.text
    router.live.set_prefix(PrefixSettings())
    subscribers.tick()  # takes the second failure's exception too
    assert subscribers.addresses == []
    publisher.close()


async def test_replicas_agree_on_a_prompt_sent_straight_to_an_engine() -> None:
    """Two gateway replicas subscribed to the same two engines both route a prompt that neither placed
    (a client sent it straight to the second engine) to the engine that holds it."""
    engines = {f"127.0.0.1:{8000 + i}": Publisher(replay=False) for i in range(2)}
    specs = tuple(endpoint(a, kv_events_port=p.port) for a, p in engines.items())

    def replica() -> Router:
        registry = Registry("prefill", "decode", 10_000.0)
        registry.update([ClusterEndpoints("prefill", specs, "p"), ClusterEndpoints("decode", specs, "d")])
        metrics = Metrics(registry.endpoints)
        return Router(
            RouterSettings(100),
            registry=registry,
            policy=Policy(prefix_weight=0.5),
            handoff=SidecarHandoff("x-dest", "x-prefill"),
            metrics=metrics,
            live=LiveParts(PrefixSettings(B, 100, source="kv-events"), metrics),
        )

    replicas = [replica(), replica()]
    tasks = [
        asyncio.create_task(KvEventSubscribers(r.registry, r.live.events, r.metrics, interval=0.05).run())
        for r in replicas
    ]
    holder, publisher = "127.0.0.1:8001", engines["127.0.0.1:8001"]
    prompt = [t for b in range(1, 9) for t in tokens(b)]
    stored_prompt = BlockStored(tuple(range(101, 109)), None, tuple(prompt), B, None, None)

    def holds(router: Router) -> bool:
        source = router.live.prefix
        assert isinstance(source, KvEventSource)
        return source.index.match(block_hashes(prompt, B, 100, ROOT), source.clock()).get(holder) == 8

    try:
        for _ in range(200):  # until both have subscribed (a SUB socket misses what precedes it)
            publisher.publish(stored_prompt)
            if all(holds(r) for r in replicas):
                break
            await asyncio.sleep(0.05)
        body = json.dumps({"model": "m", "prompt": [*prompt, 7, 7]}).encode()
        for router in replicas:
            result = router.route_body(body, RequestMeta("/v1/completions"))
            assert isinstance(result, Routed)
            assert dict(result.instructions.set_headers)["x-prefill"] == holder
            assert sample(router, "pd_extproc_prefix_predicted_hit_tokens_sum", role="prefill") == 8 * B
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for engine in engines.values():
            engine.close()


async def test_an_engine_of_another_block_size_is_logged_once_and_reported(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The first engine heard gives the pool its block size; one publishing blocks of another size is
    named once in the log and in ``/healthz``, and its blocks are counted as dropped."""
    engines = {f"127.0.0.1:{8000 + i}": Publisher(replay=False) for i in range(2)}
    specs = [endpoint(a, kv_events_port=p.port) for a, p in engines.items()]
    server = await start_server(kv_events_config(tmp_path, specs))
    (first, pool_engine), (odd, odd_engine) = engines.items()
    dropped = {"endpoint": odd, "reason": "block_size"}
    try:
        await connected(pool_engine, server.router)  # blocks of B tokens: the pool's size
        for k in range(200):  # until the subscriber has heard two (it misses what precedes it)
            odd_engine.publish(BlockStored((500 + k,), None, (k,) * (2 * B), 2 * B, None, None))
            if sample(server.router, "pd_extproc_kv_events_dropped_total", **dropped) >= 2:
                break
            await asyncio.sleep(0.05)
        warnings = [
            r.getMessage() for r in caplog.records if r.levelname == "WARNING" and odd in r.getMessage()
        ]
        assert warnings == [
            f"the KV-cache events of {odd} are of {2 * B}-token blocks, the pool's of {B} (the first size "
            "heard, which 1 publisher(s) report): its blocks are not indexed, so its cache steers no "
            "request; give every engine of the pool the same block size"
        ]
        async with aiohttp.ClientSession() as http:
            health = await (await http.get(f"http://127.0.0.1:{server.admin_port}/healthz")).json()
        assert health["kv_events"] == {"block_tokens": B, "unusable": {odd: 2 * B}}
        assert first not in health["kv_events"]["unusable"]
    finally:
        await server.stop()
        for engine in engines.values():
            engine.close()


def test_each_rank_of_an_engine_publishes_on_its_ports_offset_by_the_rank() -> None:
    registry = Registry("prefill", "decode", 10_000.0)
    specs = (
        endpoint("10.0.0.1:8000", kv_events_port=6000, kv_events_replay_port=7000, data_parallel_size=3),
        endpoint("10.0.0.2:8000"),  # the configured ports, one rank
        endpoint("[fd00::3]:8000", kv_events_port=65534, data_parallel_size=4),  # ranks past 65535: none
    )
    registry.update([ClusterEndpoints("decode", specs, "d")])
    assert targets(registry.endpoints(), KvEventsSettings(port=5557, replay_port=5558)) == {
        "10.0.0.1:8000@dp0": Target("10.0.0.1", 6000, 7000),
        "10.0.0.1:8000@dp1": Target("10.0.0.1", 6001, 7001),
        "10.0.0.1:8000@dp2": Target("10.0.0.1", 6002, 7002),
        "10.0.0.2:8000": Target("10.0.0.2", 5557, 5558),
        "[fd00::3]:8000@dp0": Target("[fd00::3]", 65534, 5558),
        "[fd00::3]:8000@dp1": Target("[fd00::3]", 65535, 5559),
    }
    assert targets(registry.endpoints(), KvEventsSettings())["10.0.0.2:8000"] == Target("10.0.0.2", 5557, 0)


def rank_publishers(size: int) -> list[Publisher]:
    """One publisher per data-parallel rank, on consecutive PUB and replay ports, as vLLM binds them."""
    for _ in range(50):
        first = Publisher()
        ranks = [first]
        try:
            for rank in range(1, size):
                ranks.append(Publisher(port=first.port + rank, replay_port=first.replay_port + rank))
        except zmq.ZMQError:  # a port taken: another try
            for taken in ranks:
                taken.close()
            continue
        return ranks
    raise AssertionError("no consecutive free ports")


async def test_every_rank_is_subscribed_and_a_request_is_pinned_to_the_rank_holding_its_prompt() -> None:
    ranks = rank_publishers(2)
    spec = endpoint(ENGINE, kv_events_port=ranks[0].port, kv_events_replay_port=ranks[0].replay_port)
    spec = dataclasses.replace(spec, data_parallel_size=2)
    registry = Registry("prefill", "decode", 10_000.0)
    registry.update([ClusterEndpoints("decode", (spec,), "d")])
    metrics = Metrics(registry.endpoints)
    router = Router(
        RouterSettings(100, pd_threshold_tokens=10_000),  # decode-only: the decode's cache counts
        registry=registry,
        policy=Policy(),
        handoff=kv_transfer.build(RoutingConfig(), HandoffConfig(), metrics),
        metrics=metrics,
        live=LiveParts(PrefixSettings(B, 100, source="kv-events"), metrics),
    )
    source = router.live.prefix
    assert isinstance(source, KvEventSource)
    subscribers = KvEventSubscribers(registry, router.live.events, metrics, interval=0.05)
    tasks = [asyncio.create_task(subscribers.run()), *(p.start() for p in ranks)]
    prompt = [t for b in range(1, 5) for t in tokens(b)]

    def held_at(rank: int, ids: list[int] = prompt) -> int:
        chain = block_hashes(ids, B, 100, ROOT)
        return source.index.match(chain, source.clock()).get(f"{ENGINE}@dp{rank}", 0)

    try:
        for _ in range(200):  # until subscribed (a SUB socket misses what precedes its connection)
            ranks[1].publish(BlockStored(tuple(range(101, 105)), None, tuple(prompt), B, None, None))
            if held_at(1):
                break
            await asyncio.sleep(0.05)
        assert held_at(1) == 4 and held_at(0) == 0
        body = json.dumps({"model": "m", "prompt": [*prompt, 7, 7]}).encode()
        result = router.route_body(body, RequestMeta("/v1/completions"), None)
        assert isinstance(result, Routed)
        assert dict(result.instructions.set_headers)["x-data-parallel-rank"] == "1"
        assert sample(router, "pd_extproc_prefix_predicted_hit_tokens_sum", role="decode") == 4 * B
        assert sample(router, "pd_extproc_kv_index_blocks", endpoint=f"{ENGINE}@dp1", tier="GPU") == 4
        fresh = json.dumps({"model": "m", "prompt": tokens(9) * 4}).encode()
        unheld = router.route_body(fresh, RequestMeta("/v1/completions"), None)
        assert isinstance(unheld, Routed) and "x-data-parallel-rank" not in dict(
            unheld.instructions.set_headers
        )

        ranks[1].publish(stored(205, 5, parent=104), send=False)  # a gap on rank 1: its own replay port
        ranks[1].publish(stored(206, 6, parent=205))
        await until(lambda: held_at(1, [*prompt, *tokens(5), *tokens(6)]) == 6)
        assert ranks[1].replays[-1] > 0 and ranks[0].replays in ([], [0])

        registry.update([ClusterEndpoints("decode", (dataclasses.replace(spec, data_parallel_size=1),), "d")])
        subscribers.tick()  # rank 1 is gone: its entries with it
        assert sorted(subscribers.addresses) == [ENGINE] and held_at(1) == 0
    finally:
        for task in tasks:
            assert task is not None
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for publisher in ranks:
            publisher.close()
