"""The simulator's KV-cache events: what its prefix cache reports, their bytes on vLLM's wire (decoded by
the gateway's own decoder into the gateway's own index), and an engine publishing them over ZMQ."""

from __future__ import annotations

import argparse
from itertools import count

import aiohttp
import pytest
import zmq
import zmq.asyncio
from builders import endpoint
from polling import until

from ext_proc.endpoints import EndpointSpec
from ext_proc.prefix.blocks import block_hashes
from ext_proc.prefix.event_index import ROOT, Applied, EventIndex
from ext_proc.prefix.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    decode_message,
    decode_replay,
)
from sim import cli
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster
from sim.cluster_process import EngineInfo, write_cluster_eds
from sim.config import (
    KV_EVENT_ENCODINGS,
    KV_EVENT_HASH_FORMS,
    EngineConfig,
    KvEventEncoding,
    KvEventHashForm,
    KvEventsConfig,
    TimingConfig,
)
from sim.kv_events import frames, wire_hash
from sim.prefix import MEDIUM_GPU, BlockCache, PromptBlocks, token_ids
from sim.server import start_engine

BLOCK = 16
TEXT = "".join(chr(ord("a") + i % 26) * 64 for i in range(8))  # 8 distinct blocks of 16 tokens


def recording(capacity: int) -> tuple[BlockCache, list[list[Event]]]:
    batches: list[list[Event]] = []
    return BlockCache(capacity, BLOCK, events=batches.append), batches


def computed(cache: BlockCache, content: str | list[int], fresh: int | None = None):  # type: ignore[no-untyped-def]
    """A sequence computed ``content`` whole: its blocks taken, cached; its holding."""
    prompt = PromptBlocks(content, BLOCK)
    hit = prompt.hashes[: cache.lookup(prompt.hashes, len(token_ids(content)) + 1)]
    holding = cache.take(hit, (fresh if fresh is not None else len(prompt.hashes)) - len(hit), 0)
    cache.cache(holding, prompt.hashes, content)
    return holding


def index_of(batches: list[list[Event]], encoding: KvEventEncoding, hashes: KvEventHashForm) -> EventIndex:
    """The gateway's index fed ``batches`` as its subscriber would get them off the wire."""
    index = EventIndex(BLOCK, 300.0, 1 << 20)
    for sequence, batch in enumerate(batches):
        applied = index.apply(
            "e:1", decode_message(frames(sequence, batch, encoding, hashes=hashes)), 0.0, False
        )
        assert isinstance(applied, Applied) and not applied.dropped and applied.reset is None
    return index


def matched(index: EventIndex, content: str | list[int]) -> int:
    return index.match(block_hashes(token_ids(content), BLOCK, 1 << 16, ROOT), 0.0).get("e:1", 0)


def test_text_tokens_are_fours_of_characters_numbered_by_their_bytes() -> None:
    assert token_ids("abcdefgh") == [int.from_bytes(b"abcd", "big"), int.from_bytes(b"efgh", "big")]
    assert token_ids("abcdef") == [int.from_bytes(b"abcd", "big"), int.from_bytes(b"ef", "big")]
    assert token_ids("") == [] and token_ids("\x7f") == [127]
    mixed = token_ids("abcd€fgh")  # one wide token among ASCII ones: each token by the same rule
    assert mixed[0] == int.from_bytes(b"abcd", "big") and mixed[1] >= 1 << 32
    wide = token_ids("€€€€€€€a")  # 12 and 10 bytes a token: hashed, still below 2**64
    assert len(wide) == 2 and all(0 <= t < 1 << 64 for t in wide) and wide[0] != wide[1]
    assert token_ids([5, 6, 7]) == [5, 6, 7]


def test_newly_cached_blocks_are_one_batch_with_parents_and_token_ids() -> None:
    cache, batches = recording(100)
    computed(cache, TEXT[: 64 * 4])
    computed(cache, TEXT[: 64 * 6])  # 4 blocks hit, 2 new after them
    first, second = batches
    assert len(first) == 1 and isinstance(first[0], BlockStored)
    assert first[0].parent_block_hash is None and len(first[0].block_hashes) == 4
    assert first[0].token_ids == tuple(token_ids(TEXT[: 64 * 4])) and first[0].medium == MEDIUM_GPU
    (event,) = second
    assert isinstance(event, BlockStored)
    assert event.parent_block_hash == first[0].block_hashes[-1] and len(event.block_hashes) == 2
    assert event.token_ids == tuple(token_ids(TEXT[64 * 4 : 64 * 6]))


def test_blocks_cached_by_someone_else_split_the_batch_into_runs() -> None:
    cache, batches = recording(100)
    prompt = PromptBlocks(TEXT[: 64 * 4], BLOCK)
    other = cache.take([], 1, 0)
    cache.cache(other, prompt.hashes[1:2], "")  # block 1 cached meanwhile (no content needed: not new)
    batches.clear()
    cache.cache(cache.take([], 4, 0), prompt.hashes, prompt.content)
    (runs,) = batches
    assert [(e.parent_block_hash, len(e.block_hashes)) for e in runs] == [  # type: ignore[union-attr]
        (None, 1),
        (prompt.hashes[1], 2),
    ]


@pytest.mark.parametrize("encoding", KV_EVENT_ENCODINGS)
@pytest.mark.parametrize("hashes", KV_EVENT_HASH_FORMS)
def test_the_bytes_decode_into_the_gateways_index_and_evictions_remove(
    encoding: KvEventEncoding, hashes: KvEventHashForm
) -> None:
    cache, batches = recording(6)
    cache.release(computed(cache, TEXT[: 64 * 4]))
    ids = [7, 8, 9] * 11  # 33 token ids: 2 blocks
    held = computed(cache, ids)
    index = index_of(batches, encoding, hashes)
    assert matched(index, TEXT[: 64 * 4]) == 4 and matched(index, ids) == 2
    assert index.blocks() == {"e:1": {"GPU": 6}}
    other = TEXT[64 * 4 :]  # 4 new blocks: 4 free cached ones must go, tail first
    computed(cache, other, fresh=4)
    removed = [e for batch in batches for e in batch if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 4 and removed[0].medium == MEDIUM_GPU
    index = index_of(batches, encoding, hashes)
    assert matched(index, TEXT[: 64 * 4]) == 0 and matched(index, ids) == 2 and matched(index, other) == 4
    cache.release(held)


def test_the_cpu_tier_reports_what_it_holds_as_vllm_offloading_does() -> None:
    """4 GPU blocks and a 2-block CPU tier: a prompt's evicted blocks are stored in the tier and removed
    from the KV cache, the tier's dropped ones removed from it, those loaded back stored in the KV cache
    again; the gateway's index follows, block for block and tier by tier."""
    batches: list[list[Event]] = []
    cache = BlockCache(4, BLOCK, 2, events=batches.append)
    first = TEXT[: 64 * 3]
    cache.release(computed(cache, first))
    cache.release(computed(cache, TEXT[64 * 4 : 64 * 7], fresh=3))  # evicts 2 of first's 3, tail first
    index = index_of(batches, "array", "int")
    assert index.blocks() == {"e:1": {"GPU": 4, "CPU": 2}}
    assert matched(index, first) == 3  # its head in GPU memory, the rest in the tier
    offload = batches[-2]
    assert [(type(e).__name__, e.medium) for e in offload] == [  # type: ignore[union-attr]
        ("BlockStored", "CPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
    ]
    prompt = PromptBlocks(first + "x", BLOCK)
    hbm = cache.lookup(prompt.hashes, 3 * BLOCK + 1)
    loaded = prompt.hashes[hbm : hbm + cache.lookup_cpu(prompt.hashes, 3 * BLOCK + 1, hbm)]
    assert (hbm, len(loaded)) == (1, 2)
    cache.take(prompt.hashes[:hbm], 3, 3 * BLOCK + 1, loaded)  # evicts 3: the tier keeps 2 of 5
    kinds = [(type(e).__name__, e.medium) for e in batches[-1]]  # type: ignore[union-attr]
    assert [k for i, k in enumerate(kinds) if not i or kinds[i - 1] != k] == [
        ("BlockStored", "CPU"),  # offloaded first: their parents are still in GPU memory
        ("BlockRemoved", "GPU"),
        ("BlockRemoved", "CPU"),
        ("BlockStored", "GPU"),  # the 2 loaded, one run
    ]
    assert kinds[-1] == ("BlockStored", "GPU") and len(batches[-1][-1].block_hashes) == 2  # type: ignore[union-attr]
    index = index_of(batches, "array", "int")
    assert index.blocks() == {"e:1": {"GPU": 3, "CPU": 2}} and matched(index, first) == 3
    assert cache.reset() is False


def test_a_reset_clears_only_when_nothing_is_in_use() -> None:
    cache, batches = recording(10)
    holding = computed(cache, TEXT[: 64 * 2])
    assert not cache.reset() and cache.cached_blocks == 2
    cache.release(holding)
    assert cache.reset() and cache.cached_blocks == 0
    assert batches[-1] == [AllBlocksCleared()]
    assert matched(index_of(batches, "array", "int"), TEXT[: 64 * 2]) == 0


def test_hashes_on_the_wire_are_64_bit_unsigned_or_32_bytes() -> None:
    assert wire_hash(-1) == (1 << 64) - 1 and wire_hash(5) == 5
    assert wire_hash(5, "bytes") == (5).to_bytes(32, "big") and wire_hash(b"xy", "bytes") == b"xy"


def test_the_cli_and_the_cluster_name_the_publisher(tmp_path) -> None:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    cli._add_options(parser)
    base = ["--role", "both", "--group", "g"]
    assert cli.config_from_args(parser.parse_args(base)).kv_events is None
    args = parser.parse_args([*base, "--kv-events-port", "5557", "--kv-events-encoding", "map"])
    assert cli.config_from_args(args).kv_events == KvEventsConfig(5557, None, "map", "int")
    with pytest.raises(ValueError, match="encoding"):
        KvEventsConfig(encoding="json")  # type: ignore[arg-type]
    info = EngineInfo("127.0.0.1:8000", "prefill", "g", 1000, 8000, 5557)
    write_cluster_eds([info], tmp_path / "p.json", tmp_path / "d.json")
    assert '"kv_events_port": 5557' in (tmp_path / "p.json").read_text()


async def test_an_engine_publishes_on_zmq_and_replays() -> None:
    timing = TimingConfig(time_scale=0.01, enable_prefix_caching=True)
    engines = await start_cluster([EngineSpec("both", "g")], timing=timing, kv_events=KvEventsConfig())
    (running,) = engines
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    try:
        port = running.kv_events_port
        assert port is not None
        spec: EndpointSpec = endpoint_specs(engines)[0]
        assert spec.kv_events_port == port and endpoint(spec.address).address == running.address
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        ids: list[int] = []
        firsts = count(100, 40)
        async with aiohttp.ClientSession() as http:

            async def send() -> bool:
                """A fresh prompt of 2 full blocks and 8 tokens; whether its batch came (a slow
                joiner misses the first ones)."""
                first = next(firsts)
                ids[:] = range(first, first + 40)
                body = {"prompt": ids, "max_tokens": 1}
                async with http.post(running.url + "/v1/completions", json=body) as response:
                    assert response.status == 200
                return await sub.poll(200) != 0

            await until(send)
            batch = decode_message(await sub.recv_multipart())
            (event,) = batch.events
            assert isinstance(event, BlockStored) and event.token_ids == tuple(ids[:32])
            async with http.post(running.url + "/reset_prefix_cache") as response:
                assert response.status == 200
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{running.publisher.replay_port}")  # type: ignore[union-attr]
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while (answer := decode_replay(await dealer.recv_multipart())) is not None:
            replayed.append(answer)
        assert [b.sequence for b in replayed] == list(range(len(replayed)))
        assert replayed[-1].events == (AllBlocksCleared(),)
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        context.destroy(linger=0)
        await stop_cluster(engines)


async def test_an_engine_without_kv_events_publishes_nothing() -> None:
    running = await start_engine(EngineConfig(role="both", group="g", timing=TimingConfig(time_scale=0.01)))
    try:
        assert running.kv_events_port is None and running.engine.scheduler.cache.events is None
    finally:
        await running.stop()
