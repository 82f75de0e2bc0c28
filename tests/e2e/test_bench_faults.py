"""Smoke test of the fault campaign (``bench/faults.py``) at reduced size, and its verdicts (never timing):
each check of a row fed what must fail it."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest

from bench import fault_rig, fault_scenarios, faults, soak
from sim.cluster import EngineSpec
from sim.cluster_process import EngineInfo


def test_two_scenarios_and_a_short_soak_pass_and_write_json(tmp_path, capsys):
    out = tmp_path / "faults.json"
    argv = ["--quick", "--scenarios", "prefill-killed-kv,engine-garbage,soak", "--soak-requests", "200"]
    assert faults.main([*argv, "--json", str(out)]) == 0
    rows = {row["scenario"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["prefill-killed-kv", "engine-garbage", "soak"]
    assert rows["prefill-killed-kv"]["outcomes"] == {"200": faults.QUICK.requests}  # a leg was cut
    assert rows["engine-garbage"]["outcomes"] == {"200": faults.QUICK.requests}  # each retried elsewhere
    soak = rows["soak"]
    assert soak["requests"] == 200 and soak["outcomes"]["aborted"] > 0 and soak["fds_after"] > 0
    for row in rows.values():
        assert (row["hung"], row["load_left_requests"], row["outside_discovered"]) == (0, 0, 0)
        assert row["access_log_lines"] >= row["requests"] and row["passed"], row["failures"]
    assert "PASS" in capsys.readouterr().out


def _measured(
    *labels: str,
    load: tuple[int, float] | None = (0, 0),
    outside: int = 0,
    lines: int | None = None,
    after: dict | None = None,
):
    outcomes = [fault_rig.Outcome(label, 0.1) for label in labels]
    usage = {"rss": 80.0, "fds": 15}
    after = after or (usage if load else {"rss": None, "fds": None})
    return fault_rig.Measured(
        outcomes, load, usage, after, len(outcomes) if lines is None else lines, outside
    )


def test_a_scenario_fails_on_any_broken_expectation():
    scenario = faults.SCENARIOS["prefill-killed-sglang"]  # allows 200 and the decode's 502, at most 15%
    assert faults.verdict(scenario, _measured(*["200"] * 9, "502 502"), None)["passed"]
    failing = {
        "a 500": _measured("200", "500 internal_error"),
        "a hung client": _measured("200", "hung"),
        "load left": _measured("200", load=(1, 300.0)),
        "pd-extproc exited": _measured("200", load=None),
        "an address outside the set": _measured("200", outside=1),
        "a request without its access-log line": _measured("200", "200", lines=1),
        "no access log": _measured("200", lines=0),
        "too many failed": _measured("200", "502 502"),
        "none served": _measured("502 502"),
    }
    for name, run in failing.items():
        row = faults.verdict(scenario, run, None)
        assert not row["passed"] and row["failures"], name
    assert faults.verdict(scenario, _measured("200"), "the view did not converge")["failures"] == [
        "the view did not converge"
    ]


def test_a_garbage_decode_fails_the_row_when_it_is_not_left_out():
    bound = fault_scenarios.EJECTION_FAILURES  # 3 + 25 requests/s x 1 s poll
    assert bound == 28
    assert fault_scenarios.left_out(0, bound) is None
    assert fault_scenarios.left_out(bound, bound) is None
    for attempts in (bound + 1, 34):  # 34 of 100: a third of the requests, without the ejection
        assert fault_scenarios.left_out(attempts, bound) == (
            f"the broken decode got {attempts} requests, more than {bound}: it was not left out"
        )
    row = faults.verdict(
        faults.SCENARIOS["engine-garbage"], _measured("200"), fault_scenarios.left_out(34, bound)
    )
    assert not row["passed"]


def _line(listener: str, start: float, named: str, upstream: str, to_upstream: str = "3") -> str:
    return f"{listener} {start:.3f} {to_upstream} 500 {named} {upstream} 200"


def test_every_name_is_checked_against_the_set_listed_when_the_request_was_decided(tmp_path):
    rig = fault_rig.Rig(tmp_path)
    a, b, flapping = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
    rig.listings = [
        fault_rig.Listing(1000.0, 1010.0, frozenset({a, b, flapping})),
        fault_rig.Listing(1010.0, 1020.0, frozenset({a, b})),  # the flapping decode out for 10 s
        fault_rig.Listing(1020.0, math.inf, frozenset({a, b, flapping})),
    ]
    lag = fault_rig.DISCOVERY_LAG_S
    inside = [
        _line("gateway", 1005.0, f"{a},{flapping}", a),
        _line("gateway", 1010.0 + lag - 0.01, flapping, flapping),  # pd-extproc read the file late
        _line("gateway", 1019.998, flapping, flapping, to_upstream="1"),  # decided as it came back
        _line("gateway", 1015.0, "-", "-", to_upstream="-"),  # not routed
        _line("prefill_leg", 1015.0, b, b),
    ]
    outside = [
        _line("gateway", 1010.0 + lag + 0.01, flapping, a),  # named while unlisted
        _line("gateway", 1015.0, a, flapping),  # Envoy connected to it while unlisted
        _line("gateway", 1015.0, "10.9.9.9:80", "-", to_upstream="-"),  # never discovered
        _line("prefill_leg", 1005.0, "127.0.0.1:4", "127.0.0.1:4"),
    ]
    for line in inside:
        assert not fault_rig.names_outside(line.partition(" ")[2], rig.listings), line
    for line in outside:
        assert fault_rig.names_outside(line.partition(" ")[2], rig.listings), line
    rig.access_log.write_text("\n".join(inside + outside) + "\n")
    assert asyncio.run(rig.named_outside(7)) == (7, len(outside))


def test_no_access_log_is_no_line_and_fails_the_row(tmp_path):
    rig = fault_rig.Rig(tmp_path)
    lines, outside = asyncio.run(rig.named_outside(3, wait=0.1))
    assert (lines, outside) == (0, 0)
    run = _measured("200", "200", "200", lines=lines)
    assert faults.verdict(faults.SCENARIOS["eds-flapping"], run, None)["failures"] == [
        "0 gateway access-log lines for 3 requests"
    ]


def test_the_rig_records_each_set_it_lists(tmp_path):
    rig = fault_rig.new_rig()
    engines = [EngineInfo(f"127.0.0.1:{p}", "decode", "a", 1000) for p in (1, 2)]
    try:
        rig.write_eds(engines)
        rig.write_eds(engines[:1])
    finally:
        rig.stop()
    first, second = rig.listings
    assert first.addresses == {"127.0.0.1:1", "127.0.0.1:2"} and second.addresses == {"127.0.0.1:1"}
    assert first.since <= second.since <= first.until < second.until == math.inf


def test_the_soak_fails_on_rss_or_file_descriptor_growth():
    base = {"rss": 80.0, "fds": 15}
    assert soak.soak_verdict(_measured("200", "aborted", after=base))["passed"]
    assert soak.soak_verdict(_measured("200", after={"rss": 87.9, "fds": 15}))["passed"]
    grown = soak.soak_verdict(_measured("200", after={"rss": 88.0, "fds": 15}))
    assert grown["failures"] == ["RSS grew 10.0% (limit 10%)"] and grown["rss_growth"] == pytest.approx(0.1)
    leaked = soak.soak_verdict(_measured("200", after={"rss": 80.0, "fds": 16}))
    assert leaked["failures"] == ["file descriptors grew 15 -> 16"]


async def test_an_engine_with_nothing_in_flight_is_not_killed_and_the_row_says_why():
    rig = fault_rig.new_rig()
    try:
        rig.start_cluster([EngineSpec("prefill", "a"), EngineSpec("decode", "a")])
        await rig.start_router()
        plan = fault_scenarios._kill_busy_engine(rig, "decode", 0.0, wait=0.2)
        ((_, kill),) = plan.faults
        await kill()  # nothing is sent: nothing in flight on the decode
        decode = rig.engines("decode")[0].address
        assert await plan.check() == f"nothing in flight on the decode {decode} within 0.2 s: not killed"
        async with aiohttp.ClientSession() as session, session.get(f"http://{decode}/health") as response:
            assert response.status == 200  # still alive
    finally:
        rig.stop()
