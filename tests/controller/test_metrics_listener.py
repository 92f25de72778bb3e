"""The controller's metrics listener bounds what idle connections hold (an attacker review:
aiohttp's server kept every connection that sent nothing, or a request line trickled, for good;
with a container's 1,024 file descriptors, 1,100 such connections pinned a real controller at
1,024 open files, its own /metrics timed out and asyncio logged `Too many open files` on every
accept, and every connection the controller then had to open — Redis after a reconnect, a new
replica's scrape — would fail the same way)."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import urllib.request

import pytest
from floodgate.controller.metrics import ControllerMetrics
from floodgate.extproc import metrics as metrics_mod

from floodgate.supervisor import free_port


def _server_side(port: int) -> int:
    """This process's sockets connected on `port` as their local port (the listener's side of
    each connection, the listening socket left out)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            local_port = int(cols[1].rsplit(":", 1)[1], 16)
            if local_port == port and cols[3] == "01" and cols[9] in inodes:  # ESTABLISHED, ours
                n += 1
    return n


def _wait_closed(port: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while _server_side(port):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read()


async def test_idle_connections_to_the_controller_metrics_are_bounded_and_closed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_mod, "METRICS_READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(metrics_mod, "METRICS_MAX_CONNECTIONS", 4)
    port = free_port()
    server = await ControllerMetrics().serve(f"127.0.0.1:{port}")
    idle: list[socket.socket] = []
    try:
        assert b"floodgate_desired_replicas" in await asyncio.to_thread(_scrape, port)
        for i in range(3 * metrics_mod.METRICS_MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port))
            if i % 2:
                s.sendall(b"GET /metr")  # a request that never completes
            idle.append(s)
        await asyncio.sleep(0.5)
        # Past the bound a connection is closed unanswered: the listener holds at most the bound.
        assert _server_side(port) <= metrics_mod.METRICS_MAX_CONNECTIONS
        # Every idle connection is closed by the server (over the bound, or at the deadline).
        for s in idle:
            s.settimeout(10)
            try:
                got = await asyncio.to_thread(s.recv, 1024)
            except ConnectionResetError:
                got = b""
            assert got == b""
        assert await asyncio.to_thread(_wait_closed, port)
        # ...and a scrape is served again.
        assert b"floodgate_desired_replicas" in await asyncio.to_thread(_scrape, port)
    finally:
        for s in idle:
            s.close()
        await server.cleanup()
