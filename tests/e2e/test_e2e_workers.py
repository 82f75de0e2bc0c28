"""``pd-extproc serve --workers N`` as users run it (docs/operations.md "Worker processes"): the real
command, a real private nats-server, the workers driven over gRPC on their own ports as Envoy drives
them, then the real Envoy listing both; a booking on one worker seen by the other; SIGTERM or a dead
worker stopping everything, no process left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from builders import endpoint
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from extproc_messages import body, destination, headers
from polling import until

from ext_proc.discovery.eds import write_eds_file
from sim.gateway import free_port, render_bootstrap, start_gateway, wait_router_ready
from standins.backends import start_backend
from standins.metrics import by_outcome

DROPPED = "pd_extproc_shared_messages_dropped_total"
BOOKING = 20
"""Tokens :data:`extproc_messages.BODY` books on its decode: 10 prompt + 10 output."""
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": 8}


def _children(pid: int) -> dict[int, str]:
    """The live child processes of ``pid``: pid → command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == pid and stat[0] != "Z":
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def serve_workers(
    tmp_path: Path, workers: int, prefill_address: str, decode_address: str
) -> Iterator[tuple[subprocess.Popen, int, int]]:
    """``pd-extproc serve --workers N`` over one prefill and one decode (EDS files ``prefill.yaml`` and
    ``decode.yaml`` in ``tmp_path``), in a session of its own (whatever the test leaves running is killed
    at the end); the process, its first gRPC and admin ports. Its log: ``tmp_path / "serve.log"``."""
    prefill, decode = tmp_path / "prefill.yaml", tmp_path / "decode.yaml"
    write_eds_file(prefill, "prefill", [endpoint(prefill_address, "a", 1000.0)])
    write_eds_file(decode, "decode", [endpoint(decode_address, "a", 1000.0)])
    grpc_port, admin_port = free_port(), free_port()  # each the first of 8 free ports
    command = [
        sys.executable,
        "-m",
        "ext_proc.cli",
        "serve",
        "--workers",
        str(workers),
        "--listen",
        f"127.0.0.1:{grpc_port}",
        "--metrics-listen",
        f"127.0.0.1:{admin_port}",
        "--eds-file",
        str(prefill),
        "--eds-file",
        str(decode),
    ]
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        yield process, grpc_port, admin_port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def _decode_row(session: aiohttp.ClientSession, admin_port: int) -> dict:
    async with session.get(f"http://127.0.0.1:{admin_port}/debug/endpoints") as response:
        (row,) = [r for r in await response.json() if r["role"] == "decode"]
    return row


async def _book(channel: grpc.aio.Channel, decode: str) -> grpc.aio.StreamStreamCall:
    """Open an ext_proc stream and send one request's headers and body, as Envoy does; the stream, held
    open (the request still running), once it was routed to ``decode``."""
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    await call.write(headers())
    await call.read()
    await call.write(body())
    assert destination(await call.read()) == decode
    return call


async def _decisions(session: aiohttp.ClientSession, admin_port: int) -> float:
    """The requests the worker at ``admin_port`` routed so far."""
    admin = f"http://127.0.0.1:{admin_port}"
    return sum((await by_outcome(session, admin, "pd_extproc_route_decisions_total", "mode")).values())


async def _through_envoy(
    tmp_path: Path, session: aiohttp.ClientSession, grpc_port: int, requests: int
) -> None:
    """Send ``requests`` chat requests through the shipped Envoy listing both workers (ports ``grpc_port``
    and the next), each answered 200."""
    listen, admin = free_port(), free_port()
    bootstrap = render_bootstrap(
        listen_port=listen,
        admin_port=admin,
        extproc_port=grpc_port,
        extproc_workers=2,
        prefill_leg_port=free_port(),
        decode_eds_path=str(tmp_path / "decode.yaml"),
        prefill_eds_path=str(tmp_path / "prefill.yaml"),
    )
    gateway = await start_gateway(bootstrap, listen, admin)
    try:
        for _ in range(requests):
            async with session.post(f"{gateway.url}/v1/chat/completions", json=CHAT) as response:
                assert response.status == 200, await response.text()
    finally:
        gateway.stop()


async def test_two_workers_share_their_bookings_and_stop_together(tmp_path: Path) -> None:
    prefill, decode = await start_backend(), await start_backend()
    try:
        with serve_workers(tmp_path, 2, prefill.address, decode.address) as (process, grpc_port, admin_port):
            for i in range(2):
                await wait_router_ready(process, admin_port + i, timeout=60)
            children = _children(process.pid)
            assert sorted(cmd.split()[0].rsplit("/", 1)[-1] for cmd in children.values()) == [
                "nats-server",
                *[Path(sys.executable).name] * 2,
            ], children
            async with aiohttp.ClientSession() as session:
                await _share(session, grpc_port, admin_port, decode.address)
                before = [await _decisions(session, admin_port + i) for i in range(2)]
                await _through_envoy(tmp_path, session, grpc_port, 6)
                after = [await _decisions(session, admin_port + i) for i in range(2)]
                assert sum(after) - sum(before) == 6
                assert min(a - b for a, b in zip(after, before, strict=True)) >= 2  # Envoy spreads them
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            assert [pid for pid in children if _alive(pid)] == []
    finally:
        await prefill.stop()
        await decode.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "worker 0 ext_proc.app: pd-extproc serving ext_proc" in log
    assert "worker 1 ext_proc.app: pd-extproc serving ext_proc" in log


async def _share(session: aiohttp.ClientSession, grpc_port: int, admin_port: int, decode: str) -> None:
    """A request booked on each worker over gRPC shows in the other's ``peer_tokens`` until it ends; no
    message dropped."""
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as first,
        grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port + 1}") as second,
    ):
        on_first = await _book(first, decode)

        async def peer_load(port: int) -> tuple[int, int]:
            row = await _decode_row(session, port)
            return row["peer_tokens"], row["peer_requests"]

        await until(lambda: _is(peer_load(admin_port + 1), (BOOKING, 1)))
        on_second = await _book(second, decode)
        await until(lambda: _is(peer_load(admin_port), (BOOKING, 1)))
        row = await _decode_row(session, admin_port)
        assert (row["active_tokens"], row["active_requests"]) == (2 * BOOKING, 2)  # own + peer's
        await on_first.done_writing()
        assert await on_first.read() == grpc.aio.EOF
        await until(lambda: _is(peer_load(admin_port + 1), (0, 0)))
        on_second.cancel()
        await until(lambda: _is(peer_load(admin_port), (0, 0)))
    for i in range(2):  # nothing garbled: not even the server's answer to a lone sync request
        admin = f"http://127.0.0.1:{admin_port + i}"
        assert await by_outcome(session, admin, DROPPED, "reason") == {}


async def _is(value, expected) -> bool:
    return await value == expected


async def test_a_worker_that_dies_stops_serve_and_the_others(tmp_path: Path) -> None:
    with serve_workers(tmp_path, 2, "10.0.0.1:8000", "10.0.1.1:8000") as (process, _, admin_port):
        for i in range(2):
            await wait_router_ready(process, admin_port + i, timeout=60)
        children = _children(process.pid)
        async with aiohttp.ClientSession() as session:
            victim = (await _json(session, f"http://127.0.0.1:{admin_port + 1}/debug/shared"))["replica"]
        pid = int(victim.split("-")[-2])  # the replica name: host-pid-random
        assert pid in children
        os.kill(pid, signal.SIGKILL)
        assert process.wait(timeout=30) == 1
        assert [p for p in children if _alive(p)] == []
    log = (tmp_path / "serve.log").read_text()
    assert f"worker 1 (pid {pid}) ended on its own (killed by SIGKILL)" in log


def test_a_worker_that_cannot_listen_ends_serve_with_exit_1(tmp_path: Path) -> None:
    with (
        socket.socket() as taken,
        serve_workers(tmp_path, 2, "10.0.0.1:8000", "10.0.1.1:8000") as (process, grpc_port, _),
    ):
        taken.bind(("127.0.0.1", grpc_port + 1))  # worker 1's port, long before it binds (seconds)
        taken.listen()
        assert process.wait(timeout=60) == 1
    log = (tmp_path / "serve.log").read_text()
    assert f"pd-extproc worker 1: cannot start: cannot listen on 127.0.0.1:{grpc_port + 1}" in log, log
    assert "worker 1 (pid" in log and "ended on its own (exit code 1)" in log


async def _json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as response:
        return await response.json()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--listen", "127.0.0.1:0"), "listen: port 0 cannot be used with --workers 2"),
        (("--listen", "127.0.0.1:9002", "--metrics-listen", "127.0.0.1:9003"), "listen and metrics_listen"),
    ],
)
def test_ports_workers_cannot_share_are_refused_before_anything_starts(args, message) -> None:
    command = [sys.executable, "-m", "ext_proc.cli", "serve", "--workers", "2", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
