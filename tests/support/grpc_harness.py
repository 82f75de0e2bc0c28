"""A pd-extproc server on loopback for tests that drive its gRPC shell with a real gRPC client
(the ``server`` and ``stub`` fixtures are in ``conftest.py``)."""

from __future__ import annotations

import json

from builders import endpoint
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.app import start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file


async def start_with(
    tmp_path,
    decode_addresses: list[str],
    listen: str = "127.0.0.1:0",
    metrics_listen: str = "127.0.0.1:0",
    prefill_address: str = "10.0.0.1:8000",
    settings: dict[str, object] | None = None,
):
    """A server on ``listen`` and ``metrics_listen``, the prefill ``prefill_address`` and the given
    decodes, all group a, every prompt disaggregated; ``settings``: more configuration (dotted keys)."""
    decodes = [endpoint(a, "a", 1000.0) for a in decode_addresses]
    prefill = [endpoint(prefill_address, "a", 1000.0)]
    write_eds_file(tmp_path / "p.json", "prefill", prefill)
    write_eds_file(tmp_path / "d.json", "decode", decodes)
    overrides = {
        "listen": listen,
        "metrics_listen": metrics_listen,
        "discovery.eds_files": [str(tmp_path / "p.json"), str(tmp_path / "d.json")],
        "routing.pd_threshold_tokens": 0,  # the short test prompts are disaggregated too
        **(settings or {}),
    }
    return await start_server(load_config(None, overrides, environ={}))


def load(server) -> list[tuple[str, int, int]]:
    """Every endpoint's (role, active tokens, active requests)."""
    return [(s.role.value, s.active_tokens, s.active_requests) for s in server.router.registry.endpoints()]


def error_code(response: pb.ProcessingResponse) -> str:
    """The OpenAI error code of an ``ImmediateResponse`` answer."""
    return json.loads(response.immediate_response.body)["error"]["code"]
