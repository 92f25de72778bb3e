"""Small clients for the integration tests: HTTP through Envoy, metrics, Redis state."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from floodgate.extproc.state import PoolStatus, read_pool_status, redis_client
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from aiohttp import web
    from floodgate.extproc.admission import Admitter
    from floodgate.extproc.metrics import Metrics
    from floodgate.extproc.redis_client import AnyRedis
    from floodgate.extproc.registry import Registry

    from floodgate.stack import LocalStack


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed: float
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


async def post(session: aiohttp.ClientSession, url: str, *, headers: dict[str, str] | None = None,
               timeout: float = 30.0, stream: bool = True) -> Reply:
    t0 = time.monotonic()
    body = {"model": "m", "prompt": "hello", "stream": stream, "max_tokens": 4}
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers or {},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            data = await r.read()
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, data, time.monotonic() - t0)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Reply(0, {}, b"", time.monotonic() - t0, error=f"{type(exc).__name__}: {exc}")


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as r:
        return await r.json()


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Flatten a /metrics page into {'name{a="b"}': value} with labels sorted."""
    async with session.get(url) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def start_test_upstream(stack: LocalStack, name: str, port: int | None = None, status: int = 0) -> tuple[Any, int]:
    """tests/upstream.py as a replica on `port` (a free one by default), answering every
    completion with `status` when non-zero; returns (its child process, its port)."""
    import sys
    from pathlib import Path

    from floodgate.supervisor import free_port

    port = port or free_port()
    script = Path(__file__).resolve().parent / "upstream.py"
    child = stack.start_upstream([sys.executable, str(script), "--port", str(port), "--status", str(status)],
                                 name=name, port=port)
    return child, port


async def pool_status(redis_url: str, pool: str = "default") -> PoolStatus:
    client = redis_client(redis_url, op_timeout_s=2)
    try:
        return await read_pool_status(client, pool)
    finally:
        await client.aclose()


async def wait_until(pred: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll `pred` (returning a bool, or an awaitable of one) until true or `timeout`."""
    async def check() -> bool:
        r = pred()
        return bool(await r if inspect.isawaitable(r) else r)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(interval)
    return await check()


async def drained(redis_url: str, timeout: float = 10.0) -> PoolStatus:
    """Wait until nothing holds a permit and nothing waits; return the final status."""
    async def idle() -> bool:
        st = await pool_status(redis_url)
        return st.inflight_total == 0 and st.queued_total == 0
    await wait_until(idle, timeout)
    return await pool_status(redis_url)


def picking_admitter(url: str, client: AnyRedis, initial: int, pool: str = "f",
                     prefill_tokens_per_s: float = 0.0) -> Admitter:
    """A processor (gateway `a`) for one pool that picks endpoints and runs Vegas from `initial`,
    reading the registry every 50 ms: the set-up of the tests where the limit follows the
    active endpoints. Prefill-aware picking is off unless asked for: these tests count grants
    on a frozen script clock, where its estimates never drain (tests/test_prefill.py has it)."""
    from floodgate.extproc.admission import Admitter
    from floodgate.extproc.config import Config

    cfg = Config.model_validate({
        "redis": {"url": url, "poll_interval_s": 0.05},
        "pools": [{"name": pool, "endpoint_picking": True, "prefill_tokens_per_s": prefill_tokens_per_s,
                   "limit": {"mode": "vegas", "initial": initial, "min": 1}}]})
    return Admitter(cfg, client, gateway_id="a")


@dataclass
class Gateway:
    """One processor on a fresh server (`one_processor`), and what a test reaches it with."""

    admitter: Admitter
    client: AnyRedis  # the processor's own client
    raw: aioredis.Redis  # a connection of the test's own to the same server (the test's hand)
    metrics: Metrics


@contextlib.asynccontextmanager
async def one_processor(stack: LocalStack, *, limit: int, lease_ttl_s: float, op_timeout_s: float,
                        pool: dict[str, Any] | None = None, **redis: float) -> AsyncIterator[Gateway]:
    """A started processor (gateway `gw`) with one pool `a` (static `limit`, no local credits; `pool`: more of its settings)
    on a fresh Redis-protocol server, with `redis.*` settings besides the URL and TTL (the poll
    interval 60 s unless given: only the test's calls and the renewal touch Redis). Stopped and
    its connections closed on exit."""
    import redis.asyncio as aioredis
    from floodgate.extproc.admission import Admitter
    from floodgate.extproc.config import Config
    from floodgate.extproc.metrics import Metrics

    url = stack.start_redis()
    cfg = Config.model_validate({
        "redis": {"url": url, "lease_ttl_s": lease_ttl_s, "op_timeout_s": op_timeout_s,
                  "poll_interval_s": 60, **redis},
        "pools": [{"name": "a", "match_authority": "a.x", "local_credits": 0,
                   "limit": {"mode": "static", "initial": limit}, **(pool or {})}]})
    client = redis_client(url, op_timeout_s=op_timeout_s)
    raw = aioredis.Redis.from_url(url)
    metrics = Metrics()
    admitter = Admitter(cfg, client, metrics=metrics, gateway_id="gw")
    await admitter.start()
    try:
        yield Gateway(admitter, client, raw, metrics)
    finally:
        await admitter.stop()
        await client.aclose()
        await raw.aclose()


async def activate(reg: Registry, first: int, last: int) -> None:
    """Endpoints 10.0.0.<i>:8000 (replica r<i>) for i in first..last turn active."""
    for i in range(first, last + 1):
        await reg.set(f"10.0.0.{i}:8000", "active", f"r{i}")


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[int]:
    """`app` served on a free loopback port (yielded) until the block ends: a stand-in server
    for what the real components cannot be made to do (a bad page, a slow answer)."""
    from aiohttp import web

    from floodgate.supervisor import free_port

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def subscribed(client: Any, pool: str, *gateways: str) -> Any:
    """Subscribe to these gateways' grant channels of `pool`, as their live processors would:
    the script grants a waiter only while someone hears its gateway (leases.lua `hears`), and a
    test that plays a gateway by calling the script directly must listen for it too. The
    caller closes it (`aclose`)."""
    from floodgate.extproc.redis_client import subscribe
    from floodgate.extproc.schema import gateway_channel

    return await subscribe(client, [gateway_channel(gw, pool) for gw in gateways], connect_timeout_s=2.0)


@contextlib.asynccontextmanager
async def listening(client: Any, pool: str, *gateways: str) -> AsyncIterator[None]:
    """`subscribed` for the duration of the block."""
    sub = await subscribed(client, pool, *gateways)
    try:
        yield
    finally:
        await sub.aclose()
