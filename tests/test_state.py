"""The Redis Lua state against its pure reference model, on a real Redis-protocol server.

Random operation sequences run against both `leases.lua` (through `PoolState`) and
`PermitTable`; after every step the set of permit holders must be identical and the
invariants must hold: no ticket both queued and leased, counters equal to the sets they
count, in-flight never above the limit.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.state import PoolState, pool_keys, redis_client

from floodgate.stack import LocalStack

SHARES = (0.5, 0.3, 0.1)


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[aioredis.Redis]:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    yield c
    await c.aclose()


async def leased(c: aioredis.Redis, pool: str) -> set[str]:
    return {t.decode() for t in await c.zrange(pool_keys(pool)[0], 0, -1)}


async def check_invariants(c: aioredis.Redis, pool: str, st: PoolState, before: int = 0) -> None:
    keys = pool_keys(pool)
    leases = await leased(c, pool)
    queue = {t.decode() for t in await c.zrange(keys[2], 0, -1)}
    assert not leases & queue
    counts = {k.decode(): int(v) for k, v in (await c.hgetall(keys[5])).items()}
    lmeta = {k.decode(): int(v) for k, v in (await c.hgetall(keys[1])).items()}
    assert set(lmeta) == leases
    for cls in range(3):
        assert counts.get(f"i{cls}", 0) == sum(1 for v in lmeta.values() if v == cls)
    qmeta = {k.decode(): v.decode() for k, v in (await c.hgetall(keys[3])).items()}
    assert set(qmeta) == queue
    for cls in range(3):
        assert counts.get(f"q{cls}", 0) == sum(1 for v in qmeta.values() if v.startswith(f"{cls}|"))
    # A lowered limit lets held permits finish; it only stops new grants, so an operation
    # never takes in-flight above the limit (or above what it already was).
    status = await st.status()
    assert status.inflight_total <= max(status.limit, before)


@pytest.mark.parametrize("seed", range(10))
async def test_lua_matches_reference_model(client: aioredis.Redis, seed: int) -> None:
    rng = random.Random(seed)
    pool = f"diff{seed}"
    limit = rng.choice([1, 2, 3, 5, 10])
    always = (rng.random() < 0.5, False, rng.random() < 0.3)  # some seeds keep reservations always
    st = PoolState(client, pool, lease_ttl_s=600, initial_limit=limit, shares=SHARES, always=always)
    model = PermitTable(limit=limit, shares=SHARES, always=always)
    version = 0
    queued: list[str] = []
    n = 0
    for _step in range(150):
        before = len(model.held)
        op = rng.choices(["arrive", "release", "cancel", "limit"], [5, 3, 1, 1])[0]
        if op == "arrive":
            n += 1
            ticket, cls, tenant = f"g:{n}", rng.randrange(3), rng.choice("ab")
            snap = await st.acquire(ticket, "g", cls, tenant)
            got = model.try_acquire(ticket, cls, now=0.0)
            assert snap.granted == got, (op, ticket, cls)
            if not got:
                snap = await st.enqueue(ticket, "g", cls, tenant, 600)
                model.enqueue(ticket, cls, tenant, deadline=1e9, now=0.0)
                queued.append(ticket)
        elif op == "release" and model.held:
            ticket = rng.choice(sorted(model.held))
            assert await st.release(ticket) == 1
            model.release(ticket, now=0.0)
        elif op == "cancel" and queued:
            ticket = queued.pop(rng.randrange(len(queued)))
            assert await st.cancel(ticket) == model.cancel(ticket)
        elif op == "limit":
            limit = rng.choice([1, 2, 4, 8])
            rec = await st.get_limit()
            assert rec.version == version
            assert await st.set_limit(version, rec.state.__class__(limit=float(limit)))
            version += 1
            model.set_limit(limit, now=0.0)
        assert await leased(client, pool) == set(model.held)
        await check_invariants(client, pool, st, before)


async def test_stale_version_is_refused(client: aioredis.Redis) -> None:
    st = PoolState(client, "cas", lease_ttl_s=60, initial_limit=4, shares=SHARES)
    rec = await st.get_limit()
    assert await st.set_limit(rec.version, rec.state.__class__(limit=8.0))
    assert not await st.set_limit(rec.version, rec.state.__class__(limit=2.0))
    assert (await st.get_limit()).state.limit == 8.0


async def test_expired_lease_is_reclaimed_and_granted_to_next_waiter(client: aioredis.Redis) -> None:
    st = PoolState(client, "ttl", lease_ttl_s=0.5, initial_limit=1, shares=(0, 0, 0))
    assert (await st.acquire("a:1", "a", 1, "t")).granted
    assert not (await st.acquire("b:1", "b", 1, "t")).granted
    pubsub = client.pubsub()
    await pubsub.subscribe("fg:gw:b")
    assert not (await st.enqueue("b:1", "b", 1, "t", 30)).granted
    await st.renew("b", [])  # b stays alive; a never renews
    await asyncio.sleep(0.6)
    await st.renew("b", [])  # any script call reclaims expired leases and grants
    assert await st.granted_among(["b:1"]) == {"b:1": ""}
    msg = None
    for _ in range(20):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            break
    assert msg is not None and msg["data"] == b"ttl|b:1|"  # targeted grant, to b only (no picking)
    assert await st.renew("a", ["a:1"]) == ["a:1"]  # a learns its lease was lost
    await pubsub.aclose()


async def test_cancel_after_grant_reports_ownership(client: aioredis.Redis) -> None:
    st = PoolState(client, "race", lease_ttl_s=30, initial_limit=1, shares=(0, 0, 0))
    assert (await st.acquire("a:1", "a", 1, "t")).granted
    await st.enqueue("a:2", "a", 1, "t", 30)
    assert await st.release("a:1") == 1  # grants a:2
    assert await st.cancel("a:2") == 1  # the waiter timed out at the same moment: it owns a permit
    assert await st.release("a:2") == 1
    assert await st.release("a:2") == 0  # exactly once
    assert await st.cancel("nope") == 2


async def test_waiters_of_dead_gateways_and_expired_deadlines_are_skipped(client: aioredis.Redis) -> None:
    st = PoolState(client, "skip", lease_ttl_s=0.3, initial_limit=1, shares=(0, 0, 0))
    assert (await st.acquire("a:1", "a", 1, "t")).granted
    await st.enqueue("dead:1", "dead", 0, "t", 30)  # gateway `dead` never renews
    await st.enqueue("a:2", "a", 1, "t", 0.05)  # its deadline passes
    await st.enqueue("a:3", "a", 2, "t", 30)
    await asyncio.sleep(0.4)
    await st.renew("a", ["a:1"])
    await st.release("a:1")
    assert await leased(client, "skip") == {"a:3"}
    await check_invariants(client, "skip", st)


async def test_noscript_reload(client: aioredis.Redis) -> None:
    st = PoolState(client, "ns", lease_ttl_s=30, initial_limit=2, shares=SHARES)
    assert (await st.acquire("a:1", "a", 1, "t")).granted
    await client.script_flush()
    assert (await st.acquire("a:2", "a", 1, "t")).granted  # NOSCRIPT -> reload -> run


async def test_two_pools_are_independent(client: aioredis.Redis) -> None:
    a = PoolState(client, "pa", lease_ttl_s=30, initial_limit=1, shares=SHARES)
    b = PoolState(client, "pb", lease_ttl_s=30, initial_limit=1, shares=SHARES)
    assert (await a.acquire("g:1", "g", 1, "t")).granted
    assert (await b.acquire("g:2", "g", 1, "t")).granted
    assert all(k.startswith("fg:{pa}:") for k in pool_keys("pa"))


async def test_credits_only_below_half_the_limit_and_recalled_by_a_queue(client: aioredis.Redis) -> None:
    st = PoolState(client, "cr", lease_ttl_s=30, initial_limit=10, shares=(0, 0, 0))
    got = await st.acquire("a:1", "a", 1, "t", credits=8)
    assert got.granted and len(got.credits) == 4  # at most half the limit: 1 + 4 = 5
    assert (await st.status()).inflight_total == 5  # credits are leases: they count
    assert (await st.acquire("a:2", "a", 1, "t", credits=8)).credits == ()  # already half full
    pubsub = client.pubsub()
    await pubsub.subscribe("fg:gw:a")
    for i in range(3, 7):  # 6 held so far (a:1, 4 credits, a:2) + 4 = the limit
        assert (await st.acquire(f"b:{i}", "b", 1, "t")).granted
    assert not (await st.acquire("b:9", "b", 1, "t")).granted  # full: the creditor is told
    msg = None
    for _ in range(20):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            break
    assert msg is not None and msg["data"] == b"cr|!return|"
    await st.enqueue("b:9", "b", 1, "t", 30)
    await st.return_credits(*got.credits)
    assert await st.granted_among(["b:9"]) == {"b:9": ""}  # a returned credit went to the waiter
    assert (await st.status()).grant_rate == 0  # returning credits is not a completion
    await pubsub.aclose()
