"""The Redis Lua state against its pure reference model, on a real Redis-protocol server.

Random histories run against both `leases.lua` (through `PoolState`, with the script's clock
driven by the test) and `PermitTable`: several gateways, acquires with credits, enqueues with
deadlines and tenant caps, releases, cancels, limit changes, time passing (lease expiry,
deadlines, dead gateways), syncs that re-assert or abandon entries, and Redis losing its state.
After every step the holders, the queue and the live gateways must be identical and the
invariants must hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.schema import (
    PAD_FIELD,
    SCRIPT_KEYS,
    PoolSettings,
    gateway_channel,
    key,
    script_keys,
)
from floodgate.extproc.state import FUNCTION, PoolState, read_demand, read_pool_status
from floodgate.extproc.vegas import VegasState

from tests.helpers import listening

SHARES = (0.5, 0.3, 0.1)
K = {name: i for i, name in enumerate(SCRIPT_KEYS)}

Listen = Callable[..., Awaitable[None]]


@pytest.fixture
async def listen(client: aioredis.Redis) -> AsyncIterator[Listen]:
    """`await listen(pool, *gateways)`: those gateways are heard (live processors subscribe to
    their grant channels) until the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        async def on(pool: str, *gateways: str) -> None:
            await stack.enter_async_context(listening(client, pool, *gateways))
        yield on


async def make(c: aioredis.Redis, pool: str, *, ttl: float = 30, limit: int = 4,
               shares: tuple[float, float, float] = SHARES, picking: bool = False,
               always: tuple[bool, bool, bool] = (False, False, False),
               max_queue: tuple[int, int, int] = (100, 100, 100),
               tenant_cap: tuple[int, int, int] = (100, 100, 100),
               headroom: tuple[float, float, float] = (0.0, 0.0, 0.0),
               ramp: tuple[float, float, float, float] = (0.0, 0.0, 8.0, 8.0),
               ramp_ep: tuple[float, float] = (0.0, 0.0), fair: bool = True) -> PoolState:
    st = PoolState(c, pool, lease_ttl_s=ttl, settings=PoolSettings(limit, shares, always, picking, max_queue, tenant_cap,
                                                                     headroom=headroom, ramp_burst=ramp[0],
                                                                     ramp_rate=ramp[1], ramp_min_burst=ramp[2],
                                                                     ramp_min_rate=ramp[3], ramp_ep_burst=ramp_ep[0],
                                                                     ramp_ep_rate=ramp_ep[1], fair=fair))
    await st.configure()
    return st


async def leased(c: aioredis.Redis, pool: str) -> set[str]:
    return {t.decode() for t in await c.zrange(script_keys(pool)[K["leases"]], 0, -1)}


async def queue_order(c: aioredis.Redis, pool: str) -> list[str]:
    return [t.decode() for t in await c.zrange(script_keys(pool)[K["queue"]], 0, -1)]


async def check_invariants(c: aioredis.Redis, pool: str) -> None:
    keys = script_keys(pool)
    leases = await leased(c, pool)
    queue = set(await queue_order(c, pool))
    assert not leases & queue
    counts = {k.decode(): int(v) for k, v in (await c.hgetall(keys[K["counts"]])).items()}
    lmeta = {k.decode(): int(v.decode().split("|")[0]) for k, v in (await c.hgetall(keys[K["lmeta"]])).items()
             if k.decode() != PAD_FIELD}
    assert set(lmeta) == leases
    for cls in range(3):
        assert counts.get(f"i{cls}", 0) == sum(1 for v in lmeta.values() if v == cls)
    qmeta = {k.decode(): v.decode() for k, v in (await c.hgetall(keys[K["qmeta"]])).items() if k.decode() != PAD_FIELD}
    assert set(qmeta) == queue
    for cls in range(3):
        assert counts.get(f"q{cls}", 0) == sum(1 for v in qmeta.values() if v.startswith(f"{cls}|"))
    tenants: dict[str, int] = {}
    for v in qmeta.values():
        parts = v.split("|", 4)
        if parts[4]:  # a waiter without a tenant is not counted (no cap applies to it)
            tenants[f"t{parts[0]}:{parts[4]}"] = tenants.get(f"t{parts[0]}:{parts[4]}", 0) + 1
    assert {k: v for k, v in counts.items() if k.startswith("t")} == tenants


GATEWAYS = ("ga", "gb", "gc")


@pytest.mark.parametrize("seed", range(16))
async def test_lua_matches_reference_model(client: aioredis.Redis, listen: Listen, seed: int) -> None:
    rng = random.Random(seed)
    pool = f"diff{seed}"
    await listen(pool, *GATEWAYS)  # a gateway that stops syncing here stalled: it still listens
    limit = rng.choice([1, 2, 3, 5, 10])
    always = (rng.random() < 0.5, False, rng.random() < 0.3)  # some seeds keep reservations always
    # the old partitions and the shipped ones (no floor for P2); headroom kept free for the
    # classes above (odd seeds: P0's, sometimes P1's too)
    shares = SHARES if seed % 4 < 2 else (0.5, 0.1, 0.0)
    headroom = (rng.choice([0.1, 0.2, 0.5]), rng.choice([0.0, 0.2]), 0.0) if seed % 2 else (0.0, 0.0, 0.0)
    maxq = (rng.choice([1, 3, 100]), rng.choice([2, 100]), rng.choice([1, 4]))
    tcap = (rng.choice([1, 2, 100]), 100, rng.choice([1, 100]))
    # the onset ramp (bucket share, refill share of the limit per second, floors: permits at
    # once, per second) on most seeds; small floors, so tokens run out at these small limits and
    # lower classes are paced while P0 runs
    ramp = ((rng.choice([0.0, 0.5]), rng.choice([0.1, 0.5, 2.0]), rng.choice([1.0, 4.0]), rng.choice([0.0, 0.5, 2.0]))
            if seed % 4 != 3 else (0.0, 0.0, 8.0, 8.0))
    # the ramp's floors per active endpoint (at once, per second) with 0-3 endpoints registered
    # active on some seeds: the script counts the registry's set, the model is told the count
    ramp_ep = (rng.choice([0.5, 1.0, 2.0]), rng.choice([0.5, 1.0, 3.0])) if seed % 3 == 1 else (0.0, 0.0)
    n_ep = (1, 3)[seed % 2] if seed % 3 == 1 else 0
    ttl_ms = 3000
    clock = key(pool, "admin_testclock")
    now = 1_000_000
    await client.set(clock, now)
    fair = seed % 5 != 4  # `fair_order: false` on some seeds: arrival order within a class
    st = await make(client, pool, ttl=ttl_ms / 1000, limit=limit, shares=shares, always=always, max_queue=maxq,
                    tenant_cap=tcap, headroom=headroom, ramp=ramp, ramp_ep=ramp_ep, fair=fair)
    for i in range(n_ep):
        await client.sadd(script_keys(pool)[K["active"]], f"10.0.0.{i}:8000")
    if seed % 3 == 2:
        st._script.functions = False  # the EVALSHA fallback (a server without Functions) runs the same source
    model = PermitTable(limit=limit, shares=shares, always=always, headroom=headroom, max_queue=maxq,
                        tenant_cap=tcap, ttl=ttl_ms, waiter_grace=1000, ramp_burst=ramp[0],
                        ramp_rate=ramp[1] / 1000, ramp_min_burst=ramp[2],
                        ramp_min_rate=ramp[3] / 1000,  # the script's clock is in ms
                        ramp_ep_burst=ramp_ep[0], ramp_ep_rate=ramp_ep[1] / 1000, endpoints=n_ep, fair=fair)
    seqs = dict.fromkeys(GATEWAYS, 0)
    dead: set[str] = set()
    version = 0

    async def sync(gw: str, abandon: bool) -> None:
        held = {t: (ls.cls, ls.seq) for t, ls in model.leases.items() if ls.gateway == gw}
        waiting = {w.ticket: (w.cls, w.seq, max(1.0, w.deadline - now), w.tenant)
                   for q in model.queues for w in q if w.gateway == gw}
        if abandon and (held or waiting):  # the gateway forgot one (an abandoned call)
            victim = rng.choice(sorted([*held, *waiting]))
            held.pop(victim, None)
            waiting.pop(victim, None)
        watermark = seqs[gw] + 1 - rng.choice([0, 0, 1])  # sometimes a call is still in flight
        # the script rounds the remaining time to whole ms
        waiting = {t: (c, s, float(max(1, int(rem))), ten) for t, (c, s, rem, ten) in waiting.items()}
        await st.sync(gw, watermark, {t: (c, s, "") for t, (c, s) in held.items()},
                      {t: (c, s, rem / 1000, ten) for t, (c, s, rem, ten) in waiting.items()})
        model.sync(gw, watermark, held, waiting, now)

    for gw in GATEWAYS:
        await sync(gw, False)
    for step in range(160):
        before = sum(model.inflight())
        ops = ["arrive", "release", "cancel", "limit", "time", "sync", "mine", "credits", "die", "flush"]
        op = rng.choices(ops, [6, 3, 1, 1, 2, 2, 1, 1, 0.2, 0.15])[0]
        live = [g for g in GATEWAYS if g not in dead]
        if op == "arrive" and live:
            gw = rng.choice(live)
            seqs[gw] += 1
            seq = seqs[gw]
            ticket, cls, tenant = f"{gw}/{seq}", rng.randrange(3), rng.choice("ab")
            wanted = rng.choice([0, 0, 3])
            timeout = rng.choice([500, 2000, 8000])
            if rng.random() < 0.5:  # acquire-or-enqueue in one call: the same as the two calls
                snap = await st.admit(ticket, gw, seq, cls, tenant, wanted, timeout / 1000)
                got, credits, _ = model.acquire(ticket, cls, now, gateway=gw, seq=seq, credits=wanted)
                assert snap.granted == got, (step, op, ticket, cls)
                assert list(snap.credits) == credits
                if not got:
                    outcome, _ = model.enqueue(ticket, cls, tenant, now + timeout, now, gateway=gw, seq=seq)
                    assert (snap.rejected or ("queued" if snap.enqueued else "refused")) == outcome, (step, ticket)
                    assert snap.queued == tuple(model.queued()[k] - (k == cls and outcome == "queued")
                                                for k in range(3))  # the state before it joined
            else:
                snap = await st.acquire(ticket, gw, seq, cls, tenant, wanted)
                got, credits, _ = model.acquire(ticket, cls, now, gateway=gw, seq=seq, credits=wanted)
                assert snap.granted == got, (step, op, ticket, cls)
                assert list(snap.credits) == credits
            if not got and not snap.enqueued and not snap.rejected:
                snap = await st.enqueue(ticket, gw, seq, cls, tenant, timeout / 1000)
                outcome, _ = model.enqueue(ticket, cls, tenant, now + timeout, now, gateway=gw, seq=seq)
                expected = "granted" if snap.granted else (snap.rejected or "queued")
                assert expected == outcome, (step, ticket)
        elif op == "release" and model.leases:
            tickets = rng.sample(sorted(model.leases), min(len(model.leases), rng.choice([1, 1, 2])))
            n, _ = model.release_many(tickets, now)
            assert await st.release(*tickets) == n
        elif op == "cancel":
            waiting = sorted(model.waiting()) + sorted(model.leases)[:1]
            if waiting:
                ticket = rng.choice(waiting)
                assert await st.cancel(ticket) == model.cancel(ticket)
        elif op == "limit":
            limit = rng.choice([1, 2, 4, 8])
            rec = await st.get_limit()
            assert rec.version == version
            # now and then with the onset ramp's credit of endpoints that turned active
            credit, credit_ms = (rng.choice([1, 2, 5]), rng.choice([1000, 3000])) if rng.random() < 0.3 else (0, 0)
            assert await st.set_limit(version, VegasState(limit=float(limit)), credit, credit_ms / 1000)
            version += 1
            model.set_limit(limit, now, credit, credit_ms)
        elif op == "time":
            now += rng.choice([100, 900, 1500, 3500])
            await client.set(clock, now)
        elif op == "sync" and live:
            # Right before some renewals the counts are lost or overwritten (a DEL, an eviction,
            # a buggy peer): the renewal recounts them, and the script matches the model again.
            r, ck = rng.random(), script_keys(pool)[K["counts"]]
            if r < 0.25:  # (the fair order's flow tags kept: state, not counts)
                fields = [f for f in await client.hkeys(ck) if not f.startswith(b"f")]
                if fields:
                    await client.hdel(ck, *fields)
            elif r < 0.4:
                await client.hset(ck, mapping={"i1": "abc", "q0": "-7", "i2": "9", "nf1": "x", "t2:zz": "4"})
            elif r < 0.5:
                await client.hset(ck, mapping={"i0": "1e", "q2": "5", "n2": "99"})
            await sync(rng.choice(live), rng.random() < 0.3)
        elif op == "mine":
            tickets = sorted(model.waiting())[:3] + sorted(model.leases)[:1]
            if tickets:
                got_mine, _ = model.mine(tickets, now)
                assert set(await st.granted_among(tickets)) == set(got_mine)
        elif op == "credits":
            credits = [t for t in model.leases if ":c" in t][:2]
            if credits:
                model.return_credits(credits, now)
                await st.return_credits(*credits)
        elif op == "die" and len(live) > 1:
            dead.add(rng.choice(live))  # it never syncs again: its waiters must never be granted
        elif op == "flush":
            # Redis restarted empty: every live gateway re-asserts what it has.
            holders = {g: ({t: (ls.cls, ls.seq) for t, ls in model.leases.items() if ls.gateway == g},
                           {w.ticket: (w.cls, w.seq, max(1.0, float(int(w.deadline - now))), w.tenant)
                            for q in model.queues for w in q if w.gateway == g}) for g in live}
            await client.delete(*[k for k in script_keys(pool) if not k.endswith(":admin_testclock")])
            model.leases.clear()
            for q in model.queues:
                q.clear()
            model.gateways.clear()
            model.creditors.clear()
            model.forget_order()  # the fair order's state went with the rest
            model.tokens = None  # the bucket went with the state: full again
            model.extra = 0.0  # and the ramp's credit
            # and the registry (until a controller writes it again): no active endpoint for the
            # ramp's per-endpoint floors (a review's seed paced a P2 in the script, not the model)
            model.endpoints = 0
            model.limit = limit = st.settings.initial_limit if st.settings else limit
            version = 0
            for g, (held, waiting) in holders.items():
                await st.sync(g, seqs[g] + 1, {t: (c, s, "") for t, (c, s) in held.items()},
                              {t: (c, s, rem / 1000, ten) for t, (c, s, rem, ten) in waiting.items()})
                model.sync(g, seqs[g] + 1, held, waiting, now)
        assert await leased(client, pool) == set(model.leases), (step, op)
        assert await queue_order(client, pool) == [w.ticket for q in model.queues for w in q], (step, op)
        await check_invariants(client, pool)
        if op not in ("sync", "flush", "limit"):
            st_now = await st.status()
            assert st_now.inflight_total <= max(st_now.limit, before)


async def test_dead_gateways_waiters_are_never_granted_and_purged(client: aioredis.Redis) -> None:
    st = await make(client, "dead", ttl=0.3, limit=1, shares=(0, 0, 0))
    await st.sync("a", 1, {}, {})
    await st.sync("dead", 1, {}, {})
    assert (await st.acquire("dead/1", "dead", 1, 1, "t")).granted
    await st.enqueue("dead/2", "dead", 2, 0, "t", 30)  # a P0 waiter of the gateway that dies
    await st.enqueue("a/1", "a", 1, 1, "t", 30)
    await asyncio.sleep(0.2)
    await st.sync("a", 2, {}, {"a/1": (1, 1, 30.0, "t")})
    await asyncio.sleep(0.2)  # `dead` never synced again: its lease and liveness expire
    await st.sync("a", 2, {}, {"a/1": (1, 1, 30.0, "t")})
    assert await leased(client, "dead") == {"a/1"}  # the survivor, not the dead P0 waiter
    assert (await st.status()).queued_total == 0  # the dead gateway's waiter is purged
    await check_invariants(client, "dead")


async def test_a_grant_to_a_stalled_gateway_ends_with_its_liveness(client: aioredis.Redis, listen: Listen) -> None:
    """A gateway that stalled with a waiter queued (SIGSTOP, a blocked loop: its connections
    stay open, so it is heard) is known dead only one TTL after its last sync; a permit freed
    before then may be granted to that waiter. The lease ends with the gateway's liveness, not a
    full TTL after the grant: the pool has every permit back one TTL after the stall began
    (`floodgate bench faults`, sigkill, read 15.59 s at TTL 15 s before)."""
    pool = "stallgrant"
    clock = key(pool, "admin_testclock")
    t0 = 1_000_000
    await client.set(clock, t0)
    st = await make(client, pool, ttl=3.0, limit=1, shares=(0, 0, 0))
    await listen(pool, "a", "stalled")
    await st.sync("a", 1, {}, {})
    await st.sync("stalled", 1, {}, {})  # its last sync: alive until t0 + 3 s
    assert (await st.acquire("a/1", "a", 1, 1, "t")).granted
    assert not (await st.enqueue("stalled/1", "stalled", 1, 0, "t", 30)).granted  # then it stalls
    await client.set(clock, t0 + 2000)
    await st.sync("a", 2, {"a/1": (1, 1, "")}, {})
    assert await st.release("a/1") == 1  # the grant loop hands the permit to the stalled one's waiter
    assert await leased(client, pool) == {"stalled/1"}
    await client.set(clock, t0 + 2999)
    await st.sync("a", 2, {}, {})
    assert not (await st.acquire("a/2", "a", 2, 1, "t")).granted
    await st.cancel("a/2")
    await client.set(clock, t0 + 3001)  # one TTL after the stall (was: t0 + 5000, a TTL after the grant)
    await st.sync("a", 3, {}, {})
    assert (await st.acquire("a/3", "a", 3, 1, "t")).granted
    await check_invariants(client, pool)


async def test_a_crashed_gateways_waiters_are_dropped_at_their_turn(client: aioredis.Redis, listen: Listen) -> None:
    """A gateway that crashed (its connections closed: no one hears its grant channel) keeps its
    liveness until one TTL after its last sync. Its waiters are dropped when their turn comes,
    and the permit goes to the next waiter at once, not to a process that can never use it
    (the fault review: a pool of L 4 served 2, then 0, until the dead one's liveness ran out)."""
    pool = "crashgrant"
    clock = key(pool, "admin_testclock")
    t0 = 1_000_000
    await client.set(clock, t0)
    st = await make(client, pool, ttl=3.0, limit=2, shares=(0, 0, 0))
    await listen(pool, "a")
    await st.sync("a", 1, {}, {})
    await st.sync("dead", 1, {}, {})  # alive in `gws` until t0 + 3 s; nobody listens for it
    assert (await st.acquire("a/1", "a", 1, 1, "t")).granted
    assert (await st.acquire("a/2", "a", 2, 1, "t")).granted
    for seq in (1, 2, 3):  # three waiters of the crashed one, queued ahead of the survivor's
        assert not (await st.enqueue(f"dead/{seq}", "dead", seq, 0, "t", 30)).granted
    assert not (await st.enqueue("a/3", "a", 3, 1, "t", 30)).granted
    await client.set(clock, t0 + 1000)
    assert await st.release("a/1") == 1  # the three dead heads are dropped, a/3 is granted
    assert await leased(client, pool) == {"a/2", "a/3"}
    assert (await st.status()).queued_total == 0
    # the survivor's own poll: the granted one is leased, a dropped one would be reported gone
    assert await st.waiting_among(["a/3", "a/9"]) == ({"a/3": ""}, {"a/9"})
    await check_invariants(client, pool)


async def test_a_gateway_not_heard_re_queues_its_dropped_waiters(client: aioredis.Redis, listen: Listen) -> None:
    """A live gateway whose pub/sub connection was down when its waiter's turn came loses that
    waiter in Redis; its poll reports it gone and its sync puts it back (at the back of its class),
    with its remaining deadline."""
    pool = "deaf"
    st = await make(client, pool, limit=1, shares=(0, 0, 0))
    await st.sync("a", 1, {}, {})
    await st.sync("b", 1, {}, {})
    assert (await st.acquire("b/1", "b", 1, 1, "t")).granted
    await st.enqueue("a/1", "a", 1, 1, "t", 30)
    await listen(pool, "b")
    await st.enqueue("b/2", "b", 2, 1, "t", 30)
    assert await st.release("b/1") == 1  # a/1's turn: `a` is not heard, so b/2 is granted
    assert await leased(client, pool) == {"b/2"}
    assert await st.waiting_among(["a/1"]) == ({}, {"a/1"})
    await listen(pool, "a")  # its subscription is back; the poll's sync re-queues the waiter
    await st.sync("a", 2, {}, {"a/1": (1, 1, 25.0, "t")})
    assert await queue_order(client, pool) == ["a/1"]
    assert await st.waiting_among(["a/1"]) == ({}, set())
    assert await st.release("b/2") == 1
    assert await st.waiting_among(["a/1"]) == ({"a/1": ""}, set())
    await check_invariants(client, pool)


async def test_a_gateway_that_cannot_subscribe_is_heard_by_its_polls(client: aioredis.Redis) -> None:
    """A processor that holds no subscription (a proxy or ACL without pub/sub, a connection
    being re-made) says so at every poll: for that long its waiters are granted (the poll finds
    the grant), not dropped at every turn; once it stops polling (it died) they are dropped."""
    pool = "deafpoll"
    clock = key(pool, "admin_testclock")
    t0 = 1_000_000
    await client.set(clock, t0)
    st = await make(client, pool, limit=1, shares=(0, 0, 0))
    await st.sync("a", 1, {}, {})
    await st.sync("b", 1, {}, {})
    assert (await st.acquire("b/1", "b", 1, 1, "t")).granted
    for seq in (1, 2):
        await st.enqueue(f"a/{seq}", "a", seq, 1, "t", 30)
    assert await st.waiting_among(["a/1", "a/2"], deaf="a", deaf_ms=1000) == ({}, set())
    assert await st.release("b/1") == 1  # heard by its polls: granted, found by the next poll
    assert await st.waiting_among(["a/2"], deaf="a", deaf_ms=1000) == ({}, set())
    assert await st.granted_among(["a/1"]) == {"a/1": ""}
    await client.set(clock, t0 + 1500)  # no poll for 1.5 s: it died
    assert await st.release("a/1") == 1
    assert await leased(client, pool) == set() and await queue_order(client, pool) == []
    await check_invariants(client, pool)


async def test_ticket_hashes_are_hashtables_and_their_pad_is_no_ticket(client: aioredis.Redis) -> None:
    # As listpacks (up to 512 fields on Valkey 9) every ticket lookup scanned the whole hash;
    # sync keeps a pad field in them so the server stores hashtables. The pad is no ticket:
    # not counted, not dropped by sync, not purged with a dead gateway, not a lease in status.
    from floodgate.status import read_pool

    st = await make(client, "pad", limit=2, shares=(0, 0, 0))
    await st.sync("a", 1, {}, {})
    for k in ("lmeta", "qmeta", "state"):
        assert await client.object("encoding", key("pad", k)) == b"hashtable", k
    for seq in range(1, 6):
        await st.admit(f"a/{seq}", "a", seq, 1, "t", 0, 30)
    assert (await st.status()).queued_total == 3
    await check_invariants(client, "pad")
    await st.sync("a", 6, {"a/1": (1, 1, ""), "a/2": (1, 2, "")}, {f"a/{s}": (1, s, 30.0, "t") for s in (3, 4, 5)})
    await check_invariants(client, "pad")  # nothing re-asserted or dropped: the pad is no entry of `a`
    assert await leased(client, "pad") == {"a/1", "a/2"}
    assert [g.leases for g in (await read_pool(client, "pad")).gateways] == [2]
    await st.release("a/1", "a/2")
    for seq in (3, 4, 5):
        await st.cancel(f"a/{seq}")  # a/3 and a/4 were granted by the releases: they own permits
    await st.release("a/3", "a/4")
    await check_invariants(client, "pad")
    assert await client.hkeys(key("pad", "qmeta")) == [PAD_FIELD.encode()]  # empty, and still a hashtable
    assert await client.object("encoding", key("pad", "qmeta")) == b"hashtable"


async def test_sync_makes_the_big_zsets_skiplists_and_leaves_no_pad(client: aioredis.Redis, listen: Listen) -> None:
    # As listpacks (up to 128 entries by default) every ZADD / ZREM of a lease scanned the ZSET;
    # sync converts leases, queue and qdl of 16 entries or more by adding and removing a long
    # member in one call: no reader ever sees it. A smaller ZSET stays a listpack.
    st = await make(client, "zpad", limit=20, shares=(0, 0, 0))
    await listen("zpad", "a")
    await st.sync("a", 1, {}, {})
    for seq in range(1, 31):
        await st.admit(f"a/{seq}", "a", seq, 1, "t", 0, 30)
    zk = {n: key("zpad", n) for n in ("leases", "queue", "qdl")}
    assert {n: await client.object("encoding", k) for n, k in zk.items()} == \
        {"leases": b"listpack", "queue": b"listpack", "qdl": b"listpack"}
    held = {f"a/{s}": (1, s, "") for s in range(1, 21)}
    waiting = {f"a/{s}": (1, s, 30.0, "t") for s in range(21, 31)}
    await st.sync("a", 31, held, waiting)
    assert await client.object("encoding", zk["leases"]) == b"skiplist"  # 20 leases
    assert await client.object("encoding", zk["queue"]) == b"listpack"   # 10 waiters
    assert await leased(client, "zpad") == set(held)
    assert set(await queue_order(client, "zpad")) == set(waiting)
    assert await client.zcard(zk["qdl"]) == 10
    await check_invariants(client, "zpad")
    await st.release("a/1", "a/2")  # grants a/21, a/22: still a skiplist
    assert await client.object("encoding", zk["leases"]) == b"skiplist"
    assert await leased(client, "zpad") == (set(held) - {"a/1", "a/2"}) | {"a/21", "a/22"}
    await check_invariants(client, "zpad")


async def test_status_never_writes(client: aioredis.Redis) -> None:
    # No settings stored, nothing at all: a read must not create anything.
    assert (await read_pool_status(client, "empty")).limit == 1
    assert await client.keys("fg:{empty}:*") == []
    st = await make(client, "ro", ttl=0.2, limit=1, shares=(0, 0, 0), picking=True)
    await client.sadd(key("ro", "active"), "10.0.0.1:80")
    await st.sync("a", 1, {}, {})
    assert (await st.acquire("a/1", "a", 1, 1, "t")).granted
    await st.enqueue("b/1", "b", 1, 2, "t", 30)
    await asyncio.sleep(0.3)  # a/1 has expired: a write would reclaim it and grant b/1
    dump = {k: await client.dump(k) for k in await client.keys("fg:{ro}:*")}
    for _ in range(3):
        s = await read_pool_status(client, "ro")
        assert s.inflight_total == 1 and s.queued_total == 1
    assert {k: await client.dump(k) for k in await client.keys("fg:{ro}:*")} == dump


async def test_settings_are_stored_once_and_used_by_every_grant(client: aioredis.Redis) -> None:
    first = await make(client, "cfg", limit=4, shares=(0.5, 0.0, 0.0), always=(True, False, False))
    other = PoolState(client, "cfg", lease_ttl_s=30, settings=PoolSettings(4, (0.0, 0.0, 0.0)))
    stored = await other.configure()
    assert stored == first.settings
    assert other.settings is not None and other.settings.differences(stored)  # reported by the admitter
    # `other` grants with the stored reservation: 2 of 4 kept for P0, even via its calls.
    assert (await other.acquire("o/1", "o", 1, 2, "t")).granted
    assert (await other.acquire("o/2", "o", 2, 2, "t")).granted
    assert not (await other.acquire("o/3", "o", 3, 2, "t")).granted
    newer = PoolState(client, "cfg", lease_ttl_s=30, settings=PoolSettings(4, (0.0, 0.0, 0.0), epoch=1))
    assert (await newer.configure()).epoch == 1  # a higher epoch replaces them
    assert (await other.acquire("o/4", "o", 4, 2, "t")).granted


async def test_caps_are_checked_atomically_in_enqueue(client: aioredis.Redis) -> None:
    st = await make(client, "caps", limit=1, shares=(0, 0, 0), max_queue=(100, 3, 100), tenant_cap=(100, 2, 100))
    assert (await st.acquire("a/1", "a", 1, 1, "x")).granted
    # Two gateways both saw an empty queue on `acquire`; the caps hold anyway.
    results = await asyncio.gather(*(st.enqueue(f"{g}/{i}", g, i, 1, "t", 30) for g in "bc" for i in range(2, 5)))
    reasons = sorted(r.rejected or "queued" for r in results)
    assert reasons == ["queued", "queued", "tenant_cap", "tenant_cap", "tenant_cap", "tenant_cap"]
    assert (await st.enqueue("d/1", "d", 1, 1, "u", 30)).rejected == ""
    assert (await st.enqueue("d/2", "d", 2, 1, "v", 30)).rejected == "queue_full"


async def test_sync_reasserts_after_redis_lost_everything(client: aioredis.Redis) -> None:
    st = await make(client, "rs", limit=3, shares=(0, 0, 0))
    await st.sync("a", 1, {}, {})
    for i in (1, 2, 3):
        assert (await st.acquire(f"a/{i}", "a", i, 1, "t")).granted
    assert (await st.acquire("ghost/1", "a", 9, 1, "t")).granted is False  # full
    await client.flushall()
    res = await st.sync("a", 5, {"a/1": (1, 1, ""), "a/3": (0, 3, "")}, {"a/4": (2, 4, 10.0, "t")})
    assert res.reasserted == 2 and res.requeued == 1
    assert await leased(client, "rs") == {"a/1", "a/3", "a/4"}  # the waiter got the free permit
    # an abandoned acquire that runs late is dropped by the next sync
    assert (await st.acquire("a/2", "a", 2, 1, "t")).granted is False
    await st.release("a/4")
    assert (await st.acquire("a/5", "a", 5, 1, "t")).granted
    res = await st.sync("a", 6, {"a/1": (1, 1, ""), "a/3": (0, 3, "")}, {})
    assert res.dropped == 1 and await leased(client, "rs") == {"a/1", "a/3"}
    await check_invariants(client, "rs")


async def test_stale_version_is_refused(client: aioredis.Redis) -> None:
    st = await make(client, "cas", ttl=60, limit=4)
    rec = await st.get_limit()
    assert await st.set_limit(rec.version, VegasState(limit=8.0))
    assert not await st.set_limit(rec.version, VegasState(limit=2.0))
    assert (await st.get_limit()).state.limit == 8.0


async def test_expired_lease_is_reclaimed_and_granted_to_next_waiter(client: aioredis.Redis) -> None:
    st = await make(client, "ttl", ttl=0.5, limit=1, shares=(0, 0, 0))
    assert (await st.acquire("a/1", "a", 1, 1, "t")).granted
    assert not (await st.acquire("b/1", "b", 1, 1, "t")).granted
    pubsub = client.pubsub()
    await pubsub.ssubscribe(gateway_channel("b", "ttl"))
    assert not (await st.enqueue("b/1", "b", 1, 1, "t", 30)).granted
    await st.sync("b", 2, {}, {"b/1": (1, 1, 30.0, "t")})  # b stays alive; a never renews
    await asyncio.sleep(0.6)
    await st.sync("b", 2, {}, {"b/1": (1, 1, 30.0, "t")})  # reclaims expired leases and grants
    assert await st.granted_among(["b/1"]) == {"b/1": ""}
    msg = None
    for _ in range(20):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            break
    assert msg is not None and msg["data"] == b"ttl|b/1|"  # targeted grant, to b only (no picking)
    await pubsub.aclose()


async def test_cancel_after_grant_reports_ownership(client: aioredis.Redis, listen: Listen) -> None:
    st = await make(client, "race", limit=1, shares=(0, 0, 0))
    await listen("race", "a")
    assert (await st.acquire("a/1", "a", 1, 1, "t")).granted
    await st.enqueue("a/2", "a", 2, 1, "t", 30)
    assert await st.release("a/1") == 1  # grants a/2
    assert await st.cancel("a/2") == 1  # the waiter timed out at the same moment: it owns a permit
    assert await st.release("a/2") == 1
    assert await st.release("a/2") == 0  # exactly once
    assert await st.cancel("nope") == 2


async def test_retried_calls_are_idempotent(client: aioredis.Redis) -> None:
    st = await make(client, "idem", limit=2, shares=(0, 0, 0))
    a = await st.acquire("a/1", "a", 1, 1, "t")
    assert a.granted and (await st.acquire("a/1", "a", 1, 1, "t")).granted
    assert (await st.acquire("a/2", "a", 2, 1, "t")).granted
    await st.enqueue("a/3", "a", 3, 1, "t", 30)
    await st.enqueue("a/3", "a", 3, 1, "t", 30)
    s = await st.status()
    assert s.inflight_total == 2 and s.queued_total == 1
    await check_invariants(client, "idem")


async def test_missing_settings_are_configured_on_demand_and_noscript_reloads(client: aioredis.Redis) -> None:
    st = await make(client, "ns", limit=2)
    assert (await st.acquire("a/1", "a", 1, 1, "t")).granted
    await client.function_flush()
    await client.script_flush()
    await client.flushall()
    # "Function not found" -> library loaded again; settings missing -> configured again
    assert (await st.acquire("a/2", "a", 2, 1, "t")).granted
    assert FUNCTION in str(await client.function_list())
    st._script.functions = False  # as on a server without Functions: EVALSHA, NOSCRIPT -> reload
    await client.script_flush()
    assert (await st.acquire("a/3", "a", 3, 1, "t")).granted


async def test_settings_written_again_are_not_served_from_the_script_cache(client: aioredis.Redis) -> None:
    # The library keeps parsed settings between calls, keyed by the settings' stamp: settings
    # lost and written again at the same epoch with other values must be the ones used.
    st = await make(client, "sc", limit=1, max_queue=(100, 1, 100))
    assert (await st.admit("a/1", "a", 1, 1, "", 0, 5)).granted
    assert (await st.admit("a/2", "a", 2, 1, "", 0, 5)).enqueued
    assert (await st.admit("a/3", "a", 3, 1, "", 0, 5)).rejected == "queue_full"
    await client.flushall()
    await make(client, "sc", limit=1, max_queue=(100, 5, 100))
    assert (await st.admit("a/4", "a", 4, 1, "", 0, 5)).granted
    assert (await st.admit("a/5", "a", 5, 1, "", 0, 5)).enqueued
    assert (await st.admit("a/6", "a", 6, 1, "", 0, 5)).enqueued


async def test_two_pools_are_independent(client: aioredis.Redis) -> None:
    a = await make(client, "pa", limit=1)
    b = await make(client, "pb", limit=1)
    assert (await a.acquire("g/1", "g", 1, 1, "t")).granted
    assert (await b.acquire("g/2", "g", 2, 1, "t")).granted
    assert all(k.startswith("fg:{pa}:") for k in script_keys("pa"))


async def test_demand_counters(client: aioredis.Redis) -> None:
    st = await make(client, "dm")
    await st.add_demand({(0, "admitted"): 3, (2, "early_drop"): 2})
    await st.add_demand({(0, "admitted"): 1})
    d = await read_demand(client, "dm")
    assert d[0]["admitted"] == 4 and d[2]["early_drop"] == 2 and d[1]["queued"] == 0


async def test_credits_only_below_half_the_limit_and_recalled_by_a_queue(client: aioredis.Redis,
                                                                        listen: Listen) -> None:
    st = await make(client, "cr", limit=10, shares=(0, 0, 0))
    await listen("cr", "b")
    got = await st.acquire("a/1", "a", 1, 1, "t", credits=8)
    assert got.granted and len(got.credits) == 4  # at most half the limit: 1 + 4 = 5
    assert (await st.status()).inflight_total == 5  # credits are leases: they count
    assert (await st.acquire("a/2", "a", 2, 1, "t", credits=8)).credits == ()  # already half full
    pubsub = client.pubsub()
    await pubsub.ssubscribe(gateway_channel("a", "cr"))
    for i in range(3, 7):  # 6 held so far (a/1, 4 credits, a/2) + 4 = the limit
        assert (await st.acquire(f"b/{i}", "b", i, 1, "t")).granted
    assert not (await st.acquire("b/9", "b", 9, 1, "t")).granted  # full: the creditor is told
    msg = None
    for _ in range(20):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if msg:
            break
    assert msg is not None and msg["data"] == b"cr|!return|"
    await st.enqueue("b/9", "b", 9, 1, "t", 30)
    await st.return_credits(*got.credits)
    assert await st.granted_among(["b/9"]) == {"b/9": ""}  # a returned credit went to the waiter
    assert (await st.status()).grant_rate == 0  # returning credits is not a completion
    await pubsub.aclose()


async def test_event_rates_count_releases_and_grants(client: aioredis.Redis) -> None:
    # The decayed rates the policy's wait estimate rests on: releases (pool) and grants (class).
    st = await make(client, "rates", limit=2)
    clock = key("rates", "admin_testclock")
    now = 1_000_000
    await client.set(clock, now)
    await st.sync("g", 0, {}, {})
    for i in range(1, 31):  # one grant and one release of class 0 every 100 ms: 10/s each
        assert (await st.acquire(f"g/{i}", "g", i, 0, "", 0)).granted
        now += 100
        await client.set(clock, now)
        assert await st.release(f"g/{i}") == 1
    s = await st.status()
    assert s.release_n == 30
    assert 8 < s.grant_rate < 12  # 10/s, decayed over tau 10 s with the start-up correction
    assert s.inflight_avg == pytest.approx(1.0)  # one permit held at every release
    assert (await st.acquire("g/32", "g", 32, 0, "", 0)).granted
    assert (await st.acquire("g/33", "g", 33, 0, "", 0)).granted
    refused = await st.acquire("g/34", "g", 34, 0, "", 0)
    assert not refused.granted and 8 < refused.class_rate < 14  # class 0's grants


@pytest.mark.parametrize("endpoints, burst", [(0, 8), (2, 8), (6, 24)])
async def test_the_onset_ramp_lets_each_active_endpoint_take_its_floor(client: aioredis.Redis, endpoints: int,
                                                                      burst: int) -> None:
    # The elastic bench's burst 2: limit 80, a P0 in flight, half the permits free, a clump of
    # P2. With the shipped ramp (0.08 x L at once, at least 8, and 4 per active endpoint) six
    # active endpoints let 24 in at once where the pool-wide floor alone let 8; two endpoints
    # (the overload bench's pool) or none registered read as before.
    pool = f"rampep{endpoints}"
    clock = key(pool, "admin_testclock")
    await client.set(clock, 1_000_000)
    st = await make(client, pool, limit=80, shares=(0.5, 0.1, 0.0), ramp=(0.08, 0.1, 8.0, 8.0),
                    ramp_ep=(4.0, 4.0))
    for i in range(endpoints):
        await client.sadd(script_keys(pool)[K["active"]], f"10.0.0.{i}:8000")
    assert (await st.acquire("p0/1", "a", 1, 0, "t")).granted
    granted = 0
    for i in range(40):
        granted += bool((await st.acquire(f"p2/{i}", "a", 2 + i, 2, "t")).granted)
    assert granted == burst - 1  # the P0 took a token too
    # and the bucket refills at the floor: 4 per endpoint per second (8 at least)
    await client.set(clock, 1_000_000 + 500)
    more = sum([bool((await st.acquire(f"p2/b{i}", "a", 100 + i, 2, "t")).granted) for i in range(40)])
    assert more == int(0.5 * max(8.0, 4.0 * endpoints))


async def _held_and_waiting(client: aioredis.Redis, pool: str, listen: Listen) -> PoolState:
    """Limit 4, every permit held by gateway a (P0, P1, P2 and a routed one), 8 waiters of
    gateway b in three classes and three flows (two tenants, and none)."""
    st = await make(client, pool, limit=4, shares=(0, 0, 0), picking=True)
    await client.sadd(key(pool, "active"), "10.0.0.1:80", "10.0.0.2:80")
    await listen(pool, "a", "b")
    await st.sync("a", 1, {}, {})
    await st.sync("b", 1, {}, {})
    for i, cls in enumerate((0, 1, 2, 1), start=1):
        assert (await st.acquire(f"a/{i}", "a", i, cls, "x" if i % 2 else "")).granted
    for i in range(1, 9):
        assert not (await st.enqueue(f"b/{i}", "b", i, 1 + i % 2, ("x", "y", "")[i % 3], 30)).granted
    await check_invariants(client, pool)
    return st


async def _renew(st: PoolState, client: aioredis.Redis, pool: str) -> int:
    """Gateway a's renewal (its four permits) and b's (its waiters, or the permits they got)."""
    held_a = {f"a/{i}": (cls, i, "") for i, cls in enumerate((0, 1, 2, 1), start=1)}
    res = await st.sync("a", 5, held_a, {})
    waiting = {f"b/{i}": (1 + i % 2, i, 30.0, ("x", "y", "")[i % 3]) for i in range(1, 9)}
    res_b = await st.sync("b", 9, {}, waiting)
    return res.recounted + res_b.recounted


@pytest.mark.parametrize("loss", ["deleted", "garbage", "negative"])
async def test_lost_counts_are_recounted_at_the_next_renewal(client: aioredis.Redis, listen: Listen,
                                                             loss: str) -> None:
    # A review: the counts hash deleted with 4 permits held and 8 waiting left in-flight at -4
    # for good, and 8 requests ran at limit 4 on every later burst.
    pool = f"lost-{loss}"
    st = await _held_and_waiting(client, pool, listen)
    counts, epinf = key(pool, "counts"), key(pool, "epinf")
    if loss == "deleted":
        await client.delete(counts, epinf)
    elif loss == "garbage":  # a value that is not a number failed every call that reads the counts
        await client.hset(counts, mapping={"i1": "abc", "q2": "1e", "t1:x": "?"})
        await client.hset(epinf, "10.0.0.1:80", "many")
        with pytest.raises(aioredis.ResponseError):
            await st.acquire("c/1", "c", 1, 1, "")
    else:
        await client.hset(counts, mapping={"i0": -50, "i1": -3, "q1": 7, "t2:y": 9, "t0:ghost": 2, "f0:ghost": 99})
        await client.hset(epinf, mapping={"10.0.0.1:80": -9, "10.0.0.9:80": 5})
    assert await _renew(st, client, pool) > 0
    await check_invariants(client, pool)
    eps = {k.decode(): int(v) for k, v in (await client.hgetall(epinf)).items()}
    routed = [v.decode() for v in (await client.hgetall(key(pool, "lep"))).values()]
    assert eps == {e: routed.count(e) for e in set(routed)} and sum(eps.values()) == 4
    assert await client.hget(counts, "f0:ghost") is None  # a flow tag with no waiter left
    assert await _renew(st, client, pool) == 0  # nothing left to correct
    # The limit holds again: four releases grant four waiters, not eight.
    await st.release(*[f"a/{i}" for i in range(1, 5)])
    assert len(await leased(client, pool)) == 4 and len(await queue_order(client, pool)) == 4
    await check_invariants(client, pool)


async def test_a_limit_or_clock_that_is_not_a_number_is_none(client: aioredis.Redis) -> None:
    # A review: a non-numeric `state.limit` or test clock failed every call of the pool (the
    # processors degraded to local limits, one of them to 0) until someone fixed the key.
    st = await make(client, "nan", limit=2, shares=(0, 0, 0))
    await st.sync("a", 1, {}, {})
    await client.hset(key("nan", "state"), "limit", "abc")
    await client.set(key("nan", "admin_testclock"), "noon")
    assert (await st.acquire("a/1", "a", 1, 1, "")).granted  # the pool's initial limit, 2
    assert (await st.acquire("a/2", "a", 2, 1, "")).granted
    assert not (await st.acquire("a/3", "a", 3, 1, "")).granted


async def test_a_lost_leases_key_leaves_no_route_of_an_ended_request(client: aioredis.Redis, listen: Listen) -> None:
    # A review: with the leases key gone, two of four routed requests ended before the next
    # renewal; their routes stayed and the endpoints kept two phantom permits for good (a drain
    # of them never saw 0), and every renewal reported them dropped again.
    pool = "lost-leases"
    st = await make(client, pool, limit=4, shares=(0, 0, 0), picking=True)
    await client.sadd(key(pool, "active"), "10.0.0.1:80", "10.0.0.2:80")
    await listen(pool, "a")
    await st.sync("a", 1, {}, {})
    eps = {}
    for i in range(1, 5):
        snap = await st.acquire(f"a/{i}", "a", i, 1, "")
        assert snap.granted
        eps[f"a/{i}"] = snap.endpoint
    await client.delete(key(pool, "leases"))
    assert await st.release("a/1", "a/2") == 0  # those requests end: no lease found
    held = {f"a/{i}": (1, i, eps[f"a/{i}"]) for i in (3, 4)}
    await st.sync("a", 5, held, {})
    res = await st.sync("a", 5, held, {})
    assert res.dropped == 0 and res.recounted == 0
    routes = {k.decode(): v.decode() for k, v in (await client.hgetall(key(pool, "lep"))).items()}
    assert set(routes) == {"a/3", "a/4"}
    counts = {k.decode(): int(v) for k, v in (await client.hgetall(key(pool, "epinf"))).items()}
    assert counts == {e: list(routes.values()).count(e) for e in set(routes.values())}
    await check_invariants(client, pool)


async def test_a_lost_queue_key_is_refilled_by_the_waiters_renewal(client: aioredis.Redis, listen: Listen) -> None:
    # A review: with the queue key gone (the waiters' metas kept) no renewal queued them again,
    # and a newcomer took each freed permit while they waited to their deadlines.
    pool = "lost-queue"
    st = await make(client, pool, limit=2, shares=(0, 0, 0))
    await listen(pool, "a", "b")
    await st.sync("a", 1, {}, {})
    await st.sync("b", 1, {}, {})
    for i in (1, 2):
        assert (await st.acquire(f"a/{i}", "a", i, 1, "")).granted
    for i in (1, 2, 3):
        assert not (await st.enqueue(f"b/{i}", "b", i, 1, "x" if i == 2 else "", 30)).granted
    await client.delete(key(pool, "queue"))
    waiting = {f"b/{i}": (1, i, 30.0, "x" if i == 2 else "") for i in (1, 2, 3)}
    assert (await st.sync("b", 4, {}, waiting)).requeued == 3
    await check_invariants(client, pool)
    await st.release("a/1", "a/2")
    assert len(await st.granted_among(list(waiting))) == 2  # the freed permits went to the waiters
    assert not (await st.acquire("c/1", "c", 1, 1, "")).granted


@pytest.mark.parametrize("field", ["t1:a", "f1:a"])
async def test_a_tenant_count_or_tag_that_is_not_a_number_is_none(client: aioredis.Redis, listen: Listen,
                                                                   field: str) -> None:
    # A review: `t1:a` = "?" (tenant a not waiting) or `f1:a` = "?" (tenant a waiting) failed every
    # call that queued a P1 request of tenant a, and no renewal dropped it.
    pool = f"nan-{field[0]}"
    st = await make(client, pool, limit=1, shares=(0, 0, 0))
    await listen(pool, "a")
    await st.sync("a", 1, {}, {})
    assert (await st.acquire("a/1", "a", 1, 1, "a")).granted
    waiting: dict[str, tuple[int, int, float, str]] = {}
    if field.startswith("f"):
        assert not (await st.enqueue("a/2", "a", 2, 1, "a", 30)).granted
        waiting = {"a/2": (1, 2, 30.0, "a")}
    await client.hset(key(pool, "counts"), field, "?")
    assert not (await st.enqueue("a/3", "a", 3, 1, "a", 30)).granted  # queued: "?" read as none
    waiting["a/3"] = (1, 3, 30.0, "a")
    await st.sync("a", 4, {"a/1": (1, 1, "")}, waiting)
    value = await client.hget(key(pool, "counts"), field)
    assert value is None or value.decode().isdigit()
    await check_invariants(client, pool)
