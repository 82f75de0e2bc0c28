"""The simulator's PD handoff protocols over real HTTP on loopback: vLLM's kv_transfer_params (KV
held by the prefill until pulled or timed out, recompute on bad params) and SGLang's bootstrap
rendezvous (either arrival order, timeouts on both sides)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ext_proc.discovery.eds import load_eds_file, write_eds_file
from ext_proc.handoff.body import PREFILL_REQUEST_PARAMS
from sim.cli import add_parser, config_from_args
from sim.cluster import EngineSpec, endpoint_specs, start_cluster, stop_cluster
from sim.cluster_process import EngineInfo, write_cluster_eds
from sim.config import KvConfig, TimingConfig
from sim.server import RunningEngine

FAST = TimingConfig(time_scale=0.01)  # 1 model second = 10 wall ms
DEADLINE_S = 10.0
PATIENT = {"kv_lease_s": 6000.0, "mooncake_abort_timeout_s": 6000.0, "bootstrap_timeout_s": 6000.0}
"""Model seconds (60 wall s at ``FAST``) for the waits a test does not exercise. The defaults are
0.3 to 4.8 wall s at ``FAST``: on a loaded machine a prefill's hold could expire, or a rendezvous
give up, between two requests of a test, before its own :data:`DEADLINE_S`."""


def kv(**settings: object) -> KvConfig:
    """A :class:`KvConfig` of ``settings``, the waits not named :data:`PATIENT`."""
    return KvConfig(**{**PATIENT, **settings})  # type: ignore[arg-type]


RECOMPUTE = kv(kv_load_failure_policy="recompute")
PREFILL_LEG = (
    PREFILL_REQUEST_PARAMS  # what the gateway's prefill leg asks (test_e2e_handoff.py spells it out)
)
PROMPT = [7] * 40  # 40 prompt tokens: 3 blocks of 16


@asynccontextmanager
async def cluster(
    specs: list[EngineSpec],
    eds: Path | None = None,
    config: KvConfig | None = None,
    timing: TimingConfig = FAST,
) -> AsyncIterator[list[RunningEngine]]:
    """Engines of ``specs`` (``config``: :func:`kv`'s default); with ``eds``, that file lists them all
    (groups, bootstrap ports)."""
    engines = await start_cluster(specs, [eds] if eds else [], timing=timing, kv=config or kv())
    try:
        if eds is not None:
            write_eds_file(eds, "pd", endpoint_specs(engines))
        yield engines
    finally:
        await stop_cluster(engines)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(
    http: aiohttp.ClientSession, engine: RunningEngine, body: dict, path: str = "/v1/completions", **kw
) -> tuple[int, dict[str, str], dict]:
    async with http.post(engine.url + path, json=body, **kw) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def metrics(http: aiohttp.ClientSession, engine: RunningEngine) -> dict[str, float]:
    """Samples by name, ``{label}`` appended for samples with a ``kind``/``finished_reason``."""
    async with http.get(engine.url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = s.labels.get("kind") or s.labels.get("finished_reason")
            out[f"{s.name}{{{extra}}}" if extra else s.name] = s.value
    return out


async def until(
    http: aiohttp.ClientSession, engine: RunningEngine, check: Callable[[dict[str, float]], bool]
) -> dict[str, float]:
    """Poll ``engine``'s metrics until ``check`` holds (fail after :data:`DEADLINE_S`)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        m = await metrics(http, engine)
        if check(m):
            return m
        assert time.monotonic() < deadline, f"condition never held; last metrics {m}"
        await asyncio.sleep(0.01)


def idle(m: dict[str, float]) -> bool:
    """Nothing held, no KV in use, no bootstrap room open."""
    return (
        m["sim:kv_held_requests"] == 0
        and m["vllm:kv_cache_usage_perc"] == 0
        and m["sim:bootstrap_rooms"] == 0
    )


async def prefill_leg(
    http: aiohttp.ClientSession,
    prefill: RunningEngine,
    extra: dict | None = None,
    request_id: str | None = None,
) -> tuple[int, dict[str, str], dict]:
    body = {
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_LEG,
        **(extra or {}),
    }
    headers = {"X-Request-Id": request_id} if request_id else {}
    return await post(http, prefill, body, headers=headers)


def decode_body(params: dict, **extra: object) -> dict:
    return {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params, **extra}


# --- vLLM kv_transfer_params: the prefill ------------------------------------------------------


async def test_prefill_params_name_the_request_and_the_blocks_stay_held(http) -> None:
    async with cluster([EngineSpec("prefill", "g1")]) as [prefill]:
        status, headers, body = await prefill_leg(http, prefill, request_id="gw-42")
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        params = body["kv_transfer_params"]
        assert params["remote_request_id"] == "gw-42"
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", prefill.port)
        assert isinstance(params["remote_engine_id"], str) and params["tp_size"] == 1
        assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 3
        assert headers["x-sim-kv-transfer"] == "none"
        m = await metrics(http, prefill)
        assert m["sim:kv_held_requests"] == 1 and m["sim:remote_prefills_total"] == 1
        assert m["vllm:kv_cache_usage_perc"] == pytest.approx(3 / (262144 // 16))  # 41 tokens: 3 blocks

        _, _, body = await prefill_leg(http, prefill)  # no X-Request-Id: one the engine makes
        assert body["kv_transfer_params"]["remote_request_id"] not in ("", "gw-42")
        assert body["kv_transfer_params"]["remote_block_ids"] != params["remote_block_ids"]
        assert (await metrics(http, prefill))["sim:kv_held_requests"] == 2


@pytest.mark.parametrize(("sim_output_tokens", "reason"), [(1, "stop"), (2, "length")])
async def test_a_nixl_prefill_hands_off_on_a_stop_too(http, sim_output_tokens, reason) -> None:
    """vLLM 0.32 NIXL returns params for FINISHED_STOPPED as for FINISHED_LENGTH_CAPPED."""
    async with cluster([EngineSpec("prefill", "g1")]) as [prefill]:
        status, _, body = await prefill_leg(http, prefill, {"sim_output_tokens": sim_output_tokens})
        assert status == 200 and body["choices"][0]["finish_reason"] == reason
        assert body["usage"]["completion_tokens"] == 1
        assert body["kv_transfer_params"]["do_remote_prefill"] is True
        m = await metrics(http, prefill)
        assert m["sim:kv_held_requests"] == 1 and m["vllm:kv_cache_usage_perc"] > 0


async def test_sim_output_tokens_at_the_budget_is_a_stop_and_plain_requests_keep_length(http) -> None:
    async with cluster([EngineSpec("both", "g1")]) as [engine]:
        _, _, body = await post(http, engine, {"prompt": "abcd", "max_tokens": 3, "sim_output_tokens": 3})
        assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 3
        _, _, body = await post(http, engine, {"prompt": "abcd", "max_tokens": 3, "sim_output_tokens": 9})
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
        _, _, body = await post(http, engine, {"prompt": "abcd", "max_tokens": 3})
        assert body["choices"][0]["finish_reason"] == "length"


async def test_held_blocks_block_admission_until_the_decode_pulls_them(http) -> None:
    small = TimingConfig(time_scale=0.01, kv_capacity_tokens=64)  # 4 blocks
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], timing=small) as engines:
        prefill, decode = engines
        _, _, first = await prefill_leg(http, prefill)
        assert (await metrics(http, prefill))["vllm:kv_cache_usage_perc"] == 0.75
        second = asyncio.create_task(prefill_leg(http, prefill))  # needs 3 of the 1 free block
        await until(http, prefill, lambda m: m["vllm:num_requests_waiting"] == 1)
        assert not second.done()

        status, headers, body = await post(http, decode, decode_body(first["kv_transfer_params"]))
        assert status == 200 and headers["x-sim-prefill-engine"] == prefill.address
        assert body["usage"]["completion_tokens"] == 4
        status, _, second_body = await asyncio.wait_for(second, DEADLINE_S)  # admitted once freed
        assert status == 200 and "kv_transfer_params" in second_body
        m = await metrics(http, prefill)
        assert m["sim:kv_held_requests"] == 1 and m["vllm:kv_cache_usage_perc"] == 0.75


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_pull_frees_the_blocks_and_a_second_pull_fails_by_policy(http, tmp_path: Path, policy) -> None:
    specs = [EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]
    config = kv(kv_load_failure_policy=policy)
    async with cluster(specs, tmp_path / "eds.json", config) as [prefill, decode]:
        _, _, first = await prefill_leg(http, prefill, request_id="r1")
        params = first["kv_transfer_params"]
        status, headers, body = await post(http, decode, decode_body(params), headers={"X-Request-Id": "r1"})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert (
            headers["x-sim-kv-transfer"] == "same_group"
            and headers["x-sim-prefill-engine"] == prefill.address
        )
        assert headers["x-sim-prefill-group"] == "g1" and "x-sim-warning" not in headers
        assert float(headers["x-sim-kv-transfer-ms"]) == pytest.approx(
            KvConfig().unloaded_transfer_ms(40, same_group=True), rel=1e-3
        )
        assert idle(await metrics(http, prefill))

        status, headers, body = await post(http, decode, decode_body(params))  # released: not held any more
        dm = await metrics(http, decode)
        assert dm["sim:kv_transfers_total{same_group}"] == 1
        if policy == "fail":  # vLLM 0.32's answer to a request finished with reason "error"
            assert status == 500 and body == {
                "error": {
                    "message": "Internal server error",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
            assert dm["sim:kv_load_failures_total"] == 1 and dm["sim:kv_recomputes_total"] == 0
            return
        assert status == 200 and headers["x-sim-kv-transfer"] == "none"
        assert "holds no such KV blocks" in headers["x-sim-warning"] and "x-sim-prefill-engine" not in headers
        assert dm["sim:kv_recomputes_total"] == 1 and dm["sim:kv_load_failures_total"] == 0


async def test_blocks_of_another_engine_id_or_unknown_ids_are_recomputed(http) -> None:
    specs = [EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]
    async with cluster(specs, config=RECOMPUTE) as [prefill, decode]:
        _, _, first = await prefill_leg(http, prefill)
        params = first["kv_transfer_params"]
        for wrong, says in (
            ({"remote_engine_id": "sim-other"}, "is not"),
            ({"remote_block_ids": [[10**6]]}, "holds no such KV blocks"),
        ):
            status, headers, _ = await post(http, decode, decode_body({**params, **wrong}))
            assert (
                status == 200 and headers["x-sim-kv-transfer"] == "none" and says in headers["x-sim-warning"]
            )
        assert (await metrics(http, prefill))["sim:kv_held_requests"] == 1  # untouched


async def test_hold_expires_after_the_lease_and_frees_the_blocks(http) -> None:
    config = kv(kv_lease_s=5.0, kv_load_failure_policy="recompute")  # 50 wall ms at time_scale 0.01
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], config=config) as [
        prefill,
        decode,
    ]:
        _, _, first = await prefill_leg(http, prefill)
        m = await until(http, prefill, lambda m: m["sim:kv_holds_expired_total"] == 1)
        assert idle(m)
        status, headers, _ = await post(http, decode, decode_body(first["kv_transfer_params"]))
        assert status == 200 and headers["x-sim-kv-transfer"] == "none"
        assert "holds no such KV blocks" in headers["x-sim-warning"]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"remote_host": None}, "remote_host"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_port": "8000"}, "remote_port"),
        ({"remote_port": None}, "remote_port"),
        ({"remote_block_ids": [1, "2"]}, "remote_block_ids"),
        ({"remote_block_ids": [[1], [2, "3"]]}, "remote_block_ids"),
        ({"remote_block_ids": [[1], 2]}, "remote_block_ids"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"remote_block_ids": None}, "remote_block_ids"),
        ({"remote_engine_id": 5}, "remote_engine_id"),
    ],
)
async def test_malformed_params_are_recomputed_with_a_warning(http, bad: dict, field: str) -> None:
    """vLLM ignores invalid params ("will not utilize KVTransfer"), whatever the failure policy."""
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]) as [prefill, decode]:
        _, _, first = await prefill_leg(http, prefill)
        status, headers, body = await post(http, decode, decode_body({**first["kv_transfer_params"], **bad}))
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert headers["x-sim-kv-transfer"] == "none" and float(headers["x-sim-kv-transfer-ms"]) == 0.0
        assert (
            "malformed kv_transfer_params" in headers["x-sim-warning"] and field in headers["x-sim-warning"]
        )
        dm = await metrics(http, decode)
        assert dm["sim:kv_recomputes_total"] == 1
        assert (await metrics(http, prefill))["sim:kv_held_requests"] == 1  # nobody pulled it


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_unreachable_prefill_streams_by_policy(http, unused_tcp_port: int, policy: str) -> None:
    """``fail``: a 200 stream whose only event is vLLM's error, then ``[DONE]`` (as vLLM 0.32 answers
    a streaming request whose KV load failed); ``recompute``: the decode prefills and streams."""
    async with cluster([EngineSpec("decode", "g1")], config=kv(kv_load_failure_policy=policy)) as [decode]:
        params = {**PREFILL_LEG, "do_remote_decode": False, "do_remote_prefill": True}
        params.update(
            remote_engine_id="e", remote_block_ids=[[1]], remote_host="127.0.0.1", remote_port=unused_tcp_port
        )
        async with http.post(decode.url + "/v1/completions", json=decode_body(params, stream=True)) as resp:
            assert resp.status == 200 and resp.headers["x-sim-kv-transfer"] == "none"
            text = await resp.text()
        if policy == "fail":
            error = {
                "message": "Internal server error",
                "type": "InternalServerError",
                "param": None,
                "code": 500,
            }
            assert text == f"data: {json.dumps({'error': error}, separators=(',', ':'))}\n\ndata: [DONE]\n\n"
            return
        assert "unreachable" in resp.headers["x-sim-warning"]
        assert text.endswith("data: [DONE]\n\n")


async def test_sidecar_pull_releases_the_held_blocks(http) -> None:
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]) as [prefill, decode]:
        hdr = {"x-prefiller-host-port": prefill.address, "X-Request-Id": "side-1"}
        status, headers, _ = await post(http, decode, {"prompt": PROMPT, "max_tokens": 3}, headers=hdr)
        assert status == 200 and headers["x-sim-kv-transfer"] == "cross_group"  # no EDS file: unknown
        assert headers["x-sim-prefill-engine"] == prefill.address
        m = await metrics(http, prefill)
        assert idle(m) and m["sim:remote_prefills_total"] == 1


async def test_decode_heartbeats_keep_the_prefills_lease_while_it_queues(http) -> None:
    """A NIXL decode request queued longer than the lease still pulls: its heartbeats (every lease/6)
    keep renewing the prefill's hold (vLLM 0.32 ``_send_heartbeats`` / ``_handle_heartbeat``).

    The lease is 90 model s (0.9 wall s), not the default 30: a heartbeat renews it to 2/3 of a lease
    from when the prefill takes it, so each may arrive half a lease (0.45 wall s) late, which a loaded
    machine's loop takes."""
    lease = 90.0
    slow = TimingConfig(time_scale=0.01, max_batch=1, decode_step_ms=1000.0)  # one token per model s
    specs = [EngineSpec("prefill", "g1", timing=FAST), EngineSpec("decode", "g1")]
    async with cluster(specs, config=kv(kv_lease_s=lease), timing=slow) as [prefill, decode]:
        _, _, first = await prefill_leg(http, prefill, request_id="hb-1")
        busy = asyncio.create_task(post(http, decode, {"prompt": "abcd", "max_tokens": 250}))  # 250 model s
        await until(http, decode, lambda m: m["vllm:num_requests_running"] == 1)
        status, headers, _ = await post(http, decode, decode_body(first["kv_transfer_params"]))
        assert status == 200 and headers["x-sim-prefill-engine"] == prefill.address
        assert float(headers["x-sim-queue-ms"]) > 2 * lease * 1000  # waited longer than two leases
        assert (await busy)[0] == 200
        m = await metrics(http, prefill)
        assert m["sim:kv_holds_expired_total"] == 0 and idle(m)


# --- vLLM upstream MooncakeConnector ---------------------------------------------------------------

MOONCAKE = kv(kv_connector="mooncake")


def mooncake_leg(transfer_id: str) -> dict:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


def mooncake_decode(prefill: RunningEngine, transfer_id: str, engine_id: str | None = None) -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": f"http://{prefill.address}",
        "remote_engine_id": engine_id or prefill.engine.engine_id,
    }


async def test_mooncake_bootstrap_server_answers_its_engine_ids(http) -> None:
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], config=MOONCAKE) as engines:
        prefill, decode = engines
        async with http.get(prefill.url + "/query") as resp:
            assert resp.status == 200
            worker = {"0": {"0": prefill.address}}
            assert await resp.json() == {"0": {"engine_id": prefill.engine.engine_id, "worker_addr": worker}}
        async with http.get(decode.url + "/query") as resp:
            assert resp.status == 404


@pytest.mark.parametrize("decode_first", [True, False])
async def test_mooncake_legs_meet_by_transfer_id_in_either_order(http, tmp_path: Path, decode_first) -> None:
    specs = [EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]
    async with cluster(specs, tmp_path / "eds.json", MOONCAKE) as [prefill, decode]:
        leg = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": mooncake_leg("xfer-1")}
        to_decode = post(http, decode, decode_body(mooncake_decode(prefill, "xfer-1")))
        to_prefill = post(http, prefill, leg)
        if decode_first:
            d = asyncio.create_task(to_decode)
            await until(http, decode, lambda m: m["vllm:num_requests_waiting"] == 1)  # pulling, waiting
            p = await to_prefill
            d = await d
        else:
            p = await to_prefill
            d = await to_decode
        status, _, body = p
        assert status == 200 and "kv_transfer_params" not in body  # vLLM's Mooncake prefill returns none
        status, headers, body = d
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert (
            headers["x-sim-kv-transfer"] == "same_group"
            and headers["x-sim-prefill-engine"] == prefill.address
        )
        assert "x-sim-warning" not in headers
        assert idle(await metrics(http, prefill))


@pytest.mark.parametrize(
    ("case", "says"),
    [("engine-id", "not found from bootstrap server"), ("no-prefill", "holds no KV of transfer")],
)
@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_mooncake_load_failures_follow_the_policy(http, case, says, policy) -> None:
    """An engine id the bootstrap server does not list, or a transfer no prefill request brings within
    ``mooncake_abort_timeout_s``: the decode's policy decides."""
    config = kv(kv_connector="mooncake", kv_load_failure_policy=policy, mooncake_abort_timeout_s=2.0)
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], config=config) as [
        prefill,
        decode,
    ]:
        params = mooncake_decode(prefill, "xfer-9", "sim-other" if case == "engine-id" else None)
        status, headers, body = await post(http, decode, decode_body(params))
        dm = await metrics(http, decode)
        if policy == "fail":
            assert status == 500 and body["error"]["message"] == "Internal server error"
            assert dm["sim:kv_load_failures_total"] == 1
        else:
            assert (
                status == 200 and headers["x-sim-kv-transfer"] == "none" and says in headers["x-sim-warning"]
            )
            assert dm["sim:kv_recomputes_total"] == 1


@pytest.mark.parametrize(
    ("params", "extra", "held"),
    [
        (mooncake_leg("xfer-2"), {}, 1),
        ({"do_remote_decode": True, "do_remote_prefill": False}, {}, 0),  # "Missing transfer_id"
        (mooncake_leg("xfer-3"), {"sim_output_tokens": 1}, 0),  # a stop hands nothing off
    ],
    ids=["held", "no-transfer-id", "stop"],
)
async def test_mooncake_prefill_holds_only_a_length_capped_transfer(http, params, extra, held) -> None:
    async with cluster([EngineSpec("prefill", "g1")], config=MOONCAKE) as [prefill]:
        leg = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": params, **extra}
        status, _, body = await post(http, prefill, leg)
        assert status == 200 and "kv_transfer_params" not in body
        assert (await metrics(http, prefill))["sim:kv_held_requests"] == held


async def test_mooncake_malformed_decode_params_are_recomputed(http) -> None:
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], config=MOONCAKE) as engines:
        prefill, decode = engines
        for bad in (
            {"transfer_id": None},
            {"remote_bootstrap_addr": prefill.address},
            {"remote_engine_id": 3},
        ):
            params = {**mooncake_decode(prefill, "xfer-4"), **bad}
            status, headers, _ = await post(http, decode, decode_body(params))
            assert status == 200 and "malformed kv_transfer_params" in headers["x-sim-warning"]


# --- SGLang bootstrap ------------------------------------------------------------------------------


def bootstrap_body(prefill: RunningEngine, room: int, **extra: object) -> dict:
    return {
        "prompt": PROMPT,
        "max_tokens": 5,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.port,
        "bootstrap_room": room,
        **extra,
    }


@pytest.mark.parametrize("decode_first", [True, False])
async def test_bootstrap_rendezvous_in_either_order(http, tmp_path: Path, decode_first: bool) -> None:
    specs = [EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]
    async with cluster(specs, tmp_path / "eds.json") as [prefill, decode]:
        body = bootstrap_body(prefill, 2**63 - 1)
        first, second = (decode, prefill) if decode_first else (prefill, decode)
        first_task = asyncio.create_task(post(http, first, body))
        await until(http, prefill, lambda m: m["sim:bootstrap_rooms"] == 1)
        if not decode_first:
            # SGLang's bootstrap queue: the prefill is not admitted before its decode registered
            assert (await metrics(http, prefill))["vllm:prompt_tokens_total"] == 0
        second_result = await post(http, second, body)
        first_result = await asyncio.wait_for(first_task, DEADLINE_S)
        (p_status, p_headers, p_body), (d_status, d_headers, d_body) = (
            (second_result, first_result) if decode_first else (first_result, second_result)
        )
        assert p_status == 200 and p_body["usage"] == {
            "prompt_tokens": 40,
            "completion_tokens": 1,
            "total_tokens": 41,
        }
        assert "kv_transfer_params" not in p_body and p_headers["x-sim-kv-transfer"] == "none"
        assert d_status == 200 and d_body["usage"]["completion_tokens"] == 5
        assert (
            d_headers["x-sim-kv-transfer"] == "same_group"
            and d_headers["x-sim-prefill-engine"] == prefill.address
        )
        assert d_headers["x-sim-prefill-group"] == "g1" and "x-sim-warning" not in d_headers
        assert float(d_headers["x-sim-kv-transfer-ms"]) == pytest.approx(
            KvConfig().unloaded_transfer_ms(40, same_group=True), rel=1e-3
        )
        pm = await metrics(http, prefill)
        assert idle(pm) and pm["vllm:prompt_tokens_total"] == 40 and pm["sim:remote_prefills_total"] == 1
        dm = await metrics(http, decode)
        assert dm["vllm:prompt_tokens_total"] == 40 and dm["sim:kv_transfers_total{same_group}"] == 1


async def test_bootstrap_cross_group_streams_with_ground_truth_headers(http, tmp_path: Path) -> None:
    specs = [EngineSpec("prefill", "g2"), EngineSpec("decode", "g1")]
    async with cluster(specs, tmp_path / "eds.json") as [prefill, decode]:
        body = bootstrap_body(prefill, 7, stream=True)

        async def stream_decode() -> tuple[dict[str, str], str]:
            async with http.post(decode.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                return dict(resp.headers), await resp.text()

        (headers, text), (p_status, _, _) = await asyncio.gather(
            stream_decode(), post(http, prefill, {**body, "stream": False})
        )
        assert p_status == 200 and text.endswith("data: [DONE]\n\n")
        assert headers["x-sim-kv-transfer"] == "cross_group" and headers["x-sim-prefill-group"] == "g2"
        assert headers["x-sim-prefill-engine"] == prefill.address
        assert float(headers["x-sim-kv-transfer-ms"]) == pytest.approx(
            KvConfig().unloaded_transfer_ms(40, same_group=False), rel=0.05
        )
        assert idle(await metrics(http, prefill))


@pytest.mark.parametrize("stream", [False, True])
async def test_bootstrap_decode_fails_when_no_prefill_comes(http, stream: bool) -> None:
    config = kv(bootstrap_timeout_s=20.0)  # 200 wall ms
    async with cluster([EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")], config=config) as [
        prefill,
        decode,
    ]:
        status, headers, body = await post(http, decode, bootstrap_body(prefill, 11, stream=stream))
        assert status == 502 and headers["Content-Type"].startswith("application/json")
        message = body["error"]["message"]  # the decode's own wait or the bootstrap server's, both 20 s
        assert body["error"]["code"] == 502 and "room 11" in message and "within 20 model s" in message
        await until(http, prefill, idle)  # the room is gone once the bootstrap server's wait ended
        assert (await metrics(http, decode))["vllm:kv_cache_usage_perc"] == 0


async def test_bootstrap_prefill_fails_when_no_decode_comes(http) -> None:
    config = kv(bootstrap_timeout_s=20.0)
    async with cluster([EngineSpec("prefill", "g1")], config=config) as [prefill]:
        status, _, body = await post(http, prefill, bootstrap_body(prefill, 12, stream=False))
        assert status == 500 and body["error"]["code"] == 500
        assert "no decode registered for bootstrap room 12 within 20 model s" in body["error"]["message"]
        m = await metrics(http, prefill)
        assert idle(m) and m["vllm:prompt_tokens_total"] == 0


async def test_bootstrap_prefill_fails_when_its_decode_gives_up(http) -> None:
    """The decode's 20 s wait ends first: its prefill queues behind a request running 60 model s."""
    slow = TimingConfig(time_scale=0.01, max_batch=1, decode_step_ms=1000.0)
    config = kv(bootstrap_timeout_s=20.0)
    specs = [EngineSpec("prefill", "g1"), EngineSpec("decode", "g1")]
    async with cluster(specs, config=config, timing=slow) as [prefill, decode]:
        blocker = asyncio.create_task(post(http, prefill, {"prompt": "abcd", "max_tokens": 60}))
        await until(http, prefill, lambda m: m["vllm:num_requests_running"] == 1)
        body = bootstrap_body(prefill, 13)
        (d_status, _, d_body), (p_status, _, p_body) = await asyncio.gather(
            post(http, decode, body), post(http, prefill, body)
        )
        assert d_status == 502 and "within 20 model s" in d_body["error"]["message"]
        assert p_status == 500 and "gave up" in p_body["error"]["message"]
        assert (await blocker)[0] == 200
        assert idle(await metrics(http, prefill))


async def test_bootstrap_prompt_too_big_for_the_prefill_fails_both_sides(http) -> None:
    tiny = TimingConfig(time_scale=0.01, kv_capacity_tokens=32)
    async with cluster([EngineSpec("prefill", "g1", timing=tiny), EngineSpec("decode", "g1")]) as engines:
        prefill, decode = engines
        body = bootstrap_body(prefill, 21)
        (d_status, _, d_body), (p_status, _, p_body) = await asyncio.gather(
            post(http, decode, body), post(http, prefill, body)
        )
        assert p_status == 400 and "KV" in p_body["error"]["message"]
        assert d_status == 502 and "bootstrap room 21 failed" in d_body["error"]["message"]
        assert idle(await metrics(http, prefill))


async def test_bootstrap_server_unreachable_or_not_a_prefill(http, unused_tcp_port: int) -> None:
    async with cluster([EngineSpec("decode", "g1"), EngineSpec("decode", "g1")]) as [decode, other]:
        body = {**bootstrap_body(other, 3), "bootstrap_port": unused_tcp_port}
        status, _, reply = await post(http, decode, body)
        assert status == 502 and "unreachable" in reply["error"]["message"]
        status, _, reply = await post(http, decode, bootstrap_body(other, 3))
        assert status == 502 and "without a bootstrap server" in reply["error"]["message"]


async def test_role_both_ignores_bootstrap_fields_and_bad_fields_are_400(http, unused_tcp_port: int) -> None:
    async with cluster([EngineSpec("both", "g1"), EngineSpec("decode", "g1")]) as [both, decode]:
        body = {**bootstrap_body(both, 1), "bootstrap_port": unused_tcp_port}
        status, headers, reply = await post(http, both, body)
        assert status == 200 and headers["x-sim-kv-transfer"] == "none"
        assert reply["usage"]["completion_tokens"] == 5
        for bad in (
            {"bootstrap_room": -1},
            {"bootstrap_room": "1"},
            {"bootstrap_port": 0},
            {"bootstrap_host": ""},
        ):
            status, _, reply = await post(http, decode, {**bootstrap_body(both, 1), **bad})
            assert status == 400 and reply["error"]["param"] == next(iter(bad))
        status, _, reply = await post(http, decode, {"prompt": "abcd", "bootstrap_room": 5})
        assert status == 400 and reply["error"]["param"] == "bootstrap_host"


# --- cluster helpers and CLI ---------------------------------------------------------------------


async def test_cluster_eds_files_carry_the_prefills_bootstrap_port(tmp_path: Path) -> None:
    async with cluster(
        [EngineSpec("prefill", "g1"), EngineSpec("decode", "g1"), EngineSpec("both", "g1")]
    ) as es:
        assert [s.bootstrap_port for s in endpoint_specs(es)] == [es[0].port, None, None]
    infos = [
        EngineInfo("127.0.0.1:9001", "prefill", "g", 64, 9001),
        EngineInfo("127.0.0.1:9002", "decode", "g", 64),
    ]
    write_cluster_eds(infos, tmp_path / "p.json", tmp_path / "d.json")
    [prefill] = load_eds_file(tmp_path / "p.json", namespace="pd").endpoints
    [decode] = load_eds_file(tmp_path / "d.json", namespace="pd").endpoints
    assert (prefill.bootstrap_port, decode.bootstrap_port) == (9001, None)


def parse_sim_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", "--role", "prefill", "--group", "g", *argv])


def test_cli_exposes_the_handoff_timeouts_connector_and_policy() -> None:
    argv = ["--kv-lease-s", "12.5", "--mooncake-abort-timeout-s", "9", "--bootstrap-timeout-s", "7"]
    argv += ["--kv-connector", "mooncake", "--kv-load-failure-policy", "recompute"]
    kv = config_from_args(parse_sim_args(argv)).kv
    assert (kv.kv_lease_s, kv.mooncake_abort_timeout_s, kv.bootstrap_timeout_s) == (12.5, 9.0, 7.0)
    assert (kv.kv_connector, kv.kv_load_failure_policy) == ("mooncake", "recompute")
    defaults = config_from_args(parse_sim_args([])).kv
    assert (defaults.kv_lease_s, defaults.mooncake_abort_timeout_s, defaults.bootstrap_timeout_s) == (
        30.0,
        480.0,
        300.0,
    )
    assert (defaults.kv_connector, defaults.kv_load_failure_policy) == ("nixl", "fail")
    for bad in ({"bootstrap_timeout_s": 0.0}, {"kv_lease_s": -1.0}, {"kv_connector": "lmcache"}):
        with pytest.raises(ValueError):
            KvConfig(**bad)
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KvConfig(kv_load_failure_policy="retry")
