"""Batched admission calls (`PoolState` sends the admission ops made while a call is in the air
as one `batch` script run) against a real Redis-protocol server.

A batch must mean exactly what its ops mean one call at a time: the same replies and the same
state afterwards (random histories run both ways on two pools with one clock), except that a
snapshot after the call's first is fresh only in the op's own part (in-flight, queued, its
tenant's waiters, its class's rate) and shares the rest with the call's first; ops reach Redis
in the order they were made even when one is made while the previous batch is in the air; a
grant to the caller's own waiter comes back in the reply, not as a message; one failing op does
not fail the others; and a batch lost in the air (Redis frozen) degrades its callers without
leaking a permit once Redis is back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.backends import Permit
from floodgate.extproc.redis_client import subscribe
from floodgate.extproc.schema import (
    SCRIPT_KEYS,
    PoolSettings,
    PoolStatus,
    expand_snapshots,
    gateway_channel,
    script_keys,
)
from floodgate.extproc.state import FUNCTION, PoolState
from redis.exceptions import ResponseError

from floodgate.stack import LocalStack
from floodgate.status import read_pool, render
from tests.helpers import listening, one_processor, wait_until

K = {name: i for i, name in enumerate(SCRIPT_KEYS)}
SHARES = (0.5, 0.3, 0.1)


async def make(c: aioredis.Redis, pool: str, *, gateway: str = "", limit: int = 3,
               on_grant: dict[str, str] | None = None, ttl: float = 30) -> PoolState:
    st = PoolState(c, pool, lease_ttl_s=ttl, gateway=gateway,
                   settings=PoolSettings(limit, SHARES, max_queue=(6, 6, 6), tenant_cap=(3, 3, 3)))
    if on_grant is not None:
        st.on_grant = on_grant.__setitem__
    await st.configure()
    return st


async def dump(c: aioredis.Redis, pool: str) -> dict[str, object]:
    """Every key of the pool, by its role (the test clock excluded)."""
    out: dict[str, object] = {}
    for name, k in zip(SCRIPT_KEYS, script_keys(pool), strict=True):
        t = (await c.type(k)).decode()
        if name == "admin_testclock" or t == "none":
            continue
        if t == "zset":
            out[name] = await c.zrange(k, 0, -1, withscores=True)
        elif t == "hash":
            h = await c.hgetall(k)
            if name == "settings":
                h = {f: v for f, v in h.items() if f not in (b"stamp", b"pool")}
            if name == "state":  # a batch's fence (`bx:<gateway>`) is the batch's own bookkeeping
                h = {f: v for f, v in h.items() if not f.startswith(b"bx:")}
            if name == "counts":  # a count that went back to its start within a batch is not rewritten
                h = {f: v for f, v in h.items() if v != b"0"}
            out[name] = h
        elif t == "set":
            out[name] = sorted(await c.smembers(k))
        else:
            out[name] = await c.get(k)
    return out


def _norm(x: object) -> object:
    """Floats to 10 significant digits: a batch formats an event rate once where single calls
    format it after every event (the 14-digit rounding in between may move the last digit)."""
    if isinstance(x, float):
        return float(f"{x:.10g}")
    if isinstance(x, bytes):
        parts = x.split(b"|")
        out = []
        for p in parts:
            try:
                out.append(f"{float(p):.10g}".encode() if b"." in p or b"e" in p else p)
            except ValueError:
                out.append(p)
        return b"|".join(out)
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_norm(v) for v in x)
    return x


def reply(r: object) -> object:
    if isinstance(r, int):
        return r
    return _norm(dataclasses.asdict(PoolStatus.from_reply(r)))  # type: ignore[arg-type]


# What a snapshot after a batch's first one reports fresh (leases.lua `snapshot`, `snapo`), with
# the reply's own fields; the rest is the call's first snapshot's.
OWN = ("inflight", "queued", "tenant_queued", "class_rate", "ahead",
       "granted", "endpoint", "partial", "credits", "rejected", "enqueued")


def as_one_batch(replies: list[object]) -> list[object]:
    """The replies of ops sent one call at a time, as one batch of them reports them."""
    first: dict[str, object] | None = None
    out: list[object] = []
    for r in replies:
        if isinstance(r, dict) and not r["partial"]:
            if first is None:
                first = r
            else:
                r = {**{k: v for k, v in first.items() if k not in OWN}, **{k: r[k] for k in OWN}}
        out.append(r)
    return out


@pytest.mark.parametrize("seed", range(6))
async def test_a_batch_means_its_ops_one_call_at_a_time(client: aioredis.Redis, seed: int) -> None:
    """The same random history on two pools with one clock: one op per call on `one`, the ops
    of each step made together (one batch) on `bat`. The whole stored state after every step
    must be identical, and so must every reply: a snapshot after the batch's first with its
    own part fresh and the rest the first's (what the ops share between them, the reads, the
    counts, the event rates, never goes stale: the own parts and the state show it)."""
    rng = random.Random(seed)
    grants_one: dict[str, str] = {}
    grants_bat: dict[str, str] = {}
    # A short TTL: leases expire and gateways that stop syncing die while the history runs.
    one = await make(client, f"one{seed}", gateway="ga", on_grant=grants_one, ttl=3)
    bat = await make(client, f"bat{seed}", gateway="ga", on_grant=grants_bat, ttl=3)
    now = 1_000_000
    for st in (one, bat):
        await client.set(st.keys[K["admin_testclock"]], now)
        for g in ("ga", "gb"):
            await st.sync(g, 1, {}, {})
    seqs = {"ga": 0, "gb": 0}
    seen_own_part = False
    for step in range(60):
        leases = [t.decode() for t in await client.zrange(one.keys[K["leases"]], 0, -1)]
        queued = [t.decode() for t in await client.zrange(one.keys[K["queue"]], 0, -1)]
        ops: list[tuple[str, tuple[object, ...]]] = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.choices(["admit", "acquire", "release", "cancel", "credits"], [6, 1, 3, 1, 1])[0]
            if kind in ("admit", "acquire"):
                gw = rng.choice(["ga", "gb"])
                seqs[gw] += 1
                args: tuple[object, ...] = (f"{gw}/{seqs[gw]}", gw, seqs[gw], rng.choices([0, 1, 2], [1, 3, 2])[0],
                                            rng.choice(["", "", "a", "b"]), rng.choice([0, 0, 2]))
                if kind == "admit":
                    args += (rng.choice([200, 1000, 5000]),)
                ops.append((kind, args))
            elif kind == "release" and leases:
                ops.append(("release", tuple(rng.sample(leases, min(len(leases), rng.choice([1, 2]))))))
            elif kind == "cancel" and (queued or leases):
                ops.append(("cancel", (rng.choice(queued + leases[:1]),)))
            elif kind == "credits":
                credits = [t for t in leases if ":c" in t][:2]
                if credits:
                    ops.append(("return_credits", tuple(credits)))
        r_one = [reply(await one._run(op, *args)) for op, args in ops]
        batches = bat.batches
        r_bat = [reply(r) for r in await asyncio.gather(*(bat._run(op, *args) for op, args in ops))]
        assert bat.batches == batches + bool(ops)  # the step's ops went as one call
        assert as_one_batch(r_one) == r_bat, (seed, step, ops)
        snaps = [r for r in r_bat if isinstance(r, dict) and not r["partial"]]
        seen_own_part |= len(snaps) > 1 and snaps[0] != snaps[-1]
        d_one, d_bat = _norm(await dump(client, one.pool)), _norm(await dump(client, bat.pool))
        assert d_one == d_bat, (seed, step, ops)
        assert grants_one == grants_bat
        if rng.random() < 0.3:
            now += rng.choice([100, 700, 2000])
            for st in (one, bat):
                await client.set(st.keys[K["admin_testclock"]], now)
            # `ga` makes the calls, so it renews like a live processor (gb may die). A caller
            # declared dead and purged holds the grants at its next call (its fence is gone:
            # leases.lua OPS.batch), and one op per call re-sets the fence before the next
            # call where a batch does not: the two histories would part for that reason alone.
            mine = {t.decode(): (1, int(t.decode().split("/")[1].split(":")[0]), "")
                    for t in await client.zrange(one.keys[K["leases"]], 0, -1) if t.decode().startswith("ga")}
            waits: dict[str, tuple[int, int, float, str]] = {}
            for t, meta in (await client.hgetall(one.keys[K["qmeta"]])).items():
                fields = meta.decode().split("|")
                if t.decode().startswith("ga/") and len(fields) == 5:  # class|deadline|gateway|seq|tenant
                    waits[t.decode()] = (int(fields[0]), int(fields[3]), max(0.001, (int(fields[1]) - now) / 1000),
                                         fields[4])
            for st in (one, bat):
                await st.sync("ga", seqs["ga"] + 1, mine, waits)
        if rng.random() < 0.1:
            for st in (one, bat):
                await st.sync("gb", seqs["gb"] + 1, {}, {})  # gb lets go of everything it had
        elif rng.random() < 0.15:
            g = rng.choice(["ga", "gb"])  # alive for another TTL, holding what Redis says it has
            mine = {t.decode(): (1, int(t.decode().split("/")[1].split(":")[0]), "")
                    for t in await client.zrange(one.keys[K["leases"]], 0, -1) if t.decode().startswith(g)}
            for st in (one, bat):
                await st.sync(g, seqs[g] + 1, mine, {})
    assert grants_bat  # the history granted some of ga's waiters in a reply
    assert seen_own_part  # some batch carried snapshots after its first, and they differed


async def test_own_grants_come_in_the_reply_and_others_by_message(client: aioredis.Redis) -> None:
    got: dict[str, str] = {}
    ga = await make(client, "own", gateway="ga", limit=1, on_grant=got)
    gb = await make(client, "own", gateway="gb", limit=1)
    for g in ("ga", "gb"):
        await ga.sync(g, 1, {}, {})
    sub = await subscribe(client, [gateway_channel("ga", "own"), gateway_channel("gb", "own")])
    try:
        assert (await ga.admit("ga/1", "ga", 1, 1, "", 0, 30)).granted
        assert (await ga.admit("ga/2", "ga", 2, 1, "", 0, 30)).enqueued
        assert (await gb.admit("gb/1", "gb", 1, 1, "", 0, 30)).enqueued
        assert await ga.release("ga/1") == 1
        assert got == {"ga/2": ""}  # told by the reply
        assert await gb.release("ga/2") == 1  # gb's call grants gb's waiter: also in the reply
        assert await ga.release("gb/1") == 1  # nothing waits
        assert (await ga.admit("ga/3", "ga", 3, 1, "", 0, 30)).granted
        assert (await gb.admit("gb/2", "gb", 2, 1, "", 0, 30)).enqueued
        assert await ga.release("ga/3") == 1  # ga's call grants gb's waiter: a message to gb
        msgs = []
        while (m := await sub.get_message(0.3)) is not None:
            msgs.append(m)
        assert msgs == [(gateway_channel("gb", "own"), b"own|gb/2|")]
    finally:
        await sub.aclose()


async def test_ops_made_while_a_batch_is_in_the_air_follow_it_in_order(client: aioredis.Redis) -> None:
    """A `cancel` made while its `admit` is in the air must not overtake it (it would find
    nothing, and the waiter queued afterwards would be granted a permit nobody holds)."""
    st = await make(client, "order", gateway="ga", limit=1)
    await st.sync("ga", 1, {}, {})
    assert (await st.admit("ga/1", "ga", 1, 1, "", 0, 30)).granted
    b0, n0 = st.batches, st.batched_ops
    admits = [asyncio.create_task(st.admit(f"ga/{i}", "ga", i, 1, "", 0, 30)) for i in (2, 3)]
    for _ in range(10):  # until the batch of both admits is in the air
        if st.batches > b0:
            break
        await asyncio.sleep(0)
    assert st.batches == b0 + 1
    cancel = asyncio.create_task(st.cancel("ga/2"))
    release = asyncio.create_task(st.release("ga/1"))  # grants the head: ga/3 once ga/2 is gone
    assert all(s.enqueued for s in await asyncio.gather(*admits))
    assert await cancel == 0  # it found the waiter its admit queued
    assert await release == 1
    assert (st.batches - b0, st.batched_ops - n0) == (2, 4)
    status = await st.status()
    assert status.queued_total == 0 and status.inflight_total == 1
    assert await client.zrange(st.keys[K["leases"]], 0, -1) == [b"ga/3"]


async def test_an_op_given_up_before_its_batch_was_sent_is_not_sent(client: aioredis.Redis) -> None:
    st = await make(client, "gaveup", gateway="ga", limit=1)
    t = asyncio.create_task(st.admit("ga/1", "ga", 1, 1, "", 0, 30))
    await asyncio.sleep(0)  # queued, not sent
    t.cancel()
    other = await st.admit("ga/2", "ga", 2, 1, "", 0, 30)
    assert other.granted  # ga/1 never took the only permit
    assert await client.zrange(st.keys[K["leases"]], 0, -1) == [b"ga/2"]


async def test_one_failing_op_does_not_fail_the_others_in_its_batch(client: aioredis.Redis) -> None:
    st = await make(client, "fail", gateway="ga", limit=2)
    ok1 = st.admit("ga/1", "ga", 1, 1, "", 0, 30)
    bad = st._run("admit", "ga/2", "ga", 2, "not-a-class", "", 0, 30000)
    ok2 = st.admit("ga/3", "ga", 3, 1, "", 0, 30)
    r1, rbad, r2 = await asyncio.gather(ok1, bad, ok2, return_exceptions=True)
    assert isinstance(rbad, ResponseError)
    assert isinstance(r1, PoolStatus) and r1.granted
    assert isinstance(r2, PoolStatus) and r2.granted
    assert st.batches == 1
    assert (await st.status()).inflight_total == 2


async def test_a_batch_lost_in_the_air_degrades_and_leaks_no_permit(stack: LocalStack) -> None:
    """Permits held and waiters queued; Redis freezes while a batch of releases and admits is
    in the air. Every caller of that batch degrades (nobody hangs past its timeout); when Redis
    is back the processor re-asserts what it holds, and once everything is released Redis
    holds no lease and no waiter."""
    async with one_processor(stack, limit=2, lease_ttl_s=3, op_timeout_s=0.25, reconnect_interval_s=0.2,
                             poll_interval_s=0.25) as g:
        admitter, metrics = g.admitter, g.metrics
        assert stack.redis_child is not None
        rt = admitter.pools["a"]
        frozen = False
        results: list[Permit | object] = []

        def degraded() -> float:
            return float(metrics.pool_degraded.labels("a")._value.get())

        async def status_is(inflight: int, queued: int) -> bool:
            try:
                st = await asyncio.wait_for(rt.state.status(), 1)
            except (TimeoutError, OSError, Exception):
                return False
            return st.inflight_total == inflight and st.queued_total == queued

        try:
            held = [await admitter.admit("a", 1, "t") for _ in range(2)]
            assert all(isinstance(p, Permit) for p in held)
            waiters = [asyncio.create_task(admitter.admit("a", 1, "t")) for _ in range(3)]
            assert await wait_until(lambda: status_is(2, 3), 10)
            stack.redis_child.kill(signal.SIGSTOP)
            frozen = True
            batches = rt.state.batches
            release = asyncio.create_task(admitter.release(held[0]))  # grants a waiter: the reply is lost
            late = [asyncio.create_task(admitter.admit("a", 1, "t")) for _ in range(2)]
            assert await wait_until(lambda: degraded() == 1, 10)
            assert rt.state.batches > batches
            stack.redis_child.kill(signal.SIGCONT)
            frozen = False
            await release
            results = list(await asyncio.gather(*waiters, *late))
            assert await wait_until(lambda: degraded() == 0, 20)
            permits = [r for r in [held[1], *results] if isinstance(r, Permit)]
            for p in permits:
                await admitter.release(p)
            assert not rt.held
            assert await wait_until(lambda: status_is(0, 0), 10)  # within a few sync periods
        finally:
            if frozen:
                stack.redis_child.kill(signal.SIGCONT)


async def test_a_batch_that_runs_after_a_later_one_is_refused(stack: LocalStack) -> None:
    """A batch whose caller gave up while the server was frozen still runs when the server gets
    to its bytes, and may run after a later batch of the same processor that went over another
    connection (seen once in CI: a sync from before a freeze, run after the switch back, leased
    again a permit released during the freeze and queued again a waiter that had moved to the
    local queue; 2 of L 2 held by nobody until their TTL). Here the old sync's bytes run late on
    a connection of their own, as the frozen server would run them, against the real script: the
    newer batches stand, the old one is refused whole, and the processor goes on unharmed. A
    processor restarted with the same gateway id starts above its predecessor's fence."""
    async with one_processor(stack, limit=2, lease_ttl_s=3, op_timeout_s=0.25) as g:
        admitter, client, raw = g.admitter, g.client, g.raw  # raw: the late bytes' own connection
        rt = admitter.pools["a"]
        real = rt.state._script
        syncs: list[list[object]] = []

        class Recorded:
            async def __call__(self, keys: list[str], args: list[object], *, read: bool = False) -> object:
                if not read and args[0] == "batch" and "sync" in args:
                    syncs.append(list(args))
                return await real(keys, args, read=read)

        rt.state._script = Recorded()  # type: ignore[assignment]
        held = [await admitter.admit("a", 1, "t") for _ in range(2)]
        assert all(isinstance(p, Permit) for p in held)
        waiter = asyncio.create_task(admitter.admit("a", 1, "t"))
        assert await wait_until(lambda: len(rt.waiting) == 1 and all(w.enqueued for w in rt.waiting.values()), 5)
        await admitter._sync(rt)  # what the renewal sends: held 2, one waiter
        stale = syncs[-1]
        assert len(stale[stale.index("sync") + 2:]) >= 5  # (gateway, watermark, 2, both held, the waiter)
        await admitter.release(held[0])  # grants the waiter
        got = await asyncio.wait_for(waiter, 5)
        assert isinstance(got, Permit)
        for p in (held[1], got):
            await admitter.release(p)
        await admitter._sync(rt)  # a later sync: nothing held, nothing waiting
        assert (await rt.state.status()).inflight_total == 0
        keys = rt.state.keys
        replies, grants, _ = await raw.fcall(FUNCTION, len(keys), *keys, *stale)
        assert [r[0] for r in replies] == [b"err"] and b"FGSTALE" in replies[0][1] and grants == []
        st = await rt.state.status()
        assert st.inflight_total == 0 and st.queued_total == 0  # no phantom lease, no phantom waiter
        # The processor's own next calls are not refused.
        again = await admitter.admit("a", 0, "t")
        assert isinstance(again, Permit)
        await admitter.release(again)
        assert (await rt.state.status()).inflight_total == 0
        # A restarted processor with the same id (a new PoolState) is above the old fence.
        fresh = PoolState(client, "a", lease_ttl_s=3, settings=rt.settings, gateway="gw")
        assert (await fresh.sync("gw", 1, {}, {})).status.inflight_total == 0


async def test_an_older_fence_is_refused_only_while_its_gateway_lives(client: aioredis.Redis) -> None:
    """The fence a processor's clock gave its batches can go backwards only when it restarts
    after a clock step: its calls are refused while Redis thinks the gateway alive, and taken
    again once its liveness (one lease TTL) has run out, so it is back on shared state by itself."""
    st = await make(client, "fenced", gateway="ga", limit=2, ttl=3)
    clock = st.keys[K["admin_testclock"]]
    await client.set(clock, 1_000_000)

    async def batch(fence: int, *ops: object) -> list[object]:
        replies, _, _ = await st._script(st.keys, ["batch", st._ttl, "ga", fence, *ops])
        return list(replies)
    sync = ["sync", 3, "ga", 1, 0]
    assert (await batch(500, *sync))[0][0] == b"granted"  # (a sync's reply is a snapshot)
    assert (await batch(500, *sync))[0][0] == b"granted"  # the same batch again (a client retry) runs
    refused = await batch(499, *sync, "admit", 7, "ga/1", "ga", 1, 1, "", 0, 1000)
    assert [r[0] for r in refused] == [b"err", b"err"] and all(b"FGSTALE" in r[1] for r in refused)
    assert (await st.status()).inflight_total == 0  # the refused admit leased nothing
    await client.set(clock, 1_000_000 + 3_001)  # the gateway's liveness ran out
    # (Calling with its liveness run out and its fence still here reads as the server's clock
    # having jumped: the grants wait until the gateways re-assert, here its own sync, first.)
    taken = await batch(1, *sync, "admit", 7, "ga/2", "ga", 2, 1, "", 0, 1000)
    assert taken[1][0] == b"granted" and (await st.status()).inflight_total == 1
    assert (await batch(2, *sync))[0][0] == b"granted"  # its fence is the low one now


async def test_a_batch_sent_twice_counts_once(client: aioredis.Redis) -> None:
    """The client re-sends a call once on a fresh connection when the first broke, which may
    have run: a batch run twice must leave what one run leaves (new tickets skip the
    idempotency checks only the first time: `hw:<gateway>`)."""
    st = await make(client, "twice", gateway="ga", limit=1)
    await st.sync("ga", 1, {}, {})
    argv = ["batch", st._ttl, "ga"]
    for i in (1, 2, 3):
        argv += ["admit", 7, f"ga/{i}", "ga", i, 1, "", 0, 30000]
    first = await st._script(st.keys, argv)
    before = await dump(client, "twice")
    again = await st._script(st.keys, argv)
    assert await dump(client, "twice") == before
    once, twice = ([PoolStatus.from_reply(r) for r in expand_snapshots(first[0])],
                   [PoolStatus.from_reply(r) for r in expand_snapshots(again[0])])
    assert [s.granted for s in once] == [s.granted for s in twice] == [True, False, False]
    assert [s.enqueued for s in once[1:]] == [True, True]
    status = await st.status()
    assert status.inflight_total == 1 and status.queued_total == 2
    assert await client.zrange(st.keys[K["queue"]], 0, -1) == [b"ga/2", b"ga/3"]


async def test_an_op_that_fails_after_its_snapshot_leaves_the_next_one_whole(client: aioredis.Redis) -> None:
    """A batch's snapshots after its first carry only their own part; when the op that built
    the first whole one fails after building it, its reply is an error, so the next snapshot
    must be whole again (the processor could not complete it otherwise)."""
    st = await make(client, "snapfail", gateway="ga", limit=1)
    await st.sync("ga", 1, {}, {})
    b0 = st.batches  # (the sync is a batch of its own)
    ok1 = st.admit("ga/1", "ga", 1, 1, "", 0, 30)  # granted: a short reply, no snapshot
    bad = st._run("admit", "ga/2", "ga", 2, 1, "", 0, "not-a-timeout")  # refused: snapshot, then fails
    ok2 = st.admit("ga/3", "ga", 3, 1, "", 0, 30)
    ok3 = st.admit("ga/4", "ga", 4, 1, "", 0, 30)
    r1, rbad, r2, r3 = await asyncio.gather(ok1, bad, ok2, ok3, return_exceptions=True)
    assert st.batches == b0 + 1
    assert isinstance(rbad, ResponseError)
    assert isinstance(r1, PoolStatus) and r1.granted
    assert isinstance(r2, PoolStatus) and r2.enqueued and r2.limit == 1 and r2.queued == (0, 0, 0)
    assert isinstance(r3, PoolStatus) and r3.enqueued and r3.limit == 1 and r3.queued == (0, 1, 0)
    assert r3.tail_left == r2.tail_left  # shared with the call's whole snapshot (ga/3's)


def test_expand_snapshots_completes_each_from_the_calls_whole_one() -> None:
    whole = "limit 8 i0 0 i1 8 i2 0 q0 0 q1 3 q2 0 tenant_queued 0 rate 5 class_rate 2.5 gateways 2 rank -1 " \
            "now 1000 active 0 epoch 0 rate_n 40 lvl 7.5 hl0 0 hl1 900 hl2 0 tl0 0 tl1 4900 tl2 0"
    own = "i0 0 i1 8 i2 0 q0 0 q1 4 q2 0 tenant_queued 1 class_rate 2.6"
    replies = [[b"granted", b"g", b"endpoint", b"", b"credits", b""], 1, [b"err", b"boom"],
               [b"granted", b"0", b"snap", whole.encode(), b"queued", b"1"],
               [b"granted", b"0", b"snapo", own.encode(), b"queued", b"1"]]
    out = expand_snapshots(replies)
    assert out[:4] == replies[:4]
    st = PoolStatus.from_reply(out[4])
    assert (st.queued, st.tenant_queued, st.class_rate, st.enqueued) == ((0, 4, 0), 1, 2.6, True)
    assert (st.limit, st.grant_rate, st.release_n, st.inflight_avg, st.tail_left) == (8, 5.0, 40, 7.5, (0.0, 4.9, 0.0))
    with pytest.raises(ValueError):
        expand_snapshots([[b"granted", b"0", b"snapo", own.encode()]])


T0 = 1_000_000  # the hold tests' fake clock starts here (ms)


@dataclasses.dataclass
class ClockedPool:
    """Gateways of one pool on the script's fake clock, each synced once at T0 (the hold tests).
    `take` acquires a P1 permit with the next ticket number (shared by all gateways); `lose`
    lowers a gateway's stored fence below every one it sent, as a replica that missed its last
    batches holds it: its next call finds the loss."""

    client: aioredis.Redis
    st: dict[str, PoolState]
    seq: Iterator[int] = dataclasses.field(default_factory=lambda: iter(range(1, 100)))

    @property
    def state_key(self) -> str:
        return next(iter(self.st.values())).keys[K["state"]]

    async def at(self, ms: int) -> None:
        await self.client.set(next(iter(self.st.values())).keys[K["admin_testclock"]], T0 + ms)

    async def take(self, gw: str) -> bool:
        n = next(self.seq)
        return (await self.st[gw].acquire(f"{gw}/{n}", gw, n, 1, "t")).granted

    async def lose(self, gw: str) -> None:
        await self.client.hset(self.state_key, f"bx:{gw}", "1")

    async def sync(self, gw: str, watermark: int = 100) -> None:
        await self.st[gw].sync(gw, watermark, {}, {})

    async def hold(self) -> bytes:
        return await self.client.hget(self.state_key, "hold") or b""


async def clocked_pool(client: aioredis.Redis, pool: str, gateways: tuple[str, ...], *, limit: int,
                       ttl: float) -> ClockedPool:
    p = ClockedPool(client, {g: await make(client, pool, gateway=g, limit=limit, ttl=ttl) for g in gateways})
    await p.at(0)
    for g in gateways:
        await p.sync(g, 1)
    return p


async def test_the_hold_after_lost_writes_ends_when_its_gateways_synced_went_quiet_or_its_time_ran_out(
        client: aioredis.Redis) -> None:
    """Redis answering below a fence the gateway had acknowledged holds every grant (leases.lua
    `held`) until each gateway alive in that state has synced, or has gone unheard past the
    quiet time (2 s), or one renewal period and a second have passed (TTL 3 s: 2 s). Fake
    clock; the loss is made by lowering the stored fence, as a replica that missed the last
    batches holds it."""
    p = await clocked_pool(client, "hold", ("gb", "ga"), limit=2, ttl=3)
    ga = p.st["ga"]

    # Held until both synced: ga's own sync is not enough, gb's ends it.
    await p.lose("ga")
    assert not await p.take("ga")  # the call that finds the loss is refused, with both permits free
    assert (await p.hold()).startswith(str(T0 + 2000).encode())
    st = await ga.status()  # what `floodgate status` and the processors' gauge read
    assert st.hold_s == 2.0 and st.hold_waiting == ("ga", "gb")
    report = await read_pool(client, "hold")
    assert "GRANTS HELD" in render([report]) and "ga, gb re-assert" in render([report])
    await p.sync("ga")
    assert not await p.take("ga") and not await p.take("gb")
    assert (await ga.status()).hold_waiting == ("gb",)
    await p.sync("gb")
    assert (await p.hold()).startswith(b"0|")  # over (its start kept)
    st = await ga.status()
    assert st.hold_s == 0 and st.hold_waiting == ()
    assert "GRANTS HELD" not in render([await read_pool(client, "hold")])
    assert await p.take("ga")
    await ga.release("ga/4")

    # Held until its time runs out when a gateway never syncs.
    await p.lose("ga")
    assert not await p.take("ga")
    await p.sync("ga")
    await p.at(1999)
    assert not await p.take("ga")
    await p.at(2000)
    assert await p.take("ga")
    await ga.release("ga/7")

    # A gateway whose liveness here runs out during the hold is still waited for: that
    # liveness is as old as the state Redis went back to (it may have renewed in the lost
    # writes). Not heard, it is dropped at the quiet time (2 s), here also the hold's end.
    await p.at(2500)
    await p.sync("ga")  # gb's liveness ends at T0 + 3000 (its last sync)
    await p.lose("ga")
    assert not await p.take("ga")
    await p.sync("ga")
    await p.at(3000)
    assert not await p.take("ga")  # was granted here: gb read dead while its permits ran
    await p.at(4499)
    assert not await p.take("ga")
    await p.at(4500)
    assert await p.take("ga")
    assert (await p.hold()).startswith(b"0|")


async def test_the_hold_waits_for_a_gateway_whose_liveness_lapsed_in_the_lost_writes(client: aioredis.Redis) -> None:
    """A planned switchover: the replica is promoted, the processors keep writing to the old
    primary until Sentinel names the new one (~1 s), and a processor that moves late (its
    follower's poll, or a reconnect after its first call there timed out under load) finds its
    liveness on the new primary run out: it renewed on the old one. The hold after the first
    processor's loss lists it (lapsed within a TTL) and waits for it while it is heard, until it
    syncs. Dropped as dead, the grants filled the permits it still ran (the likely cause of
    14 in flight of L 8 in two loaded CI runs of the switchover fault)."""
    p = await clocked_pool(client, "lapsed", ("ga", "gb"), limit=2, ttl=6)  # hold: 3 s
    await p.at(4000)
    await p.sync("ga")  # ga renewed here; gb's renewals since T0 went to the lost writes
    async with listening(client, "lapsed", "gb"):  # gb is alive: subscribed here
        await p.at(6500)  # gb's liveness here ended at T0 + 6000
        await p.lose("ga")
        assert not await p.take("ga")  # the loss: held, gb listed although it reads dead
        assert sorted((await p.st["ga"].status()).hold_waiting) == ["ga", "gb"]
        await p.sync("ga")
        await p.at(6500 + 2500)  # past the quiet time: gb is heard, so still waited for
        assert not await p.take("ga")
        await p.sync("gb", 1)  # gb arrives and re-asserts: the hold ends
        assert (await p.hold()).startswith(b"0|")
        assert await p.take("ga")

    # Lapsed longer than a TTL before the loss: not listed (dead before it, whatever was lost).
    p = await clocked_pool(client, "gone", ("ga", "gb"), limit=2, ttl=6)
    await p.at(10_000)
    await p.sync("ga")
    await p.at(12_500)  # gb's liveness ended at T0 + 6000, more than a TTL ago
    await p.lose("ga")
    assert not await p.take("ga")
    assert (await p.st["ga"].status()).hold_waiting == ("ga",)


async def test_the_hold_stops_waiting_for_a_gateway_not_heard_after_its_quiet_time(client: aioredis.Redis) -> None:
    """A gateway listed alive in the state Redis went back to, but neither subscribed to its
    channel nor polling (a processor killed around the failover), is waited for 2 s, not the
    whole hold (TTL 15 s: 6 s; a review read P0 waiting 6 s, P1 timed out, P2 turned away). One
    that is subscribed (a live processor) is waited for until it syncs or the hold runs out."""
    p = await clocked_pool(client, "quiet", ("gb", "ga"), limit=2, ttl=15)

    async def lose_then_sync() -> None:
        await p.lose("ga")
        assert not await p.take("ga")  # finds the loss: held
        await p.sync("ga")

    await lose_then_sync()  # gb silent: not heard
    await p.at(1999)
    assert not await p.take("ga")
    await p.at(2000)
    assert await p.take("ga")  # gb not heard 2 s after the hold began: not waited for
    await p.sync("ga")  # (the taken permit is not asserted: dropped)

    async with listening(client, "quiet", "gb"):  # gb subscribed: a live processor, waited for
        await p.at(3000)
        await p.sync("gb", 1)
        await lose_then_sync()
        await p.at(3000 + 5999)
        assert not await p.take("ga")
        await p.at(3000 + 6000)  # the hold ran out (15 s / 3 + 1 s)
        assert await p.take("ga")


async def test_a_late_gateway_holds_the_grants_only_for_those_not_synced_since_the_last_hold(
        client: aioredis.Redis) -> None:
    """A gateway whose loss reaches Redis after a hold ended (it arrived late, or was dropped
    as not heard) starts another hold. Those that synced since the first one began re-asserted
    after the loss and are not listed again (a review: every processor was refused and told to
    sync again, once per late processor). A start in the future or an end further than one
    hold's length from it (a clock stepped back, a value written by something else) ends a
    hold: it never lasts for good (a review's forged end held at +600 s)."""
    p = await clocked_pool(client, "late", ("ga", "gb", "gc"), limit=4, ttl=3)
    ga = p.st["ga"]

    await p.lose("ga")
    assert not await p.take("ga")  # the first hold: ga, gb, gc
    assert (await ga.status()).hold_waiting == ("ga", "gb", "gc")
    await p.at(500)
    await p.sync("ga")
    await p.sync("gb")
    await p.at(2000)  # it ran out (TTL 3 s: 2 s) before gc came
    await p.sync("ga")  # (a renewal)
    assert await p.take("ga")
    await p.lose("gc")  # gc's own loss reaches Redis now
    assert not await p.take("gc")
    assert (await ga.status()).hold_waiting == ("gc",)  # not ga and gb once more
    await p.sync("gc")
    assert await p.take("gb")

    # Written by something else: an end far away, or a start ahead of the server's clock.
    for bad in (f"{T0 + 600_000}|{T0 + 2000}|ga gb gc", f"{T0 + 9000}|{T0 + 5000}|ga gb gc"):
        await client.hset(p.state_key, "hold", bad)
        assert await p.take("ga"), bad


async def test_a_forward_clock_jump_past_the_ttl_holds_the_grants_until_the_gateways_re_assert(
        client: aioredis.Redis) -> None:
    """The server's clock steps ahead past the lease TTL (an NTP step, a VM resumed on the Redis
    host): the next call's reclaim expires every lease and declares every gateway dead at once,
    while their requests still run. A review (the same fake clock, through Envoy, TTL 15 s, a
    20 s step) read 10-13 in flight of L 8: the grants made before the processors re-asserted
    came on top. The caller, alive since it calls, finds its own liveness run out with its
    fence still here: the grants are held until the gateways registered here re-assert."""
    p = await clocked_pool(client, "jump", ("ga", "gb"), limit=2, ttl=3)
    assert await p.take("ga") and await p.take("gb")  # ga/1, gb/2: the pool is full
    await p.at(10_000)  # 10 s ahead: past the 3 s TTL
    assert not await p.take("ga")  # before: both leases had expired, and this one was granted
    hold = await p.hold()
    assert b"j|" in hold and b"ga" in hold and b"gb" in hold, hold
    await p.st["ga"].sync("ga", 100, {"ga/1": (1, 1, "")}, {})  # each re-asserts what it holds
    assert not await p.take("ga")  # gb has not yet
    await p.st["gb"].sync("gb", 100, {"gb/2": (1, 2, "")}, {})
    assert (await p.hold()).startswith(b"0|")
    assert not await p.take("ga")  # over, and the pool is full again: its two requests run
    await p.st["ga"].release("ga/1")
    assert await p.take("ga")


async def test_a_clock_jump_hold_stops_waiting_for_a_gateway_not_heard(client: aioredis.Redis) -> None:
    """After a jump every gateway reads dead by the jumped clock, so the hold waits for each
    listed one only while it is heard: a processor that really died is waited for the quiet
    time (2 s), not the whole hold."""
    p = await clocked_pool(client, "jumpq", ("ga", "gb"), limit=2, ttl=15)
    assert await p.take("ga")
    await p.at(20_000)
    assert not await p.take("ga")
    await p.st["ga"].sync("ga", 100, {"ga/1": (1, 1, "")}, {})
    await p.at(21_999)
    assert not await p.take("ga")  # gb (silent) still waited for
    await p.at(22_000)
    assert await p.take("ga")  # not heard 2 s after the hold began: no longer waited for


async def test_a_clock_jump_is_held_whichever_call_comes_first(client: aioredis.Redis) -> None:
    """A review of the jump hold: it was started only by a batch of a gateway that found its
    own liveness run out, but the waiters' poll (`mine`, sent on its own) runs the reclaim and
    the grant loop too: first after the jump, it expired every fence and lease and granted the
    freed permits on top of the running requests (13 and 11 of L 8 through Envoy). A poll by a
    gateway (its tickets name it) whose own liveness ran out with its fence still here starts
    the hold too."""
    p = await clocked_pool(client, "jumpp", ("ga", "gb"), limit=2, ttl=3)
    ps = client.pubsub()
    await ps.ssubscribe("fg:{jumpp}:gw:ga", "fg:{jumpp}:gw:gb")  # the processors, connected
    try:
        assert await p.take("ga") and await p.take("gb")  # ga/1, gb/2: the pool is full
        await p.at(10_000)
        assert await p.st["gb"].granted_among(["gb/9"]) == {}  # a poll comes first
        assert not await p.take("ga")  # before: granted, a third request on a pool of 2
        assert b"j|" in await p.hold()
        await p.st["ga"].sync("ga", 100, {"ga/1": (1, 1, "")}, {})
        await p.st["gb"].sync("gb", 100, {"gb/2": (1, 2, "")}, {})
        assert not await p.take("ga")  # the hold is over, and the pool is full
        await p.st["gb"].release("gb/2")
        assert await p.take("ga")
    finally:
        await ps.aclose()


async def test_a_fence_without_liveness_is_no_clock_jump(client: aioredis.Redis) -> None:
    """A gateway with no liveness entry left cleanly: its fence, still here (left by a version
    whose `leave` kept it, or written back by a batch that landed after the leave), says
    nothing about the server's clock. A soak review restarted a processor under its id after a
    clean stop: its first batch found the old fence with no liveness, took the jump branch and
    held every grant of the pool, with a `!resync` of every processor. Only a liveness that is
    here and has run out is a jump (the test above); neither a batch nor a poll of such a
    gateway starts a hold, and its grants go on."""
    p = await clocked_pool(client, "left", ("ga", "gb"), limit=2, ttl=3)
    assert await p.take("ga")
    await p.st["ga"].release("ga/1")
    await client.zrem(p.st["ga"].keys[K["gws"]], "ga")  # its liveness gone, its fields kept
    assert await client.hexists(p.state_key, "bx:ga")
    await p.at(1_000)
    assert await p.st["ga"].granted_among(["ga/9"]) == {}  # a poll of its tickets
    assert await p.take("ga")  # a batch
    assert await p.hold() == b""
    await p.at(10_000)  # ... while a real jump still holds: gb's liveness is here and ran out
    assert not await p.take("gb")
    assert b"j|" in await p.hold()


async def test_a_renewal_reports_a_grant_whose_message_was_lost(client: aioredis.Redis) -> None:
    """A grant to another processor's waiter goes by pub/sub; one that never reaches it (here a
    subscription on its channel that the processor does not read: what Redis sees of a
    connection cut around an operator's `CLUSTER FAILOVER`) left the waiter waiting on a
    permit it held. Its renewals found the lease and extended it ("granted while this renewal
    was on its way") without telling the processor, so only its poll could: with
    `poll_interval_s` raised, two processors at L 4 stalled 14 s after a graceful failover in a
    review, every permit leased to waiters that never heard. A renewal now reports such a
    waiter's grant in its reply, like a grant the batch made itself."""
    grants: dict[str, str] = {}
    a = await make(client, "lostmsg", gateway="ga", limit=1)
    b = await make(client, "lostmsg", gateway="gb", on_grant=grants)
    async with listening(client, "lostmsg", "gb"):  # gb is heard; its processor never reads this
        await b.sync("gb", 1, {}, {})  # gb is alive
        assert (await a.acquire("ga/1", "ga", 1, 1, "t")).granted
        assert not (await b.enqueue("gb/2", "gb", 2, 1, "t", 30)).granted
        await a.release("ga/1")  # grants gb/2 by a message gb's processor never reads
        assert await b.granted_among(["gb/2"]) == {"gb/2": ""} and grants == {}
        res = await b.sync("gb", 3, {}, {"gb/2": (1, 2, 30.0, "t")})
        assert res.requeued == 0 and res.status.inflight_total == 1
        assert grants == {"gb/2": ""}  # told by the renewal (before: never, only by a poll)
