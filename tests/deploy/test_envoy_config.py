"""Every shipped Envoy config, and every variant the tests and benchmarks render, passes
``envoy --mode validate``; the shipped EDS files are valid for both Envoy and pd-extproc."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from ext_proc.discovery.eds import load_eds_file
from ext_proc.handoff.base import owned_headers
from ext_proc.handoff.config import HandoffConfig
from ext_proc.handoff.kv_transfer import TIMEOUT_MARGIN_SECONDS
from ext_proc.handoff.routing import RoutingConfig
from ext_proc.server import ENVOY_BODY_LIMIT_BYTES, MAX_RECEIVE_BYTES
from sim.gateway import (
    SHIPPED_ADS_BOOTSTRAP,
    SHIPPED_BOOTSTRAP,
    GatewayError,
    render_bootstrap,
    validate_envoy,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONFIGS = sorted((REPO / "envoy").glob("*.yaml"))
SHIPPED_EDS = sorted((REPO / "envoy" / "eds").glob("*.yaml"))


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_envoy_config_validates(config):
    result = validate_envoy(config, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"extproc_port": None},
        {"extproc_port": None, "round_robin": True},
        {"response_headers": True},
        {"template": SHIPPED_ADS_BOOTSTRAP},
        {"fail_open": True},
        {"fail_open": True, "template": SHIPPED_ADS_BOOTSTRAP},
    ],
    ids=["routed", "no-filter", "round-robin", "response-headers", "ads", "fail-open", "ads-fail-open"],
)
def test_rendered_variants_validate(tmp_path, variant):
    options = {
        "listen_port": 18080,
        "admin_port": 19901,
        "extproc_port": 19002,
        "decode_eds_path": str(REPO / "envoy" / "eds" / "decode.yaml"),
        "prefill_eds_path": str(REPO / "envoy" / "eds" / "prefill.yaml"),
        "prefill_leg_port": 11001,
        **variant,
    }
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render_bootstrap(**options)))
    result = validate_envoy(path, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_ads_bootstrap_is_the_file_bootstrap_with_endpoints_from_pd_extproc():
    """envoy-ads.yaml differs from envoy.yaml only in where the prefill and decode endpoints come
    from (every listener, filter, route and cluster setting is shared), and its ADS stream goes to
    pd-extproc's gRPC port, the same cluster as ext_proc."""
    files = yaml.safe_load(SHIPPED_BOOTSTRAP.read_text())
    ads = yaml.safe_load(SHIPPED_ADS_BOOTSTRAP.read_text())
    assert ads["dynamic_resources"] == {
        "ads_config": {
            "api_type": "GRPC",
            "transport_api_version": "V3",
            "set_node_on_first_message_only": True,
            "grpc_services": [
                {
                    "envoy_grpc": {
                        "cluster_name": "pd_extproc",
                        "retry_policy": {"retry_back_off": {"base_interval": "0.25s", "max_interval": "1s"}},
                    }
                }
            ],
        }
    }
    expected = copy.deepcopy(files)
    expected["dynamic_resources"] = ads["dynamic_resources"]
    for cluster in expected["static_resources"]["clusters"]:
        if cluster["name"] in ("prefill", "decode"):
            cluster["eds_cluster_config"]["eds_config"] = {"ads": {}, "resource_api_version": "V3"}
    assert ads == expected


def test_a_file_bootstrap_needs_its_eds_paths():
    with pytest.raises(GatewayError, match="reads the decode endpoints from a file"):
        render_bootstrap(listen_port=1, admin_port=2, extproc_port=3, prefill_leg_port=4)


def test_validate_rejects_a_broken_config(tmp_path):
    """The check above can fail: a config with an unknown field is refused."""
    config = yaml.safe_load(SHIPPED_BOOTSTRAP.read_text())
    config["static_resources"]["clusters"][0]["no_such_field"] = 1
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert validate_envoy(path, cwd=REPO).returncode != 0


@pytest.mark.parametrize("eds", SHIPPED_EDS, ids=lambda p: p.name)
def test_shipped_eds_files_load_with_groups(eds):
    cluster = load_eds_file(eds)
    assert cluster.cluster_name in {"prefill", "decode"}
    assert cluster.endpoints and all(e.group for e in cluster.endpoints)


def _gateway_listener() -> dict:
    config = yaml.safe_load(SHIPPED_BOOTSTRAP.read_text())
    return next(entry for entry in config["static_resources"]["listeners"] if entry["name"] == "gateway")


def _ext_proc_filter(listener: dict) -> dict:
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    return next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]


def test_max_message_timeout_covers_a_prefill_leg_and_its_retry_within_the_idle_timeouts():
    """The kv-transfer-params handoff asks Envoy to wait 2 x prefill_timeout_seconds + margin for the
    body answer; Envoy ignores a request above the shipped filter's max_message_timeout, and the stream
    and route idle timeouts would end a request waiting that long first."""
    config = yaml.safe_load(SHIPPED_BOOTSTRAP.read_text())
    listener = next(entry for entry in config["static_resources"]["listeners"] if entry["name"] == "gateway")
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")[
        "typed_config"
    ]
    route = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r)["route"]
    cap = _seconds(ext_proc["max_message_timeout"])
    leg = HandoffConfig().prefill_timeout_seconds
    assert (
        2 * leg + TIMEOUT_MARGIN_SECONDS
        <= cap
        < min(_seconds(hcm["stream_idle_timeout"]), _seconds(route["idle_timeout"]))
    )


def _seconds(duration: str) -> float:
    return float(duration.removesuffix("s"))


def test_pd_extproc_takes_every_body_the_shipped_envoy_buffers():
    """The gateway's buffer limit is the server's constant (its gRPC receive limit adds the message's
    own overhead), Envoy's gRPC client takes answers as large (0, the default, is unlimited) and the
    413 Envoy answers beyond the limit names it."""
    listener = _gateway_listener()
    limit = listener["per_connection_buffer_limit_bytes"]
    assert limit == ENVOY_BODY_LIMIT_BYTES < MAX_RECEIVE_BYTES
    answers = _ext_proc_filter(listener)["grpc_service"]["envoy_grpc"].get("max_receive_message_length", 0)
    assert answers == 0 or answers >= MAX_RECEIVE_BYTES
    mappers = listener["filter_chains"][0]["filters"][0]["typed_config"]["local_reply_config"]["mappers"]
    (too_large,) = [m for m in mappers if _status_of(m) == 413]
    error = too_large["body_format_override"]["json_format"]["error"]
    assert error["code"] == "request_too_large"
    assert f"{limit // 2**20} MiB ({limit} bytes)" in error["message"]


def _status_of(mapper: dict) -> int | None:
    """The one status a local-reply mapper's filter matches (``None`` for other filters)."""
    comparison = mapper["filter"].get("status_code_filter", {}).get("comparison", {})
    return comparison["value"]["default_value"] if comparison.get("op") == "EQ" else None


NIXL_LEASE_SECONDS = 30
"""vLLM 0.32 NixlConnector: a prefill frees a finished leg's KV blocks this long after the leg
(``kv_connector_extra_config.kv_lease_duration``) unless its decode renews the lease."""
NIXL_HEARTBEAT_SECONDS = NIXL_LEASE_SECONDS // 6
"""How often a decode that has the request renews the lease (vLLM: a sixth of the lease)."""
SGLANG_BOOTSTRAP_TIMEOUT_SECONDS = 300
"""SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``: how long each side waits for the other."""
ENVOY_RETRY_BACKOFF_MAX_SECONDS = 0.25
"""Envoy's default retry back-off cap (25 ms base, ten times that at most)."""


@pytest.mark.parametrize("template", [SHIPPED_BOOTSTRAP, SHIPPED_ADS_BOOTSTRAP], ids=lambda p: p.name)
def test_a_kv_handoff_reaches_its_decode_well_within_the_prefills_kv_lease(template):
    """Between a prefill leg's answer and the decode having the request, the gateway spends at most
    Envoy's connect attempts on the decodes (pd-extproc answers Envoy as the leg returns); that plus
    one heartbeat interval must stay under the NIXL lease, or the prefill frees blocks the decode
    then reads (docs/handoffs.md "KV holds and the gateway's timeouts"), with at least half the lease left for
    the decode engine's own intake (HTTP server, tokenizer, queue). A reset retry could wait a whole
    generation first: the KV handoff route has none."""
    config = yaml.safe_load(template.read_text())
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    listener = next(entry for entry in config["static_resources"]["listeners"] if entry["name"] == "gateway")
    routes = listener["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0][
        "routes"
    ]
    (kv_route,) = [
        r for r in routes if any(h["name"] == "x-gateway-kv-handoff" for h in r["match"].get("headers", []))
    ]
    retry = kv_route["route"]["retry_policy"]
    assert "reset" not in retry["retry_on"].split(",")
    attempts = 1 + retry["num_retries"]
    worst = attempts * _seconds(clusters["decode"]["connect_timeout"]) + retry["num_retries"] * (
        ENVOY_RETRY_BACKOFF_MAX_SECONDS
    )
    assert worst + NIXL_HEARTBEAT_SECONDS < NIXL_LEASE_SECONDS / 2


def test_an_sglang_prefill_leg_gives_up_before_its_decode_stops_waiting():
    """With sglang-bootstrap the decode waits for its prefill's KV for SGLang's bootstrap timeout; a
    leg pd-extproc still waits for after that is lost work holding a prefill charge."""
    assert HandoffConfig().prefill_timeout_seconds < SGLANG_BOOTSTRAP_TIMEOUT_SECONDS


@pytest.mark.parametrize("template", [SHIPPED_BOOTSTRAP, SHIPPED_ADS_BOOTSTRAP], ids=["eds", "ads"])
def test_the_shipped_listener_removes_every_header_a_handoff_owns(template):
    """Envoy removes a client's routing and steering headers before anything reads them, so they are
    gone also when pd-extproc is down or fails open (the same set every handoff strips)."""
    config = yaml.safe_load(template.read_text())
    listeners = config["static_resources"]["listeners"]
    (gateway,) = [listener for listener in listeners if listener["name"] == "gateway"]
    manager = gateway["filter_chains"][0]["filters"][0]["typed_config"]
    (early,) = manager["early_header_mutation_extensions"]
    removed = [mutation["remove"] for mutation in early["typed_config"]["mutations"]]
    routing = RoutingConfig()
    assert sorted(removed) == sorted(owned_headers(routing.destination_header, routing.prefill_header))
