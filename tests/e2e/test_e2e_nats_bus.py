"""The shared state's NATS bus against a real nats-server (the private one ``serve --workers`` starts): what
the client refuses to send or throws away unread is counted, and the bus goes on."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from builders import endpoint
from polling import until

from ext_proc.app import start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
from ext_proc.shared import nats_bus
from ext_proc.shared.config import NatsConfig
from ext_proc.shared.nats_bus import NatsBus
from ext_proc.shared.runner import Handler
from ext_proc.workers import find_nats_server, start_private_nats
from standins.metrics import by_outcome

DECODE = "10.0.1.1:8000"
DROPPED = "pd_extproc_shared_messages_dropped_total"


async def test_a_lone_replica_counts_no_message_dropped(tmp_path: Path) -> None:
    """The first replica's sync request has no peer to hear it: the server's "no responders" status
    answer is not a peer's message, not counted dropped (nor logged garbled)."""
    binary = find_nats_server()
    assert binary is not None
    nats = start_private_nats(binary)
    try:
        write_eds_file(tmp_path / "p.yaml", "prefill", [endpoint("10.0.0.1:8000", "a")])
        write_eds_file(tmp_path / "d.yaml", "decode", [endpoint(DECODE, "a")])
        config = load_config(
            None,
            {
                "listen": "127.0.0.1:0",
                "metrics_listen": "127.0.0.1:0",
                "discovery.eds_files": [str(tmp_path / "p.yaml"), str(tmp_path / "d.yaml")],
                "shared_state.kind": "nats",
                "shared_state.nats.url": nats.url,
                "shared_state.nats.token": nats.token,
                "shared_state.sync_wait_seconds": 0.3,
            },
            environ={},
        )
        server = await start_server(config)
        try:
            # start() waited sync_wait_seconds for answers to its sync request: the server's came at once
            assert server.shared.describe()["connected"] is True
            async with aiohttp.ClientSession() as session:
                admin = f"http://127.0.0.1:{server.admin_port}"
                assert await by_outcome(session, admin, DROPPED, "reason") == {}
        finally:
            await server.stop(grace=0)
    finally:
        nats.stop()


@contextlib.asynccontextmanager
async def _buses(count: int) -> AsyncIterator[tuple[list[NatsBus], list[tuple[str, str]]]]:
    """``count`` buses on one private nats-server, and what they report dropped: (reason, detail)."""
    binary = find_nats_server()
    assert binary is not None
    nats = start_private_nats(binary)
    dropped: list[tuple[str, str]] = []
    config = NatsConfig(url=nats.url, token=nats.token)
    buses: list[NatsBus] = []
    try:
        for i in range(count):
            buses.append(
                NatsBus(config, f"bus-{i}", lambda state: None, lambda *report: dropped.append(report))
            )
        yield buses, dropped
    finally:
        for bus in buses:
            await bus.close()
        nats.stop()


async def _started(bus: NatsBus, subscriptions: dict[str, Handler]) -> None:
    await bus.start(subscriptions, lambda: None)
    assert bus.connected


async def test_a_message_the_server_would_refuse_is_counted_as_a_publish_error_and_the_bus_goes_on() -> None:
    async with _buses(2) as ((sender, receiver), dropped):
        got: list[bytes] = []
        await _started(receiver, {"t.x": lambda payload, _: got.append(payload)})
        await _started(sender, {})
        sender.publish("t.x", b"\x00" * (2 * 1024 * 1024))  # over the server's max_payload (1 MiB)
        sender.publish("t.x", b"small")
        await until(lambda: got == [b"small"], 10)
        assert [reason for reason, _ in dropped] == ["publish_error"]
        assert "2097152 bytes on t.x" in dropped[0][1]


async def test_messages_beyond_the_pending_limit_are_counted_as_slow_consumer_and_the_rest_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nats_bus, "PENDING_MESSAGES", 8)
    async with _buses(2) as ((sender, receiver), dropped):
        got: list[bytes] = []

        def slow(payload: bytes, _: str) -> None:
            time.sleep(0.002)  # a handler that blocks the loop: the client's queue fills meanwhile
            got.append(payload)

        await _started(receiver, {"t.x": slow})
        await _started(sender, {})
        flood = 500
        for i in range(flood):
            sender.publish("t.x", b"%d" % i)
        await until(lambda: len(got) + len(dropped) >= flood, 20)
        assert {reason for reason, _ in dropped} == {"slow_consumer"}
        assert got and len(got) + len(dropped) == flood
        sender.publish("t.x", b"after")  # the subscription goes on
        await until(lambda: got[-1] == b"after", 10)
