"""``pd-extproc envoy-bootstrap``: the shipped bootstraps with one ext_proc endpoint per pd-extproc behind
that Envoy, health-checked when several, validated by the real Envoy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ext_proc.envoy_bootstrap import HEALTH_CHECK, BootstrapError, with_extproc_workers
from sim.gateway import SHIPPED_ADS_BOOTSTRAP, validate_envoy

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "envoy" / "envoy.yaml"


def _cluster(bootstrap: dict) -> dict:
    return next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "pd_extproc")


def _ports(bootstrap: dict) -> list[int]:
    group = _cluster(bootstrap)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [e["endpoint"]["address"]["socket_address"]["port_value"] for e in group]


def _pd_extproc(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ext_proc.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("path", [SHIPPED, SHIPPED_ADS_BOOTSTRAP])
def test_several_workers_are_listed_on_the_ports_after_the_first_and_health_checked(
    path: Path, tmp_path: Path
) -> None:
    result = _pd_extproc("envoy-bootstrap", str(path), "--extproc-workers", "3")
    assert result.returncode == 0, result.stderr
    bootstrap = yaml.safe_load(result.stdout)
    assert _ports(bootstrap) == [9002, 9003, 9004]
    assert _cluster(bootstrap)["health_checks"] == [HEALTH_CHECK]
    shipped = yaml.safe_load(path.read_text())
    assert bootstrap["static_resources"]["listeners"] == shipped["static_resources"]["listeners"]
    out = tmp_path / "envoy.yaml"
    out.write_text(result.stdout)
    validate_envoy(out)


def test_one_worker_is_the_shipped_bootstrap_unchanged() -> None:
    shipped = yaml.safe_load(SHIPPED.read_text())
    assert with_extproc_workers(shipped, 1) == shipped
    assert "health_checks" not in _cluster(with_extproc_workers(shipped, 1))


def test_a_bootstrap_without_the_cluster_or_past_the_last_port_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BootstrapError, match="no pd_extproc cluster"):
        with_extproc_workers({"static_resources": {"clusters": []}}, 2)
    with pytest.raises(BootstrapError, match="past 65535"):
        with_extproc_workers(yaml.safe_load(SHIPPED.read_text()), 60_000)
    missing = _pd_extproc("envoy-bootstrap", str(tmp_path / "none.yaml"), "--extproc-workers", "2")
    assert missing.returncode == 2 and "none.yaml" in missing.stderr
    bad = _pd_extproc("envoy-bootstrap", str(SHIPPED), "--extproc-workers", "0")
    assert bad.returncode == 2 and "not a number of workers" in bad.stderr
