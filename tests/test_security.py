"""Security defaults of the shipped local bootstrap, checked through the real Envoy."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import redis.asyncio as aioredis

from floodgate.stack import LocalStack
from tests.helpers import get_json, metrics

pytestmark = pytest.mark.integration

ADMIN_PATHS = ["/sleep?level=1", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache",
               "/metrics", "/sleep/", "/SLEEP"]
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


async def test_wrong_redis_password_degrades_instead_of_failing(stack: LocalStack, upstream: int) -> None:
    _, url = stack.sup.start_redis(password="right")
    stack.redis_url = url
    stack.start_processor({"redis": {"password": "wrong"}})
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    async with aiohttp.ClientSession() as s:
        async with s.post(envoy.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200  # admitted by the local limiter
        m = await metrics(s, stack.processors[0].metrics_url)
    assert m["floodgate_degraded"] == 1
