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
import copy
import json
import socket
from typing import Any

import aiohttp
import pytest

from floodgate.envoy_config import ENVOY_DIR, load_yaml, write_config
from floodgate.stack import LocalStack
from floodgate.supervisor import free_port, wait_for_port
from tests.deploy.test_mesh import (
    SIDECAR_FILTER,
    _start_sidecar,
    ext_proc_config,
    http_filter_patches,
    inbound_bootstrap,
    patches,
)
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
    return _raw_reply(port, data)[0]


def _raw_reply(port: int, data: bytes) -> tuple[int | None, bytes]:
    """(status code or None for no reply, the rest of what Envoy sent until it closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    line = out.split(b"\r\n", 1)[0].split()
    return (int(line[1]) if len(line) >= 2 and line[1].isdigit() else None), out


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
            got, raw = await asyncio.to_thread(_raw_reply, envoy.port, data)
            assert got == want, (path, name, got)
            # OpenAI-style JSON like every other error (a review saw text/plain for the 431)
            head, _, body = raw.partition(b"\r\n\r\n")
            assert b"content-type: application/json" in head.lower(), (name, head)
            assert json.loads(body)["error"]["code"] == "bad_request", (name, body)

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

        ok = await wait_until(released, 5)
        m = await metrics(s, p.metrics_url)
        assert ok, {k: v for k, v in m.items() if k.startswith(("floodgate_releases_total", "floodgate_decisions_total"))}
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

        # A permit is released when Envoy ends the ext_proc stream, which may come just after the
        # client has the reply: wait for the third release rather than read once.
        async def released() -> bool:
            return _released(await metrics(s, p.metrics_url)) >= 3

        assert await wait_until(released, 5)
        m = await metrics(s, p.metrics_url)
    assert _released(m) == 3 and _released(m, "upstream_error") == 3, m
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0


async def _raw_head_and_body(port: int, data: bytes) -> tuple[int | None, str, bytes]:
    """(status, lower-cased head, body) of Envoy's answer to raw bytes on one connection, read up
    to its content-length (an upgrade request keeps the connection open)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        head = (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)).decode("latin-1").lower()
        length = next((int(h.split(":", 1)[1]) for h in head.split("\r\n") if h.startswith("content-length:")), 0)
        body = await asyncio.wait_for(r.readexactly(length), 10)
    finally:
        w.close()
    line = head.split("\r\n", 1)[0].split()
    return (int(line[1]) if len(line) >= 2 and line[1].isdigit() else None), head, body


async def test_connect_and_refused_upgrades_are_openai_json(stack: LocalStack, upstream: int) -> None:
    """CONNECT (no route takes it: 404) and a WebSocket upgrade (403) were empty text/plain replies
    (an attacker review); neither reaches a model server or keeps a permit."""
    stack.start_redis()
    p = stack.start_processor(_static(4))
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processors=[p])
    cases = {
        b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nhost: 127.0.0.1:1\r\n\r\n": (404, "not_found"),
        (b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
         b"sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"): (403, "invalid_request_error"),
    }
    for data, (status, kind) in cases.items():
        got, head, body = await _raw_head_and_body(envoy.port, data)
        assert got == status, (data[:20], got, head)
        assert "content-type: application/json" in head, head
        assert json.loads(body)["error"]["type"] == kind, body
    async with aiohttp.ClientSession() as s:
        # (The upgrade, a GET that could run the model, was admitted before the router refused
        # it; its permit comes back with the stream.)
        async def released() -> bool:
            return _released(await metrics(s, p.metrics_url)) >= 1

        assert await wait_until(released, 5)
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0


async def test_an_auth_filters_403_keeps_its_own_reply(stack: LocalStack, upstream: int) -> None:
    """The JSON mappers for Envoy's 403/404 match by their details (`upgrade_failed`,
    `route_not_found`): matched by status, an RBAC or ext_authz denial in front of the processor
    (where docs/operations.md puts the auth filter) read as "does not accept this request (an
    upgrade ...)" (a review of the change)."""
    from floodgate.envoy_config import render_local, write_config
    from floodgate.supervisor import free_port, wait_for_port

    stack.start_redis()
    p = stack.start_processor(_static(4))
    rbac = {"name": "envoy.filters.http.rbac", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
        "rules": {"action": "DENY", "policies": {"no-guests": {
            "permissions": [{"any": True}],
            "principals": [{"header": {"name": "x-user", "string_match": {"exact": "guest"}}}]}}}}}
    port, admin = free_port(), free_port()
    cfg = render_local(listen_port=port, admin_port=admin, processors=[("127.0.0.1", p.port)],
                       upstreams=[("127.0.0.1", upstream)])
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(1, rbac)  # after the strip filter, before ext_proc
    child = stack.sup.start_envoy(write_config(cfg, stack.sup.workdir / "envoy-rbac.json"), admin, name="envoy-rbac")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    async with aiohttp.ClientSession() as s:
        r = await post(s, f"http://127.0.0.1:{port}", headers={"x-user": "guest"})
    assert r.status == 403, (r.status, r.body[:200])
    assert b"RBAC: access denied" in r.body and b"unsupported_request" not in r.body, r.body[:300]


def _istio_sidecar(stack: LocalStack, processor_port: int, app_port: int, *, fail_open: bool = True) -> str:
    """deploy/istio/envoyfilter.yaml as a sidecar gets it: its inbound HCM merge (with the
    local_reply_config), the strip filter and the ext_proc filter in an inbound listener that
    routes to the local replica, and the processor cluster (the shipped include, pointed here)."""
    strip, http = http_filter_patches()
    (hcm,) = patches("NETWORK_FILTER")
    filt = copy.deepcopy(http["patch"]["value"])
    if not fail_open:
        ext_proc_config(filt)["failure_mode_allow"] = False
    cluster = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = processor_port
    port, admin = free_port(), free_port()
    boot = inbound_bootstrap(filt, [cluster], port=port, admin_port=admin, app_port=app_port,
                             strip=strip["patch"]["value"])
    merged = {k: v for k, v in hcm["patch"]["value"]["typed_config"].items() if k != "@type"}
    boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].update(merged)
    path = write_config(boot, stack.sup.workdir / f"istio-sidecar{port}.json")
    child = stack.sup.start_envoy(path, admin, name=f"istio-sidecar{port}")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    return f"http://127.0.0.1:{port}"


def test_the_istio_sidecar_carries_the_gateways_local_replies() -> None:
    """An HTTP filter cannot carry local_reply_config (a field of the HttpConnectionManager
    only), so the EnvoyFilter merges the gateway's, exactly, into the inbound HCM."""
    (hcm,) = patches("NETWORK_FILTER")
    gateway = load_yaml(ENVOY_DIR / "local.yaml")["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    assert hcm["patch"]["value"]["typed_config"]["local_reply_config"] == gateway["local_reply_config"]
    assert "local_reply_config" not in json.dumps(load_yaml(SIDECAR_FILTER))  # it could not go there
    # Failing closed (if set so) answers 503 as the gateway filter does, not Envoy's empty 500.
    assert ext_proc_config(load_yaml(SIDECAR_FILTER))["status_on_error"] == \
        load_yaml(ENVOY_DIR / "floodgate-filter.yaml")["typed_config"]["status_on_error"]


async def test_the_istio_sidecars_own_errors_are_openai_json(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    p = stack.start_processor({"pools": [{"name": "mesh", "endpoint_picking": False}], **TRUST_LOCAL})
    dead_replica = _istio_sidecar(stack, p.port, free_port())  # nothing listens on the replica's port
    sidecar = _istio_sidecar(stack, p.port, upstream)
    no_processor = _istio_sidecar(stack, free_port(), upstream, fail_open=False)
    async with aiohttp.ClientSession() as s:
        # The replica unreachable: Envoy's 503 "upstream connect error ..." (text/plain before).
        r = await post(s, dead_replica, headers={"x-request-priority": "1"})
        assert r.status == 503, (r.status, r.body[:300])
        assert r.headers.get("content-type") == "application/json" and r.headers.get("retry-after") == "1", r.headers
        err = _error(r)
        assert err["type"] == "service_unavailable" and err["code"] == "upstream_unavailable", err
        assert "refused" not in r.body.decode().lower()
        # Skipped paths too (the local reply is the HCM's, not the filter's).
        async with s.get(dead_replica + "/health") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "upstream_unavailable"
        # The replica's own error reply passes as it came; admission still answers.
        r = await post(s, sidecar, headers={"x-request-priority": "1", "x-test-status": "503"})
        assert r.status == 503 and _error(r) == {"message": "test failure", "type": "server_error", "code": None}
        assert "retry-after" not in r.headers
        r = await post(s, sidecar)
        assert r.status == 200 and r.headers.get("x-floodgate-priority") == "1", (r.status, r.body[:200])
        # Failing closed with no processor: 503 admission_unavailable, as at the gateway.
        r = await post(s, no_processor)
        assert r.status == 503 and r.headers.get("retry-after") == "1", (r.status, r.body[:300])
        assert _error(r)["code"] == "admission_unavailable"
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0
