"""Requests that run no model take no permit (pools[].unadmitted_methods), through the real
Envoy, the real processor and a real Redis-protocol server: a CORS preflight, HEAD and GET on
the inference paths pass while the pool is full, where they used to take a permit, queue or get
429. Anything that could still run the model is admitted as before: a body, a protocol upgrade
(vLLM's /v1/realtime is a WebSocket opened with GET), a method-override header, any other
method."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import pytest
from floodgate.extproc.config import AdmissionConfig

from floodgate.envoy_config import ENVOY_DIR, load_yaml, write_config
from floodgate.stack import LocalStack
from floodgate.supervisor import free_port, wait_for_port
from tests.deploy.test_mesh import SIDECAR_FILTER, inbound_bootstrap
from tests.helpers import drained, get_json, metrics, post, wait_until

pytestmark = pytest.mark.integration

# One permit, and a standard request that finds it taken gets 429 at once (queue_full): every
# request the processor admits while the hold runs says so, whatever the clock.
FULL = {"pools": [{"name": "default", "limit": {"mode": "static", "initial": 1}, "local_credits": 0,
                   "classes": {0: {"max_queue": 0, "share": 0.5}, 1: {"max_queue": 0, "share": 0.1},
                               2: {"max_queue": 0, "share": 0.0}}}]}


async def raw(port: int, request: bytes) -> tuple[int, dict[str, str]]:
    """Send bytes as they are; the status and headers of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
    finally:
        writer.close()
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers


def req(method: str, path: str, *extra: str, body: bytes | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: gw", "connection: close", *extra]
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


PREFLIGHT = req("OPTIONS", "/v1/chat/completions", "origin: https://app.example",
                "access-control-request-method: POST", "access-control-request-headers: content-type")
# Requests that run no model: they pass while the pool is full.
PASS = {
    "cors preflight": PREFLIGHT,
    "head": req("HEAD", "/v1/chat/completions"),
    "get": req("GET", "/v1/chat/completions"),
    "get with a query": req("GET", "/v1/completions?stream=true"),
    "empty body": req("GET", "/v1/completions", body=b""),
    "untrusted priority": req("GET", "/v1/embeddings", "x-request-priority: 0", "x-test-id: prio"),
}
# Requests that could run the model: admitted (429 while the pool is full).
ADMIT = {
    "post": req("POST", "/v1/chat/completions", body=b"{}"),
    "get with a body": req("GET", "/v1/chat/completions", "content-type: application/json", body=b'{"prompt":"x"}'),
    "get, chunked body": req("GET", "/v1/completions", "transfer-encoding: chunked") + b"2\r\n{}\r\n0\r\n\r\n",
    "x-http-method-override": req("GET", "/v1/chat/completions", "x-http-method-override: POST"),
    "x-http-method": req("HEAD", "/v1/chat/completions", "X-HTTP-Method: POST"),
    "x-method-override": req("OPTIONS", "/v1/chat/completions", "x-method-override: POST"),
    "put": req("PUT", "/v1/chat/completions", body=b"{}"),
    "patch": req("PATCH", "/v1/chat/completions", body=b"{}"),
    "delete": req("DELETE", "/v1/chat/completions"),
}


def _count(m: dict[str, float], prefix: str, *parts: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix) and all(p in k for p in parts))


async def _hold(s: aiohttp.ClientSession, url: str, upstream: int) -> asyncio.Task[Any]:
    """A request that holds the pool's one permit (streams until cancelled or ~20 s)."""
    task = asyncio.create_task(post(s, url, headers={"x-test-chunks": "400", "x-test-delay-ms": "50"}))

    async def holding() -> bool:
        return int((await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["inflight"]) == 1

    assert await wait_until(holding, 10)
    return task


async def test_requests_that_run_no_model_pass_a_full_pool(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    p = stack.start_processor(FULL)
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    async with aiohttp.ClientSession() as s:
        hold = await _hold(s, envoy.url, upstream)
        try:
            for name, data in ADMIT.items():
                status, headers = await raw(envoy.port, data)
                assert status == 429 and headers.get("x-floodgate-reject-reason") == "queue_full", (name, status)
            for name, data in PASS.items():
                status, headers = await raw(envoy.port, data)
                assert status != 429 and "x-floodgate-reject-reason" not in headers, (name, status, headers)
            # Cheap reads on their own route (no processor) pass as before.
            status, _ = await raw(envoy.port, req("GET", "/v1/models"))
            assert status == 200
            m = await metrics(s, p.metrics_url)
            st = await get_json(s, f"http://127.0.0.1:{upstream}/stats")
        finally:
            hold.cancel()
    # Every request that passed reached the model server, none of those admitted did.
    # (Envoy's HTTP/1 codec answers 400 to a lower-case method: it never reaches the processor.)
    assert st["paths"] == ["/v1/completions",  # the hold
                           "/v1/chat/completions", "/v1/chat/completions", "/v1/chat/completions",
                           "/v1/completions?stream=true", "/v1/completions", "/v1/embeddings", "/v1/models"], st["paths"]
    # An untrusted priority header is dropped on the way, as on an admitted request.
    (prio,) = [h for h in st["seen"] if h.get("x-test-id") == "prio"]
    assert "x-request-priority" not in prio, prio
    assert _count(m, "floodgate_unadmitted_total", 'reason="method"') == len(PASS)
    assert _count(m, "floodgate_untrusted_priority_header_total") == 1  # the one it dropped, counted
    assert _count(m, "floodgate_decisions_total", 'outcome="rejected"', 'reason="queue_full"') == len(ADMIT)
    assert _count(m, "floodgate_decisions_total", 'outcome="admitted"') == 1  # the hold
    st2 = await drained(stack.redis_url)
    assert st2.inflight_total == 0 and st2.queued_total == 0


def _sidecar_with_upgrades(stack: LocalStack, processor_port: int, app_port: int) -> int:
    """The shipped sidecar filter in an inbound listener that allows WebSocket upgrades, as
    Istio's inbound listeners do by default."""
    cluster = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = processor_port
    port, admin = free_port(), free_port()
    boot = inbound_bootstrap(load_yaml(SIDECAR_FILTER), [cluster], port=port, admin_port=admin, app_port=app_port)
    boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["upgrade_configs"] = [
        {"upgrade_type": "websocket"}]
    path = write_config(boot, stack.sup.workdir / f"sidecar-ws{port}.json")
    child = stack.sup.start_envoy(path, admin, name=f"sidecar-ws{port}")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    return port


async def test_a_websocket_upgrade_is_admitted(stack: LocalStack, upstream: int) -> None:
    """vLLM's /v1/realtime runs the model over a WebSocket opened with GET. A listener that
    allows upgrades (an Istio sidecar does by default) must still admit it."""
    stack.start_redis()
    p = stack.start_processor({**FULL, "pools": [{**FULL["pools"][0], "name": "mesh"}]})
    port = _sidecar_with_upgrades(stack, p.port, upstream)
    url = f"http://127.0.0.1:{port}"
    ws = req("GET", "/v1/realtime?model=m", "upgrade: websocket", "connection: Upgrade",
             "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==", "sec-websocket-version: 13")
    async with aiohttp.ClientSession() as s:
        hold = await _hold(s, url, upstream)
        try:
            status, headers = await raw(port, ws)
            assert status == 429 and headers.get("x-floodgate-reject-reason") == "queue_full", (status, headers)
            status, headers = await raw(port, PREFLIGHT)  # the sidecar asks the same processor
            assert status != 429 and "x-floodgate-reject-reason" not in headers, (status, headers)
            m = await metrics(s, p.metrics_url)
        finally:
            hold.cancel()
    assert _count(m, "floodgate_unadmitted_total", 'reason="method"') == 1
    assert _count(m, "floodgate_decisions_total", 'outcome="rejected"') == 1


async def test_a_request_passed_by_its_method_but_refused_counts_as_refused(stack: LocalStack,
                                                                           upstream: int) -> None:
    """With endpoint picking and no active endpoint, a GET that takes no permit still gets 503
    no_endpoints: counted as a refusal (floodgate_decisions_total), not as passed
    (floodgate_unadmitted_total counted it as passed before), with the Retry-After an admitted
    request gets (`retry_after_min_s`, jittered, and retry-after-ms; it said 1 whatever was set)."""
    stack.start_redis()
    # default_priority 0: its class's queue timeout (20 s) is what an unknown wait would fall back
    # to; a 503 no_endpoints says retry_after_min_s whatever the class.
    p = stack.start_processor({"admission": {"retry_after_min_s": 3, "retry_after_max_s": 60, "default_priority": 0},
                               "pools": [{"name": "default", "endpoint_picking": True}]})
    envoy = stack.start_envoy([("127.0.0.1", upstream)], picking=True)
    async with aiohttp.ClientSession() as s:
        status, headers = await raw(envoy.port, req("GET", "/v1/chat/completions"))
        assert status == 503 and headers.get("x-floodgate-reject-reason") == "no_endpoints", (status, headers)
        top = 3 * (1 + AdmissionConfig().retry_after_jitter)
        assert 3 <= int(headers["retry-after"]) <= math.ceil(top), headers
        assert 3000 <= int(headers["retry-after-ms"]) <= top * 1000, headers
        m = await metrics(s, p.metrics_url)
    assert _count(m, "floodgate_unadmitted_total") == 0
    assert _count(m, "floodgate_decisions_total", 'outcome="rejected"', 'reason="no_endpoints"') == 1
