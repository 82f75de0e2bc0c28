"""The ``sim`` command line: option parsing, exit codes, and a real ``python -m sim`` process."""

from __future__ import annotations

import argparse
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from sim.cli import add_parser, config_from_args, run


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["sim", *argv])


def test_add_parser_builds_config() -> None:
    argv = "--role decode --group g2 --port 0 --eds-file a.json --eds-file b.yaml --decode-step-ms 15"
    args = _parse([*argv.split(), "--max-batch", "8", "--time-scale", "0.5", "--cross-group-gbps", "5"])
    assert args.func is run
    config = config_from_args(args)
    assert (config.role, config.group, config.port) == ("decode", "g2", 0)
    assert config.eds_files == ("a.json", "b.yaml")
    assert (config.timing.decode_step_ms, config.timing.max_batch, config.timing.time_scale) == (15.0, 8, 0.5)
    assert config.kv.cross_group_gbps == 5.0 and config.kv.kv_bytes_per_token == 128 * 1024


def test_role_is_validated() -> None:
    with pytest.raises(SystemExit):
        _parse(["--role", "router", "--group", "g"])


def test_invalid_values_exit_2_and_busy_port_exits_1(capsys) -> None:
    assert run(_parse(["--role", "both", "--group", "g", "--max-batch", "0"])) == 2
    assert "max_batch" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run(_parse(["--role", "both", "--group", "g", "--port", str(port)])) == 1
    assert "cannot start" in capsys.readouterr().err


def test_python_m_sim_serves_and_stops_on_sigterm() -> None:
    cmd = [
        sys.executable,
        "-m",
        "sim",
        "--role",
        "both",
        "--group",
        "g1",
        "--port",
        "0",
        "--time-scale",
        "0.01",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        address = None
        deadline = time.monotonic() + 15
        while address is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "sim exited before listening"
            if match := re.search(r"sim engine (\S+) role=both group='g1' listening", line):
                address = match.group(1)
        assert address is not None
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "shutting down" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
