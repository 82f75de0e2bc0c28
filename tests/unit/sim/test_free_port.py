"""``sim.gateway.free_port``: the loopback ports handed to listeners the tests start later."""

from __future__ import annotations

import socket

from sim.gateway import _ephemeral_start, free_port


def test_ports_are_distinct_bindable_and_below_the_outgoing_connections_range() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(10_000 <= port < _ephemeral_start() for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_some_listener_holds_is_skipped() -> None:
    taken = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", taken + 1))  # the next port this process would hand out
        other.listen()
        assert free_port() not in {taken, taken + 1}
