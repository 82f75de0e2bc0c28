"""Shared test setup: make the test helper modules importable; load benchmark scripts; Helm."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))
BENCH = Path(__file__).resolve().parent.parent / "bench"

from helm_tool import HelmUnavailable, ensure_helm  # noqa: E402 (after the path it is found on)


def load_bench(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def helm() -> Path:
    """The Helm binary (a test fails, naming what to install, where it cannot be fetched)."""
    try:
        return ensure_helm()
    except HelmUnavailable as exc:
        pytest.fail(str(exc))
