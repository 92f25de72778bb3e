"""free_port: ports for child processes, outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

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


def test_a_port_range_from_the_environment_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # Test workers side by side each take their own range (tests/conftest.py).
    monkeypatch.setenv("FLOODGATE_PORT_RANGE", "24000-25000")
    assert all(24000 <= free_port() < 25000 for _ in range(20))
    for bad in ("", "x", "25000-24000", "1-2", "24000-70000"):
        monkeypatch.setenv("FLOODGATE_PORT_RANGE", bad)
        assert 20000 <= free_port() < min(_ephemeral_low(), 32768), bad


@pytest.mark.parametrize("bad", ["abc", "50000-40000", "80-90"])
def test_a_port_range_that_cannot_be_used_stops_the_cli_naming_the_variable(bad: str) -> None:
    # It was ignored without a word: `floodgate up` ran on the default range (review user).
    import os
    import subprocess
    import sys

    env = {**os.environ, "FLOODGATE_PORT_RANGE": bad}
    r = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", "redis://127.0.0.1:1/0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"FLOODGATE_PORT_RANGE={bad!r}" in r.stderr and "Traceback" not in r.stderr, r.stderr
