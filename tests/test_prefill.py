"""Prefill-aware picking: the pure model (extproc/prefill.py, fake clock) and the grant script
(leases.lua `pick`, `pf_open`) checked against it on a real Redis with the script's clock set."""

from __future__ import annotations

import asyncio
import gzip
import random
import sys
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from floodgate.extproc.prefill import (
    MAX_REQUEST_TOKENS,
    PrefillEstimate,
    PrefillSettings,
    drained,
    prompt_tokens,
    unprefilled,
)
from floodgate.extproc.registry import Registry
from floodgate.extproc.schema import PoolSettings, key
from floodgate.extproc.state import PoolState, redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.conftest import ROOT
from tests.helpers import subscribed, wait_until

ON = PrefillSettings(rate=6000.0, request_tokens=512.0, pace_tokens=512.0)
EPS = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def test_estimate_drains_at_the_rate_and_never_below_zero() -> None:
    est = PrefillEstimate(ON)
    est.routed("a", 1000)
    est.routed("a", 1000)
    assert est.level("a", 1000) == 1024.0
    assert est.level("a", 1100) == 1024.0 - 600.0  # 6 tokens per ms
    assert est.level("a", 5000) == 0.0
    assert est.level("never", 5000) == 0.0
    assert drained(100.0, 10, 5, 1.0) == 100.0  # a clock behind the stored time drains nothing


def test_routed_adds_the_requests_own_size_or_the_pools_mean() -> None:
    est = PrefillEstimate(ON)
    est.routed("a", 0, 100.0)
    est.routed("a", 0)  # no size: the pool's request_tokens (a request of an older processor)
    est.routed("b", 0, 0.0)
    assert est.level("a", 0) == 612.0 and est.level("b", 0) == 0.0
    assert est.pick(["a", "b"], {}, start=0, now_ms=0) == "b"


def test_a_request_ended_unanswered_or_refused_is_unprefilled() -> None:
    assert unprefilled(None) and unprefilled(404) and unprefilled(405) and unprefilled(500)
    assert not unprefilled(200) and not unprefilled(206)
    est = PrefillEstimate(ON)
    est.routed("a", 0, 2000.0)
    est.routed("a", 0, 300.0)
    est.refunded("a", 100, 1400.0)
    assert est.level("a", 100) == 2300.0 - 600.0 - 1400.0  # (drained 600 in 100 ms)
    est.refunded("a", 100, 5000.0)
    assert est.level("a", 100) == 0.0  # never below zero
    est.refunded("never", 100, 5.0)
    assert "never" not in est.levels


def _tokens(cl: list[str] | None, ce: list[str] | None = None, bpt: float = 4.0) -> float:
    return prompt_tokens(cl, ce, bytes_per_token=bpt, default=512.0, max_tokens=MAX_REQUEST_TOKENS)


def test_prompt_tokens_from_content_length_with_fallback_and_clamp() -> None:
    assert _tokens(["4000"]) == 1000.0
    assert _tokens([" 3002 "]) == 750.0  # rounded; whitespace tolerated
    assert _tokens(["6000"], bpt=6.0) == 1000.0
    assert _tokens(["4000", "4000"]) == 1000.0  # a repeated, identical value
    # clamped: at least one token (an empty body), at most MAX_REQUEST_TOKENS (a base64 image)
    assert _tokens(["0"]) == 1.0 and _tokens(["1"]) == 1.0
    assert _tokens([str(4 * 8192 + 4)]) == MAX_REQUEST_TOKENS == 8192.0
    assert _tokens(["99999999999999"]) == MAX_REQUEST_TOKENS
    assert prompt_tokens(["4000"], None, bytes_per_token=4.0, default=512.0, max_tokens=0.5) == 1.0
    # unreadable: the pool's mean prompt, never an error
    for bad in (None, [], ["-5"], ["12abc"], ["1e9"], ["0x10"], ["4000", "8"], [""], ["  "], ["٣٠٠٠"],
                ["9" * 40], ["+400"], ["40.5"]):
        assert _tokens(bad) == 512.0, bad
    # an encoded body: its compressed bytes say little about its tokens
    assert _tokens(["4000"], ["gzip"]) == 512.0 and _tokens(["4000"], ["identity"]) == 1000.0
    assert _tokens(["4000"], bpt=0.0) == 512.0  # reading the size is off


def test_pick_least_estimate_then_fewest_permits_then_rotation() -> None:
    est = PrefillEstimate(ON)
    loads = {"a": 5, "b": 0, "c": 0}
    # idle estimates: fewest permits, ties from the rotation's start
    assert est.pick(["a", "b", "c"], loads, start=0, now_ms=0) == "b"
    assert est.pick(["a", "b", "c"], loads, start=2, now_ms=0) == "c"
    est.routed("b", 0)
    est.routed("c", 0)
    # b and c each hold an unprefilled prompt: a, with more permits but nothing to prefill, wins
    assert est.pick(["c", "b", "a"], loads, start=1, now_ms=0) == "a"
    assert est.pick(["a", "b", "c"], loads, start=0, now_ms=0) == "a"
    assert est.pick([], loads, start=0, now_ms=0) == ""


def test_lower_classes_wait_while_a_p0_runs_and_every_endpoint_has_prefill_queued() -> None:
    est = PrefillEstimate(ON)
    for ep in ("a", "b"):
        est.routed(ep, 0)
        est.routed(ep, 0)  # 1024 tokens each
    assert est.open(0, 1, ["a", "b"], 0)  # P0 is never paced
    assert est.open(1, 0, ["a", "b"], 0)  # nothing to protect without a P0 in flight
    assert not est.open(1, 1, ["a", "b"], 0)
    assert not est.open(2, 1, ["a", "b"], 85)  # 1024 - 510 = 514 > 512
    assert est.open(2, 1, ["a", "b"], 86)  # 1024 - 516 <= 512
    assert est.open(1, 1, [], 0)  # no endpoint known: not this rule's decision
    off = PrefillEstimate(PrefillSettings())
    off.routed("a", 0)
    assert not off.settings.on and off.open(1, 1, ["a"], 0)


async def _clock(client: object, pool: str, ms: int) -> None:
    await client.set(key(pool, "admin_testclock"), ms)  # type: ignore[attr-defined]


# a pool whose limit and partitions never refuse (limit 1000, no shares, ramp off), picking with
# the estimate on, and a lease TTL no test outlives
PACED = PoolSettings(1000, (0.0, 0.0, 0.0), picking=True, pf_rate=ON.rate, pf_size=ON.request_tokens,
                     pf_k=ON.pace_tokens)


async def _picking_pool(c: Any, pool: str, endpoints: list[str], settings: PoolSettings = PACED) -> PoolState:
    """The endpoints registered active (replica names r0, r1, ...) and the pool's state layer."""
    reg = Registry(c, pool)
    for i, ep in enumerate(endpoints):
        await reg.set(ep, "active", f"r{i}")
    return PoolState(c, pool, lease_ttl_s=600, settings=settings)


async def test_script_picks_and_paces_as_the_model(stack: LocalStack) -> None:
    """Random acquires (all classes) and releases at random script times: every grant goes to
    the endpoint the model picks, and a request is refused exactly when the model paces it (the
    limit and partitions never refuse here: limit 1000, no shares, no headroom, ramp off)."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "pf"
    try:
        st = await _picking_pool(c, pool, EPS)
        model = PrefillEstimate(ON)
        rng = random.Random(7)
        now = 1_000_000
        rr = 0
        held: dict[str, tuple[int, str]] = {}  # ticket -> class, endpoint
        refused = granted = 0
        for i in range(400):
            now += rng.choice((0, 0, 1, 5, 20, 60, 150))
            await _clock(c, pool, now)
            if held and rng.random() < 0.35:
                t = rng.choice(sorted(held))
                await st.release(t)
                del held[t]
                continue
            cls = rng.choices((0, 1, 2), (0.2, 0.5, 0.3))[0]
            p0 = sum(1 for k, _ in held.values() if k == 0)
            expect_open = model.open(cls, p0, EPS, now)
            loads = {ep: sum(1 for _, e in held.values() if e == ep) for ep in EPS}
            got = await st.acquire(f"g:{i}", "g", i + 1, cls, "")
            assert got.granted == expect_open, (i, cls, p0, model.least(EPS, now))
            if not got.granted:
                refused += 1
                continue
            rr += 1
            ep = model.pick(EPS, loads, rr % len(EPS), now)
            assert got.endpoint == ep, (i, {e: model.level(e, now) for e in EPS}, loads)
            model.routed(ep, now)
            held[f"g:{i}"] = (cls, ep)
            granted += 1
        assert refused > 20 and granted > 100  # both paths were exercised
    finally:
        await c.aclose()


async def test_script_counts_each_requests_own_size_as_the_model(stack: LocalStack) -> None:
    """Random histories with a size per request (none for some: an older processor's op):
    arrivals by `admit` (granted or queued with their size), `acquire` (refused: not queued) and
    `acquire` + `enqueue`, releases and cancels, at random script times. Every grant — the
    request's own and each waiter the grant loop lets in later, with the size it queued with —
    goes to the endpoint the model picks, in the model's order (highest class first, FIFO, the
    loop stops at the first paced head), and `qsize` holds exactly the sizes of the waiters."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "ps"
    sub = None
    try:
        sub = await subscribed(c, pool, "g")
        st = await _picking_pool(c, pool, EPS)
        model = PrefillEstimate(ON)
        rng = random.Random(11)
        now = 1_000_000
        rr = 0
        held: dict[str, tuple[int, str]] = {}  # ticket -> class, endpoint
        queues: dict[int, list[tuple[str, float | None]]] = {0: [], 1: [], 2: []}  # class -> FIFO
        stats = {"own": 0, "waiter": 0, "queued": 0, "refused": 0, "cancelled": 0, "none": 0}

        def grant(t: str, cls: int, size: float | None) -> str:
            nonlocal rr
            rr += 1
            loads = {ep: sum(1 for _, e in held.values() if e == ep) for ep in EPS}
            ep = model.pick(EPS, loads, rr % len(EPS), now)
            model.routed(ep, now, size)
            held[t] = (cls, ep)
            return ep

        def p0() -> int:
            return sum(1 for k, _ in held.values() if k == 0)

        def loop() -> dict[str, str]:
            """The script's grant loop: what it grants now, ticket -> endpoint."""
            out: dict[str, str] = {}
            while True:
                cls = next((k for k in (0, 1, 2) if queues[k]), None)
                if cls is None or not model.open(cls, p0(), EPS, now):
                    return out
                t, size = queues[cls].pop(0)
                out[t] = grant(t, cls, size)

        async def check_waiters(expected: dict[str, str]) -> None:
            waiting = [t for q in queues.values() for t, _ in q] + list(expected)
            assert await st.granted_among(waiting) == expected
            stats["waiter"] += len(expected)
            sizes = {k.decode(): float(v) for k, v in (await c.hgetall(key(pool, "qsize"))).items()}
            assert sizes == {t: z for q in queues.values() for t, z in q if z is not None}

        for i in range(500):
            now += rng.choice((0, 0, 1, 5, 20, 60, 150))
            await _clock(c, pool, now)
            r = rng.random()
            waiting = [(k, t) for k, q in queues.items() for t, _ in q]
            if held and r < 0.3:
                t = rng.choice(sorted(held))
                await st.release(t)
                del held[t]
                await check_waiters(loop())
                continue
            if waiting and r < 0.38:
                k, t = rng.choice(waiting)
                assert await st.cancel(t) == 0
                queues[k] = [w for w in queues[k] if w[0] != t]
                stats["cancelled"] += 1
                await check_waiters({})
                continue
            cls = rng.choices((0, 1, 2), (0.2, 0.5, 0.3))[0]
            size = rng.choice((None, 1.0, 8192.0, float(rng.randint(1, 3000)), float(rng.randint(1, 3000))))
            stats["none"] += size is None
            t = f"g:{i}"
            how = rng.choice(("admit", "admit", "acquire", "enqueue"))
            before = loop()  # the call's grant loop runs before its own request is decided
            own_open = not any(queues[k] for k in range(cls + 1)) and model.open(cls, p0(), EPS, now)
            if how == "admit":
                got = await st.admit(t, "g", i + 1, cls, "", 0, 600.0, size)
            else:
                got = await st.acquire(t, "g", i + 1, cls, "", 0, size)
            assert got.granted == own_open, (i, how, cls, p0(), model.least(EPS, now))
            if own_open:
                assert got.endpoint == grant(t, cls, size), (i, {e: model.level(e, now) for e in EPS})
                stats["own"] += 1
                await check_waiters(before)
                continue
            if how == "acquire":
                stats["refused"] += 1
                await check_waiters(before)
                continue
            if how == "enqueue":
                await check_waiters(before)
                got = await st.enqueue(t, "g", i + 1, cls, "", 600.0, size)
                queues[cls].append((t, size))
                later = loop()
                assert got.granted == (t in later)
                if t in later:
                    assert got.endpoint == later.pop(t)
                await check_waiters(later)
            else:
                assert got.enqueued
                queues[cls].append((t, size))
                await check_waiters(before)
            stats["queued"] += 1
        # every path was exercised
        assert stats["own"] > 50 and stats["waiter"] > 20 and stats["queued"] > 30, stats
        assert stats["refused"] > 5 and stats["cancelled"] > 5 and stats["none"] > 20, stats
    finally:
        if sub is not None:
            await sub.aclose()
        await c.aclose()


async def test_script_refunds_as_the_model(stack: LocalStack) -> None:
    """Random routed sizes and refunds at random script times (some of an endpoint with no
    estimate, some for more than it holds): the script's `refund` leaves every estimate where
    the model's `refunded` does; with pacing off, or a size that is not a number, it changes
    nothing."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "rf"
    try:
        st = await _picking_pool(c, pool, EPS)
        model = PrefillEstimate(ON)
        rng = random.Random(5)
        now, rr, held = 1_000_000, 0, {}
        for i in range(300):
            now += rng.choice((0, 1, 10, 50, 200))
            await _clock(c, pool, now)
            if rng.random() < 0.5:
                size = rng.choice((1.0, 100.0, 2000.0, 8192.0))
                got = await st.acquire(f"g:{i}", "g", i + 1, 0, "", 0, size)  # P0: never paced
                rr += 1
                loads = {ep: sum(1 for e in held.values() if e == ep) for ep in EPS}
                ep = model.pick(EPS, loads, rr % len(EPS), now)
                assert got.granted and got.endpoint == ep
                model.routed(ep, now, size)
                held[f"g:{i}"] = ep
            else:
                ep = rng.choice([*EPS, "10.9.9.9:1"])
                n = rng.choice((10.0, 700.0, 3000.0, 1e6))
                applied = await st.refund(ep, n)
                assert applied == (1 if ep in model.levels else 0)
                model.refunded(ep, now, n)
            for ep in EPS:
                raw = await c.hget(key(pool, "epfill"), ep)
                lv, ts = (0.0, now) if raw is None else (float(raw.decode().split("|")[0]), int(raw.decode().split("|")[1]))
                assert drained(lv, ts, now, ON.rate_ms) == pytest.approx(model.level(ep, now), abs=1e-6), (i, ep)
        before = await c.hget(key(pool, "epfill"), EPS[0])
        assert await st._run("refund", EPS[0], "nan") == 0 and await st._run("refund", EPS[0], "x") == 0
        off = await _picking_pool(c, "rf-off", EPS, replace(PACED, pf_rate=0.0))
        assert await off.refund(EPS[0], 10.0) == 0
        assert await c.hget(key(pool, "epfill"), EPS[0]) == before
    finally:
        await c.aclose()


async def test_sync_drops_sizes_whose_waiter_left_without_them(stack: LocalStack) -> None:
    """A waiter popped by an older version's grant loop leaves its size in `qsize`: the next
    renewal (`sync`) of any gateway drops sizes with no waiter, and keeps the others."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "pq"
    sub = None
    try:
        sub = await subscribed(c, pool, "g")
        st = await _picking_pool(c, pool, EPS[:1])
        await _clock(c, pool, 1_000_000)
        assert (await st.acquire("g:1", "g", 1, 0, "", 0, 2000.0)).granted  # P0: 2000 queued
        assert (await st.admit("g:2", "g", 2, 1, "", 0, 30.0, 700.0)).enqueued  # paced, queued
        await c.hset(key(pool, "qsize"), "g:gone", "900.0")  # an older version popped it
        await st.sync("h", 1, {}, {})
        assert {k: float(v) for k, v in (await c.hgetall(key(pool, "qsize"))).items()} == {b"g:2": 700.0}
        await _clock(c, pool, 1_000_300)  # 2000 - 1800 = 200 <= 512: the P1 goes, with its size
        await st.release("g:1")
        assert await st.granted_among(["g:2"]) == {"g:2": EPS[0]}
        level, _ = (await c.hget(key(pool, "epfill"), EPS[0])).decode().split("|")
        assert float(level) == 200.0 + 700.0
        assert await c.exists(key(pool, "qsize")) == 0
    finally:
        if sub is not None:
            await sub.aclose()
        await c.aclose()


async def test_paced_waiter_is_granted_once_the_estimate_drains(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "pw"
    sub = None
    try:
        sub = await subscribed(c, pool, "g")
        st = await _picking_pool(c, pool, EPS[:1])
        await _clock(c, pool, 1_000_000)
        assert (await st.acquire("g:1", "g", 1, 0, "")).endpoint == EPS[0]  # P0: 512 queued
        assert (await st.acquire("g:2", "g", 2, 1, "")).granted  # 512 <= 512: granted, 1024 now
        assert not (await st.acquire("g:3", "g", 3, 2, "")).granted  # paced
        assert not (await st.enqueue("g:3", "g", 3, 2, "", 30)).granted
        await _clock(c, pool, 1_000_080)  # 1024 - 480 = 544 > 512: still paced
        assert await st.release("g:2") == 1
        assert await st.granted_among(["g:3"]) == {}
        await _clock(c, pool, 1_000_090)  # 1024 - 540 = 484: the next call's grant loop lets it in
        assert (await st.acquire("g:4", "g", 4, 0, "")).granted
        assert await st.granted_among(["g:3"]) == {"g:3": EPS[0]}
        # P0 gone: lower classes are not paced, whatever the estimate
        await st.release("g:1", "g:4")
        assert (await st.acquire("g:5", "g", 5, 1, "")).granted
        assert (await st.acquire("g:6", "g", 6, 1, "")).granted
    finally:
        if sub is not None:
            await sub.aclose()
        await c.aclose()


async def test_prefill_off_picks_by_permits_alone(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "po"
    try:
        st = await _picking_pool(c, pool, EPS[:2], PoolSettings(1000, (0.0, 0.0, 0.0), picking=True))
        await _clock(c, pool, 1_000_000)
        assert (await st.acquire("g:0", "g", 1, 0, "")).granted
        eps = [(await st.acquire(f"g:{i}", "g", i + 1, 1, "")).endpoint for i in range(1, 9)]
        assert (await st.acquire("g:9", "g", 10, 2, "")).granted  # never paced
        assert sorted(eps).count(EPS[0]) in (4, 5) and await c.exists(key(pool, "epfill")) == 0
    finally:
        await c.aclose()


def test_snapshot_reads_prefill_pacing_beside_the_ramp() -> None:
    """Early drop's view (backends._snapshot): with prefill-aware picking a lower class is paced
    while a P0 runs even with the ramp off; the ramp's refill stays what it is, and the prefill
    pacing lets one request per endpoint in every `pf_size / pf_rate` s from `pf_wait` on."""
    from floodgate.extproc.backends import _snapshot
    from floodgate.extproc.schema import PoolStatus

    st = PoolStatus(granted=False, limit=100, inflight=(1, 50, 0), queued=(0, 0, 0), active_endpoints=4,
                    pf_wait=0.25)
    ramp = PoolSettings(100, (0.5, 0.1, 0.0), ramp_burst=0.08, ramp_rate=0.1)
    assert _snapshot(st, settings=ramp).ramp and _snapshot(st, settings=ramp).ramp_refill == 10.0
    assert _snapshot(st, settings=ramp).pf_rate == 0.0  # no picking: no prefill pacing
    both = PoolSettings(100, (0.5, 0.1, 0.0), picking=True, ramp_burst=0.08, ramp_rate=0.1, pf_rate=6000.0)
    snap = _snapshot(st, settings=both)
    assert snap.ramp and snap.ramp_refill == 10.0
    assert snap.pf_rate == 4 * 6000.0 / 512.0 and snap.pf_wait == 0.25
    only = PoolSettings(100, (0.5, 0.1, 0.0), picking=True, pf_rate=6000.0)
    assert _snapshot(st, settings=only).ramp and _snapshot(st, settings=only).ramp_refill == 0.0
    no_picking = PoolSettings(100, (0.5, 0.1, 0.0), pf_rate=6000.0)  # the estimate needs picking
    assert not _snapshot(st, settings=no_picking).ramp
    # the ramp's floor per active endpoint (4 per second each): 4 endpoints read 16, over 0.1 x L
    per_ep = PoolSettings(100, (0.5, 0.1, 0.0), ramp_burst=0.08, ramp_rate=0.1, ramp_ep_burst=4.0, ramp_ep_rate=4.0)
    assert _snapshot(st, settings=per_ep).ramp_refill == 16.0
    assert _snapshot(replace(st, active_endpoints=2), settings=per_ep).ramp_refill == 10.0


@pytest.mark.integration
async def test_processor_counts_the_content_length_of_requests_through_envoy(stack: LocalStack) -> None:
    """Real Envoy, processor, Redis and upstream, picking with the estimate on, the script's
    clock frozen (nothing drains): each request adds its content-length / 6 to its endpoint's
    estimate, clamped to the pool's max; an encoded body adds the pool's mean prompt; every
    request is served."""
    url = stack.start_redis()
    port = free_port()
    stack.start_upstream([sys.executable, str(ROOT / "tests" / "upstream.py"), "--port", str(port)],
                         name="up", port=port)
    stack.start_processor({"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
                           "pools": [{"name": "default", "endpoint_picking": True,
                                      "prefill_max_request_tokens": 2000,
                                      "limit": {"mode": "static", "initial": 50}}]})
    envoy = stack.start_envoy([], picking=True)
    c = redis_client(url, op_timeout_s=5)
    ep = f"127.0.0.1:{port}"
    try:
        await Registry(c, "default").set(ep, "active", "r0")
        await _clock(c, "default", 1_000_000)

        async def level() -> float:
            raw = await c.hget(key("default", "epfill"), ep)
            return 0.0 if raw is None else float(raw.decode().split("|")[0])

        async with aiohttp.ClientSession() as s:
            async def send(body: bytes, **headers: str) -> int:
                async with s.post(envoy.url + "/v1/completions", data=body,
                                  headers={"content-type": "application/json", **headers}) as r:
                    await r.read()
                    return r.status

            assert await wait_until(lambda: _served(send), 5)  # the processor sees the endpoint
            base = await level()
            assert base > 0 and base % 100.0 == 0  # each probe served: 600 bytes
            assert await send(b" " * 6000) == 200
            assert await level() == base + 1000.0
            assert await send(b" " * 60_000) == 200  # a huge body counts at most the max
            assert await level() == base + 3000.0
            # an encoded body (~60 bytes for 40,000 of text) counts as the pool's mean prompt
            assert await send(gzip.compress(b" " * 40_000), **{"content-encoding": "gzip"}) == 200
            assert await level() == base + 3512.0
    finally:
        await c.aclose()


@pytest.mark.integration
async def test_a_request_whose_body_never_comes_leaves_the_estimate_and_holds_nobody_back(stack: LocalStack) -> None:
    """A review's attack: request headers claiming a 60 KB body, no body, the connection closed
    at once. The grant counted the claimed size (the pool's max, 2,000 tokens) in the endpoint's
    estimate, nothing took it back, and while a P0 ran every lower-class request waited behind
    prefill that never came: three such requests (300 bytes of headers) held an honest P1 past
    its queue timeout (429). Now a request that ends with nothing back from the upstream takes
    its prompt out of the estimate (prefill.unprefilled), as does one the upstream refuses. Real Envoy,
    processor, Redis and upstream; the estimate drains at 100 tokens/s here, so only the
    refunds can bring it down in time."""
    url = stack.start_redis()
    port = free_port()
    stack.start_upstream([sys.executable, str(ROOT / "tests" / "upstream.py"), "--port", str(port)],
                         name="up", port=port)
    stack.start_processor({"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
                           "pools": [{"name": "default", "endpoint_picking": True,
                                      "prefill_tokens_per_s": 100, "prefill_max_request_tokens": 2000,
                                      "limit": {"mode": "static", "initial": 50}}]})
    envoy = stack.start_envoy([], picking=True)
    c = redis_client(url, op_timeout_s=5)
    ep = f"127.0.0.1:{port}"
    try:
        await Registry(c, "default").set(ep, "active", "r0")

        async def level() -> float:
            raw = await c.hget(key("default", "epfill"), ep)
            if raw is None:
                return 0.0
            lv, ts = raw.decode().split("|")
            t = await c.time()
            return max(0.0, float(lv) - 0.1 * (t[0] * 1000 + t[1] // 1000 - int(ts)))

        async def headers_only(path: str = "/v1/completions", method: str = "POST") -> None:
            _, w = await asyncio.open_connection("127.0.0.1", envoy.port)
            w.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    "x-request-priority: 1\r\ncontent-length: 60000\r\n\r\n".encode())
            await w.drain()
            await asyncio.sleep(0.5)  # admitted and routed; the upstream waits for a body (or answers 404)
            w.close()

        async with aiohttp.ClientSession() as s:
            async def send(body: bytes, **headers: str) -> int:
                async with s.post(envoy.url + "/v1/completions", data=body,
                                  headers={"content-type": "application/json", **headers}) as r:
                    await r.read()
                    return r.status

            assert await wait_until(lambda: _served(send), 5)
            # held at once (a second review: refunding only the size less the drain left most of
            # 30 such requests counted), and on a path the upstream refuses (404: response headers
            # came back, and nothing was refunded)
            await asyncio.gather(*(headers_only() for _ in range(6)), headers_only("/v1/nope"),
                                 headers_only("/v1/completions", "PUT"))
            # each counted 2,000 tokens when granted; back out once their streams ended
            assert await wait_until(lambda: _below(level, 400.0), 5), await level()
            p0 = asyncio.create_task(send(b'{"prompt": "x"}', **{"x-request-priority": "0", "x-test-chunks": "40",
                                                                  "x-test-delay-ms": "100"}))
            await asyncio.sleep(0.5)  # the P0 runs (4 s): lower classes are paced behind the estimate
            t0 = asyncio.get_running_loop().time()
            assert await send(b'{"prompt": "honest"}', **{"x-request-priority": "1"}) == 200
            assert asyncio.get_running_loop().time() - t0 < 1.0  # not held for its 1.5 s queue timeout
            assert await p0 == 200
    finally:
        await c.aclose()


async def _below(level: Any, bound: float) -> bool:
    return bool(await level() < bound)


async def _served(send: Any) -> bool:
    return bool(await send(b" " * 600) == 200)


async def test_script_reports_when_prefill_pacing_opens(stack: LocalStack) -> None:
    """A refused lower-class request's snapshot carries `pf_wait`: the time until the least
    estimate is down to the pace level (0 with no P0 in flight: nothing is paced)."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "pfw"
    try:
        st = await _picking_pool(c, pool, EPS[:2])
        await _clock(c, pool, 1_000_000)
        assert (await st.acquire("g:1", "g", 1, 0, "")).granted  # P0 on one endpoint: 512
        for i in range(2, 6):  # 1024 on both, then 1536 on one
            assert (await st.acquire(f"g:{i}", "g", i, 0, "")).granted
        await _clock(c, pool, 1_000_030)  # 1024 - 180 = 844 (332 above the pace level), 1356 (844)
        got = await st.acquire("g:6", "g", 6, 2, "")
        assert not got.granted and got.pf_wait == 0.056  # ceil(332 / 6) ms
        assert got.pf_backlog == 332 + 844
        await st.release("g:1", "g:2", "g:3", "g:4", "g:5")
        got = await st.acquire("g:7", "g", 7, 2, "")
        assert got.granted  # no P0 in flight: not paced
    finally:
        await c.aclose()


def test_a_request_the_upstream_refused_as_malformed_is_unprefilled() -> None:
    """Mutation review: every status of 400 or more is a refusal, 400 itself (a malformed body,
    the engine's most common refusal) included: its prompt was never prefilled, so its size
    must leave the endpoint's estimate, or it paces the lower classes for nothing."""
    assert unprefilled(400) and not unprefilled(399)
