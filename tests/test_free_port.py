"""free_port: ports for child processes, outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from floodgate.supervisor import _ephemeral_low, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    """bind(0) hands out a port in the range the kernel also uses for the source ports of
    outgoing connections; one of those took an Envoy's listener port between the pick and the
    bind in a fresh-clone CI run. Below the range no client socket can take it."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # none handed out twice, even before anything binds it
    assert all(20000 <= p < min(_ephemeral_low(), 32768) for p in ports), ports
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))
