"""Istio's DestinationRule schema for the chart tests, fetched by package name like Helm.

The npm package ``@kubernetes-models/istio`` carries, for every Istio CRD version, a validator
generated from that CRD's OpenAPI schema (its ``_schemas/NetworkingIstioIoV1DestinationRule``:
types, enums, required fields; not the CEL rules, and unknown fields pass, as the API server prunes
them). :func:`destination_rule_problems` runs it under Node.js on rendered manifests; the package and
its dependencies are installed once with ``npm install`` into ``.cache/istio-models/`` (ignored by git).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

PACKAGE = "@kubernetes-models/istio@3.0.1"
"""The version pinned for the tests: generated from Istio 1.29's CRDs."""


class ModelsUnavailable(RuntimeError):
    """The package could not be installed; the message says why and what to install."""


CACHE = Path(__file__).resolve().parents[2] / ".cache" / "istio-models"
_CHECK = """
import { DestinationRule } from "@kubernetes-models/istio/networking.istio.io/v1/DestinationRule";
for (const doc of JSON.parse(process.argv[2])) {
  try { new DestinationRule(doc).validate(); console.log(""); } catch (e) { console.log(e.message); }
}
"""


def ensure_models(cache: Path = CACHE) -> Path:
    """The folder whose ``node_modules`` holds the package, installed with npm on first use."""
    marker = cache / "node_modules" / "@kubernetes-models" / "istio" / "package.json"
    if marker.is_file() and json.loads(marker.read_text())["version"] == PACKAGE.rpartition("@")[2]:
        return cache
    npm = shutil.which("npm")
    if npm is None:
        raise ModelsUnavailable(
            f"the chart tests need Node.js and npm for {PACKAGE} (e.g. `apt-get install npm`)"
        )
    cache.mkdir(parents=True, exist_ok=True)
    command = [npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", "--silent", PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise ModelsUnavailable(f"`npm install {PACKAGE}` failed:\n{result.stderr.strip()}")
    return cache


def destination_rule_problems(docs: list[dict]) -> list[str]:
    """For each of ``docs`` (networking.istio.io/v1 DestinationRules), what the schema finds wrong
    (``""``: nothing)."""
    folder = ensure_models()
    node = shutil.which("node")
    assert node is not None, "npm is installed without node"
    script = folder / "check.mjs"
    script.write_text(_CHECK)
    result = subprocess.run(
        [node, str(script), json.dumps(docs)], capture_output=True, text=True, timeout=60, cwd=folder
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\n")[: len(docs)]
