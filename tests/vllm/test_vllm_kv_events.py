"""The ``kv-events`` prefix source on real vLLM engines: the gateway routes by what the engines publish.

Two engines of role ``both`` (no connector: each prefills and decodes its own requests;
:func:`rig.cluster.kv_events_spec`), each publishing its KV-cache events (``--kv-events-config``,
ZeroMQ, with a replay socket): ``rack-a`` names its blocks by 64-bit integers (vLLM's default),
``rack-b`` by 32 raw bytes and holds only :data:`SMALL_CACHE_BLOCKS` blocks, so that it evicts. They
are this module's own (the session's four-engine cluster is not started for it). Each test starts
its own ``pd-extproc serve`` (an empty index) with ``affinity.prefix.source: kv-events`` behind the
shipped Envoy; every prompt is below ``pd_threshold_tokens``, so a request goes to one engine, the
one whose reported blocks match more of it (the prefix weight outweighs any load). Prompts are
token ids (completions ``prompt: [ints]``), which the events' token ids are matched against, or text
(a chat, a completions prompt) that the gateway tokenizes itself (``affinity.prefix.tokenizer``: the
rig's model folder); those tokens are also checked against the engine's ``POST /tokenize``.

What vLLM 0.32 for CPU publishes, seen here: a batch ``[ts, events, data_parallel_rank]`` per engine
step that changed its cache, its events maps with ``type`` (``BlockStored`` with ``medium: "GPU"``
for the CPU's own cache, ``group_idx``, ``lora_name``; ``BlockRemoved`` one per evicted block;
``AllBlocksCleared``). Events are published at the end of an engine step, so the
``AllBlocksCleared`` of ``POST /reset_prefix_cache`` reaches subscribers only with the engine's next
request. Its replay socket answers ``[b"", topic, sequence, payload]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import zmq
import zmq.asyncio
from e2e_harness import wait_idle
from polling import until

from ext_proc.prefix.kv_events import BlockStored, decode_replay
from ext_proc.tokenize.folder import TokenizerSettings, load_prompt_tokenizer
from rig.cluster import VllmCluster, kv_events_spec, start_kv_events_stack
from rig.engine import BLOCK_TOKENS, MODEL_NAME, Engine, parse_metrics
from rig.model import prompt, vocabulary
from sim.stack import Stack

pytestmark = pytest.mark.timeout(600)  # the first test waits for two engines to start (1-3 min)

SMALL_CACHE_BLOCKS = 48
"""``rack-b``'s KV cache in blocks: room for three prompts of the model's longest (2,048 tokens)."""
PD_THRESHOLD_TOKENS = 100_000
"""Above every prompt: each request is served by one engine, no prefill leg."""
GATEWAY_CONFIG = {"affinity": {"prefix": {"enabled": True, "source": "kv-events", "weight": 10.0}}}
"""The gateway's configuration: ``block_tokens`` left at its default (16), the engines' events give
theirs (:data:`BLOCK_TOKENS`)."""
Prompt = list[int] | str | list[dict[str, str]]
"""A completions prompt (token ids or text), or a chat's messages."""
HEARD_ATTEMPTS = 10
"""One-block prompts sent to an engine before the gateway must have heard from it (a ZeroMQ
subscriber misses what is published before it is connected)."""
_VOCABULARY = vocabulary()
_SEEDS = itertools.count(5000)


def fresh_ids(tokens: int) -> list[int]:
    """A prompt of ``tokens`` token ids that no engine has seen."""
    return [_VOCABULARY[word] for word in prompt(tokens, next(_SEEDS)).split()]


def cluster_of(stack: Stack) -> VllmCluster:
    assert isinstance(stack.cluster, VllmCluster)
    return stack.cluster


@pytest.fixture(scope="module")
def events_stack() -> Iterator[Stack]:
    """``rack-a`` (integer hashes) and ``rack-b`` (byte hashes, a small cache), no gateway yet."""
    started = time.monotonic()
    specs = [
        kv_events_spec("rack-a"),
        kv_events_spec("rack-b", int_block_hashes=False, kv_blocks=SMALL_CACHE_BLOCKS),
    ]
    stack = asyncio.run(start_kv_events_stack(specs))
    cluster = cluster_of(stack)
    print(
        f"\nvLLM engines publishing KV-cache events: ready in {time.monotonic() - started:.0f} s ("
        + ", ".join(f"{e.spec.name} {e.ready_seconds:.0f} s" for e in cluster.running.values())
        + f"); {cluster.attention.describe()}",
        flush=True,
    )
    try:
        yield stack
    finally:
        stack.stop()


def engines(stack: Stack) -> tuple[Engine, Engine]:
    """``rack-a``'s engine and ``rack-b``'s."""
    cluster = cluster_of(stack)
    a, b = (next(e for e in cluster.running.values() if e.spec.group == g) for g in ("rack-a", "rack-b"))
    return a, b


@contextlib.asynccontextmanager
async def routed(stack: Stack, tokenizer: bool = False) -> AsyncIterator[aiohttp.ClientSession]:
    """A fresh gateway (``kv-events``, an empty index; with ``tokenizer``, the model's folder as its
    tokenizer) that has heard from both engines, and a session."""
    prefix = GATEWAY_CONFIG["affinity"]["prefix"]
    if tokenizer:
        prefix = {**prefix, "tokenizer": str(cluster_of(stack).model)}
    config = {"affinity": {"prefix": prefix}}
    await stack.route_with("prefer", pd_threshold_tokens=PD_THRESHOLD_TOKENS, config=config)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for engine in engines(stack):
            await heard(session, stack, engine)
        yield session
        assert await wait_idle(session, stack.admin_url) == []


async def complete(session: aiohttp.ClientSession, base_url: str, prompt: Prompt) -> None:
    """One request generating one token at ``base_url`` (an engine or the gateway): a chat of
    ``prompt``'s messages, else a completion of ``prompt``."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        path, body = "/v1/chat/completions", {"messages": prompt}
    else:
        path, body = "/v1/completions", {"prompt": prompt}
    async with session.post(
        f"{base_url}{path}", json={"model": MODEL_NAME, "max_tokens": 1, **body}
    ) as response:
        assert response.status == 200, await response.text()


async def gateway_samples(session: aiohttp.ClientSession, stack: Stack) -> dict[str, float]:
    """The gateway's metrics, keyed as :func:`rig.engine.parse_metrics` keys them."""
    async with session.get(f"{stack.admin_url}/metrics") as response:
        return parse_metrics(await response.text())


async def gateway_sample(session: aiohttp.ClientSession, stack: Stack, name: str, **labels: str) -> float:
    """The gateway's sample ``name`` with exactly ``labels`` (at least one; 0 when absent)."""
    key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
    return (await gateway_samples(session, stack)).get(key, 0.0)


async def index_blocks(session: aiohttp.ClientSession, stack: Stack, engine: Engine) -> float:
    """The blocks the gateway's index holds for ``engine`` (vLLM reports its own cache as ``GPU``)."""
    return await gateway_sample(
        session, stack, "pd_extproc_kv_index_blocks", endpoint=engine.address, tier="GPU"
    )


async def decoded(session: aiohttp.ClientSession, stack: Stack, engine: Engine, kind: str) -> float:
    """The events of ``kind`` (``BlockStored``, ...) the gateway decoded from ``engine``."""
    return await gateway_sample(
        session, stack, "pd_extproc_kv_events_decoded_total", endpoint=engine.address, kind=kind
    )


async def straight(
    session: aiohttp.ClientSession, stack: Stack, engine: Engine, prompt: Prompt, deadline: float = 20.0
) -> None:
    """Send ``prompt`` straight to ``engine`` (not through the gateway) and wait until the gateway has
    received the batch that publishes the blocks it stored (``prompt`` must hold a block no engine has)."""
    stored = await decoded(session, stack, engine, "BlockStored")
    await complete(session, engine.url, prompt)

    async def published() -> bool:
        return await decoded(session, stack, engine, "BlockStored") > stored

    await until(published, deadline)


async def heard(session: aiohttp.ClientSession, stack: Stack, engine: Engine) -> int:
    """Send one-block prompts straight to ``engine`` until the gateway has received one's batch; how
    many were sent."""
    for attempt in range(1, HEARD_ATTEMPTS + 1):
        with contextlib.suppress(AssertionError):
            await straight(session, stack, engine, fresh_ids(BLOCK_TOKENS), deadline=2.0)
            return attempt
    pytest.fail(f"the gateway heard nothing from {engine.spec.name} in {HEARD_ATTEMPTS} prompts")


async def served(session: aiohttp.ClientSession, stack: Stack, prompt: Prompt) -> tuple[str, float]:
    """Send ``prompt`` through the gateway: the address of the engine that served it and its prefix-cache
    hit in tokens (the engines' own counters)."""
    running = list(cluster_of(stack).running.values())

    async def counters() -> list[tuple[float, float]]:
        pages = await asyncio.gather(*(e.metrics(session) for e in running))
        return [
            (
                sum(v for k, v in page.items() if k.startswith("vllm:request_success_total")),
                page.get("vllm:prefix_cache_hits_total", 0.0),
            )
            for page in pages
        ]

    before = await counters()
    await complete(session, stack.url, prompt)
    after: list[tuple[float, float]] = []

    async def counted() -> bool:
        nonlocal after
        after = await counters()
        return any(new[0] > old[0] for old, new in zip(before, after, strict=True))

    await until(counted)
    served_by = [i for i, (old, new) in enumerate(zip(before, after, strict=True)) if new[0] > old[0]]
    assert len(served_by) == 1, f"requests counted at {served_by}"
    (i,) = served_by
    return running[i].address, after[i][1] - before[i][1]


async def test_a_prompt_sent_straight_to_an_engine_draws_the_next_request_sharing_it(events_stack):
    """The gateway never saw the prompt: only the engines' events say who holds it, and how much.

    One engine holds all four blocks of a prompt, the other its first two: ``rack-a`` twice, then
    ``rack-b`` (no alternation between the engines, as a tie broken round robin gives, passes)."""
    a, b = engines(events_stack)
    async with routed(events_stack) as session:
        for holder, other in ((a, b), (a, b), (b, a)):
            shared = fresh_ids(4 * BLOCK_TOKENS)
            await straight(session, events_stack, holder, shared)
            await straight(session, events_stack, other, shared[: 2 * BLOCK_TOKENS])
            address, hit = await served(session, events_stack, shared + fresh_ids(100))
            assert (address, hit) == (holder.address, 4 * BLOCK_TOKENS)


def text_prompts(kind: str) -> tuple[Prompt, Prompt, Prompt]:
    """A text prompt of four full blocks (``kind``: ``chat`` or ``completions``), the same prompt's
    first two blocks alone, and the prompt extended (a chat's next turn).

    A chat renders ``system : <300 words> user : <250 words> assistant :`` (556 tokens; its system
    message alone, 304), a completions prompt is BOS and 550 words (its first 300 words, 301)."""
    seed = next(_SEEDS)
    if kind == "chat":
        system = {"role": "system", "content": prompt(300, seed)}
        chat = [system, {"role": "user", "content": prompt(250, seed + 1)}]
        more = [
            {"role": "assistant", "content": prompt(20, seed + 2)},
            {"role": "user", "content": prompt(80, seed + 3)},
        ]
        return chat, [system], [*chat, *more]
    words = prompt(550, seed).split()
    return " ".join(words), " ".join(words[:300]), " ".join(words) + " " + prompt(100, seed + 1)


async def test_text_prompts_the_gateway_tokenizes_meet_the_blocks_the_engines_reported(events_stack):
    """With the gateway tokenizer, a chat or a completions text sent straight to an engine draws the
    next request that extends it (the chat's next turn), as token ids do: ``rack-a`` holds a chat,
    then a completions text, ``rack-b`` a chat, the other engine their first two blocks each."""
    a, b = engines(events_stack)
    async with routed(events_stack, tokenizer=True) as session:
        for holder, other, kind in ((a, b, "chat"), (a, b, "completions"), (b, a, "chat")):
            whole, head, extended = text_prompts(kind)
            await straight(session, events_stack, holder, whole)
            await straight(session, events_stack, other, head)
            assert await served(session, events_stack, extended) == (holder.address, 4 * BLOCK_TOKENS), kind
        samples = await gateway_samples(session, events_stack)
        assert samples.get("pd_extproc_tokenize_tokens_total{source=tokenizer}", 0.0) > 0
        assert not [k for k in samples if k.startswith("pd_extproc_tokenize_fallbacks_total")]


async def test_a_prefix_cache_reset_empties_the_engines_entries(events_stack):
    """``POST /reset_prefix_cache``: vLLM publishes ``AllBlocksCleared`` with its next step (here a
    one-block prompt); the gateway then holds that block alone for it, and the prompt the engine
    held goes to the other engine, which holds its first half."""
    a, b = engines(events_stack)
    async with routed(events_stack) as session:
        shared = fresh_ids(4 * BLOCK_TOKENS)
        await straight(session, events_stack, a, shared)
        await straight(session, events_stack, b, shared[: 2 * BLOCK_TOKENS])
        assert await index_blocks(session, events_stack, a) >= 4
        async with session.post(f"{a.url}/reset_prefix_cache") as response:
            assert response.status == 200 and (await response.json())["success"] is True
        cleared = await decoded(session, events_stack, a, "AllBlocksCleared")
        await straight(session, events_stack, a, fresh_ids(BLOCK_TOKENS))
        assert await decoded(session, events_stack, a, "AllBlocksCleared") == cleared + 1
        assert await index_blocks(session, events_stack, a) == 1
        assert await served(session, events_stack, shared + fresh_ids(100)) == (b.address, 2 * BLOCK_TOKENS)


async def test_an_engine_restarted_with_an_empty_cache_is_not_credited_with_its_old_blocks(events_stack):
    """The engine dies (SIGKILL) and starts again on the same ports with an empty cache; its first
    batch numbers from 0 again, which tells the gateway to drop what it held for it."""
    a, b = engines(events_stack)
    cluster = cluster_of(events_stack)
    async with routed(events_stack) as session:
        shared = fresh_ids(4 * BLOCK_TOKENS)
        await straight(session, events_stack, a, shared)
        await straight(session, events_stack, b, shared[: 2 * BLOCK_TOKENS])
        restarts = await gateway_sample(
            session, events_stack, "pd_extproc_kv_events_resets_total", endpoint=a.address, reason="restart"
        )
        cluster.stop_engine(a.address)
        await cluster.restart([a.address], session)
        a = cluster.engine(a.address)
        probes = await heard(session, events_stack, a)
        assert (
            await gateway_sample(
                session,
                events_stack,
                "pd_extproc_kv_events_resets_total",
                endpoint=a.address,
                reason="restart",
            )
            == restarts + 1
        )
        assert await index_blocks(session, events_stack, a) <= probes  # the probes' blocks at most
        assert await served(session, events_stack, shared + fresh_ids(100)) == (b.address, 2 * BLOCK_TOKENS)


async def test_blocks_an_engine_evicts_leave_the_index(events_stack):
    """``rack-b``'s small cache: prompts of more blocks than it holds evict the older ones, which it
    reports (``BlockRemoved``, byte hashes); the prompt it held goes to ``rack-a`` (its first half)."""
    a, b = engines(events_stack)
    async with routed(events_stack) as session:
        shared = fresh_ids(4 * BLOCK_TOKENS)
        await straight(session, events_stack, b, shared)
        await straight(session, events_stack, a, shared[: 2 * BLOCK_TOKENS])
        removed = await decoded(session, events_stack, b, "BlockRemoved")
        for _ in range(SMALL_CACHE_BLOCKS // 15 + 1):
            await straight(session, events_stack, b, fresh_ids(15 * BLOCK_TOKENS))
        assert await decoded(session, events_stack, b, "BlockRemoved") > removed
        assert await index_blocks(session, events_stack, b) <= SMALL_CACHE_BLOCKS
        assert await served(session, events_stack, shared + fresh_ids(100)) == (a.address, 2 * BLOCK_TOKENS)


async def test_the_gateway_tokenizes_a_chat_and_a_completions_prompt_as_the_engine_does(events_stack):
    """The gateway tokenizer over the model's folder (``tokenizer.json``, the chat template of
    ``tokenizer_config.json``) against the engine's ``POST /tokenize``: a completions prompt (the
    tokenizer's BOS added), a chat, and the chat's next turn (tokenized from the cached first turn)."""
    a, _ = engines(events_stack)
    tokenizer = load_prompt_tokenizer(TokenizerSettings(str(cluster_of(events_stack).model))).tokenizer
    turn = [
        {"role": "system", "content": prompt(40, 1)},
        {"role": "user", "content": prompt(30, 2)},
    ]
    bodies = [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": prompt(50, 3)}),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": turn}),
        (
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [
                    *turn,
                    {"role": "assistant", "content": prompt(10, 4)},
                    {"role": "user", "content": prompt(20, 5)},
                ],
            },
        ),
    ]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for index, (path, body) in enumerate(bodies):
            async with session.post(f"{a.url}/tokenize", json=body) as response:
                assert response.status == 200, await response.text()
                engine_ids = (await response.json())["tokens"]
            tokenized = tokenizer.tokens(body, path, float(index))
            assert list(tokenized.ids) == engine_ids, path
    assert tokenized.cached > 0, "the next turn was tokenized from the first one's cached tokens"


async def test_the_replay_socket_answers_in_the_format_the_decoder_reads(events_stack):
    """Every batch an engine buffered, asked of its replay socket from sequence 0: all decode, in
    order, then the end marker; ``rack-a`` names blocks by integers, ``rack-b`` by 32 bytes."""
    context = zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for engine, hash_type in zip(engines(events_stack), (int, bytes), strict=True):
                await complete(session, engine.url, fresh_ids(BLOCK_TOKENS))
                dealer = context.socket(zmq.DEALER)
                dealer.connect(f"tcp://127.0.0.1:{engine.spec.kv_replay_port}")
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                batches = []
                while (
                    batch := decode_replay(await asyncio.wait_for(dealer.recv_multipart(), 10))
                ) is not None:
                    batches.append(batch)
                dealer.close(linger=0)
                sequences = [batch.sequence for batch in batches]
                assert sequences == list(range(sequences[0], sequences[0] + len(batches))) and sequences
                hashes = [
                    h
                    for batch in batches
                    for e in batch.events
                    if isinstance(e, BlockStored)
                    for h in e.block_hashes
                ]
                assert hashes and all(type(h) is hash_type for h in hashes), engine.spec.name
                assert hash_type is int or {len(h) for h in hashes} == {32}
    finally:
        context.destroy(linger=0)
