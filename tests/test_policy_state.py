"""What early drop reads from the real script: head/tail deadlines per class, how much the
release rate rests on, the in-flight level at releases, the limiter's extra state — and no
tenant cap for tenant-less requests (real Redis-protocol server)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.schema import PoolSettings
from floodgate.extproc.state import PoolState
from floodgate.extproc.vegas import VegasState

from tests.helpers import listening


async def make(c: aioredis.Redis, pool: str, limit: int = 2, tenant_cap: int = 1) -> PoolState:
    st = PoolState(c, pool, lease_ttl_s=30, settings=PoolSettings(
        limit, (0.5, 0.3, 0.1), (False, False, False), False, (100, 100, 100), (tenant_cap,) * 3))
    await st.configure()
    return st


async def test_snapshot_carries_queue_deadlines_and_rate_basis(client: aioredis.Redis) -> None:
    async with listening(client, "pd", "g"):  # the waiters' gateway is live: heard
        st = await make(client, "pd")
        for i in range(2):
            assert (await st.acquire(f"h{i}", "g", i, 1, "a")).granted
        await st.enqueue("w1", "g", 10, 1, "a", 5.0)
        await st.enqueue("w2", "g", 11, 1, "b", 9.0)
        s = await st.status()
        assert s.head_left is not None and s.tail_left is not None
        assert 4.0 < s.head_left[1] <= 5.0 and 8.0 < s.tail_left[1] <= 9.0
        assert s.head_left[0] == s.tail_left[0] == 0.0
        # releases: counted, with the in-flight level they happened at (2 held each time)
        for i in range(6):
            await st.release(f"h{i % 2}" if i < 2 else f"w{i - 1}" if i < 4 else "none")
            if i < 3:
                await st.acquire(f"x{i}", "g", 20 + i, 2, "a")
        s = await st.status()
        assert s.release_n >= 4 and s.inflight_avg == pytest.approx(2.0)


async def test_tenant_less_requests_are_not_one_tenant(client: aioredis.Redis) -> None:
    st = await make(client, "pt", limit=1, tenant_cap=1)
    assert (await st.acquire("h", "g", 1, 1, "")).granted
    assert not (await st.enqueue("a1", "g", 2, 1, "team", 5.0)).rejected
    assert (await st.enqueue("a2", "g", 3, 1, "team", 5.0)).rejected == "tenant_cap"
    assert not (await st.enqueue("n1", "g", 4, 1, "", 5.0)).rejected
    assert not (await st.enqueue("n2", "g", 5, 1, "", 5.0)).rejected


async def test_limit_state_round_trips_the_baseline_bookkeeping(client: aioredis.Redis) -> None:
    st = await make(client, "pl")
    rec = await st.get_limit()
    assert rec.state.probe_jitter == 1.0  # never drawn: vegas.py draws it on the first update
    new = VegasState(limit=40.5, rtt_noload=0.02, probe_count=7, probe_jitter=0.6, noload_inflight=12,
                     epoch_rtt=0.025, epoch_inflight=9, endpoints=5)
    assert await st.set_limit(rec.version, new)
    assert (await st.get_limit()).state == new
