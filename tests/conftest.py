"""Shared test setup: make the test helper modules importable; load benchmark scripts; the fake
Kubernetes API server."""

import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_kube_api import FakeKubeApi

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` (benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    """A running fake Kubernetes API server."""
    server = FakeKubeApi()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def kubeconfig(api: FakeKubeApi, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A kubeconfig for ``api`` whose context's namespace is the test module's ``NS``."""
    path = tmp_path / "kubeconfig"
    path.write_text(api.kubeconfig(request.module.NS))
    return path
