"""Rendering ``charts/pd-extproc`` with the real Helm (:mod:`helm_tool`) for the chart tests
(``test_helm_chart.py``: gateway mode, ``test_helm_picker.py``: picker mode): ``helm template``,
the rendered manifests looked up by kind, their pd-extproc configuration through ``pd-extproc
check-config``, and the built-in kinds against the Kubernetes schemas (``kubernetes-validate``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import kubernetes_validate
import yaml

from ext_proc.config import Config, as_dict

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pd-extproc"
NAMESPACE = "llm"
RELEASE = "gw"
FULLNAME = f"{RELEASE}-pd-extproc"
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
"""The chart's kubeVersion floor and the newest schemas kubernetes-validate ships."""
CONFIG_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PD_EXTPROC_")}


def leaf_keys(tree: dict[str, object], prefix: str = "") -> set[str]:
    """The dotted keys of the leaves of ``tree`` (a mapping of mappings)."""
    keys: set[str] = set()
    for name, value in tree.items():
        if isinstance(value, dict):
            keys |= leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


CONFIG_KEYS = leaf_keys(as_dict(Config()))
"""Every key of pd-extproc's configuration, dotted."""


def run_helm(helm: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``helm`` with ``args`` (``env``: the environment, e.g. a KUBECONFIG; default: this one)."""
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, env=env)


def helm_args(tmp_path: Path, values: dict[str, object], sets: tuple[str, ...]) -> list[str]:
    """The namespace, a values file holding ``values`` (in ``tmp_path``) and ``--set`` of each of ``sets``."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    return ["--namespace", NAMESPACE, "-f", str(values_file), *(a for s in sets for a in ("--set", s))]


def template(
    helm: Path,
    tmp_path: Path,
    values: dict[str, object],
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = (),
) -> list[dict]:
    """``helm template`` of the chart: the rendered manifests (``api_versions``: APIs the cluster serves
    besides the built-in ones, e.g. ``monitoring.coreos.com/v1``)."""
    args = ["template", RELEASE, str(CHART), "--kube-version", KUBE_VERSIONS[0]]
    args += [a for version in api_versions for a in ("--api-versions", version)]
    result = run_helm(helm, *args, *helm_args(tmp_path, values, sets))
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


class Manifests:
    """Rendered manifests, looked up by kind (and name)."""

    def __init__(self, docs: list[dict]) -> None:
        self.docs = docs

    def all(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        (doc,) = [d for d in self.all(kind) if name is None or d["metadata"]["name"] == name]
        return doc

    @property
    def config(self) -> str:
        return self.one("ConfigMap", f"{FULLNAME}-config")["data"]["config.yaml"]

    @property
    def envoy(self) -> dict:
        return yaml.safe_load(self.one("ConfigMap", f"{FULLNAME}-envoy")["data"]["envoy.yaml"])

    @property
    def pod(self) -> dict:
        return self.one("Deployment", FULLNAME)["spec"]["template"]["spec"]

    def container(self, name: str) -> dict:
        (container,) = [c for c in self.pod["containers"] if c["name"] == name]
        return container


def install_dry_run(
    helm: Path, tmp_path: Path, values: dict[str, object], sets: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """``helm install --dry-run=client`` of the chart: the schema check, the manifests and the notes."""
    args = ["install", RELEASE, str(CHART), "--dry-run=client"]
    return run_helm(helm, *args, *helm_args(tmp_path, values, sets))


def assert_refused_by_schema(result: subprocess.CompletedProcess[str], messages: list[str]) -> None:
    """``result`` failed on ``values.schema.json``, saying each of ``messages``."""
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    for message in messages:
        assert message in result.stderr


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    """The installed ``pd-extproc check-config`` on ``path``, without PD_EXTPROC_* variables."""
    command = [str(Path(sys.executable).with_name("pd-extproc")), "check-config", "--config", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=CONFIG_ENV)


def effective_config(manifests: Manifests, tmp_path: Path) -> dict:
    """``pd-extproc check-config``'s effective configuration of the rendered file, as rendered.

    EDS files are mounted in the pod (``extraVolumes``), not on this machine: ``check-config`` must
    name each and exit 1, still printing the configuration."""
    path = tmp_path / "config.yaml"
    path.write_text(manifests.config)
    result = check_config(path)
    discovery = yaml.safe_load(manifests.config).get("discovery") or {}
    mounted = (discovery.get("eds_files") or []) if discovery.get("source") == "files" else []
    assert result.returncode == (1 if mounted else 0), result.stderr
    for eds in mounted:
        assert f"discovery.eds_files: {eds}: no such file" in result.stderr
    return yaml.safe_load(result.stdout)


def lookup(tree: dict, dotted: str) -> object:
    """The value at the dotted key ``dotted`` of ``tree``."""
    node: object = tree
    for name in dotted.split("."):
        node = typing.cast(dict, node)[name]
    return node


def port_of(host_port: str) -> int:
    """The port of ``host:port``."""
    return int(host_port.rpartition(":")[2])


CUSTOM_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "DestinationRule": "networking.istio.io/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
}
"""Kinds the chart renders from CRDs (kubernetes-validate has no schema for them), by apiVersion."""


def kubernetes_problems(docs: list[dict], version: str) -> list[str]:
    """What ``kubernetes-validate`` (strict) finds wrong in the built-in kinds among ``docs``."""
    problems = []
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] == CUSTOM_KINDS[doc["kind"]]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    return problems
