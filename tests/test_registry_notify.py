"""The controller tells the processors when the registry's active set or its ceiling changed
(`Registry.notify`: `pool|!registry` on each gateway's channel), and they read it at once instead
of at their next once-a-second refresh: a promoted replica serves, and counts under the ceiling,
that much sooner. A real processor on a real Redis; its periodic status tick is switched off
here, so only the message can make it see a change."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from floodgate.extproc.registry import Registry
from floodgate.extproc.state import redis_client

from floodgate.redis_topology import ClusterTopology
from floodgate.stack import LocalStack
from tests.helpers import activate, picking_admitter
from tests.redis_topologies import cluster  # noqa: F401 - fixture


async def _until(cond: Callable[[], bool], what: str, tries: int = 1000) -> None:
    """Wait on observable state, not for a time (a loaded box delivers late, never not)."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def _until_async(cond: Callable[[], Awaitable[bool]], what: str, tries: int = 1000) -> None:
    for _ in range(tries):
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def _limit(rt: Any, *, endpoints: int | None = None, limit: float | None = None) -> bool:
    st = (await rt.state.get_limit()).state
    return (endpoints is None or st.endpoints == endpoints) and (limit is None or st.limit == limit)


async def _reached(reg: Registry) -> bool:
    return await reg.notify() == 1


async def test_processors_read_the_registry_when_told(stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    a = picking_admitter(url, c, 16)
    try:
        await activate(reg, 1, 2)
        await a.start()
        ra = a.pools["f"]
        await _until(lambda: len(ra.picker.active) == 2, "the first refresh")
        ticks: list[float] = []

        async def no_tick(rt: Any) -> None:  # the once-a-second refresh is off from here on
            ticks.append(0.0)

        monkeypatch.setattr(a, "_tick", no_tick)
        await _until(lambda: len(ticks) > 0, "the sync loop runs the patched tick")
        # The processor must be subscribed before a message can reach it: the gateway is in
        # `gws` once it synced, and its channel counts a subscriber once the pub/sub loop runs.
        await _until_async(lambda: _reached(reg), "the processor subscribed", tries=3000)
        await reg.set("10.0.0.3:8000", "active", "r3")  # a promotion
        await _until(lambda: len(ra.picker.active) == 3, "the promoted endpoint")
        # the limit follows it (the picker is updated first, the limit's compare-and-set after)
        await _until_async(lambda: _limit(ra, endpoints=3), "the limit sized for 3 endpoints")
        await reg.set_ceiling(5.0, 30)  # under the limit (16 x 3 / 2 = 24): it caps
        await _until(lambda: ra.ceiling == pytest.approx(15.0), "the published ceiling")
        await _until_async(lambda: _limit(ra, limit=15.0), "the limit capped at 5 x 3")
        await reg.set("10.0.0.1:8000", "draining", "r1")  # leaves the active set
        await _until(lambda: len(ra.picker.active) == 2, "the draining endpoint gone")
        await reg.clear_ceiling()
        await _until(lambda: ra.ceiling is None, "the ceiling taken back")
    finally:
        await a.stop()
        await c.aclose()


async def test_only_changes_are_announced(stack: LocalStack) -> None:
    """Every tick the controller rewrites its registry view and its ceiling (level-triggered):
    only a change of the active set or of the ceiling's value sends a message. Messages on one
    channel arrive in order, so each expected one is read before the next write."""
    from floodgate.extproc.redis_client import make_client, subscribe
    from floodgate.extproc.schema import gateway_channel, key

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    sub_client = make_client(url, op_timeout_s=5, blocking=True)
    reg = Registry(c, "f")
    await c.zadd(key("f", "gws"), {"z": 2**50})  # a gateway (its liveness far ahead)
    sub = await subscribe(sub_client, [gateway_channel("z", "f")])
    got: list[str] = []

    async def next_message() -> str:
        for _ in range(500):
            m = await sub.get_message(0.05)
            if m is not None:
                return str(m[1].decode())
        raise AssertionError("no message")

    try:
        # subscribed once a probe reaches it (the confirmation may come after subscribe returns)
        for _ in range(500):
            if await c.spublish(gateway_channel("z", "f"), "probe") == 1:
                break
            await asyncio.sleep(0.02)
        assert await next_message() == "probe"
        steps: list[tuple[Any, bool]] = [
            (reg.set("10.0.0.1:8000", "loading", "r1"), False),  # not active before, not now
            (reg.set("10.0.0.1:8000", "active", "r1"), True),
            (reg.set("10.0.0.1:8000", "active", "r1"), False),
            (reg.set_ceiling(10.5, 30), True),
            (reg.set_ceiling(10.5, 30), False),  # the TTL refreshed, the same value
            (reg.set_ceiling(12.0, 30), True),
            (reg.clear_ceiling(), True),
            (reg.clear_ceiling(), False),
            (reg.remove("10.0.0.1:8000"), True),
            (reg.remove("10.0.0.1:8000"), False),
        ]
        for i, (write, announced) in enumerate(steps):
            await write
            if announced:
                got.append(await next_message())
            else:  # a marker: the next message must be it, not an announcement
                assert await c.spublish(gateway_channel("z", "f"), f"marker {i}") == 1
                assert await next_message() == f"marker {i}"
        assert got == ["f|!registry"] * 5
    finally:
        await sub.aclose()
        await sub_client.aclose()
        await c.aclose()


async def test_announced_in_the_pools_slot_on_a_cluster(cluster: ClusterTopology) -> None:  # noqa: F811
    """On a Cluster the message goes out by SPUBLISH in the pool's slot (its hash tag), where the
    processor's sharded subscription listens (redis_client.subscribe)."""
    from floodgate.extproc.redis_client import make_client, subscribe
    from floodgate.extproc.schema import gateway_channel, key

    client = make_client(cluster.url, op_timeout_s=0.5)
    sub_client = make_client(cluster.url, op_timeout_s=0.5, blocking=True)
    try:
        for shard in (0, 2):
            pool = cluster.key_on_shard(shard)
            reg = Registry(client, pool)
            await client.zadd(key(pool, "gws"), {"b": 2**50})
            sub = await subscribe(sub_client, [gateway_channel("b", pool)])
            try:
                for _ in range(500):  # subscribed once an announcement reaches it
                    if await reg.notify() == 1:
                        break
                    await asyncio.sleep(0.02)
                assert await sub.get_message(2) == (gateway_channel("b", pool), f"{pool}|!registry".encode())
            finally:
                await sub.aclose()
    finally:
        await sub_client.aclose()
        await client.aclose()
