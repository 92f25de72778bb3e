"""A request cancelled while its permit is on its way leaks no permit.

Envoy cancels the ext_proc stream when the client goes away. A connection-level review read two
windows in which a cancellation left a permit held: between the grant and the reply (the granted
endpoint looked up in the registry), where the permit sat in `held` and was renewed for good, and
a plain acquire in the air, whose lease Redis kept until it expired (`lease_ttl_s`). Both run here
on a real Redis with the window held open: a slow registry look-up, and Redis frozen (SIGSTOP)
with the acquire sent."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import pytest
from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.registry import Registry
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.helpers import wait_until


def _config(url: str, picking: bool, credits: int = 0, limit: int = 2) -> Config:
    return Config.model_validate({
        "redis": {"url": url, "op_timeout_s": 5, "lease_ttl_s": 60},
        "pools": [{"name": "f", "endpoint_picking": picking, "local_credits": credits,
                   "limit": {"mode": "static", "initial": limit}}]})


async def _leased(a: Admitter) -> int:
    return sum((await a.pools["f"].state.status()).inflight)


@pytest.mark.integration
async def test_cancelled_between_the_grant_and_the_reply(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    a = Admitter(_config(url, picking=True), c, gateway_id="a")
    try:
        await reg.set("10.0.0.1:8000", "active", "r1")
        await a.start()
        rt = a.pools["f"]
        await a._tick(rt)
        assert rt.picker.active == ["10.0.0.1:8000"]
        # A replica promoted since this processor's last registry read: the grant names it,
        # and the processor looks it up in the registry's hash (held open here) before replying.
        rt.picker.update = lambda _eps: None  # type: ignore[method-assign]  # its view stays behind
        await reg.set("10.0.0.1:8000", "draining", "r1")
        await reg.set("10.0.0.2:8000", "active", "r2")
        asked, answer = asyncio.Event(), asyncio.Event()

        async def slow_hexists(*_args: Any) -> int:
            asked.set()
            await answer.wait()
            return 1

        rt.client.hexists = slow_hexists  # type: ignore[method-assign]
        req = asyncio.create_task(a.admit("f", 1, ""))
        await asyncio.wait_for(asked.wait(), 5)
        assert await _leased(a) == 1 and len(rt.held) == 1  # granted, the reply not yet made
        req.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await req
        assert rt.held == {}  # no longer renewed ...
        assert await wait_until(lambda: _none_leased(a), 5)  # ... and given back at once
        assert await reg.inflight("10.0.0.2:8000") == 0
    finally:
        await a.stop()
        await c.aclose()


@pytest.mark.integration
@pytest.mark.parametrize("credits", [0, 4], ids=["no-credits", "credits"])
async def test_cancelled_with_its_acquire_in_the_air(stack: LocalStack, credits: int) -> None:
    """With `local_credits` the grant also leases credits (L 8, an empty pool: 3 of the 4
    asked for) that the cancelled request never took: handed back with its permit (they stayed
    leased until the renewal, 20 s here)."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    a = Admitter(_config(url, picking=False, credits=credits, limit=8 if credits else 2), c, gateway_id="a")
    try:
        await a.start()
        assert stack.redis_child is not None
        stack.redis_child.kill(signal.SIGSTOP)  # the acquire goes out; its reply does not come
        try:
            req = asyncio.create_task(a.admit("f", 1, ""))
            await asyncio.sleep(0.3)
            assert not req.done()
            req.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await req
        finally:
            stack.redis_child.kill(signal.SIGCONT)
        # Redis runs the acquire (a lease for a request that is gone), then the processor's
        # cancel hands it back; left alone it was held until its lease expired, 60 s here.
        assert await wait_until(lambda: _none_leased(a), 5), (await a.pools["f"].state.status()).inflight
    finally:
        await a.stop()
        await c.aclose()


async def _none_leased(a: Admitter) -> bool:
    return await _leased(a) == 0


@pytest.mark.integration
async def test_a_stop_ends_although_a_loop_lost_its_cancellation(stack: LocalStack) -> None:
    """Python 3.11's `wait_for` (inside every redis-py command) can lose a cancellation; a
    processor's stop that cancelled its loops once and awaited them then waited for ever, its
    permits unreleased (they would have expired only one lease TTL later). The stop cancels
    again and still hands its permits back."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    a = Admitter(_config(url, picking=False), c, gateway_id="a")
    lost = asyncio.Event()
    try:
        await a.start()
        permit = await a.admit("f", 0, "t")
        assert isinstance(permit, Permit) and await _leased(a) == 1

        async def loses_one() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                lost.set()  # as inside redis-py: the loop goes on
            await asyncio.sleep(3600)

        loop_task = asyncio.create_task(loses_one())
        a._tasks.append(loop_task)
        await asyncio.sleep(0)
        stop = asyncio.create_task(a.stop())
        done, _ = await asyncio.wait({stop}, timeout=30)  # (a failure detector; it ends at once)
        assert stop in done, "the stop waits for the loop that lost its cancellation"
        assert lost.is_set() and loop_task.cancelled()
        assert await _leased(a) == 0  # handed back, not left to expire
    finally:
        await c.aclose()
