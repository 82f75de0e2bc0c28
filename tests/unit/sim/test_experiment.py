"""A measured run stops, saying which process and why, when pd-extproc or Envoy exits under it
(sim.experiment, sim.stack), and the demo says so in one message instead of printing a table of failed
requests. No engines and no Envoy: stand-in processes and a stand-in stack."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ext_proc.cli import main
from sim.experiment import measure, watched
from sim.gateway import Gateway, free_port
from sim.stack import Replica, Stack, StackError
from sim.workload import plan_workload


def _exited(code: int, output: str, log: Path) -> subprocess.Popen:
    """A process that printed ``output`` into ``log`` and exited with ``code``."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", f"print({output!r}); raise SystemExit({code})"], stdout=out
        )
    process.wait(timeout=30)
    return process


class _Cluster:
    def __init__(self) -> None:
        self.engines: list = []

    def stop_engine(self, address: str) -> None:
        """Nothing to stop."""

    def stop(self) -> None:
        """Nothing to stop."""


def _stack(tmp_path: Path, *replicas: Replica) -> Stack:
    return Stack(_Cluster(), tmp_path, tmp_path / "p.json", tmp_path / "d.json", list(replicas))


def test_a_stack_names_the_process_that_exited_with_its_code_and_log(tmp_path: Path) -> None:
    server_log = tmp_path / "server.log"
    replica = Replica(server=_exited(3, "grpc: address in use", server_log), log=server_log)
    assert _stack(tmp_path, replica).failure() == (
        "pd-extproc exited with code 3; the end of its log:\ngrpc: address in use"
    )
    envoy_dir = tmp_path / "envoy"
    envoy_dir.mkdir()
    envoy = _exited(1, "critical: out of memory", envoy_dir / "envoy.log")
    routed = Replica(gateway=Gateway(envoy, 1, 2, envoy_dir))
    assert _stack(tmp_path, Replica(), routed).failure() == (
        "replica 1: Envoy exited with code 1; the end of its log:\ncritical: out of memory"
    )
    assert _stack(tmp_path, Replica(), Replica()).failure() is None  # stopped on purpose: nothing running


async def test_watched_returns_the_result_or_stops_at_the_first_failure() -> None:
    async def slow() -> str:
        await asyncio.sleep(30)
        return "late"

    async def quick() -> str:
        return "done"

    assert await watched(quick(), lambda: None, interval=0.01) == "done"
    checks = iter([None, None, "Envoy exited with code 1"])
    started = time.monotonic()
    with pytest.raises(StackError, match=r"^Envoy exited with code 1$"):
        await watched(slow(), lambda: next(checks), interval=0.01)
    assert time.monotonic() - started < 5
    with pytest.raises(StackError, match="gone"):  # also once the work is done
        await watched(quick(), lambda: "gone", interval=0.01)


class _DyingStack:
    """A stack whose gateway (a port nobody listens on) is reported dead from the third check on."""

    def __init__(self) -> None:
        self.checks = 0
        self.urls = [f"http://127.0.0.1:{free_port()}"]

    async def route_with(self, *args: object, **kwargs: object) -> str:
        return self.urls[0]

    def decode_capacities(self) -> dict[str, float]:
        return {}

    def failure(self) -> str | None:
        self.checks += 1
        return "Envoy exited with code -9; the end of its log:\n" if self.checks >= 3 else None


async def test_a_run_stops_when_its_gateway_exits_instead_of_failing_every_request() -> None:
    plans = plan_workload(40, 4.0, prompt_tokens=(8, 8), output_tokens=(1, 1))  # 10 s of arrivals
    started = time.monotonic()
    with pytest.raises(StackError, match=r"^Envoy exited with code -9"):
        await measure(_DyingStack(), "prefer", plans)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5


def test_the_demo_says_which_run_stopped_and_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def dies(stack: object, mode: str, *args: object, **kwargs: object) -> dict:
        if mode == "prefer":
            raise StackError("pd-extproc exited with code -11; the end of its log:\nSegmentation fault")
        return {}

    class Stopped:
        def stop(self) -> None:
            """Nothing to stop."""

    monkeypatch.setattr("sim.demo.start_stack", lambda *args, **kwargs: Stopped())
    monkeypatch.setattr("sim.demo.measure", dies)
    assert main(["demo", "--count", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.endswith(
        "pd-extproc demo: the prefer run stopped: pd-extproc exited with code -11; the end of its log:\n"
        "Segmentation fault\n"
    )
