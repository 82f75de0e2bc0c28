"""Text prompts put in the engine's token ids before routing: the stream's step, its fallback, end to end.

End to end in-process: a server with the ``kv-events`` source and a tokenizer folder, two engines
publishing their KV-cache events on loopback (:mod:`sim.kv_events`), a chat sent straight to one of them
(not through the gateway), then the conversation's next turn through the gRPC shell.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import grpc
import pytest
from builders import CHAT_META, D_SAME_IDLE, DEST, P1, PREFILL, endpoint, kv_events_config, make_router, value
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, destination, headers, trailers, with_modes

from ext_proc.app import start_server
from ext_proc.prefix.event_source import KvEventSource
from ext_proc.prefix.kv_events import BlockStored
from ext_proc.prefix.settings import PrefixSettings
from ext_proc.stream import PendingRoute, Streams
from ext_proc.tokenize.folder import TokenizerSettings, load_prompt_tokenizer
from sim.kv_events import Publisher
from sim.tokenizer_folder import write_tokenizer_folder

B = 16
CHAT = "/v1/chat/completions"
DOCS = Path(__file__).parents[3] / "docs"
FALLBACKS = "pd_extproc_tokenize_fallbacks_total"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = (page.read_text() for page in sorted(DOCS.glob("*.md"))[:4])
    return write_tokenizer_folder(tmp_path_factory.mktemp("tokenizer"), texts, vocab_size=1000)


def chat(*turns: str) -> dict[str, object]:
    """A conversation: a system prompt, then user and assistant turns alternating."""
    system = "You answer questions about routing requests between prefill and decode engines. " * 8
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return {"model": "m", "messages": [{"role": "system", "content": system}, *messages], "max_tokens": 8}


async def test_an_unloadable_folder_is_counted_and_the_request_routed_on_its_text(tmp_path: Path) -> None:
    prefix = PrefixSettings(B, 100, source="kv-events", tokenizer=str(tmp_path / "missing"))
    router = make_router([endpoint(P1)], [endpoint(D_SAME_IDLE)], prefix=prefix)
    stream = Streams(router).open()
    assert stream.answer(headers(path=CHAT_META.path)) is not None
    pending = stream.answer(body(json.dumps(chat("hello")).encode()))
    assert isinstance(pending, PendingRoute)
    assert await pending.ready() is None
    answers = stream.prepared(pending.request, None)
    assert isinstance(answers, tuple) and destination(answers[0]).startswith(D_SAME_IDLE)
    assert value(router, FALLBACKS, reason="no_tokenizer") == 1
    stream.close()
    router.live.close()


async def answers_of(router, messages: list) -> list:
    """Every answer of one stream to ``messages``, its pending route awaited as the shell awaits them."""
    stream = Streams(router).open()
    out = []
    for message in messages:
        answers = stream.answer(message)
        if isinstance(answers, PendingRoute):
            answers = stream.prepared(answers.request, await answers.ready())
        assert isinstance(answers, tuple)
        out += answers
    stream.close()
    return out


@pytest.mark.parametrize("full_duplex", [False, True])
async def test_tokenizing_first_leaves_the_choreography_as_it_was(tmp_path: Path, full_duplex: bool) -> None:
    """The same answers, message for message, with a tokenizer (which cannot load here) and without."""
    raw = json.dumps(chat("hello")).encode()
    first = headers(path=CHAT)
    if full_duplex:
        messages = [with_modes(first), body(raw[:10], end_of_stream=False), body(raw[10:], False), trailers()]
    else:
        messages = [first, body(raw)]
    answers = []
    for folder in ("", str(tmp_path / "missing")):
        prefix = PrefixSettings(B, 100, source="kv-events", tokenizer=folder)
        router = make_router([endpoint(P1)], [endpoint(D_SAME_IDLE)], prefix=prefix)
        answers.append(await answers_of(router, messages))
        router.live.close()
    assert answers[0] == answers[1]
    assert any(D_SAME_IDLE in str(answer) for answer in answers[0])  # routed, not refused


async def test_the_stream_routes_on_the_tokens_it_awaited(folder: Path) -> None:
    prefix = PrefixSettings(B, 100, source="kv-events", tokenizer=str(folder))
    router = make_router([endpoint(P1)], [endpoint(D_SAME_IDLE)], prefix=prefix)
    stream = Streams(router).open()
    stream.answer(headers(path=CHAT))
    raw = json.dumps(chat("hello " * 50)).encode()
    pending = stream.answer(body(raw))
    assert isinstance(pending, PendingRoute)
    tokens = await pending.ready()
    assert tokens is not None and len(tokens) > 0
    answers = stream.prepared(pending.request, tokens)
    assert isinstance(answers, tuple) and answers[0].WhichOneof("response") == "request_body"
    prefill = next(s for s in router.registry.endpoints() if s.role.value == "prefill")
    assert prefill.active_tokens == len(tokens)  # the exact count, not the estimate
    assert value(router, "pd_extproc_tokenize_seconds_count") == 1
    stream.close()
    router.live.close()


async def test_a_chat_sent_straight_to_an_engine_routes_the_next_turn_there(
    tmp_path: Path, folder: Path
) -> None:
    """Only the engine's events can know: the first turn never went through the gateway."""
    engines = {f"127.0.0.1:{8000 + i}": Publisher(replay=False) for i in range(2)}
    specs = [endpoint(a, kv_events_port=p.port) for a, p in engines.items()]
    overrides = {"routing.pd_threshold_tokens": 0, "affinity.prefix.tokenizer": str(folder)}
    server = await start_server(kv_events_config(tmp_path, specs, overrides))
    # The first engine: on a tie (no hit known) the server's first decision takes the second.
    holder, publisher = "127.0.0.1:8000", engines["127.0.0.1:8000"]
    first = chat("How does the gateway pick a prefill engine for a long prompt?")
    ids = load_prompt_tokenizer(TokenizerSettings(str(folder))).tokenizer.tokens(first, CHAT, 0.0).ids
    blocks = len(ids) // B
    assert blocks >= 4
    stored = BlockStored(tuple(range(1, blocks + 1)), None, tuple(ids[: blocks * B]), B)
    source = server.live.prefix
    assert isinstance(source, KvEventSource)
    try:
        for _ in range(200):  # until subscribed (a SUB socket misses what precedes its connection)
            publisher.publish(stored)
            if source.index.match(source.chain({}, ids), source.clock()).get(holder) == blocks:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the subscriber never saw the engine's blocks")
        following = chat(first["messages"][1]["content"], "It weighs the cache.", "And the decode?")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers(path=CHAT))
            await call.read()
            await call.write(body(json.dumps(following).encode()))
            answer = await call.read()
            await call.done_writing()
        sent = {
            h.header.key: h.header.raw_value.decode()
            for h in answer.request_body.response.header_mutation.set_headers
        }
        assert sent[PREFILL] == holder and sent[DEST].startswith(holder)
        metrics_url = f"http://127.0.0.1:{server.admin_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
            page = await response.text()
        assert "pd_extproc_tokenize_seconds_count 1.0" in page
        assert 'pd_extproc_tokenize_tokens_total{source="tokenizer"}' in page
    finally:
        await server.stop()
        for engine in engines.values():
            engine.close()
