"""The Grafana dashboard and the Prometheus rules of ``charts/pd-extproc/monitoring/``: every query names
only metrics pd-extproc exports (the names each query reads, tokenized, against the sample names of a
:class:`~ext_proc.metrics.Metrics` with every collector registered: ``promql_names``), ``promtool check
rules`` and ``promtool test rules`` (the alerts evaluated on synthetic series: ``tests/deploy/monitoring/``).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from promql_names import metric_names, pd_extproc_names, unknown_names

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "charts" / "pd-extproc" / "monitoring"
DASHBOARD = MONITORING / "pd-extproc-dashboard.json"
RULES = MONITORING / "pd-extproc-rules.yaml"
RULE_TESTS = Path(__file__).parent / "monitoring" / "pd-extproc-rules.test.yaml"


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return pd_extproc_names()


def dashboard_panels() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel["targets"]]


def variable_queries() -> list[str]:
    """The metric of each ``label_values(metric, label)`` query of the dashboard's variables."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    found = [
        re.fullmatch(r"label_values\((.+), *\w+\)", v["definition"])
        for v in variables
        if v["type"] == "query"
    ]
    assert all(found)
    return [match.group(1) for match in found if match]


def rule_queries() -> list[str]:
    return [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_the_tokenizer_reads_metric_names_only() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, role) (rate(a_bucket{role="x", b="c{d}"}[$__rate_interval])))'
        " / on (job) group_left (reason) b_total offset 1d > 0.05 + 2 * c:rate5m and d >= 1e3"
        ' or vector(-Inf) unless sum without (e) (f{job=~"$job"}) > bool 0x1F'
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c:rate5m", "d", "f"}


def test_the_check_finds_a_name_pd_extproc_does_not_export(exported: set[str]) -> None:
    queries = ["sum(rate(pd_extproc_rejected_total[5m]))", "rate(pd_extproc_rejected[5m]) > pd_extproc_nope"]
    assert unknown_names(queries, exported) == {queries[1]: {"pd_extproc_rejected", "pd_extproc_nope"}}


def test_every_dashboard_query_names_only_exported_metrics(exported: set[str]) -> None:
    queries = dashboard_queries() + variable_queries()
    assert len(queries) > 40
    assert unknown_names(queries, exported) == {}


def test_every_rule_names_only_exported_metrics(exported: set[str]) -> None:
    queries = rule_queries()
    assert len(queries) == 7
    assert unknown_names(queries, exported) == {}


def test_the_dashboard_is_one_grafana_dashboard_filtered_by_job() -> None:
    """Unique panel ids, every panel on the dashboard's data source variable, every selector of every
    query limited to the chosen jobs."""
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] == "pd-extproc"
    for panel in dashboard_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            selectors = re.findall(r"(pd_extproc_\w+)(\{[^}]*\})?", target["expr"])
            assert all('job=~"$job"' in labels for _, labels in selectors), target["expr"]


def test_the_panels_the_operations_guide_names_are_there() -> None:
    titles = {p["title"] for p in dashboard_panels()}
    assert {
        "Request rate",
        "Decisions by mode and locality",
        "Cross-group share",
        "Decode TTFT from the engines",
        "Booked tokens per endpoint",
        "Blended load per endpoint",
        "Prefix hit rate: predicted vs engines",
        "KV-event health",
        "Bus and peers",
        "Shared-state drops by reason",
        "Sync requests by outcome",
        "Queued at the engines",
        "Decode headroom",
    } <= titles


def test_promtool_checks_the_rules(promtool: Path) -> None:
    result = subprocess.run(
        [str(promtool), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 7 rules found" in result.stdout


def test_promtool_unit_tests_of_the_alerts_pass(promtool: Path) -> None:
    result = subprocess.run(
        [str(promtool), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
    }
    alerts = {
        rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    }
    assert tested == alerts


def test_every_dashboard_query_is_promql_that_promtool_parses(promtool: Path, tmp_path: Path) -> None:
    """Each query, Grafana's ``$__rate_interval`` made 5m, as a recording rule of a file promtool checks."""
    queries = [q.replace("$__rate_interval", "5m") for q in dashboard_queries()]
    rules = [{"record": f"pd_extproc:dashboard_query_{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [str(promtool), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout
