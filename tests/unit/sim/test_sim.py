"""HTTP tests of the simulated engine: real aiohttp servers on loopback, real HTTP clients."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from builders import endpoint
from polling import until
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.discovery.eds import write_eds_file
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster
from sim.config import EngineConfig, KvConfig, TimingConfig
from sim.handoff import PREFILL_CACHED_PARAM, PREFILL_MS_PARAM
from sim.server import RunningEngine, start_engine

FAST = TimingConfig(time_scale=0.01)


@asynccontextmanager
async def cluster(
    specs: list[EngineSpec], eds_files: Sequence[Path] = (), timing: TimingConfig = FAST
) -> AsyncIterator[list[RunningEngine]]:
    engines = await start_cluster(specs, eds_files, timing=timing)
    try:
        yield engines
    finally:
        await stop_cluster(engines)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


async def post(http: aiohttp.ClientSession, engine: RunningEngine, path: str, body: object, **kw):
    async with http.post(engine.url + path, json=body, **kw) as resp:
        return resp.status, resp.headers, await resp.json()


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


async def metrics(http: aiohttp.ClientSession, engine: RunningEngine) -> dict[str, float]:
    """Samples by name (plus ``{kind}`` / ``{finished_reason}`` label when present)."""
    async with http.get(engine.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = s.labels.get("kind") or s.labels.get("finished_reason")
            out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    return out


def eds_for(path: Path, engines: list[RunningEngine], roles: tuple[str, ...]) -> Path:
    write_eds_file(path, "pd-" + roles[0], endpoint_specs(engines, roles))
    return path


# --- OpenAI surface ---------------------------------------------------------------------------


async def test_completions_non_streaming_shape(http) -> None:
    async with cluster([EngineSpec("both", "g1")]) as [engine]:
        status, headers, body = await post(
            http, engine, "/v1/completions", {"prompt": "abcdefghi", "max_tokens": 5}
        )
        assert status == 200
        assert re.fullmatch(r"cmpl-\S+", body["id"]) and body["object"] == "text_completion"
        assert isinstance(body["created"], int) and body["model"] == "sim-llama-3-8b"
        [choice] = body["choices"]
        assert choice["index"] == 0 and len(choice["text"]) == 20 and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        assert headers["x-sim-engine"] == engine.address and headers["x-sim-group"] == "g1"
        assert headers["x-sim-kv-transfer"] == "none" and float(headers["x-sim-kv-transfer-ms"]) == 0.0
        assert "x-sim-prefill-engine" not in headers

        body_ids = {"prompt": [[1, 2, 3], [4]], "max_tokens": 4, "sim_output_tokens": 2, "model": "m2"}
        _, _, body = await post(http, engine, "/v1/completions", body_ids)
        assert body["model"] == "m2" and body["choices"][0]["finish_reason"] == "stop"
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


async def test_chat_non_streaming_shape(http) -> None:
    messages = [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [{"type": "text", "text": "efghijkl"}]},
    ]
    async with cluster([EngineSpec("decode", "g1")]) as [engine]:
        req = {"messages": messages, "max_tokens": 9, "max_completion_tokens": 3}
        status, _, body = await post(http, engine, "/v1/chat/completions", req)
        assert status == 200
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        [choice] = body["choices"]
        assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"]) == 12
        assert choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_streaming_completions_sse(http) -> None:
    async with cluster([EngineSpec("both", "g1")]) as [engine]:
        _, _, plain = await post(http, engine, "/v1/completions", {"prompt": "abcd", "max_tokens": 6})
        req = {"prompt": "abcd", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(engine.url + "/v1/completions", json=req) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["x-sim-engine"] == engine.address
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        *content, last = chunks
        assert last["choices"] == [] and last["usage"] == {
            "prompt_tokens": 1,
            "completion_tokens": 6,
            "total_tokens": 7,
        }
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in content)
        assert len({c["id"] for c in chunks}) == 1
        assert "".join(c["choices"][0]["text"] for c in content) == plain["choices"][0]["text"]
        reasons = [c["choices"][0]["finish_reason"] for c in content]
        assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}

        async with http.post(engine.url + "/v1/completions", json={**req, "stream_options": None}) as resp:
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        assert all("usage" not in json.loads(e) for e in events[:-1])


async def test_streaming_chat_sse(http) -> None:
    async with cluster([EngineSpec("both", "g1")]) as [engine]:
        req = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}
        async with http.post(engine.url + "/v1/chat/completions", json=req) as resp:
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:])
        assert len(text) == 16 and chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_models_and_health(http) -> None:
    async with cluster([EngineSpec("prefill", "g1")]) as [engine]:
        async with http.get(engine.url + "/health") as resp:
            assert resp.status == 200
        async with http.get(engine.url + "/v1/models") as resp:
            body = await resp.json()
        assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["sim-llama-3-8b"]
        assert body["data"][0]["object"] == "model"


async def test_metrics_names_and_counters(http) -> None:
    async with cluster([EngineSpec("both", "g1")]) as [engine]:
        async with http.get(engine.url + "/metrics") as resp:
            text = await resp.text()
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:time_per_output_token_seconds_bucket",
        ):
            assert name in text, name
        before = await metrics(http, engine)
        await post(http, engine, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 5})
        after = await metrics(http, engine)
        assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 10
        assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
        assert (
            after["vllm:time_to_first_token_seconds_count"]
            == before["vllm:time_to_first_token_seconds_count"] + 1
        )
        assert after["vllm:request_success_total{length}"] == 1
        assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


async def test_two_engines_have_separate_registries(http) -> None:
    async with cluster([EngineSpec("both", "g1"), EngineSpec("both", "g1")]) as [a, b]:
        await post(http, a, "/v1/completions", {"prompt": "abcd", "max_tokens": 2})
        assert (await metrics(http, a))["vllm:generation_tokens_total"] == 2
        assert (await metrics(http, b))["vllm:generation_tokens_total"] == 0


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b'{"max_tokens": 3}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 100000}'),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
        ("/v1/chat/completions", b'{"prompt": "hi"}'),
    ],
)
async def test_bad_requests_are_400(http, path: str, data: bytes) -> None:
    async with cluster([EngineSpec("both", "g1")]) as [engine]:
        async with http.post(
            engine.url + path, data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400
            body = await resp.json()
        assert set(body["error"]) >= {"message", "type", "code"} and body["error"]["code"] == 400
        assert body["error"]["message"]


async def test_request_larger_than_kv_cache_is_400(http) -> None:
    timing = TimingConfig(time_scale=0.01, kv_capacity_tokens=64)
    async with cluster([EngineSpec("both", "g1")], timing=timing) as [engine]:
        status, _, body = await post(http, engine, "/v1/completions", {"prompt": [1] * 60, "max_tokens": 10})
        assert status == 400 and "KV" in body["error"]["message"]


# --- PD handoff -------------------------------------------------------------------------------

HANDOFF = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


@pytest.mark.parametrize("stops", [False, True], ids=["length", "stop"])
async def test_prefill_returns_kv_transfer_params_in_vllm_0_32_shape(http, stops) -> None:
    """vLLM 0.32 NIXL (``NixlConnectorScheduler.request_finished``): params also when the one token
    is a stop, blocks per KV cache group, the request's id, the parallel sizes and token count."""
    async with cluster([EngineSpec("prefill", "g1")]) as [prefill]:
        req = {"prompt": [7] * 40, "max_tokens": 1, "stream": False, "kv_transfer_params": HANDOFF}
        if stops:
            req["sim_output_tokens"] = 1
        status, headers, body = await post(
            http, prefill, "/v1/completions", req, headers={"X-Request-Id": "r-1"}
        )
        assert status == 200
        params = body["kv_transfer_params"]
        params.pop(PREFILL_MS_PARAM)
        assert params.pop(PREFILL_CACHED_PARAM) == 0  # the simulator's own: its prefix-cache hit
        (blocks,) = params.pop("remote_block_ids")  # one KV cache group
        assert len(blocks) == 3 and all(type(b) is int for b in blocks)  # 40 tokens, 16-token blocks
        assert params == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": prefill.engine.engine_id,
            "remote_request_id": "r-1",
            "remote_host": "127.0.0.1",
            "remote_port": prefill.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": 40,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        reason = "stop" if stops else "length"
        assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == reason
        assert headers["x-sim-kv-transfer"] == "none"
        assert (await metrics(http, prefill))["sim:remote_prefills_total"] == 1


async def test_roles_reject_the_wrong_half(http) -> None:
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]) as [prefill, decode]:
        req = {"prompt": "abcd", "max_tokens": 1, "kv_transfer_params": HANDOFF}
        status, _, _ = await post(http, decode, "/v1/completions", req)
        assert status == 400
        hdr = {"x-prefiller-host-port": decode.address}
        status, _, _ = await post(http, prefill, "/v1/completions", {"prompt": "abcd"}, headers=hdr)
        assert status == 400


async def test_sidecar_header_same_vs_cross_group(http, tmp_path: Path) -> None:
    specs = [EngineSpec("prefill", "g1"), EngineSpec("prefill", "g2"), EngineSpec("decode", "g1")]
    files = [tmp_path / "prefill.json", tmp_path / "decode.json"]
    async with cluster(specs, files) as engines:
        p1, p2, decode = engines
        eds_for(files[0], engines, ("prefill",))
        eds_for(files[1], engines, ("decode",))
        req = {"prompt": "x" * 4000, "max_tokens": 3}  # 1000 prompt tokens
        ms = {}
        for prefill, kind, group in ((p1, "same_group", "g1"), (p2, "cross_group", "g2")):
            hdr = {"x-prefiller-host-port": prefill.address}
            status, headers, body = await post(http, decode, "/v1/completions", req, headers=hdr)
            assert status == 200 and body["usage"]["completion_tokens"] == 3
            assert headers["x-sim-kv-transfer"] == kind
            assert headers["x-sim-prefill-engine"] == prefill.address
            assert headers["x-sim-prefill-group"] == group and "x-sim-warning" not in headers
            assert headers["x-sim-engine"] == decode.address
            ms[kind] = float(headers["x-sim-kv-transfer-ms"])
            pm = await metrics(http, prefill)
            assert pm["sim:remote_prefills_total"] == 1 and pm["vllm:prompt_tokens_total"] == 1000
        kv = KvConfig()
        assert ms["same_group"] == pytest.approx(kv.unloaded_transfer_ms(1000, same_group=True), rel=1e-3)
        assert ms["cross_group"] == pytest.approx(kv.unloaded_transfer_ms(1000, same_group=False), rel=0.05)
        assert ms["cross_group"] > ms["same_group"]
        dm = await metrics(http, decode)
        assert (
            dm["sim:kv_transfers_total{same_group}"] == 1 and dm["sim:kv_transfers_total{cross_group}"] == 1
        )


async def test_sidecar_streaming_reports_before_first_chunk(http, tmp_path: Path) -> None:
    eds = tmp_path / "eds.json"
    async with cluster([EngineSpec("prefill", "g2"), EngineSpec("decode", "g1")], [eds]) as engines:
        prefill, decode = engines
        eds_for(eds, engines, ("prefill", "decode"))
        req = {
            "prompt": "abcd" * 10,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        hdr = {"x-prefiller-host-port": prefill.address}
        async with http.post(decode.url + "/v1/completions", json=req, headers=hdr) as resp:
            assert resp.headers["x-sim-kv-transfer"] == "cross_group"
            assert float(resp.headers["x-sim-kv-transfer-ms"]) > 0
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 4


async def test_unknown_prefill_is_cross_group(http, tmp_path: Path) -> None:
    eds = tmp_path / "eds.json"
    write_eds_file(eds, "pd", [endpoint("10.1.1.1:1", "g1")])
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], [eds]) as [prefill, decode]:
        hdr = {"x-prefiller-host-port": prefill.address}
        status, headers, _ = await post(
            http, decode, "/v1/completions", {"prompt": "abcd", "max_tokens": 2}, headers=hdr
        )
        assert status == 200 and headers["x-sim-kv-transfer"] == "cross_group"
        assert headers["x-sim-prefill-group"] == "unknown" and "no EDS file" in headers["x-sim-warning"]


async def test_group_change_in_eds_file_is_picked_up(http, tmp_path: Path) -> None:
    eds = tmp_path / "eds.json"
    async with cluster([EngineSpec("prefill", "g2"), EngineSpec("decode", "g1")], [eds]) as [prefill, decode]:
        hdr = {"x-prefiller-host-port": prefill.address}
        req = {"prompt": "abcd", "max_tokens": 2}
        write_eds_file(eds, "pd", [endpoint(prefill.address, "g2")])
        _, headers, _ = await post(http, decode, "/v1/completions", req, headers=hdr)
        assert headers["x-sim-kv-transfer"] == "cross_group"
        write_eds_file(eds, "pd", [endpoint(prefill.address, "g1")])
        _, headers, _ = await post(http, decode, "/v1/completions", req, headers=hdr)
        assert headers["x-sim-kv-transfer"] == "same_group"
        # the prefill reports its own group in x-sim-group; the mismatch with EDS is flagged
        assert "EDS says 'g1'" in headers["x-sim-warning"]


async def test_decode_with_kv_transfer_params_pulls_directly(http, tmp_path: Path) -> None:
    eds = tmp_path / "eds.json"
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("both", "g1")], [eds]) as engines:
        prefill, decode = engines
        eds_for(eds, engines, ("prefill", "both"))
        req = {"prompt": "abcd" * 100, "max_tokens": 1, "kv_transfer_params": HANDOFF}
        _, _, first = await post(http, prefill, "/v1/completions", req)
        req = {"prompt": "abcd" * 100, "max_tokens": 5, "kv_transfer_params": first["kv_transfer_params"]}
        status, headers, body = await post(http, decode, "/v1/completions", req)
        assert status == 200 and body["usage"] == {
            "prompt_tokens": 100,
            "completion_tokens": 5,
            "total_tokens": 105,
        }
        assert (
            headers["x-sim-kv-transfer"] == "same_group"
            and headers["x-sim-prefill-engine"] == prefill.address
        )
        assert float(headers["x-sim-kv-transfer-ms"]) == pytest.approx(
            KvConfig().unloaded_transfer_ms(100, same_group=True), rel=1e-3
        )
        assert (await metrics(http, prefill))["sim:remote_prefills_total"] == 1  # not called again
        dm = await metrics(http, decode)
        assert dm["vllm:prompt_tokens_total"] == 100 and dm["sim:kv_transfers_total{same_group}"] == 1

        bad = {"prompt": "abcd", "kv_transfer_params": {"do_remote_prefill": True}}
        status, headers, _ = await post(http, decode, "/v1/completions", bad)  # vLLM recomputes
        assert status == 200 and headers["x-sim-kv-transfer"] == "none"
        assert "remote_host" in headers["x-sim-warning"]


async def test_decode_without_prefill_info_prefills_locally(http) -> None:
    async with cluster([EngineSpec("decode", "g1")]) as [decode]:
        status, headers, _ = await post(
            http, decode, "/v1/completions", {"prompt": "abcd" * 50, "max_tokens": 2}
        )
        assert status == 200 and headers["x-sim-kv-transfer"] == "none"
        assert (await metrics(http, decode))["vllm:prompt_tokens_total"] == 50


async def test_unreachable_prefiller_is_502(http, unused_tcp_port: int) -> None:
    async with cluster([EngineSpec("decode", "g1")]) as [decode]:
        hdr = {"x-prefiller-host-port": f"127.0.0.1:{unused_tcp_port}"}
        status, headers, body = await post(http, decode, "/v1/completions", {"prompt": "abcd"}, headers=hdr)
        assert status == 502 and body["error"]["code"] == 502
        assert headers["x-sim-prefill-engine"] == hdr["x-prefiller-host-port"]


# --- load: batching and queueing --------------------------------------------------------------


async def test_queueing_beyond_max_batch_shows_as_waiting(http) -> None:
    timing = TimingConfig(time_scale=0.02, max_batch=1)  # one request at a time, 0.24 ms wall per token
    async with cluster([EngineSpec("both", "g1")], timing=timing) as [engine]:

        async def engine_shows(running: int, waiting: int) -> bool:
            m = await metrics(http, engine)
            assert m["vllm:num_requests_running"] <= 1
            return (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (running, waiting)

        long = {"prompt": "abcd", "max_tokens": 30000, "stream": True}  # ~7 s wall unless aborted
        async with http.post(engine.url + "/v1/completions", json=long) as streaming:
            await streaming.content.readline()  # it runs: the only batch slot is taken until we leave
            req = {"prompt": "abcd", "max_tokens": 40}
            tasks = [asyncio.create_task(post(http, engine, "/v1/completions", req)) for _ in range(3)]
            await until(lambda: engine_shows(1, 3))
            streaming.close()  # the client goes away: the engine aborts it and frees the slot
        results = await asyncio.gather(*tasks)
        assert all(status == 200 for status, _, _ in results)
        assert min(float(h["x-sim-queue-ms"]) for _, h, _ in results) > 0
        m = await metrics(http, engine)
        assert m["vllm:num_requests_waiting"] == 0 and m["vllm:request_queue_time_seconds_count"] == 4


async def test_start_engine_direct_and_stop(http) -> None:
    running = await start_engine(EngineConfig(role="both", group="gx", timing=FAST))
    try:
        assert running.port > 0 and running.address == f"127.0.0.1:{running.port}"
        status, headers, _ = await post(http, running, "/v1/completions", {"prompt": "abcd", "max_tokens": 1})
        assert status == 200 and headers["x-sim-group"] == "gx"
    finally:
        await running.stop()
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(http, running, "/v1/completions", {"prompt": "abcd"})


async def test_priority_policy_serves_the_bodys_priority_first_and_preempts_to_admit(http) -> None:
    """Over HTTP: ``priority-preempt`` preempts the running batch request for an urgent one; the batch one
    then resumes (recomputed) and still answers in full."""
    timing = TimingConfig(time_scale=0.02, max_batch=1, scheduling_policy="priority-preempt")
    async with cluster([EngineSpec("both", "g1")], timing=timing) as [engine]:
        batch = {"prompt": "abcd", "max_tokens": 400, "priority": 1, "stream": True}
        async with http.post(engine.url + "/v1/completions", json=batch) as streaming:
            await streaming.content.readline()  # it runs: the only batch slot is taken
            urgent = {"prompt": "abcd", "max_tokens": 2, "priority": -10}
            status, _, answer = await post(http, engine, "/v1/completions", urgent)
            assert status == 200 and answer["usage"]["completion_tokens"] == 2
            text = await streaming.text()
        assert text.rstrip().endswith("data: [DONE]")
        m = await metrics(http, engine)
        assert m["vllm:num_preemptions_total"] == 1
        status, _, answer = await post(http, engine, "/v1/completions", {"prompt": "x", "priority": "high"})
        assert (status, answer["error"]["param"]) == (400, "priority")
