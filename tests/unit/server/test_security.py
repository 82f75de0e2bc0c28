"""Security defaults: client-sent handoff fields never reach an engine (every handoff mode); the admin
endpoint listens on loopback unless configured, and ``/debug/endpoints`` can be switched off; TLS and
mutual TLS on the gRPC port."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from builders import P1, endpoint, make_router
from grpc_health.v1 import health_pb2, health_pb2_grpc
from steering import CHAT, INJECTED
from test_admin import D1, D2, make_registry
from test_admin import P1 as ADMIN_P1

from ext_proc.admin import build_admin_app
from ext_proc.affinity import Cost
from ext_proc.app import RunningServer, build_handoff, start_server
from ext_proc.checks import ConfigError
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.handoff.base import STEERING_HEADERS, DecodeRoute, FailurePolicy, HandoffMode
from ext_proc.handoff.body import HANDOFF_FIELDS, PREFILL_REQUEST_PARAMS, prefill_leg_body
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.kv_transfer import KvTransferParamsHandoff
from ext_proc.handoff.leg import PrefillClient
from ext_proc.handoff.sglang import SglangBootstrapHandoff
from ext_proc.metrics import Metrics
from ext_proc.outcome import HandoffJob, Placement, RequestMeta, Routed
from ext_proc.router import Router, RouterSettings
from ext_proc.server import server_credentials
from ext_proc.tls import TlsConfig, tls_mode
from standins.certs import Certificates, Pair, make_certificates

DECODE = "10.0.1.1:8000"


def sidecar_router(threshold: int) -> Router:
    """One prefill and one decode, sidecar handoff; prompts below ``threshold`` tokens go decode-only."""
    base = make_router([endpoint(P1, "g1")], [endpoint(DECODE, "g1")])
    return Router(
        RouterSettings(16, threshold),
        registry=base.registry,
        policy=base.policy,
        handoff=base.handoff,
        metrics=base.metrics,
    )


def route(router: Router, body: dict[str, object]) -> Routed:
    routed = router.route_body(json.dumps(body).encode(), RequestMeta("/v1/chat/completions"))
    assert isinstance(routed, Routed), routed
    routed.lease.release()
    return routed


@pytest.mark.parametrize("threshold", [0, 10_000], ids=["with-prefill", "decode-only"])
@pytest.mark.parametrize("field", sorted(INJECTED))
def test_sidecar_removes_a_client_handoff_field(threshold, field):
    routed = route(sidecar_router(threshold), {**CHAT, field: INJECTED[field]})
    headers = dict(routed.instructions.set_headers)
    assert ("x-prefiller-host-port" in headers) is (threshold == 0)
    assert routed.instructions.body is not None
    assert json.loads(routed.instructions.body) == CHAT


@pytest.mark.parametrize("threshold", [0, 10_000], ids=["with-prefill", "decode-only"])
def test_sidecar_leaves_a_clean_body_untouched(threshold):
    assert route(sidecar_router(threshold), CHAT).instructions.body is None


def job(body: dict[str, object]) -> HandoffJob:
    return HandoffJob(json.dumps(body).encode(), body, RequestMeta("/v1/completions"), Cost(10, 14), None)


def decode_only(router: Router) -> Placement:
    placed = router._place(Cost(10, 14), router._no_prefills, router.registry.decode_pool, None)
    assert isinstance(placed, Placement) and placed.decision.prefill is None
    return placed


@pytest.mark.parametrize("mode", ["kv-transfer-params", "sglang-bootstrap"])
async def test_engine_handoffs_remove_every_client_handoff_field_when_decode_only(mode):
    router = sidecar_router(0)
    route_ = DecodeRoute("x-gateway-destination-endpoint", "x-prefiller-host-port")
    client = PrefillClient("", route_.destination_header, 1.0)
    metrics = Metrics(router.registry.endpoints)
    kind = KvTransferParamsHandoff if mode == "kv-transfer-params" else SglangBootstrapHandoff
    settings = HandoffConfig(on_prefill_failure=FailurePolicy.DECODE_ONLY, prefill_timeout_seconds=1.0)
    handoff = kind(settings, route=route_, client=client, metrics=metrics)
    placement = decode_only(router)
    try:
        routed = handoff.hand_off(job({**CHAT, **INJECTED}), placement, router)
        assert isinstance(routed, Routed)
        assert routed.instructions.body is not None
        assert json.loads(routed.instructions.body) == CHAT
    finally:
        placement.lease.release()
        await handoff.close()


def test_the_prefill_leg_carries_no_client_handoff_field():
    leg = json.loads(prefill_leg_body({**CHAT, **INJECTED}))
    assert {key: value for key, value in leg.items() if key in HANDOFF_FIELDS} == {
        "kv_transfer_params": PREFILL_REQUEST_PARAMS
    }


def test_handoff_fields_are_the_fields_engines_obey():
    assert set(HANDOFF_FIELDS) == set(INJECTED)


# --- the admin endpoint ---------------------------------------------------------------------------


def test_debug_endpoints_takes_only_a_boolean() -> None:
    assert load_config(None, {"admin.debug_endpoints": False}, environ={}).admin.debug_endpoints is False
    with pytest.raises(ConfigError, match=r"admin\.debug_endpoints: 'no' is not allowed; use true or false"):
        load_config(None, {"admin.debug_endpoints": "no"}, environ={})


@pytest.mark.parametrize("debug_endpoints", [True, False])
async def test_debug_endpoints_can_be_switched_off(debug_endpoints: bool) -> None:
    registry = make_registry()
    app = build_admin_app(registry, Metrics(registry.endpoints), debug_endpoints)
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
        response = await client.get("/debug/endpoints")
        assert response.content_type == "application/json"
        if debug_endpoints:
            assert response.status == 200
            assert [row["address"] for row in await response.json()] == [ADMIN_P1, D1, D2]
        else:
            assert response.status == 404
            error = (await response.json())["error"]
            assert error["code"] == "disabled" and "admin.debug_endpoints" in error["message"]
        queue = await client.get("/debug/queue")  # flow control off: the page says so, or is off too
        assert queue.status == (200 if debug_endpoints else 404)
        if debug_endpoints:
            assert await queue.json() == {"enabled": False}
        assert (await client.get("/metrics")).status == 200
        assert (await client.get("/healthz")).status == 200


# --- TLS on the gRPC port ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tls.cert_file": "s.crt"}, "tls.cert_file and tls.key_file: set both"),
        ({"tls.key_file": "s.key"}, "tls.cert_file and tls.key_file: set both"),
        ({"tls.client_ca_file": "ca.crt"}, "tls.client_ca_file: needs tls.cert_file"),
    ],
)
def test_tls_settings_must_be_complete(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, settings, environ={})


def test_tls_paths_resolve_against_the_config_files_folder(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "pd-extproc.yaml"
    path.parent.mkdir()
    path.write_text("tls: {cert_file: tls/s.crt, key_file: /abs/s.key}\n")
    tls = load_config(str(path), {}, environ={}).tls
    assert (tls.cert_file, tls.key_file, tls.client_ca_file) == (
        str(tmp_path / "conf/tls/s.crt"),
        "/abs/s.key",
        "",
    )
    assert tls_mode(tls) == "TLS"


def test_an_unreadable_tls_file_is_a_config_error(certificates: Certificates, tmp_path: Path) -> None:
    tls = TlsConfig(str(certificates.server.cert), str(tmp_path / "missing.key"))
    with pytest.raises(ConfigError, match=r"tls\.key_file: cannot read .*missing\.key"):
        server_credentials(tls)
    assert server_credentials(TlsConfig()) is None


@contextlib.asynccontextmanager
async def tls_server(tmp_path: Path, tls: dict[str, object]) -> AsyncIterator[RunningServer]:
    """pd-extproc with one prefill and one decode (EDS files) and the ``tls`` settings (dotted keys)."""
    files = [tmp_path / "p.yaml", tmp_path / "d.yaml"]
    write_eds_file(files[0], "prefill", [endpoint("10.0.0.1:8000", "a")])
    write_eds_file(files[1], "decode", [endpoint("10.0.1.1:8000", "a")])
    overrides = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "discovery.eds_files": [str(f) for f in files],
        **tls,
    }
    server = await start_server(load_config(None, overrides, environ={}))
    try:
        yield server
    finally:
        await server.stop(grace=0.1)


def channel_credentials(certificates: Certificates, client: Pair | None) -> grpc.ChannelCredentials:
    """Trust ``certificates.ca``; present ``client`` if given."""
    return grpc.ssl_channel_credentials(
        certificates.ca.cert.read_bytes(),
        client.key.read_bytes() if client is not None else None,
        client.cert.read_bytes() if client is not None else None,
    )


async def liveness(target: str, credentials: grpc.ChannelCredentials | None) -> bool:
    """Whether a health check over this channel is answered (``False``: the connection was refused)."""
    channel = (
        grpc.aio.insecure_channel(target)
        if credentials is None
        else grpc.aio.secure_channel(target, credentials)
    )
    async with channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=3
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
            return False
    return True


async def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(
    tmp_path: Path, certificates: Certificates
) -> None:
    c = certificates
    tls = {
        "tls.cert_file": str(c.server.cert),
        "tls.key_file": str(c.server.key),
        "tls.client_ca_file": str(c.ca.cert),
    }
    async with tls_server(tmp_path, tls) as server:
        target = f"127.0.0.1:{server.grpc_port}"
        assert await liveness(target, channel_credentials(c, c.client))
        assert not await liveness(target, channel_credentials(c, None))
        assert not await liveness(target, channel_credentials(c, c.stranger))
        assert not await liveness(target, None)


async def test_tls_without_a_client_ca_needs_no_client_certificate(
    tmp_path: Path, certificates: Certificates
) -> None:
    c = certificates
    async with tls_server(
        tmp_path, {"tls.cert_file": str(c.server.cert), "tls.key_file": str(c.server.key)}
    ) as server:
        target = f"127.0.0.1:{server.grpc_port}"
        assert await liveness(target, channel_credentials(c, None))
        assert not await liveness(target, None)


@pytest.mark.parametrize("mode", list(HandoffMode))
async def test_every_handoff_owns_the_routing_and_steering_headers(mode: HandoffMode) -> None:
    """What the server strips from each request (``routing_headers``): both routing headers and every
    header that steers a sidecar or an engine, whatever the handoff."""
    config = load_config(None, {"handoff.mode": mode.value, "routing.prefill_header": "x-p"}, environ={})
    handoff = build_handoff(config, Metrics(make_registry().endpoints))
    try:
        owned = set(handoff.routing_headers)
        assert {"x-gateway-destination-endpoint", "x-p", *STEERING_HEADERS} <= owned
        assert {"x-encoder-hosts-ports", "x-kv-cache-source-host-port", "prefer"} <= owned
        assert all(name == name.lower() for name in owned)  # Envoy's header map is lower case
    finally:
        await handoff.close()
