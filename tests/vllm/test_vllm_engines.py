"""Real vLLM engines behind the shipped Envoy and ``pd-extproc serve --handoff kv-transfer-params``.

Every claim is checked on the engines' own ``/metrics``: a request's prompt was computed by exactly
one prefill (``vllm:prompt_tokens_by_source_total{source=local_compute}``), its decode pulled it
(``vllm:nixl_xfer_time_seconds_count`` and ``...{source=external_kv_transfer}`` rose, nothing was
computed locally), and the two are in the same pdGroupID group. Faults are real: engines killed
with SIGKILL (their whole process group, as a lost node) or frozen with SIGSTOP. After each test
pd-extproc holds no load.

``rack-a``'s two engines also serve a LoRA adapter (``rack-b``'s do not; ``conftest.ADAPTER``):
its requests stay in ``rack-a`` by the engines' own ``GET /v1/models``, prefill and decode both running
it. Every engine exports its request spans (``--otlp-traces-endpoint``) to the OTLP port the tracing
test listens on; an untraced request records none.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from e2e_harness import wait_idle
from interposer import start_interposer
from polling import until
from prometheus_client.parser import text_string_to_metric_families

from rig.cluster import VllmCluster
from rig.engine import MODEL_NAME, Engine, received_adapters
from rig.model import prompt
from sim.stack import Stack
from standins.otlp import OtlpReceiver

pytestmark = pytest.mark.timeout(900)  # the first test waits for four engines to start (1-4 min)

KV = "kv-transfer-params"
XFER = "vllm:nixl_xfer_time_seconds_count"
PULLED = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
COMPUTED = "vllm:prompt_tokens_by_source_total{source=local_compute}"
PROMPT_TOKENS = 200
SPANS_DEADLINE = 60.0
"""Seconds the tracing test waits for the three spans after the answer: each process exports on a batch
thread of its own, the engines' at ``nice 19`` among their own busy threads on 2 cores (CI once had
fewer than three 10 s after the answer; the test prints how long they took)."""
_SEEDS = itertools.count(1000)


def fresh_prompt() -> str:
    """A prompt of :data:`PROMPT_TOKENS` tokens no engine has seen (no prefix-cache hit anywhere)."""
    return prompt(PROMPT_TOKENS, next(_SEEDS))


def cluster_of(stack: Stack) -> VllmCluster:
    assert isinstance(stack.cluster, VllmCluster)
    return stack.cluster


async def snapshot(cluster: VllmCluster, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]:
    """Every live engine's metrics, by address."""
    engines = list(cluster.running.values())
    pages = await asyncio.gather(*(e.metrics(session) for e in engines))
    return {e.address: page for e, page in zip(engines, pages, strict=True)}


def rose(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], key: str
) -> dict[str, float]:
    """The engines whose ``key`` rose, with how much."""
    deltas = {a: after[a].get(key, 0.0) - before.get(a, {}).get(key, 0.0) for a in after}
    return {a: d for a, d in deltas.items() if d}


async def pd_extproc_counter(admin_url: str, name: str, **labels: str) -> float:
    """The value of pd-extproc's counter ``name`` with ``labels`` (0 when absent)."""
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/metrics") as response:
        text = await response.text()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def ask(
    url: str, api: str, stream: bool, text: str, max_tokens: int = 4, model: str = MODEL_NAME
) -> str:
    """One request for ``model`` through the gateway with the OpenAI SDK; the generated text."""
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        if api == "completions":
            if not stream:
                answer = await client.completions.create(model=model, prompt=text, max_tokens=max_tokens)
                return answer.choices[0].text
            chunks = await client.completions.create(
                model=model, prompt=text, max_tokens=max_tokens, stream=True
            )
            return "".join([c.choices[0].text async for c in chunks if c.choices])
        messages = [{"role": "user", "content": text}]
        if not stream:
            reply = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens
            )
            return reply.choices[0].message.content or ""
        deltas = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in deltas if c.choices])


async def served_in_group(
    cluster: VllmCluster, session: aiohttp.ClientSession, before: dict[str, dict[str, float]]
) -> tuple[str, str]:
    """Wait for the engines' counters of one request: exactly one prefill computed the prompt,
    exactly one decode pulled it (and computed nothing); returns (prefill, decode)."""
    after: dict[str, dict[str, float]] = {}

    async def counted() -> bool:
        nonlocal after
        after = await snapshot(cluster, session)
        return bool(rose(before, after, XFER)) and bool(rose(before, after, COMPUTED))

    await until(counted)
    computed, pulled = rose(before, after, COMPUTED), rose(before, after, XFER)
    prefills = {a for a in computed if cluster.engine(a).spec.role == "prefill"}
    assert len(prefills) == 1 and len(pulled) == 1, (computed, pulled)
    (prefill,), (decode,) = prefills, pulled
    assert cluster.engine(decode).spec.role == "decode"
    assert decode not in computed, f"the decode computed part of the prompt itself: {computed}"
    assert rose(before, after, PULLED)[decode] >= PROMPT_TOKENS
    return prefill, decode


@contextlib.asynccontextmanager
async def engines_session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest.mark.parametrize("mode", ["prefer", "strict"])
async def test_completions_and_chat_streamed_or_not_move_the_kv_inside_the_group(vllm_stack, mode):
    cluster = cluster_of(vllm_stack)
    url = await vllm_stack.route_with(mode, handoff=KV, pd_threshold_tokens=0)
    async with engines_session() as session:
        pairs = []
        for api, stream in [("completions", False), ("completions", True), ("chat", False), ("chat", True)]:
            before = await snapshot(cluster, session)
            text = await ask(url, api, stream, fresh_prompt())
            assert text.strip(), f"{api} stream={stream}: no text"
            prefill, decode = await served_in_group(cluster, session, before)
            assert cluster.group_of(prefill) == cluster.group_of(decode)
            pairs.append((prefill, decode))
        assert await wait_idle(session, vllm_stack.admin_url) == []
    assert len({p for p, _ in pairs}) == 2, f"both groups' prefills take turns: {pairs}"


async def test_an_adapters_requests_stay_on_the_engines_serving_it_and_the_kv_moves_with_it(vllm_stack):
    """Only ``rack-a``'s engines serve the adapter, as their own ``GET /v1/models`` says (no EDS
    declaration): its requests (completions, a streamed chat) are prefilled and decoded there, both
    engines running the adapter, the
    KV pulled over NIXL as for the base model, which still goes to both groups; a model no engine
    serves is a 404."""
    cluster = cluster_of(vllm_stack)
    ((adapter, adapter_group),) = {
        (n, e.spec.group) for e in cluster.running.values() for n in e.spec.adapters
    }
    engine_models = {"engine_metrics": {"enabled": True, "models_interval_seconds": 0.5}}
    url = await vllm_stack.route_with("prefer", handoff=KV, pd_threshold_tokens=0, config=engine_models)
    admin = vllm_stack.admin_url
    async with engines_session() as session:

        async def rows() -> list[dict]:
            async with session.get(f"{admin}/debug/endpoints") as response:
                return await response.json()

        async def every_list_known() -> bool:
            return all(row["models"] is not None for row in await rows())

        await until(every_list_known, every=0.2)
        for row in await rows():
            assert row["models_from"] == "engine"
            served = {m["id"]: m["parent"] for m in row["models"]}
            in_group = cluster.group_of(row["address"]) == adapter_group
            assert served == ({MODEL_NAME: None, adapter: MODEL_NAME} if in_group else {MODEL_NAME: None})
        async with session.get(f"{url}/v1/models") as response:
            listed = [(m["id"], m["parent"]) for m in (await response.json())["data"]]
        assert listed == [(adapter, MODEL_NAME), (MODEL_NAME, None)]

        for api, stream in [("completions", False), ("chat", True)]:
            before = await snapshot(cluster, session)
            logs = {a: e.log_size() for a, e in cluster.running.items()}
            text = await ask(url, api, stream, fresh_prompt(), model=adapter)
            assert text.strip(), f"{api} stream={stream}: no text"
            prefill, decode = await served_in_group(cluster, session, before)
            assert cluster.group_of(prefill) == cluster.group_of(decode) == adapter_group
            for address in (prefill, decode):  # each ran its request (the leg, the decode) with the adapter
                engine = cluster.engine(address)
                assert received_adapters(engine.log_since(logs[address])) == [adapter], engine.spec.name

        lora_info = {
            cluster.engine(a).spec.name: sorted(k for k in page if k.startswith("vllm:lora_requests_info"))
            for a, page in (await snapshot(cluster, session)).items()
            if cluster.group_of(a) == adapter_group
        }
        print(f"\nvLLM's adapter signal after {adapter}'s requests: {lora_info}", flush=True)

        groups = set()
        for _ in range(4):
            before = await snapshot(cluster, session)
            assert (await ask(url, "completions", False, fresh_prompt())).strip()
            prefill, decode = await served_in_group(cluster, session, before)
            groups.add(cluster.group_of(prefill))
        assert len(groups) == 2, "the base model is served by both groups"

        with pytest.raises(openai.NotFoundError) as missing:
            await ask(url, "chat", False, fresh_prompt(), model="not-an-adapter")
        assert missing.value.code == "model_not_found"
        assert await wait_idle(session, admin) == []
    assert await pd_extproc_counter(admin, "pd_extproc_model_requests_total", model=adapter) == 2


def tracing_state(receiver: OtlpReceiver, cluster: VllmCluster, stack: Stack) -> str:
    """The spans ``receiver`` holds, and what every engine's and the gateway's log says of exporting them
    (the OpenTelemetry exporter logs a failed or retried export): a failed tracing test's message."""
    logs = {e.spec.name: e.log for e in cluster.running.values()}
    logs["pd-extproc"] = stack.replicas[0].log
    said = {
        name: [line for line in log.read_text(errors="replace").splitlines() if "xport" in line][-3:]
        for name, log in logs.items()
        if log is not None and log.exists()
    }
    spans = [(s.service, s.name) for s in receiver.spans]
    return f"spans received: {spans}; export lines in the logs: {said}"


async def test_one_trace_holds_the_gateways_span_and_both_engines_spans(vllm_stack, monkeypatch):
    """pd-extproc traced, the engines exporting to the same collector: one request through Envoy is
    one trace, the gateway's span and an ``llm_request`` span of the prefill it chose and of the decode,
    both children of the gateway's span (the context both legs carry)."""
    cluster = cluster_of(vllm_stack)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # pd-extproc's batch delay, ms (default 5 s)
    endpoint = cluster.of_role("prefill")[0].spec.otlp_traces_endpoint
    assert endpoint is not None
    receiver = await OtlpReceiver().start(int(endpoint.rsplit(":", 1)[1]))
    try:
        traced = {"tracing": {"otlp_endpoint": receiver.endpoint, "sampling_ratio": 1.0}}
        url = await vllm_stack.route_with("prefer", handoff=KV, pd_threshold_tokens=0, config=traced)
        async with engines_session() as session:
            before = await snapshot(cluster, session)
            assert (await ask(url, "chat", True, fresh_prompt())).strip()
            prefill, decode = await served_in_group(cluster, session, before)
            waited = time.monotonic()
            await until(
                lambda: len(receiver.spans) >= 3,
                deadline=SPANS_DEADLINE,
                describe=lambda: tracing_state(receiver, cluster, vllm_stack),
            )
            waited = time.monotonic() - waited
            assert await wait_idle(session, vllm_stack.admin_url) == []
    finally:
        await receiver.stop()
    (gateway,) = [s for s in receiver.spans if s.service == "pd-extproc"]
    engines = {s.service: s for s in receiver.spans if s is not gateway}
    assert sorted(engines) == sorted(f"vllm-{cluster.engine(a).spec.name}" for a in (prefill, decode))
    assert gateway.parent_span_id == ""  # the client sent no traceparent: the gateway's span is the root
    assert (gateway.attributes["pd_extproc.prefill"], gateway.attributes["pd_extproc.decode"]) == (
        prefill,
        decode,
    )
    for span in engines.values():
        assert span.name == "llm_request" and span.kind == 2  # SERVER
        assert (span.trace_id, span.parent_span_id) == (gateway.trace_id, gateway.span_id)
    print(
        f"\none trace {gateway.trace_id}, its spans all received {waited:.1f} s after the answer: "
        + "; ".join(
            f"{s.service} {s.name} {s.span_id} <- {s.parent_span_id or 'root'}" for s in receiver.spans
        ),
        flush=True,
    )


async def test_a_client_abort_during_the_prefill_leg_cancels_it_and_forwards_nothing(vllm_stack):
    """Both prefills frozen: the leg waits; the client gives up; nothing reaches a decode."""
    cluster = cluster_of(vllm_stack)
    url = await vllm_stack.route_with("prefer", handoff=KV, pd_threshold_tokens=0)
    admin = vllm_stack.admin_url
    prefills = cluster.of_role("prefill")
    async with engines_session() as session:
        before = await snapshot(cluster, session)
        cancelled = await pd_extproc_counter(admin, "pd_extproc_prefill_leg_total", outcome="cancelled")
        for engine in prefills:
            engine.pause()
        try:
            request = asyncio.create_task(ask(url, "chat", True, fresh_prompt()))

            async def leg_in_flight() -> bool:
                async with session.get(f"{admin}/debug/endpoints") as response:
                    rows = await response.json()
                return any(r["role"] == "prefill" and r["active_requests"] for r in rows)

            await until(leg_in_flight)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            assert await wait_idle(session, admin) == []
            await until(lambda: pd_extproc_counter_grew(admin, cancelled), deadline=15)
        finally:
            for engine in prefills:
                engine.resume()
        await asyncio.sleep(2)  # let the thawed prefill see the closed connection
        after = await snapshot(cluster, session)
        assert rose(before, after, XFER) == {}, "a decode pulled KV for a request nobody waits for"
        text = await ask(url, "completions", False, fresh_prompt())
        assert text.strip()


async def pd_extproc_counter_grew(admin: str, cancelled_before: float) -> bool:
    now = await pd_extproc_counter(admin, "pd_extproc_prefill_leg_total", outcome="cancelled")
    return now > cancelled_before


async def test_a_dead_prefill_still_listed_is_retried_on_the_other_and_ejected(vllm_stack):
    cluster = cluster_of(vllm_stack)
    url = await vllm_stack.route_with("prefer", handoff=KV, pd_threshold_tokens=0)
    admin = vllm_stack.admin_url
    dead, alive = cluster.of_role("prefill")
    ejections = await pd_extproc_counter(admin, "pd_extproc_prefill_ejections_total")
    vllm_stack.cluster.stop_engine(dead.address)  # EDS still lists it
    async with engines_session() as session:
        for turn in range(3):
            before = await snapshot(cluster, session)
            assert (await ask(url, "chat", turn % 2 == 0, fresh_prompt())).strip()
            prefill, decode = await served_in_group(cluster, session, before)
            assert prefill == alive.address
            assert cluster.group_of(decode) == cluster.group_of(alive.address)
        assert await pd_extproc_counter(admin, "pd_extproc_prefill_ejections_total") > ejections
        assert await wait_idle(session, admin) == []


async def test_a_prefill_killed_after_its_leg_answered_is_a_kv_transfer_failed_error(vllm_stack):
    """The decode is handed KV held by a dead engine and cannot pull it (vLLM's default
    ``kv_load_failure_policy: fail``): the client gets an OpenAI-style error naming the cause, not
    the decode's bare 500 (a 502, or the error event of a chat stream); pd-extproc counts it and
    leaves the dead prefill out, so the next request is served by the other one. Both prefills die
    here, one per kind of answer, and start again together."""
    cluster = cluster_of(vllm_stack)
    leg_listener = f"http://127.0.0.1:{vllm_stack.replicas[0].prefill_leg_port}"
    interposer = await start_interposer(leg_listener, cluster.stop_engine)
    async with engines_session() as session:
        try:
            url = await vllm_stack.route_with(
                "prefer", handoff=KV, pd_threshold_tokens=0, prefill_via=interposer.url
            )
            admin = vllm_stack.admin_url
            for stream in (False, True):
                failures = await pd_extproc_counter(
                    admin, "pd_extproc_kv_transfer_failures_total", stream=str(stream).lower()
                )
                before = await snapshot(cluster, session)
                interposer.armed = True
                with pytest.raises(openai.APIError) as raised:
                    await ask(url, "chat", stream, fresh_prompt())
                dead = interposer.killed[-1]
                error = raised.value
                assert error.code == "kv_transfer_failed", error
                assert dead in error.message
                if not stream:
                    assert isinstance(error, openai.APIStatusError) and error.status_code == 502
                after = await snapshot(cluster, session)
                (decode,) = rose(before, after, "vllm:request_success_total{finished_reason=error}")
                assert cluster.group_of(decode) == cluster.group_of(dead)
                counted = await pd_extproc_counter(
                    admin, "pd_extproc_kv_transfer_failures_total", stream=str(stream).lower()
                )
                assert counted == failures + 1
                assert await wait_idle(session, admin) == []
                if not stream:  # the dead prefill is left out: the other one serves the next request
                    before = await snapshot(cluster, session)
                    assert (await ask(url, "completions", False, fresh_prompt())).strip()
                    prefill, _ = await served_in_group(cluster, session, before)
                    assert prefill != dead
            assert len(set(interposer.killed)) == 2
        finally:
            await interposer.stop()


async def test_a_decode_killed_mid_stream_ends_the_stream_and_the_next_request_is_served(vllm_stack):
    cluster = cluster_of(vllm_stack)
    url = await vllm_stack.route_with("prefer", handoff=KV, pd_threshold_tokens=0)
    admin = vllm_stack.admin_url
    async with engines_session() as session:
        before = await snapshot(cluster, session)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        victim: Engine | None = None
        received = 0
        try:
            stream = await client.completions.create(
                model=MODEL_NAME,
                prompt=fresh_prompt(),
                max_tokens=1500,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            with pytest.raises(openai.APIError) as ended:
                async for chunk in stream:
                    received += bool(chunk.choices and chunk.choices[0].text)
                    if received == 3 and victim is None:
                        after = await snapshot(cluster, session)
                        (address,) = rose(before, after, XFER)
                        victim = cluster.engine(address)
                        cluster.stop_engine(address)
                        killed = time.monotonic()
            assert victim is not None, "the stream ended before the decode was killed"
            # The stream broke when the decode died; the client did not give up on a silent one.
            assert not isinstance(ended.value, openai.APITimeoutError), "the client was left hanging"
            print(f"\nthe stream ended {time.monotonic() - killed:.1f} s after its decode died", flush=True)
            assert await wait_idle(session, admin) == []
            # Still listed, now dead: Envoy's connect failure moves the next request to a fallback.
            assert (await ask(url, "chat", True, fresh_prompt())).strip()
            assert await wait_idle(session, admin) == []
        finally:
            await client.close()
