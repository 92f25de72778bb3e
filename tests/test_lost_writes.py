"""Redis answering without writes it had acknowledged, against a real server and the real script.

Replication is asynchronous: a replica promoted by a failover may lack the last writes its
primary acknowledged, and a Redis restarted without persistence lacks all of them. A processor
that notices no error (a Cluster client follows the MOVED to the promoted replica by itself)
used to go on until its next renewal (`lease_ttl_s / 3`) with Redis holding leases it had
released (fewer admitted than L) and missing permits its requests hold (more than L
elsewhere). Each batch's reply now carries the fence Redis held for the processor before it;
one below a fence already answered proves the loss, and the processor re-asserts at once.

The loss is made here with DUMP/RESTORE of the pool's keys (Redis rolled back to a moment in
the past, as a promoted replica is); tests/test_redis_ha.py has the real Sentinel failover.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.schema import SCRIPT_KEYS, script_keys
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.helpers import Gateway, one_processor, wait_until

pytestmark = pytest.mark.integration


async def snapshot(r: aioredis.Redis, pool: str) -> dict[str, bytes]:
    return {k: d for k in script_keys(pool) if (d := await r.dump(k)) is not None}


async def roll_back(r: aioredis.Redis, pool: str, snap: dict[str, bytes]) -> None:
    """The pool's keys as they were at `snap` (what a replica that missed the writes since holds)."""
    await r.delete(*script_keys(pool))
    for k, d in snap.items():
        await r.restore(k, 0, d, replace=True)
    # A restored key keeps no TTL here, as a replica's copy would keep its own: none of the
    # pool's script keys carries one.


async def leased(r: aioredis.Redis, pool: str) -> list[str]:
    return sorted(t.decode() for t in await r.zrange(script_keys(pool)[0], 0, -1))


@pytest.fixture
async def gw(stack: LocalStack) -> AsyncIterator[Gateway]:
    """A processor with pool `a` (L 3, no credits) on a fresh server; TTL 30 s, so its next
    renewal is 10 s away and only the loss detection can repair Redis within a test."""
    async with one_processor(stack, limit=3, lease_ttl_s=30, op_timeout_s=0.5) as g:
        yield g


async def test_a_rolled_back_redis_is_corrected_at_the_next_call(gw: Gateway) -> None:
    """Two permits held and a waiter queued; then a release grants the waiter and a new request
    is admitted; Redis rolls back to before them. The next call this processor makes (here a
    release) finds the loss in its reply, and by the time the release after it has returned,
    Redis holds exactly the permits live requests hold: the released one is not leased by
    nobody, the admitted one is counted again. The renewal is 10 s away (TTL 30 s), so only
    the loss detection can have done it."""
    admitter, raw, metrics = gw.admitter, gw.raw, gw.metrics
    rt = admitter.pools["a"]
    p1, p2, p3 = [await admitter.admit("a", 1, "t") for _ in range(3)]
    assert isinstance(p1, Permit) and isinstance(p2, Permit) and isinstance(p3, Permit)
    waiter = asyncio.create_task(admitter.admit("a", 1, "t"))
    assert await wait_until(lambda: len(rt.waiting) == 1 and all(w.enqueued for w in rt.waiting.values()), 5)
    before = await snapshot(raw, "a")  # p1, p2, p3 leased, the waiter queued
    await admitter.release(p3)  # grants the waiter
    got = await asyncio.wait_for(waiter, 5)
    assert isinstance(got, Permit)
    await admitter.release(p2)
    p4 = await admitter.admit("a", 1, "t")  # leased in the writes about to be lost
    assert isinstance(p4, Permit)
    assert await leased(raw, "a") == sorted([p1.ticket, got.ticket, p4.ticket])
    await roll_back(raw, "a", before)
    assert await leased(raw, "a") == sorted([p1.ticket, p2.ticket, p3.ticket])  # the loss
    await admitter.release(p1)  # the next call: its reply shows the loss
    await admitter.release(got)
    # Exactly what is held: p4 (its lease was lost) and nothing released or abandoned.
    assert await leased(raw, "a") == [p4.ticket]
    st = await rt.state.status()
    assert st.inflight_total == 1 and st.queued_total == 0
    assert metrics.state_rollbacks.labels("a")._value.get() == 1
    await admitter.release(p4)
    assert (await rt.state.status()).inflight_total == 0
    assert metrics.state_rollbacks.labels("a")._value.get() == 1  # no loss: no second resync


async def test_an_emptied_redis_is_corrected_at_the_next_call(gw: Gateway) -> None:
    """A restart without persistence (FLUSHALL here): the settings, leases and the processor's
    fence are gone. The next call configures the pool again, its reply shows no fence, and the
    processor re-asserts the permits its requests hold at once."""
    admitter, raw, metrics = gw.admitter, gw.raw, gw.metrics
    rt = admitter.pools["a"]
    held = [await admitter.admit("a", 1, "t") for _ in range(3)]
    assert all(isinstance(p, Permit) for p in held)
    await raw.flushall()
    await admitter.release(held[0])  # the next call
    assert await wait_until(lambda: not rt.resyncing, 5)
    assert await leased(raw, "a") == sorted(p.ticket for p in held[1:])
    assert metrics.state_rollbacks.labels("a")._value.get() == 1


@contextlib.asynccontextmanager
async def two_processors(stack: LocalStack, *, limit: int) -> AsyncIterator[tuple[Admitter, Admitter, aioredis.Redis]]:
    """Processors `ga` and `gb` sharing pool `a` (static `limit`, no credits) on a fresh server;
    TTL 30 s (renewals 10 s away) and polls every 60 s: only the test's calls, the loss
    detection and what Redis tells them reach Redis within a test."""
    url = stack.start_redis()
    cfg = Config.model_validate({
        "redis": {"url": url, "lease_ttl_s": 30, "op_timeout_s": 2, "poll_interval_s": 60},
        "pools": [{"name": "a", "match_authority": "a.x", "local_credits": 0,
                   "limit": {"mode": "static", "initial": limit}}]})
    clients = [redis_client(url, op_timeout_s=2) for _ in range(2)]
    raw = aioredis.Redis.from_url(url)
    admitters = [Admitter(cfg, c, metrics=Metrics(), gateway_id=g) for c, g in zip(clients, ("ga", "gb"), strict=True)]
    for a in admitters:
        await a.start()
    try:
        yield admitters[0], admitters[1], raw
    finally:
        for a in admitters:
            await a.stop()
        for c in clients:
            await c.aclose()
        await raw.aclose()


async def hold(raw: aioredis.Redis, pool: str) -> str:
    v = await raw.hget(script_keys(pool)[SCRIPT_KEYS.index("state")], "hold")
    return (v or b"").decode()


async def test_after_a_rollback_no_permit_is_granted_until_every_gateway_has_re_asserted(stack: LocalStack) -> None:
    """L 3: `ga` holds two permits, `gb` one. Then `ga` releases one and `gb` takes it; Redis
    rolls back to before (it counts ga 2, gb 1: a promoted replica that missed both writes).
    `ga`'s next call finds the loss and re-asserts its one permit, which frees one in Redis, but
    `gb` holds two, so the pool is full: the permit `ga`'s waiter could take is `gb`'s. Before,
    `ga`'s re-assertion granted it (4 in flight of L 3 until `gb`'s renewal, up to 10 s here;
    the suite's switchover read 14 of L 8 so). Now Redis holds the grants and tells `gb` to
    re-assert; the waiter waits for a real release."""
    async with two_processors(stack, limit=3) as (ga, gb, raw):
        a1, a2, b1 = await ga.admit("a", 0, "t"), await ga.admit("a", 0, "t"), await gb.admit("a", 0, "t")
        assert isinstance(a1, Permit) and isinstance(a2, Permit) and isinstance(b1, Permit)
        before = await snapshot(raw, "a")
        await ga.release(a2)
        b2 = await gb.admit("a", 0, "t")  # leased in the writes about to be lost
        assert isinstance(b2, Permit)
        await roll_back(raw, "a", before)
        assert await leased(raw, "a") == sorted([a1.ticket, a2.ticket, b1.ticket])

        waiter = asyncio.create_task(ga.admit("a", 0, "t"))  # ga's next call: its reply shows the loss
        want = sorted([a1.ticket, b1.ticket, b2.ticket])
        assert await _until(raw, lambda lease, h: lease == want and h.startswith("0|"), 5), \
            (await leased(raw, "a"), await hold(raw, "a"))  # both re-asserted (gb told to), the hold is over
        await asyncio.sleep(0.3)
        assert not waiter.done()  # the pool is full: 3 of L 3 (a1, b1, b2)
        assert len(ga.pools["a"].held) + len(gb.pools["a"].held) == 3
        assert ga.metrics.state_rollbacks.labels("a")._value.get() == 1
        await gb.release(b2)  # a real release: the waiter's turn
        got = await asyncio.wait_for(waiter, 5)
        assert isinstance(got, Permit)
        assert len(ga.pools["a"].held) + len(gb.pools["a"].held) == 3
        for p in (a1, got):
            await ga.release(p)
        await gb.release(b1)
        assert await leased(raw, "a") == []


async def test_after_redis_was_emptied_no_permit_is_granted_until_every_gateway_has_re_asserted(
        stack: LocalStack) -> None:
    """L 4: `ga` and `gb` hold two permits each, `ga` has a waiter; Redis is emptied (a restart
    without persistence that no call saw fail, or a FLUSHALL). `ga`'s next call ran its ops on
    the empty state: its acquires were granted up to L, and only then did it re-assert its own
    permits on top, and `gb` its two at its renewal (a fault review: 12 in flight of L 6 after a
    fast restart, 9 after a FLUSHALL). An emptied Redis keeps no fence or liveness to compare,
    but the processors still listen on their channels: the call that brings a fence Redis does
    not have holds the grants, tells those listening to re-assert, and the waiters wait for a
    real release."""
    async with two_processors(stack, limit=4) as (ga, gb, raw):
        held_a = [await ga.admit("a", 0, "t") for _ in range(2)]
        held_b = [await gb.admit("a", 0, "t") for _ in range(2)]
        assert all(isinstance(p, Permit) for p in held_a + held_b)
        waiter = asyncio.create_task(ga.admit("a", 0, "t"))
        assert await wait_until(lambda: len(ga.pools["a"].waiting) == 1
                                and all(w.enqueued for w in ga.pools["a"].waiting.values()), 5)
        await raw.flushall()
        fresh = [asyncio.create_task(ga.admit("a", 0, "t")) for _ in range(2)]  # ga's next calls
        want = sorted(p.ticket for p in held_a + held_b)
        assert await _until(raw, lambda lease, h: lease == want, 5), (await leased(raw, "a"), await hold(raw, "a"))
        await asyncio.sleep(0.3)
        granted = [t.result() for t in [waiter, *fresh] if t.done() and isinstance(t.result(), Permit)]
        assert granted == []  # the pool is full: 4 of L 4, all re-asserted
        assert len(ga.pools["a"].held) + len(gb.pools["a"].held) == 4
        await gb.release(held_b.pop())  # a real release: one waiter's turn
        assert await wait_until(lambda: sum(t.done() for t in [waiter, *fresh]) == 1, 5)
        assert len(ga.pools["a"].held) + len(gb.pools["a"].held) == 4
        for t in [waiter, *fresh]:
            t.cancel()
        for t in [waiter, *fresh]:
            with contextlib.suppress(asyncio.CancelledError):
                r = await t
                if isinstance(r, Permit):
                    await ga.release(r)
        for p in held_a:
            await ga.release(p)
        for p in held_b:
            await gb.release(p)
        assert await _until(raw, lambda lease, h: lease == [], 5)


async def test_after_redis_was_emptied_a_listener_of_another_database_is_not_waited_for(stack: LocalStack) -> None:
    """Pub/sub channels are server-wide: the hold after an emptied Redis lists whoever listens on
    the pool's channels, a processor of another deployment in another database number too, which
    is heard but never syncs here (a review: the hold lasted its whole length, 11 s at TTL 30 s).
    Told to sync at once, this pool's processors have within the quiet time (2 s); the rest are
    not waited for after it."""
    async with two_processors(stack, limit=4) as (ga, _gb, raw):
        port = raw.connection_pool.connection_kwargs["port"]
        other_url = f"redis://127.0.0.1:{port}/1"  # the same server, database 1
        cfg = Config.model_validate({
            "redis": {"url": other_url, "lease_ttl_s": 30, "op_timeout_s": 2, "poll_interval_s": 0.25},
            "pools": [{"name": "a", "match_authority": "a.x", "local_credits": 0,
                       "limit": {"mode": "static", "initial": 4}}]})
        other_client = redis_client(other_url, op_timeout_s=2)
        other = Admitter(cfg, other_client, metrics=Metrics(), gateway_id="gc")  # same pool name
        await other.start()
        try:
            theirs = await other.admit("a", 0, "t")

            async def listening() -> bool:
                return b"fg:{a}:gw:gc" in await raw.execute_command("PUBSUB", "SHARDCHANNELS", "fg:{a}:gw:*")

            assert await wait_until(listening, 5)  # gc listens on the channel name ga and gb use
            held = await ga.admit("a", 0, "t")
            assert isinstance(held, Permit)
            await raw.flushdb()  # database 0 only
            t0 = asyncio.get_running_loop().time()
            waiter = asyncio.create_task(ga.admit("a", 0, "t"))  # its batch starts the hold
            assert await wait_until(lambda: _hold_lists(raw, "gc"), 5)  # gc is listed (it listens) ...
            st = ga.pools["a"].state

            async def over() -> bool:
                return (await st.status()).hold_s == 0

            assert await wait_until(over, 10)  # ... and not waited for past the quiet time (2 s)
            assert asyncio.get_running_loop().time() - t0 < 4.0  # (its whole length is 11 s here)
            await ga.release(held)  # a call: the grant loop runs (the test's processors poll every 60 s)
            got = await asyncio.wait_for(waiter, 5)
            assert isinstance(got, Permit)
            await ga.release(got)
            await other.release(theirs)
        finally:
            await other.stop()
            await other_client.aclose()


async def _hold_lists(raw: aioredis.Redis, gw: str) -> bool:
    return gw in (await hold(raw, "a")).split("|")[-1].split()


async def test_a_batch_after_a_clean_leave_starts_no_hold(stack: LocalStack) -> None:
    """`leave` drops the gateway's fence with its liveness on purpose: a batch of the same
    process that comes after it (a release racing the stop) must not read as Redis having lost
    that fence, or it held every grant of the pool (a review: another processor's admit waited
    1.5 s and got 429 with 2 of L 4 free)."""
    async with two_processors(stack, limit=4) as (ga, gb, raw):
        p1 = await ga.admit("a", 0, "t")
        assert isinstance(p1, Permit)
        await ga.pools["a"].state.leave("ga")
        await ga.pools["a"].state.release(p1.ticket)
        assert await hold(raw, "a") == ""  # no hold began (an ended one leaves "0|<start>|...")
        got = await asyncio.wait_for(gb.admit("a", 1, "t"), 2)
        assert isinstance(got, Permit)
        await gb.release(got)


async def _until(raw: aioredis.Redis, pred: Callable[[list[str], str], bool], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if pred(await leased(raw, "a"), await hold(raw, "a")):
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.02)


async def test_a_processor_whose_subscription_was_made_again_re_asserts_at_once(gw: Gateway) -> None:
    """A `!resync` published while a processor's subscription was down (a failover moved the
    primary or the slot's owner) never reaches it, and a hold would wait for its renewal (10 s
    here). redis-py makes a killed pub/sub connection again and re-subscribes by itself, so the
    processor saw nothing before; now a subscription made again (by redis-py or by the
    processor) is followed by a sync at once. Fails before: the next sync was the renewal."""
    gws = script_keys("a")[SCRIPT_KEYS.index("gws")]
    before = await gw.raw.zscore(gws, "gw")
    assert before is not None
    await asyncio.sleep(0.05)  # (a later sync has a later score)
    await gw.raw.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    assert await _until_score(gw.raw, gws, lambda s: s is not None and s > before, 5), \
        (before, await gw.raw.zscore(gws, "gw"))


async def _until_score(raw: aioredis.Redis, gws: str, pred: Callable[[float | None], bool], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if pred(await raw.zscore(gws, "gw")):
            return True
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.05)


async def test_an_evicted_state_key_is_named_as_a_possible_cause(gw: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    """Under `maxmemory` with an allkeys-* eviction policy, Redis may evict a pool key. The
    pool's state hash (the processors' fences) evicted reads as lost writes, and the WARNING
    named a failover, a restart or a stall only: an operator review, filling a Valkey with
    allkeys-lru under two processors (7 in flight of L 4 for a moment, then recounted), was
    sent after failovers while the servers had not moved. Here the key is deleted as an
    eviction would; the WARNING names eviction too."""
    from floodgate.extproc.schema import key

    admitter, raw = gw.admitter, gw.raw
    held = [await admitter.admit("a", 1, "t") for _ in range(2)]
    assert all(isinstance(p, Permit) for p in held)
    assert await raw.delete(key("a", "state")) == 1  # what an eviction of it does
    with caplog.at_level("WARNING", logger="floodgate.admission"):
        await admitter.release(held[0])  # type: ignore[arg-type]
        assert await wait_until(lambda: "Redis lacks writes" in caplog.text, 5)
    assert "evicted under maxmemory" in caplog.text
    assert await leased(raw, "a") == [held[1].ticket]  # type: ignore[union-attr]
