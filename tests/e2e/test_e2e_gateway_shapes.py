"""pd-extproc as the endpoint picker behind the gateways that run an InferencePool: the real Envoy 1.40 in
each gateway's shape (``tests/deploy/gateway_shapes/``, bound to local ports by :func:`shapes.render_shape`),
``pd-extproc serve`` started as a process over TLS with a self-signed certificate (every shape dials the
picker over TLS without verifying it), scripted prefill engines and echo decode engines, and the OpenAI
SDK unchanged.

One Envoy and one pd-extproc per shape (module scope); pd-extproc is restarted with other settings only
where a test needs them (handoff modes, the fallback list). Each shape's pool cluster lists every model
server, prefills included, as the InferencePool selects them. Every test ends with no load left in
pd-extproc.

The endpoint-subset hint: no shape sends one that reaches the picker (GIE's reference and AI Gateway set
none; Istio forwards only ``envoy.lb``; kgateway puts it in the route's ``metadata_match``, which ext_proc
does not forward). So it is injected as GIE's own tests give it to the picker, as ext_proc request
metadata (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``): on extra copies of the
shape's listener, a ``set_metadata`` filter before ext_proc sets it, and ext_proc forwards that
namespace. The shape's own listener is unchanged.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from builders import endpoint
from e2e_harness import wait_idle

from ext_proc.discovery.eds import write_eds_file
from sim.gateway import free_port
from standins.metrics import by_outcome
from standins.shapes import (
    CLUSTER_KIND,
    EXT_PROC_TYPE,
    KV_PARAMS,
    SHAPES,
    RenderedShape,
    ShapeStack,
    nodes,
    shape_stack,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

MESSAGES = [{"role": "user", "content": "tell me about KV caches"}]


def _subset_listener(listener: dict, name: str, subset: list[str]) -> dict:
    """A copy of the shape's gateway ``listener``, named ``<its name>-<name>``, on a free port, whose
    requests carry ``subset`` as the endpoint-subset hint in ext_proc's request metadata."""
    copied = copy.deepcopy(listener)
    copied["name"] = f"{listener['name']}-{name}"
    copied["address"]["socket_address"]["port_value"] = free_port()
    hcm = copied["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    index = next(i for i, f in enumerate(filters) if f["typed_config"]["@type"] == EXT_PROC_TYPE)
    options = filters[index]["typed_config"].setdefault("metadata_options", {})
    options.setdefault("forwarding_namespaces", {}).setdefault("untyped", []).append("envoy.lb.subset_hint")
    hint = {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [
                {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "value": {"x-gateway-destination-endpoint-subset": subset},
                }
            ],
        },
    }
    filters.insert(index, hint)
    return copied


DEAD_MEMBER: dict[str, str] = {}
"""Per override_host shape, the pool member no engine listens on (see :func:`_edit`)."""


def _edit(rendered: RenderedShape, prefills: list[str], decodes: list[str]) -> None:
    """Beside the shape's own listener: ``only-decode`` (the subset is the second decode) and
    ``only-prefill`` (the first prefill: no decode in it); for kgateway, ``route-hint``: its own subset
    hint (the route's ``metadata_match``) narrowed to the second decode. An override_host pool also
    gets a member that refuses connections (a pod whose engine died, :data:`DEAD_MEMBER`), which
    pd-extproc does not know unless a test tells it."""
    listeners = rendered.config["static_resources"]["listeners"]
    own = next(e for e in listeners if e["address"]["socket_address"]["port_value"] == rendered.listen_port)
    listeners.append(_subset_listener(own, "only-decode", [decodes[1]]))
    listeners.append(_subset_listener(own, "only-prefill", [prefills[0]]))
    if CLUSTER_KIND[rendered.shape] == "subset":  # kgateway's own hint, narrowed to one decode
        narrowed = copy.deepcopy(own)
        narrowed["name"] = f"{own['name']}-route-hint"
        narrowed["address"]["socket_address"]["port_value"] = free_port()
        for node in nodes(narrowed):
            if isinstance(node, dict) and "x-gateway-destination-endpoint-subset" in node:
                node["x-gateway-destination-endpoint-subset"] = [decodes[1]]
        listeners.append(narrowed)
    if CLUSTER_KIND[rendered.shape] != "override_host":
        return
    DEAD_MEMBER[rendered.shape] = dead = f"127.0.0.1:{free_port()}"
    for cluster in rendered.config["static_resources"]["clusters"]:
        members = [n for n in nodes(cluster) if isinstance(n, dict) and "endpoint" in n]
        if decodes[0] in {_address(m["endpoint"]["address"]["socket_address"]) for m in members}:
            member = copy.deepcopy(members[0])
            host, _, port = dead.rpartition(":")
            member["endpoint"]["address"]["socket_address"] = {"address": host, "port_value": int(port)}
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"].append(member)


def _address(socket: dict) -> str:
    return f"{socket['address']}:{socket['port_value']}"


def _listener_url(stack: ShapeStack, name: str) -> str:
    listener = next(
        e for e in stack.config["static_resources"]["listeners"] if e["name"].endswith(f"-{name}")
    )
    return f"http://127.0.0.1:{listener['address']['socket_address']['port_value']}"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=SHAPES)
async def stack(request, tmp_path_factory) -> AsyncIterator[ShapeStack]:
    async with shape_stack(request.param, tmp_path_factory.mktemp(request.param), _edit) as stack:
        yield stack


@pytest_asyncio.fixture(loop_scope="module")
async def gw(request, stack: ShapeStack) -> AsyncIterator[ShapeStack]:
    """``stack`` with pd-extproc running with the base settings, updated by the test's indirect
    parameter if it has one (dotted keys), and the engines' records cleared; afterwards no load may
    be left."""
    await stack.picker(getattr(request, "param", None))
    stack.clear()
    yield stack
    async with aiohttp.ClientSession() as session:
        assert await wait_idle(session, stack.admin_url) == []


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0)


async def _generate(client: openai.AsyncOpenAI, kind: str, stream: bool) -> str:
    """One request through the SDK; the generated text."""
    if kind == "chat":
        answer = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4, stream=stream
        )
        if stream:
            return "".join([c.choices[0].delta.content or "" async for c in answer])
        return answer.choices[0].message.content
    answer = await client.completions.create(
        model="m", prompt="tell me about KV caches", max_tokens=4, stream=stream
    )
    if stream:
        return "".join([c.choices[0].text async for c in answer])
    return answer.choices[0].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_openai_sdk_requests_go_to_a_decode_of_the_prefills_group(gw: ShapeStack, stream: bool):
    async with _client(gw.url) as client:
        for kind in ("chat", "completions"):
            for _ in range(3):
                text = await _generate(client, kind, stream)
                assert text.startswith("Hello from 127.0.0.1:"), text
    served = gw.served()
    assert len(served) == 6
    prefills = {p.address for p in gw.prefills}
    for record in served:
        assert record["x-seen-destination"].split(",")[0] == record["served_by"]  # the one, or first, named
        assert record["x-seen-prefiller"] in prefills
        assert gw.group_of[record["x-seen-prefiller"]] == gw.group_of[record["served_by"]]
    assert not any(p.legs for p in gw.prefills)  # sidecar: no client request reached a prefill


async def test_a_150_kb_body_reaches_the_decode_byte_for_byte(gw: ShapeStack):
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "long prompt " * 12_500}], "max_tokens": 4}
    ).encode()
    assert len(body) > 150_000  # several ext_proc body chunks in FULL_DUPLEX_STREAMED
    async with aiohttp.ClientSession() as session:
        headers = {"content-type": "application/json"}
        async with session.post(f"{gw.url}/v1/chat/completions", data=body, headers=headers) as response:
            assert response.status == 200, await response.text()
    (record,) = gw.served()
    assert record["raw"] == body


async def test_get_models_goes_to_a_decode(gw: ShapeStack):
    async with aiohttp.ClientSession() as session, session.get(f"{gw.url}/v1/models") as response:
        assert response.status == 200
        assert (await response.json())["data"][0]["id"] == "test"
        assert response.headers["x-served-by"] in {d.address for d in gw.decodes}


async def test_malformed_json_is_answered_400_openai_json(gw: ShapeStack):
    async with aiohttp.ClientSession() as session:
        headers = {"content-type": "application/json"}
        async with session.post(
            f"{gw.url}/v1/chat/completions", data=b'{"model": "m", "messages": [', headers=headers
        ) as response:
            assert response.status == 400
            assert response.content_type == "application/json"
            error = (await response.json())["error"]
    assert error["code"] == "invalid_request"
    assert error["type"] == "invalid_request_error"
    assert gw.served() == [] and not any(p.legs for p in gw.prefills)


async def test_the_subset_hint_restricts_the_decode(gw: ShapeStack):
    only_decode, only_prefill = _listener_url(gw, "only-decode"), _listener_url(gw, "only-prefill")
    async with _client(only_decode) as client:
        for stream in (False, True):
            for kind in ("chat", "completions"):
                assert await _generate(client, kind, stream) == f"Hello from {gw.decodes[1].address}"
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "messages": MESSAGES}
        async with session.post(f"{only_prefill}/v1/chat/completions", json=body) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == "no_endpoint_in_subset"
    assert {r["served_by"] for r in gw.served()} == {gw.decodes[1].address}


@pytest.mark.parametrize("stack", ["kgateway"], indirect=True)
async def test_kgateways_own_subset_hint_never_reaches_the_picker(stack, gw: ShapeStack):
    """kgateway puts the pool's endpoints in the route's ``metadata_match`` under
    ``envoy.lb.subset_hint``; ext_proc forwards dynamic metadata only, so pd-extproc never sees it:
    narrowed to one decode there, requests still go to both decodes of the prefill's group."""
    async with _client(_listener_url(gw, "route-hint")) as client:
        for _ in range(6):
            assert (await _generate(client, "chat", False)).startswith("Hello from ")
    assert len({r["served_by"] for r in gw.served()}) > 1


@pytest.mark.parametrize("gw", [{"handoff.mode": "kv-transfer-params"}], ids=["kv"], indirect=True)
async def test_kv_transfer_params_runs_the_prefill_leg_direct(gw: ShapeStack):
    async with _client(gw.url) as client:
        for stream in (False, True):
            assert (await _generate(client, "chat", stream)).startswith("Hello from ")
    legs = {headers["x-request-id"]: (p.address, body) for p in gw.prefills for headers, body in p.legs}
    served = gw.served()
    assert len(served) == 2 and len(legs) == 2
    for record in served:
        prefill, leg = legs[record["x-request-id"]]
        assert leg["max_tokens"] == 1 and leg["stream"] is False
        assert record["body"]["kv_transfer_params"] == KV_PARAMS
        assert gw.group_of[prefill] == gw.group_of[record["served_by"]]
    assert sorted(r["body"]["stream"] for r in served) == [False, True]


@pytest.mark.parametrize("gw", [{"handoff.mode": "sglang-bootstrap"}], ids=["sglang"], indirect=True)
async def test_sglang_bootstrap_sends_the_decode_and_the_prefill_the_same_room(gw: ShapeStack):
    for decode in gw.decodes:  # as SGLang's decode waits for the KV: answer once both legs arrived
        decode.answering.clear()
    async with _client(gw.url) as client:
        requests = [asyncio.create_task(_generate(client, "chat", stream)) for stream in (False, True)]
        deadline = time.monotonic() + 10
        while gw.misrouted() < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for decode in gw.decodes:
            decode.answering.set()
        for request in requests:
            assert (await request).startswith("Hello from ")
    rooms = {r["body"]["bootstrap_room"]: r for r in gw.served()}
    legs = [(prefill.address, leg) for prefill in gw.prefills for _, leg in prefill.legs]
    assert len(rooms) == len(legs) == 2
    for prefill, leg in legs:
        decode = rooms[leg["bootstrap_room"]]
        assert decode["body"]["bootstrap_host"] == leg["bootstrap_host"] == "127.0.0.1"
        assert decode["body"]["bootstrap_port"] == leg["bootstrap_port"] == 8998
        assert gw.group_of[prefill] == gw.group_of[decode["served_by"]]


@pytest.mark.parametrize("gw", [{"routing.fallback_count": 2}], ids=["fallback2"], indirect=True)
async def test_a_fallback_list_is_only_for_override_host_clusters(gw: ShapeStack):
    """What ``routing.fallback_count: 2`` does on each cluster kind: the reason it must be 0 where the
    cluster reads the header."""
    statuses = []
    async with aiohttp.ClientSession() as session:
        for _ in range(10):
            body = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as response:
                statuses.append(response.status)
    served, misrouted_to_prefills = gw.served(), gw.misrouted()
    kind = CLUSTER_KIND[gw.shape]
    if kind == "original_dst":  # "a,b,c" is no address: nothing is forwarded
        assert statuses == [503] * 10
        assert served == [] and misrouted_to_prefills == 0
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{gw.gateway.admin_url}/stats?filter=original_dst_host_invalid") as response,
        ):
            counts = [int(line.rpartition(": ")[2]) for line in (await response.text()).splitlines()]
        assert sum(counts) >= 10  # Envoy: the header holds no valid address
    elif kind == "subset":  # no subset matches a list: any pool endpoint, prefills included
        assert statuses == [200] * 10
        assert misrouted_to_prefills > 0
        assert any(r["x-seen-destination"].split(",")[0] != r["served_by"] for r in served)
    else:  # override_host: the first listed, the others for retries
        assert statuses == [200] * 10
        assert misrouted_to_prefills == 0
        assert all(r["x-seen-destination"].split(",")[0] == r["served_by"] for r in served)
        assert all(len(r["x-seen-destination"].split(",")) == 3 for r in served)


async def _decodes_known(session: aiohttp.ClientSession, stack: ShapeStack, expected: set[str]) -> None:
    """Wait until pd-extproc's decodes are ``expected`` (it polls the EDS files)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with session.get(f"{stack.admin_url}/debug/endpoints") as response:
            if {r["address"] for r in await response.json() if r["role"] == "decode"} == expected:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"pd-extproc's decodes never became {expected}")


@pytest.mark.parametrize("stack", ["istio"], indirect=True)
async def test_istio_reports_the_endpoint_that_served_and_a_retry_moves_the_charge(stack, gw: ShapeStack):
    """Istio's override_host writes ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` and forwards
    ``envoy.lb`` at the response phase: pd-extproc reads it. A decode whose engine died (connections
    refused), ranked first, makes Envoy's retry walk the fallback list: the charge moves to the decode
    that served."""
    decode_eds = Path(gw.base["discovery.eds_files"][1])
    live = [endpoint(d.address, gw.group_of[d.address]) for d in gw.decodes]
    dead = endpoint(DEAD_MEMBER[gw.shape], "a", 10**9)  # least loaded: named first in a
    async with aiohttp.ClientSession() as session:
        before = await by_outcome(session, gw.admin_url, "pd_extproc_served_endpoint_total")
        write_eds_file(decode_eds, "decode", [*live, dead])
        try:
            await _decodes_known(session, gw, {s.address for s in live} | {dead.address})
            async with _client(gw.url) as client:
                for _ in range(4):
                    assert (await _generate(client, "chat", False)).startswith("Hello from ")
        finally:
            write_eds_file(decode_eds, "decode", live)
            await _decodes_known(session, gw, {s.address for s in live})
        after = await by_outcome(session, gw.admin_url, "pd_extproc_served_endpoint_total")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("chosen", "moved", "unknown")}
    moved = [r for r in gw.served() if r["x-seen-destination"].split(",")[0] == dead.address]
    assert moved and all(r["served_by"] != dead.address for r in moved)
    assert delta == {"chosen": 4 - len(moved), "moved": len(moved), "unknown": 0}


async def test_a_plaintext_picker_gets_every_request_refused(gw: ShapeStack):
    """Every shape dials the picker over TLS: pd-extproc in plaintext (its default) fails every
    request, and nothing reaches an engine."""
    await gw.picker({"tls.cert_file": "", "tls.key_file": ""}, through_envoy=False)
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            body = {"model": "m", "messages": MESSAGES}
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as response:
                assert response.status == 500
    assert "WRONG_VERSION_NUMBER" in gw.gateway.log_tail(1000)
    assert gw.served() == [] and gw.misrouted() == 0
