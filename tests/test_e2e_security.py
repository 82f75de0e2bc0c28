"""Security end to end through the real Envoy: what a client sends cannot steer an engine's handoff;
Envoy reaches pd-extproc over mutual TLS with the README's cluster settings, and nothing else does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import yaml
from backends import start_backend
from certs import Certificates, Pair, make_certificates
from e2e_harness import gateway_over, stack
from test_security import CHAT, INJECTED

from ext_proc.discovery.eds import EndpointSpec

README = Path(__file__).resolve().parents[1] / "README.md"


async def test_sidecar_mode_delivers_the_body_without_client_handoff_fields(tmp_path):
    async with stack(tmp_path, ["a"], ["a"]) as s, aiohttp.ClientSession() as session:
        (decode,) = s.decodes.values()
        for body in ({**CHAT, **INJECTED}, CHAT):
            async with session.post(f"{s.gateway.url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                assert response.headers["x-seen-prefiller"] in s.prefills
        assert [seen["body"] for seen in decode.requests] == [CHAT, CHAT]


def readme_transport_socket(certificates: Certificates, client: Pair) -> dict:
    """The README's ``transport_socket`` snippet for the ``pd_extproc`` cluster, with the test's files."""
    text = README.read_text(encoding="utf-8").partition("## TLS between Envoy and pd-extproc")[2]
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
    specs = [EndpointSpec(b.address, "a", None, True, "HEALTHY") for b in (prefill, decode)]
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
