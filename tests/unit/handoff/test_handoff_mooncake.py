"""The vllm-mooncake handoff's pure parts: the bootstrap server's answer, the address, both legs'
``kv_transfer_params`` (vLLM 0.32 ``mooncake_connector.py`` / ``mooncake_utils.py``)."""

from __future__ import annotations

import json

import pytest

from ext_proc.handoff.mooncake import Bootstrap, bootstrap_url, decode_params, parse_query, prefill_params

ENTRY = {"engine_id": "e0", "worker_addr": {"0": {"0": "10.0.0.1:7000"}}}


@pytest.mark.parametrize(
    ("answer", "engine_ids"),
    [
        ({"0": ENTRY}, {0: "e0"}),
        ({"0": ENTRY, "1": {**ENTRY, "engine_id": "e1"}}, {0: "e0", 1: "e1"}),
        ({"0": ENTRY, "1": {"worker_addr": {}}}, {0: "e0"}),  # a rank still registering is left out
        ({"0": ENTRY, "x": {"engine_id": "ex"}}, {0: "e0"}),
        ({"0": ENTRY, "1": {"engine_id": ""}}, {0: "e0"}),
        ({"0": ENTRY, "1": {"engine_id": 5}}, {0: "e0"}),
        ({"0": ENTRY, "1": ["e1"]}, {0: "e0"}),
    ],
)
def test_parse_query_reads_the_engine_id_of_each_rank(answer, engine_ids):
    assert parse_query(json.dumps(answer).encode()) == engine_ids


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not JSON"),
        (b"\xff", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"{}", "no data-parallel rank"),  # no worker registered yet
        (json.dumps({"0": {"worker_addr": {}}}).encode(), "no data-parallel rank"),
        (b"[" * 100_000, "not JSON"),
    ],
)
def test_parse_query_refuses_answers_without_an_engine_id(data, says):
    with pytest.raises(ValueError, match=says):
        parse_query(data)


@pytest.mark.parametrize(
    ("address", "port", "url"),
    [("10.0.0.1:8000", 8998, "http://10.0.0.1:8998"), ("[fd00::1]:8000", 9000, "http://[fd00::1]:9000")],
)
def test_bootstrap_url_is_the_prefills_host_on_the_bootstrap_port(address, port, url):
    assert bootstrap_url(address, port) == url


def test_both_legs_name_one_transfer_and_the_decode_its_ranks_engine():
    bootstrap = Bootstrap("http://10.0.0.1:8998", {0: "e0", 3: "e3"})
    assert prefill_params("xfer-1") == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "xfer-1",
    }
    assert decode_params("xfer-1", bootstrap, 3) == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "xfer-1",
        "remote_bootstrap_addr": "http://10.0.0.1:8998",
        "remote_engine_id": "e3",
    }
