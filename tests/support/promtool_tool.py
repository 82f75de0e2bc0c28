"""promtool (Prometheus' rule checker) for the monitoring tests, from Debian's ``prometheus`` package.

A ``promtool`` on the PATH is used as it is. Otherwise :func:`ensure_promtool` fetches the package with
``apt-get download`` (as root it runs ``apt-get update`` first if that fails), keeps only
``usr/bin/promtool`` under ``.cache/promtool/`` (ignored by git) and reuses it on later runs: the package
is unpacked, never installed, so no Prometheus server is set up or started on the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "prometheus"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "promtool"


class PromtoolUnavailable(RuntimeError):
    """promtool could not be fetched; the message says why and what to install."""


def ensure_promtool(cache: Path = CACHE) -> Path:
    """The path of a promtool: the PATH's, else the one unpacked into ``cache`` (fetched if not there)."""
    found = shutil.which("promtool")
    if found is not None:
        return Path(found)
    binary = cache / "promtool"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PromtoolUnavailable(f"the monitoring tests need promtool: install Debian's {PACKAGE} package")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as work_dir:
        work = Path(work_dir)
        work.chmod(0o755)  # apt's download user may write here
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

        def download() -> subprocess.CompletedProcess[str]:
            command = ["apt-get", "download", "-q", PACKAGE]
            return subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600, env=env)

        fetched = download()
        if fetched.returncode != 0 and os.geteuid() == 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600, env=env)
            fetched = download()
        debs = list(work.glob(f"{PACKAGE}_*.deb"))
        if fetched.returncode != 0 or len(debs) != 1:
            raise PromtoolUnavailable(
                f"`apt-get download {PACKAGE}` failed ({fetched.stderr.strip()}): install Debian's "
                f"{PACKAGE} package (it provides promtool), or run the tests as root"
            )
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(work / "root")], check=True, timeout=120)
        os.replace(work / "root" / "usr" / "bin" / "promtool", binary)  # atomic: never half a file
    return binary
