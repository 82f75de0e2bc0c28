"""gRPC health as GIE's gateways, kubelet and Envoy probe it: a real gRPC health client against the
ext_proc port and the separate ``health_listen`` port, every service name, readiness flipping."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from builders import endpoint
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until

from ext_proc.app import RunningServer, start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.health import Health
from ext_proc.server import start_health_grpc
from standins.certs import make_certificates

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
READY_NAMES = ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", "inference-extension", "")


async def check(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return reply.status


@pytest.fixture
async def health_port() -> AsyncIterator[tuple[Health, grpc.aio.Channel]]:
    """A :class:`Health` served on its own port, and a channel to it."""
    state = Health()
    await state.start()
    server, port = await start_health_grpc(state, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield state, channel
    finally:
        await server.stop(None)


@pytest.mark.parametrize("service", READY_NAMES)
async def test_every_readiness_name_follows_set_ready(health_port, service: str) -> None:
    state, channel = health_port
    assert await check(channel, service) == NOT_SERVING
    state.set_ready(True)
    await state.settled()
    assert (state.ready, await check(channel, service)) == (True, SERVING)
    state.set_ready(False)
    await state.settled()
    assert (state.ready, await check(channel, service)) == (False, NOT_SERVING)


async def test_liveness_serves_whatever_the_readiness(health_port) -> None:
    state, channel = health_port
    assert await check(channel, "liveness") == SERVING
    state.set_ready(True)
    await state.settled()
    assert await check(channel, "liveness") == SERVING


async def test_an_unknown_service_is_not_found(health_port) -> None:
    _, channel = health_port
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await check(channel, "envoy.service.ext_proc.v3.ExternalProcessorX")
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


async def test_quick_flips_end_on_the_last_value(health_port) -> None:
    state, channel = health_port
    for ready in (True, False, True, False, True):
        state.set_ready(ready)
    await state.settled()
    assert [await check(channel, name) for name in READY_NAMES] == [SERVING] * len(READY_NAMES)


async def test_a_watch_sees_readiness_flip(health_port) -> None:
    state, channel = health_port
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="readiness"))
    assert (await stream.read()).status == NOT_SERVING
    state.set_ready(True)
    assert (await stream.read()).status == SERVING
    state.set_ready(False)
    assert (await stream.read()).status == NOT_SERVING
    stream.cancel()


async def test_the_health_port_serves_nothing_but_health(health_port) -> None:
    _, channel = health_port
    call = pb_grpc.ExternalProcessorStub(channel).Process()
    with pytest.raises(grpc.aio.AioRpcError) as info:  # the status may end the call before the write
        await call.write(pb.ProcessingRequest())
        await call.read()
    assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED


async def test_a_health_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            OSError, match=rf"cannot listen on 127.0.0.1:{port} for gRPC health \(address in use"
        ):
            await start_health_grpc(Health(), f"127.0.0.1:{port}")


# --- through the server --------------------------------------------------------------------------


async def serve(tmp_path: Path, **overrides: object) -> RunningServer:
    """A server on the EDS file ``decode.json`` in ``tmp_path`` (absent until a test writes it)."""
    settings = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "discovery.eds_files": [str(tmp_path / "decode.json")],
        "discovery.poll_interval_seconds": 0.05,
        **overrides,
    }
    return await start_server(load_config(None, settings, environ={}))


async def test_both_ports_answer_every_name_and_turn_ready_together(tmp_path: Path) -> None:
    server = await serve(tmp_path, health_listen="127.0.0.1:0")
    try:
        assert server.health_port not in (0, server.grpc_port)
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as main,
            grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as separate,
        ):
            for channel in (main, separate):
                assert [await check(channel, name) for name in READY_NAMES] == [NOT_SERVING] * 4
                assert await check(channel, "liveness") == SERVING
            decode = [endpoint("10.0.0.2:8000", "a")]
            write_eds_file(tmp_path / "decode.json", "decode", decode)

            async def ready() -> bool:
                statuses = {await check(c, name) for c in (main, separate) for name in READY_NAMES}
                return statuses == {SERVING}

            await until(ready)
    finally:
        await server.stop(grace=0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:  # stopped with the server
            await check(channel, "liveness")
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_without_health_listen_there_is_no_second_port(tmp_path: Path) -> None:
    server = await serve(tmp_path)
    try:
        assert server.health_port == 0
    finally:
        await server.stop(grace=0)


async def test_the_health_port_is_plaintext_when_the_ext_proc_port_speaks_tls(tmp_path: Path) -> None:
    certificates = make_certificates(tmp_path / "certs")
    tls = {"tls.cert_file": str(certificates.server.cert), "tls.key_file": str(certificates.server.key)}
    server = await serve(tmp_path, health_listen="127.0.0.1:0", **tls)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as plaintext:
            assert await check(plaintext, "liveness") == SERVING
        trust = grpc.ssl_channel_credentials(certificates.ca.cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.grpc_port}", trust) as secure:
            assert await check(secure, "liveness") == SERVING
    finally:
        await server.stop(grace=0)


def listening_ports() -> set[int]:
    """The TCP ports this process's sockets listen on (Linux: its socket inodes in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # closed since it was listed
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def test_a_health_listen_in_use_stops_the_server_from_starting_and_frees_its_ports(
    tmp_path: Path,
) -> None:
    """The ext_proc port (any free one) is bound before the health port fails, and released.

    Which port it got is seen in what the process listens on: a port picked free beforehand could be
    taken by another process in between on a busy machine."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = listening_ports()
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} for gRPC health"):
            await serve(tmp_path, health_listen=f"127.0.0.1:{port}")
        assert listening_ports() <= before  # the ext_proc port was released
