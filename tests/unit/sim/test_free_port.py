"""``sim.gateway.free_port``: the loopback ports handed to listeners the tests start later."""

from __future__ import annotations

import socket
from itertools import pairwise

from sim.gateway import _BLOCK, _ephemeral_start, free_port


def test_ports_are_blocks_apart_bindable_and_below_the_outgoing_connections_range() -> None:
    ports = sorted(free_port() for _ in range(50))
    assert all(b - a >= _BLOCK for a, b in pairwise(ports))  # an engine's port + its rank
    assert all(port >= 10_000 and port + _BLOCK <= _ephemeral_start() for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_some_listener_holds_is_skipped() -> None:
    taken = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", taken + _BLOCK + 3))  # inside the next block this process would hand out
        other.listen()
        assert free_port() >= taken + 2 * _BLOCK
