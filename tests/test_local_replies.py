"""Replies Envoy makes itself, through the shipped filter and bootstrap (real Envoy 1.40).

- Its HTTP/1 codec's replies (HTTP/1.0 -> 426, a header over 60 KiB or over 100 headers ->
  431, a malformed header name or Content-Length with Transfer-Encoding -> 400) keep their
  status. With `response_header_mode: SEND` in the filter's static mode Envoy closed the
  connection without any reply instead, on every route (clients read that as a connection
  error and retry a request that can never succeed). The static mode now skips the response
  headers and the processor turns them on per admitted request (`mode_override`); the static
  response trailers SEND still keep each stream open until its request ends.
- Its own upstream errors on the inference route (no model server reachable, a route
  timeout) are OpenAI-style JSON like Floodgate's replies (`local_reply_config` in
  envoy/local.yaml), not text/plain.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import pytest

from floodgate.envoy_config import load_yaml
from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.deploy.test_mesh import SIDECAR_FILTER, _start_sidecar
from tests.helpers import drained, metrics, post, wait_until

pytestmark = pytest.mark.integration

TRUST_LOCAL = {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}}

CODEC_CASES: dict[str, tuple[bytes, int]] = {
    "http/1.0": (b"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}", 426),
    "header over 60 KiB": (b"POST {path} HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000
                           + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}", 431),
    "101 headers": (b"POST {path} HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(101))
                    + b"Content-Length: 2\r\nConnection: close\r\n\r\n{{}}", 431),
    "bad header name": (b"POST {path} HTTP/1.1\r\nHost: x\r\nBad Header: v\r\nContent-Length: 2\r\n"
                        b"Connection: close\r\n\r\n{{}}", 400),
    "content-length and chunked": (b"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                   b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n0\r\n\r\n", 400),
}


def _raw_status(port: int, data: bytes) -> int | None:
    """The status line's code of Envoy's answer to raw bytes, or None for no reply at all."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        try:
            while b"\r\n" not in out:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    line = out.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[1].isdigit() else None


def _static(limit: int) -> dict[str, Any]:
    return {"pools": [{"name": "default", "limit": {"mode": "static", "initial": limit}}], **TRUST_LOCAL}


def _released(m: dict[str, float], reason: str | None = None) -> float:
    return sum(v for k, v in m.items() if k.startswith("floodgate_releases_total")
               and (reason is None or f'reason="{reason}"' in k))


async def test_codec_replies_keep_their_status_and_admission_still_releases(stack: LocalStack,
                                                                          upstream: int) -> None:
    stack.start_redis()
    p = stack.start_processor(_static(1))
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processors=[p])
    # The admitted route and one where the filter is off (the codec answers before routing).
    for path in (b"/v1/completions", b"/v1/models"):
        for name, (template, want) in CODEC_CASES.items():
            data = template.replace(b"{path}", path).replace(b"{{}}", b"{}")
            got = await asyncio.to_thread(_raw_status, envoy.port, data)
            assert got == want, (path, name, got)

    async with aiohttp.ClientSession() as s:
        # Admission works, and the permit is held exactly as long as the response streams:
        # response headers reach the processor through the override (its headers on the
        # response), trailers SEND keep the stream open until the last chunk.
        stream = asyncio.create_task(post(s, envoy.url, headers={"x-request-priority": "1",
                                                                 "x-test-chunks": "15", "x-test-delay-ms": "100"}))
        await asyncio.sleep(1.0)
        assert not stream.done()
        assert _released(await metrics(s, p.metrics_url)) == 0  # still streaming: still held
        r = await stream
        assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n"), (r.status, r.error)
        assert r.headers.get("x-floodgate-priority") == "1"  # the response-headers reply applied

        async def released(n: int) -> bool:
            return _released(await metrics(s, p.metrics_url)) == n

        assert await wait_until(lambda: released(1), 5)
        # The processor sees the response status (an upstream 5xx releases as upstream_error).
        bad = await post(s, envoy.url, headers={"x-request-priority": "1", "x-test-status": "500"})
        assert bad.status == 500
        assert await wait_until(lambda: released(2), 5)
        m = await metrics(s, p.metrics_url)
        assert _released(m, "stream_end") == 1 and _released(m, "upstream_error") == 1, m
        admitted = sum(v for k, v in m.items() if k.startswith("floodgate_decisions_total") and 'outcome="admitted"' in k)
        assert admitted == 2, m
        # The codec's replies never opened a stream at the processor.
        assert not any(k.startswith("floodgate_decisions_total") and 'outcome="rejected"' in k and v for k, v in m.items())
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0


async def test_the_sidecar_filter_keeps_codec_replies_too(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    p = stack.start_processor({"pools": [{"name": "mesh", "endpoint_picking": False}], **TRUST_LOCAL})
    port, _admin = _start_sidecar(stack, load_yaml(SIDECAR_FILTER), p.port, upstream)
    for path in (b"/v1/completions", b"/health"):  # admitted, skipped
        for name, (template, want) in CODEC_CASES.items():
            data = template.replace(b"{path}", path).replace(b"{{}}", b"{}")
            got = await asyncio.to_thread(_raw_status, port, data)
            assert got == want, (path, name, got)
    async with aiohttp.ClientSession() as s:
        r = await post(s, f"http://127.0.0.1:{port}", headers={"x-test-chunks": "5", "x-test-delay-ms": "100"})
        assert r.status == 200 and r.body.endswith(b"data: [DONE]\n\n"), (r.status, r.error)
        assert r.headers.get("x-floodgate-priority") == "1"  # response headers reached the processor

        async def released() -> bool:
            return _released(await metrics(s, p.metrics_url), "stream_end") == 1

        assert await wait_until(released, 5)
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0


def _error(r: Any) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(r.body)["error"]
    return err


async def test_envoys_own_upstream_errors_are_openai_json(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    p = stack.start_processor(_static(4))
    dead = stack.start_envoy([("127.0.0.1", free_port())], processors=[p])  # nothing listens there
    slow = stack.start_envoy([("127.0.0.1", upstream)], processors=[p], route_timeout_s=1)
    async with aiohttp.ClientSession() as s:
        # No model server reachable: Envoy's 503 "upstream connect error ..." (text/plain before).
        r = await post(s, dead.url, headers={"x-request-priority": "1"})
        assert r.status == 503, (r.status, r.body[:300])
        assert r.headers.get("content-type") == "application/json" and r.headers.get("retry-after") == "1"
        err = _error(r)
        assert err["type"] == "service_unavailable" and err["code"] == "upstream_unavailable", err
        assert "refused" not in r.body.decode().lower()  # Envoy's reset details stay inside
        # The route timeout: Envoy's 504 "upstream request timeout".
        r = await post(s, slow.url, headers={"x-request-priority": "1", "x-test-status": "500",
                                             "x-test-delay-ms": "3000"})
        assert r.status == 504 and r.headers.get("content-type") == "application/json", (r.status, r.body[:300])
        err = _error(r)
        assert err["type"] == "server_error" and err["code"] == "upstream_timeout", err
        assert "retry-after" not in r.headers
        # A model server's own error reply passes as it came (not a local reply).
        r = await post(s, slow.url, headers={"x-request-priority": "1", "x-test-status": "503"})
        assert r.status == 503 and _error(r) == {"message": "test failure", "type": "server_error", "code": None}
        assert "retry-after" not in r.headers
        m = await metrics(s, p.metrics_url)
    assert _released(m) == 3 and _released(m, "upstream_error") == 3, m
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0
