"""Leader lease: one active controller at a time, failover when the holder's lease expires."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from floodgate.controller.leader import LeaderLease
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.controller.live import controller_config, process_actuator, running, wait_for

pytestmark = pytest.mark.integration


async def test_one_leader_and_failover_on_expiry(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=2)
    try:
        a = LeaderLease(c, "fg:test:leader", holder="a", ttl_s=0.9)
        b = LeaderLease(c, "fg:test:leader", holder="b", ttl_s=0.9)
        assert await a.try_acquire_or_renew()
        assert await a.try_acquire_or_renew()  # idempotent renewal
        assert not await b.try_acquire_or_renew()
        for _ in range(4):  # a keeps renewing past its ttl: b never gets it
            await asyncio.sleep(0.3)
            assert await a.try_acquire_or_renew()
            assert not await b.try_acquire_or_renew()
        # a stops renewing (hung or dead): it steps down locally before the lease expires
        await asyncio.sleep(0.7)
        assert not a.is_leader
        await asyncio.sleep(0.3)
        assert await b.try_acquire_or_renew()
        assert await b.holder_now() == "b"
        assert not await a.try_acquire_or_renew()  # a cannot extend b's lease
        await b.release()
        assert await b.holder_now() is None
    finally:
        await c.aclose()


async def test_two_controllers_only_one_acts(stack: LocalStack) -> None:
    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 0}, warm_pool={"enabled": False},
                            leader={"ttl_s": 1.5})
    act1 = process_actuator(stack, stack.sup.workdir / "r1")
    act2 = process_actuator(stack, stack.sup.workdir / "r2")
    async with contextlib.AsyncExitStack() as s_two:
        async with running(cfg, act1, holder="one") as one:
            two = await s_two.enter_async_context(running(cfg, act2, holder="two", wait_ready=False))
            await asyncio.sleep(1.0)
            assert one.is_leader and not two.is_leader
            assert one.pools and not two.pools  # the standby keeps no view and acts on nothing
            assert two.metrics.ticks._value.get() == 0
        # one stopped and released its lease: two is elected without waiting for expiry
        await wait_for(lambda: _ready(two), 5)
        assert two.is_leader and two.pools


async def _ready(ctl: object) -> bool:
    return bool(ctl.ready.is_set())  # type: ignore[attr-defined]
