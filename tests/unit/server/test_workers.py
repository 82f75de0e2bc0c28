"""``serve --workers N``'s plan before anything starts: each worker's ports and shared-state keys, the
ports refused, the ``--workers`` flag; and where the ``nats-server`` binary is found (the processes
themselves: tests/e2e/test_e2e_workers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ext_proc.cli import build_parser
from ext_proc.config import Config
from ext_proc.workers import find_nats_server, ports_problem, worker_overrides


def test_worker_i_listens_on_each_configured_port_plus_i() -> None:
    config = Config(listen="0.0.0.0:9002", metrics_listen="127.0.0.1:9090", health_listen="[::]:9003")
    shared = {"shared_state.kind": "nats", "shared_state.nats.url": "nats://127.0.0.1:4222"}
    flags = {"affinity.mode": "auto", "listen": "0.0.0.0:9002"}
    assert worker_overrides(config, flags, 3, shared) == {
        "affinity.mode": "auto",
        "listen": "0.0.0.0:9005",
        "metrics_listen": "127.0.0.1:9093",
        "health_listen": "[::]:9006",
        **shared,
    }
    assert "health_listen" not in worker_overrides(Config(), {}, 1, shared)  # off stays off


def test_the_default_ports_fit_many_workers() -> None:
    assert ports_problem(Config(), 2) is None
    assert ports_problem(Config(), 64) is None


@pytest.mark.parametrize(
    ("config", "workers", "problem"),
    [
        (Config(listen="127.0.0.1:0"), 2, "listen: port 0 cannot be used with --workers 2"),
        (Config(health_listen="0.0.0.0:0"), 2, "health_listen: port 0"),
        (Config(metrics_listen="127.0.0.1:65534"), 3, "metrics_listen: ports 65534-65536"),
        (
            Config(listen="0.0.0.0:9002", metrics_listen="127.0.0.1:9004"),
            3,
            "listen and metrics_listen: their ports overlap with --workers 3",
        ),
        (Config(health_listen="0.0.0.0:9001"), 2, "health_listen and listen: their ports overlap"),
    ],
)
def test_ports_the_workers_cannot_share_are_named(config: Config, workers: int, problem: str) -> None:
    found = ports_problem(config, workers)
    assert found is not None and found.startswith(problem), found


def test_two_workers_on_adjacent_ports_do_not_overlap() -> None:
    assert ports_problem(Config(listen="0.0.0.0:9002", metrics_listen="127.0.0.1:9004"), 2) is None


@pytest.mark.parametrize("value", ["0", "65", "two", "-1"])
def test_workers_is_a_number_from_1_to_64(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser("serve").parse_args(["serve", "--workers", value])
    assert exit_.value.code == 2
    assert f"{value!r} is not a number of workers from 1 to 64" in capsys.readouterr().err


def test_one_worker_is_the_default() -> None:
    assert build_parser("serve").parse_args(["serve"]).workers == 1


def test_the_nats_server_of_the_wheel_is_found_beside_python() -> None:
    found = find_nats_server()
    assert found is not None and os.access(found, os.X_OK)
    assert Path(found).name == "nats-server"
