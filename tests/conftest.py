"""Shared test setup: make the test helper modules (``tests/support/``) importable by name; Helm; the fake
Kubernetes API server; the ``server`` and ``stub`` fixtures of the tests that drive the gRPC shell
directly."""

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).parent / "support"))

from grpc_harness import start_with
from helm_tool import HelmUnavailable, ensure_helm
from promtool_tool import PromtoolUnavailable, ensure_promtool

from standins.fake_kube_api import FakeKubeApi

# Property tests are judged on their results, not on the wall clock: Hypothesis's default deadline (200 ms
# an example) fails an example whose process the scheduler left waiting, on a loaded shared machine
# ("Unreliable test timings": the failure a rerun does not repeat). Loaded before any test module, so
# every settings object inherits it; pytest-timeout (pyproject.toml) still bounds each test.
settings.register_profile("results-not-timings", deadline=None)
settings.load_profile("results-not-timings")


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


@pytest.fixture
async def server(tmp_path):
    """A pd-extproc server (one prefill, one decode: ``grpc_harness.start_with``)."""
    running = await start_with(tmp_path, ["10.0.0.2:8000"])
    yield running
    await running.stop(grace=0)


@pytest.fixture
async def stub(server):
    """ext_proc and health stubs on a gRPC channel to ``server``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel), health_pb2_grpc.HealthStub(channel)


@pytest.fixture(scope="session")
def helm() -> Path:
    """The Helm binary (a test fails, naming what to install, where it cannot be fetched)."""
    try:
        return ensure_helm()
    except HelmUnavailable as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool (:mod:`promtool_tool`): a test fails where it cannot be fetched as root, and is skipped,
    naming what to install, where it cannot be fetched otherwise."""
    try:
        return ensure_promtool()
    except PromtoolUnavailable as exc:
        if os.geteuid() == 0:
            pytest.fail(str(exc))
        pytest.skip(str(exc))
