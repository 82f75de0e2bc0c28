"""Envoy's host health read from its admin ``/clusters`` (``ext_proc/envoy_health.py``): which hosts are
failed, what the router's ejections hold after a poll, and a failed poll; its settings."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import generate_latest

from ext_proc.checks import ConfigError
from ext_proc.config import load_config
from ext_proc.ejection import Ejections
from ext_proc.envoy_health import EnvoyHealth, EnvoyHealthError, failed_hosts
from ext_proc.envoy_health_config import EnvoyHealthConfig
from ext_proc.metrics import Metrics


def _host(ip: str, port: int, **health: object) -> dict:
    return {"address": {"socket_address": {"address": ip, "port_value": port}}, "health_status": health}


def _doc(decode_hosts: list[dict], prefill_hosts: list[dict] = ()) -> dict:
    return {
        "cluster_statuses": [
            {"name": "pd_extproc", "host_statuses": [_host("10.0.0.9", 9002, failed_outlier_check=True)]},
            {"name": "decode", "host_statuses": decode_hosts},
            {"name": "prefill", "host_statuses": list(prefill_hosts)},
        ]
    }


def test_failed_hosts_are_the_ones_envoy_marks_failed_in_that_cluster():
    doc = _doc(
        [
            _host("10.0.0.1", 8000, eds_health_status="HEALTHY"),
            _host("10.0.0.2", 8000, eds_health_status="HEALTHY", failed_outlier_check=True),
            _host("10.0.0.3", 8000, failed_active_health_check=True),
            _host("10.0.0.4", 8000, eds_health_status="UNHEALTHY"),
            _host("10.0.0.5", 8000, eds_health_status="DEGRADED"),
            _host("fd00::6", 8000, failed_outlier_check=True),
        ]
    )
    failed = {"10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000", "[fd00::6]:8000"}
    assert failed_hosts(doc, "decode") == failed
    assert failed_hosts(doc, "prefill") == frozenset()


NO_ADDRESS = {"health_status": {"failed_outlier_check": True}}


@pytest.mark.parametrize("doc", [[], {"cluster_statuses": [{"host_statuses": []}]}, _doc([NO_ADDRESS])])
def test_a_malformed_document_is_a_parse_error(doc):
    with pytest.raises(EnvoyHealthError) as caught:
        failed_hosts(doc, "decode")
    assert caught.value.reason == "parse"


@contextlib.asynccontextmanager
async def _serve(answers: list[web.Response]) -> AsyncIterator[str]:
    """A stand-in Envoy admin answering ``/clusters`` with ``answers`` in turn; yields its base URL."""

    async def clusters(request: web.Request) -> web.Response:
        assert request.query["format"] == "json"
        return answers.pop(0)

    app = web.Application()
    app.router.add_get("/clusters", clusters)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_a_poll_holds_what_envoy_marks_failed_and_a_failed_poll_holds_nothing():
    def failed() -> web.Response:
        return web.json_response(_doc([_host("10.0.0.1", 8000, failed_outlier_check=True)]))

    answers = [failed(), web.Response(status=503), failed(), web.json_response(_doc([]))]
    metrics = Metrics(lambda: ())
    decodes, prefills = Ejections(0.0, metrics), Ejections(0.0, metrics)
    async with _serve(answers) as url, aiohttp.ClientSession() as session:
        roles = {"decode": "decode", "prefill": "prefill"}
        ejections = {"decode": decodes, "prefill": prefills}
        health = EnvoyHealth(EnvoyHealthConfig(admin_url=url), ejections, roles, metrics)
        await health.poll(session)
        assert (decodes.ejected(), prefills.ejected()) == ({"10.0.0.1:8000"}, frozenset())
        await health.poll(session)  # Envoy cannot be read: pd-extproc's own view alone
        assert decodes.ejected() == frozenset()
        await health.poll(session)
        assert decodes.ejected() == {"10.0.0.1:8000"}
        await health.poll(session)  # Envoy took it back
        assert decodes.ejected() == frozenset()
    text = generate_latest(metrics.registry).decode()
    assert 'pd_extproc_envoy_health_changes_total{change="ejected",role="decode"} 2.0' in text
    assert 'pd_extproc_envoy_health_changes_total{change="returned",role="decode"} 2.0' in text
    assert 'pd_extproc_envoy_health_polls_total{outcome="status"} 1.0' in text
    assert 'pd_extproc_envoy_health_polls_total{outcome="ok"} 3.0' in text


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("admin_url", "127.0.0.1:9901"),
        ("admin_url", "http://127.0.0.1:9901/clusters"),
        ("interval_seconds", 0.0),
        ("timeout_seconds", 0),
    ],
)
def test_bad_envoy_health_settings_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"envoy_health.{key}"):
        load_config(None, {f"envoy_health.{key}": value}, environ={})


def test_envoy_health_is_off_by_default():
    assert load_config(None, {}, environ={}).envoy_health.admin_url == ""
