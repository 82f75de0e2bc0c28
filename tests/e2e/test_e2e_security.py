"""Security end to end through the real Envoy: what a client sends cannot steer an engine's handoff;
Envoy reaches pd-extproc over mutual TLS with the cluster settings of docs/operations.md, and nothing
else does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import yaml
from builders import endpoint
from e2e_harness import gateway_over, stack
from polling import until
from steering import CHAT, INJECTED

from ext_proc.endpoints import EndpointSpec
from standins.backends import start_backend, start_scripted_prefill
from standins.certs import Certificates, Pair, make_certificates

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


async def test_sidecar_mode_delivers_the_body_without_client_handoff_fields(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        (decode,) = s.decodes.values()
        for body in ({**CHAT, **INJECTED}, CHAT):
            async with session.post(f"{s.gateway.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                assert response.headers["x-seen-prefiller"] in s.prefills
        assert [seen["body"] for seen in decode.requests] == [CHAT, CHAT]


@pytest.mark.parametrize("mode", ["kv-transfer-params", "sglang-bootstrap"])
async def test_requests_sharing_client_ids_keep_their_own_transfer_ids_and_charges(tmp_path, mode):
    """Two clients send the same ``X-Request-Id`` and ``bootstrap_room``: each request's legs carry ids
    the gateway made, distinct from each other and from the client's, and the second request's end
    releases one charge (charges belong to the ext_proc stream, not to any client value: keyed by the
    client's id, the two would have been one)."""
    params = {"kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1]}}
    prefill = await start_scripted_prefill(200, json.dumps(params).encode())
    decode = await start_backend()
    specs = ([endpoint(prefill.address, "a")], [_healthy(decode.address)])
    sent = {"x-request-id": "client-chosen"}
    body = {**CHAT, "bootstrap_room": 7}
    try:
        async with (
            gateway_over(tmp_path, *specs, {"handoff.mode": mode}) as g,
            aiohttp.ClientSession() as session,
        ):
            url = f"{g.gateway.url}/v1/chat/completions"

            async def load() -> int:
                async with session.get(f"{g.admin_url}/debug/endpoints") as response:
                    return sum(r["active_requests"] for r in await response.json() if r["role"] == "decode")

            async def load_is(expected: int) -> bool:
                return await load() == expected

            async def stream(delay_ms: int) -> bytes:
                sent_slowly = {**sent, "x-test-delay-ms": str(delay_ms)}  # before each of 3 chunks
                async with session.post(url, json={**body, "stream": True}, headers=sent_slowly) as response:
                    assert response.status == 200, await response.text()
                    return await response.read()

            first = asyncio.create_task(stream(400))
            second = asyncio.create_task(stream(100))
            await until(lambda: load_is(2))  # two charges: nothing merged them by the client's ids
            assert (await second).endswith(b"data: [DONE]\n\n")
            await until(lambda: load_is(1))
            assert (await first).endswith(b"data: [DONE]\n\n")
            await until(lambda: load_is(0))
            await until(lambda: len(prefill.legs) == 2)
    finally:
        await prefill.stop()
        await decode.stop()
    ids = {seen["x-request-id"] for seen in decode.requests} | {h["x-request-id"] for h, _ in prefill.legs}
    assert len(ids) == 2 and "client-chosen" not in ids
    if mode == "sglang-bootstrap":
        rooms = [seen["body"]["bootstrap_room"] for seen in decode.requests]
        assert len(set(rooms)) == 2 and 7 not in rooms
        assert sorted(rooms) == sorted(leg["bootstrap_room"] for _, leg in prefill.legs)


STEERING = {
    "x-encoder-hosts-ports": "10.9.9.9:1",
    "x-kv-cache-source-host-port": "10.9.9.9:2",
    "x-data-parallel-host-port": "10.9.9.9:3",
    "x-data-parallel-rank": "7",
    "prefer": "if-available",
}


def _without_early_mutation(bootstrap: dict) -> None:
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                network_filter["typed_config"].pop("early_header_mutation_extensions", None)


@pytest.mark.parametrize("layer", ["both", "pd-extproc-alone"])
async def test_no_steering_header_a_client_sends_reaches_an_engine(tmp_path, layer):
    """A client's sidecar- and engine-steering headers are gone at the decode: removed by Envoy's
    early header mutation and, with it deleted from the bootstrap, by pd-extproc's own answer."""
    prefill, decode = await start_backend(), await start_backend()
    specs = ([_healthy(prefill.address)], [_healthy(decode.address)])
    edit = _without_early_mutation if layer == "pd-extproc-alone" else None
    try:
        async with gateway_over(tmp_path, *specs, edit=edit) as g, aiohttp.ClientSession() as session:
            url = f"{g.gateway.url}/v1/chat/completions"
            async with session.post(url, json=CHAT, headers=STEERING) as response:
                assert response.status == 200, await response.text()
                assert response.headers["x-served-by"] == decode.address
        (seen,) = [r for r in decode.requests if r["path"] == "/v1/chat/completions"]
        assert seen["x-seen-prefiller"] == prefill.address
        assert {name.lower() for name in seen["headers"]}.isdisjoint(STEERING)
    finally:
        await prefill.stop()
        await decode.stop()


def _healthy(address: str) -> EndpointSpec:
    return endpoint(address, "a")


def readme_transport_socket(certificates: Certificates, client: Pair) -> dict:
    """The ``transport_socket`` snippet of docs/operations.md for the ``pd_extproc`` cluster, with the
    test's files."""
    text = OPERATIONS.read_text(encoding="utf-8").partition("## TLS between Envoy and pd-extproc")[2]
    snippet = yaml.safe_load(text.partition("```yaml\n")[2].partition("```")[0])
    rendered = json.dumps(snippet)
    for placeholder, path in (
        ("/etc/pd-extproc/tls/envoy.crt", client.cert),
        ("/etc/pd-extproc/tls/envoy.key", client.key),
        ("/etc/pd-extproc/tls/ca.crt", certificates.ca.cert),
    ):
        assert placeholder in rendered
        rendered = rendered.replace(placeholder, str(path))
    return json.loads(rendered)


def over_tls(transport_socket: dict) -> Callable[[dict], None]:
    """A bootstrap edit giving the ``pd_extproc`` cluster ``transport_socket``."""

    def edit(bootstrap: dict) -> None:
        (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "pd_extproc"]
        cluster.update(transport_socket)

    return edit


@pytest.mark.parametrize("client", ["envoy", "envoy-ads", "plaintext", "other-ca"])
async def test_envoy_reaches_pd_extproc_only_over_mutual_tls_with_a_certificate_from_its_ca(tmp_path, client):
    c = make_certificates(tmp_path / "certs")
    socket = {
        "envoy": readme_transport_socket(c, c.client),
        "envoy-ads": readme_transport_socket(c, c.client),  # the endpoints too come over that cluster
        "plaintext": None,
        "other-ca": readme_transport_socket(c, c.stranger),
    }[client]
    admitted = client.startswith("envoy")
    settings = {
        "tls.cert_file": str(c.server.cert),
        "tls.key_file": str(c.server.key),
        "tls.client_ca_file": str(c.ca.cert),
    }
    decode = await start_backend()
    prefill = await start_backend()
    specs = [endpoint(b.address, "a") for b in (prefill, decode)]
    try:
        async with (
            gateway_over(
                tmp_path,
                specs[:1],
                specs[1:],
                settings,
                edit=over_tls(socket) if socket else None,
                ads=client == "envoy-ads",
            ) as g,
            aiohttp.ClientSession() as session,
            session.post(f"{g.gateway.url}/v1/chat/completions", json=CHAT) as response,
        ):
            answer = await response.json()
            if admitted:
                assert response.status == 200, answer
                assert response.headers["x-served-by"] == decode.address
                assert response.headers["x-seen-prefiller"] == prefill.address
            else:
                assert response.status == 503, answer
                assert answer["error"]["code"] == "routing_unavailable"
        assert len(decode.requests) == (1 if admitted else 0)
    finally:
        await decode.stop()
        await prefill.stop()
