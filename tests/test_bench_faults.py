"""Smoke test of the fault campaign (``bench/faults.py``) at reduced size, and its verdicts (never timing)."""

from __future__ import annotations

import json

from conftest import load_bench

faults = load_bench("faults")
fault_rig = load_bench("fault_rig")


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


def _measured(*labels: str, load: tuple[int, float] | None = (0, 0), outside: int = 0):
    outcomes = [fault_rig.Outcome(label, 0.1) for label in labels]
    usage = {"rss": 80.0, "fds": 15}
    return fault_rig.Measured(
        outcomes, load, usage, usage if load else {"rss": None, "fds": None}, 9, outside
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
        "too many failed": _measured("200", "502 502"),
        "none served": _measured("502 502"),
    }
    for name, run in failing.items():
        row = faults.verdict(scenario, run, None)
        assert not row["passed"] and row["failures"], name
    assert faults.verdict(scenario, _measured("200"), "the view did not converge")["failures"] == [
        "the view did not converge"
    ]
