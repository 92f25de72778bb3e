"""Prefill-aware picking: the pure model (extproc/prefill.py, fake clock) and the grant script
(leases.lua `pick`, `pf_open`) checked against it on a real Redis with the script's clock set."""

from __future__ import annotations

import random

from floodgate.extproc.prefill import PrefillEstimate, PrefillSettings, drained
from floodgate.extproc.registry import Registry
from floodgate.extproc.schema import PoolSettings, key
from floodgate.extproc.state import PoolState, redis_client

from floodgate.stack import LocalStack

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
    await client.set(key(pool, "testclock"), ms)  # type: ignore[attr-defined]


async def test_script_picks_and_paces_as_the_model(stack: LocalStack) -> None:
    """Random acquires (all classes) and releases at random script times: every grant goes to
    the endpoint the model picks, and a request is refused exactly when the model paces it (the
    limit and partitions never refuse here: limit 1000, no shares, no headroom, ramp off)."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "pf"
    try:
        reg = Registry(c, pool)
        for i, ep in enumerate(EPS):
            await reg.set(ep, "active", f"r{i}")
        settings = PoolSettings(1000, (0.0, 0.0, 0.0), picking=True, pf_rate=ON.rate,
                                pf_size=ON.request_tokens, pf_k=ON.pace_tokens)
        st = PoolState(c, pool, lease_ttl_s=600, settings=settings)
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


async def test_paced_waiter_is_granted_once_the_estimate_drains(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "pw"
    try:
        reg = Registry(c, pool)
        await reg.set(EPS[0], "active", "r0")
        settings = PoolSettings(1000, (0.0, 0.0, 0.0), picking=True, pf_rate=ON.rate,
                                pf_size=ON.request_tokens, pf_k=ON.pace_tokens)
        st = PoolState(c, pool, lease_ttl_s=600, settings=settings)
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
        await c.aclose()


async def test_prefill_off_picks_by_permits_alone(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    pool = "po"
    try:
        reg = Registry(c, pool)
        await reg.set(EPS[0], "active", "r0")
        await reg.set(EPS[1], "active", "r1")
        st = PoolState(c, pool, lease_ttl_s=600, settings=PoolSettings(1000, (0.0, 0.0, 0.0), picking=True))
        await _clock(c, pool, 1_000_000)
        assert (await st.acquire("g:0", "g", 1, 0, "")).granted
        eps = [(await st.acquire(f"g:{i}", "g", i + 1, 1, "")).endpoint for i in range(1, 9)]
        assert (await st.acquire("g:9", "g", 10, 2, "")).granted  # never paced
        assert sorted(eps).count(EPS[0]) in (4, 5) and await c.exists(key(pool, "epfill")) == 0
    finally:
        await c.aclose()


def test_snapshot_reads_prefill_pacing_as_paced_without_the_ramps_refill() -> None:
    """Early drop's view (backends._snapshot): with prefill-aware picking a lower class is paced
    while a P0 runs even with the ramp off, and the ramp's refill is not counted as a way in."""
    from floodgate.extproc.backends import _snapshot
    from floodgate.extproc.schema import PoolStatus

    st = PoolStatus(granted=False, limit=100, inflight=(1, 50, 0), queued=(0, 0, 0))
    ramp = PoolSettings(100, (0.5, 0.1, 0.0), ramp_burst=0.08, ramp_rate=0.1)
    assert _snapshot(st, settings=ramp).ramp and _snapshot(st, settings=ramp).ramp_refill == 10.0
    both = PoolSettings(100, (0.5, 0.1, 0.0), picking=True, ramp_burst=0.08, ramp_rate=0.1, pf_rate=6000.0)
    assert _snapshot(st, settings=both).ramp and _snapshot(st, settings=both).ramp_refill == 0.0
    only = PoolSettings(100, (0.5, 0.1, 0.0), picking=True, pf_rate=6000.0)
    assert _snapshot(st, settings=only).ramp
    no_picking = PoolSettings(100, (0.5, 0.1, 0.0), pf_rate=6000.0)  # the estimate needs picking
    assert not _snapshot(st, settings=no_picking).ramp
