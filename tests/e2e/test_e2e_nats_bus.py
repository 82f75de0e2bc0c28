"""The shared state's NATS bus against a real nats-server (the private one ``serve --workers`` starts)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from builders import endpoint

from ext_proc.app import start_server
from ext_proc.config import load_config
from ext_proc.discovery.eds import write_eds_file
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
