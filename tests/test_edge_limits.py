"""The shipped edge listener's bounds on what one client connection can hold (real Envoy 1.40).

A connection-level review: with Envoy's HTTP/2 defaults (256 MiB windows, unbounded streams per
connection) one h2c connection parked 530 MiB of queued request bodies in Envoy within a second,
and 1,000 header-only streams on one connection (48 KB sent) filled a class's whole queue; 2,000
silent connections stayed open (Envoy's 1 h idle timeout, no connection limit). The bootstrap now
advertises Envoy's edge settings and caps the connections it holds."""

from __future__ import annotations

import asyncio
import struct

import aiohttp
import pytest

from floodgate.stack import LocalStack
from tests.helpers import metrics
from tests.test_admission_e2e import TRUST_LOCAL

pytestmark = pytest.mark.integration

SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


async def _server_settings(port: int) -> dict[int, int]:
    """Open an h2c connection (prior knowledge) and read the SETTINGS Envoy sends first."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0))
        await w.drain()
        head = await asyncio.wait_for(r.readexactly(9), 5)
        length, kind = int.from_bytes(head[:3], "big"), head[3]
        assert kind == 0x4, f"expected SETTINGS first, got frame type {kind}"
        body = await r.readexactly(length)
        return {int.from_bytes(body[i:i + 2], "big"): int.from_bytes(body[i + 2:i + 6], "big")
                for i in range(0, length, 6)}
    finally:
        w.close()


async def test_one_h2_connection_gets_envoys_edge_bounds(stack: LocalStack) -> None:
    stack.start_redis()
    p = stack.start_processor({"pools": [{"name": "default", "limit": {"mode": "static", "initial": 4}}],
                               **TRUST_LOCAL})
    envoy = stack.start_envoy([("127.0.0.1", 1)], processors=[p])
    settings = await _server_settings(envoy.port)
    assert settings.get(SETTINGS_MAX_CONCURRENT_STREAMS) == 100, settings
    assert settings.get(SETTINGS_INITIAL_WINDOW_SIZE) == 65536, settings
    # The overload manager watches the connection count (the cap is its configured maximum).
    async with aiohttp.ClientSession() as s:
        stats = await metrics(s, f"http://127.0.0.1:{envoy.admin_port}/stats/prometheus")
    assert any("global_downstream_max_connections" in k for k in stats), sorted(k for k in stats if "overload" in k)
