"""Capacity on its way: the controller announces the replicas the plan still needs that are
cold-starting or waking, each due at the start time it measured; the processors read the
announcement with the registry and early drop counts the permits due before a request's
deadline (the policy side: tests/test_policy.py::test_capacity_on_its_way_lets_a_request_wait_for_it)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from floodgate.controller.actuators.static import StaticActuator
from floodgate.controller.app import PoolController, Replica
from floodgate.controller.config import ActuatorConfig, AdmissionCeilingConfig, PoolConfig
from floodgate.controller.decider import Signals
from floodgate.controller.forecast import ForecastConfig
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.policy import (
    HEALTH_POLL_FAST_S,
    PolicyConfig,
    StartTimes,
    arriving_capacity,
    health_poll_pause,
    later_than_announced,
    replica_due,
)
from floodgate.controller.signals import ReplicaState, ReplicaView
from floodgate.extproc.registry import Registry, parse_arriving, parse_arriving_entries
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.controller.conftest import FakeClock, signals, views
from tests.helpers import activate, picking_admitter

S = ReplicaState
TIMES = StartTimes(cold=(15.1, 15.3), wake_awake=(0.05,), wake_asleep=(1.0, 1.2))

STATIC = ActuatorConfig(kind="static", endpoints=["127.0.0.1:1"])  # as the StaticActuator below


def test_a_loading_replica_is_polled_fast_from_a_second_before_its_measured_cold_start() -> None:
    """The bring-up's /health backoff (up to `timeouts.health_poll_s`) noticed a loaded replica
    0.125 s late on average; from a second before the shortest cold start measured to a second
    after the longest, it polls every HEALTH_POLL_FAST_S, and a pause never runs past the
    window's start. A start slower than that is polled at the backoff again."""
    t = StartTimes(cold=(15.1, 15.3))  # fast from started + 14.1 to started + 16.3
    assert health_poll_pause(0.25, 105.0, 100.0, t) == 0.25  # far from it: the backoff
    assert health_poll_pause(0.25, 113.95, 100.0, t) == pytest.approx(0.15)  # ends at 114.1
    assert health_poll_pause(0.25, 114.08, 100.0, t) == HEALTH_POLL_FAST_S  # never below the fast pace
    for now in (114.1, 115.0, 116.29):  # in the window
        assert health_poll_pause(0.25, now, 100.0, t) == HEALTH_POLL_FAST_S
    for now in (116.3, 130.0, 700.0):  # slower than any start measured: the backoff
        assert health_poll_pause(0.25, now, 100.0, t) == 0.25
    assert health_poll_pause(0.01, 115.0, 100.0, t) == 0.01  # a shorter backoff stands
    assert health_poll_pause(0.25, 115.0, 100.0, StartTimes()) == 0.25  # nothing measured
    assert health_poll_pause(0.25, 115.0, None, t) == 0.25  # adopted: its start is unknown

def test_start_times_keep_the_last_three_and_predict_the_longest() -> None:
    t = StartTimes()
    for s in (14.0, 15.0, 16.0, 15.2):
        t = t.observe("cold", s)
    assert t.cold == (15.0, 16.0, 15.2)
    assert t.observe("cold", -1.0) == t and t.observe("cold", float("nan")) == t
    loading = ReplicaView("r", S.LOADING, 100.0)
    warming = ReplicaView("r", S.WARMING, 110.0)  # state_since moved on: the start counts
    assert replica_due(loading, 100.0, t.observe("wake_awake", 0.1)) == pytest.approx(116.1)
    assert replica_due(warming, 100.0, t.observe("wake_awake", 0.1)) == pytest.approx(116.1)
    assert replica_due(loading, 100.0, t) is None  # no promotion measured yet
    assert replica_due(loading, None, TIMES) is None  # adopted: its start is unknown
    assert replica_due(ReplicaView("r", S.WAKING, 50.0, asleep=True), None, TIMES) == pytest.approx(51.2)
    assert replica_due(ReplicaView("r", S.WAKING, 50.0), None, TIMES) == pytest.approx(50.05)
    assert replica_due(ReplicaView("r", S.WAKING, 50.0, asleep=True), None, StartTimes()) is None
    for st in (S.WARM, S.ACTIVE, S.DRAINING, S.COLD):
        assert replica_due(ReplicaView("r", st, 50.0), 40.0, TIMES) is None


def test_only_the_replicas_the_plan_still_needs_are_announced() -> None:
    now = 100.0
    due: list[float | None] = [115.0, 101.0, 115.0, 130.0]
    # 3 active, 6 decided: the three earliest (one waking, two loading together)
    assert arriving_capacity(6, 3, due, now) == [(1.0, 1), (15.0, 2)]
    assert arriving_capacity(3, 3, due, now) == []  # nothing needed: the rest refill the pool
    assert arriving_capacity(2, 3, due, now) == []
    # a start slower than measured (due already past) holds its place but promises no time
    assert arriving_capacity(5, 3, [99.0, 101.0, 115.0], now) == [(1.0, 1)]
    # ... unless it is within the grace (the controller's next look): due at the grace's end
    assert arriving_capacity(5, 3, [99.6, 101.0, 115.0], now, grace_s=1.0) == [(0.6, 1), (1.0, 1)]
    assert arriving_capacity(5, 3, [99.0, 101.0, 115.0], now, grace_s=1.0) == [(1.0, 1)]  # its end: past
    assert arriving_capacity(5, 3, [98.0, 101.0, 115.0], now, grace_s=1.0) == [(1.0, 1)]
    # the grace only moves a past prediction; one still ahead is announced as measured
    assert arriving_capacity(6, 3, due, now, grace_s=1.0) == [(1.0, 1), (15.0, 2)]
    # unknown ones count last
    assert arriving_capacity(5, 3, [None, 115.0, 101.0], now) == [(1.0, 1), (15.0, 1)]


@pytest.mark.parametrize(("raw", "pttl", "want"), [
    (None, -2, []),
    (b'{"ttl_ms": 10000, "at": [[15000, 2], [1000, 1]]}', 10000, [(1.0, 1), (15.0, 2)]),
    (b'{"ttl_ms": 10000, "at": [[15000, 2], [1000, 1]]}', 8000, [(13.0, 2)]),  # 2 s old: the wake is past
    (b'{"ttl_ms": 10000, "at": [[15000, 2]]}', -1, []),  # no TTL: not the controller's write
    (b'{"ttl_ms": 10000, "at": [[15000, 2]]}', 20000, []),  # more left than it was given
    (b'{"ttl_ms": 10000, "at": [[15000, 0], [15000, -3]]}', 10000, []),
    (b'{"ttl_ms": 10000, "at": [[9999999999, 1]]}', 10000, []),  # absurdly far out
    (b'{"at": [[1000, 1]]}', 10000, []),
    (b"garbage", 10000, []),
    (b'{"ttl_ms": 10000, "at": [["x", 1]]}', 10000, []),
])
def test_parse_arriving(raw: Any, pttl: int, want: list[tuple[float, int]]) -> None:
    assert parse_arriving(raw, pttl) == want


@pytest.mark.parametrize(("raw", "pttl", "want"), [
    (b'{"ttl_ms": 10000, "grace_ms": 500, "at": [[1000, 2]]}', 10000, [(1.0, 2, 0.5)]),
    (b'{"ttl_ms": 10000, "grace_ms": 500, "at": [[1000, 2]]}', 8800, [(-0.2, 2, 0.5)]),  # late, within it
    (b'{"ttl_ms": 10000, "grace_ms": 500, "at": [[1000, 2]]}', 8400, []),  # past the grace
    (b'{"ttl_ms": 10000, "at": [[1000, 2]]}', 8800, []),  # an older controller's: no grace
    (b'{"ttl_ms": 10000, "grace_ms": -5, "at": [[1000, 2]]}', 8800, []),
    (b'{"ttl_ms": 10000, "grace_ms": 999999, "at": [[1000, 2]]}', 1000, [(-8.0, 2, 10.0)]),  # capped at 10 s
    (b'{"ttl_ms": 10000, "grace_ms": "x", "at": [[1000, 2]]}', 10000, []),
])
def test_parse_arriving_entries_with_the_controllers_grace(raw: Any, pttl: int,
                                                          want: list[tuple[float, int, float]]) -> None:
    got = parse_arriving_entries(raw, pttl)
    assert [(pytest.approx(s), n, pytest.approx(g)) for s, n, g in want] == got
    assert parse_arriving(raw, pttl) == [(s, n) for s, n, _ in got if s > 0]  # ahead only, as before


async def test_controller_announces_and_processor_counts_capacity_on_its_way(stack: LocalStack) -> None:
    """The live controller's announcement through a real Redis: a replica it cold-started for
    a scale-up is due at its start + the measured cold start + promotion; the processor's
    registry refresh reads it (with the key's TTL, on Redis's clock) and the snapshot early
    drop decides on counts the permits it brings (the limit's share per endpoint). Taken back
    when the pool has what it needs; an announcement nobody renews expires with its TTL."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    policy = PolicyConfig(min_replicas=1, max_replicas=8, target_concurrency=3.0)
    session = aiohttp.ClientSession()
    pc = PoolController(PoolConfig(name="f", actuator=STATIC, policy=policy, forecast=ForecastConfig(enabled=False),
                                   admission_ceiling=AdmissionCeilingConfig(ttl_s=30)),
                        StaticActuator(["127.0.0.1:1"]), c, session, ControllerMetrics())
    clock = FakeClock()
    pc.clock = lambda: clock.now
    pc.start_times = TIMES
    a = picking_admitter(url, c, 40)
    try:
        reps = views(clock.now, active=2)
        loading = ReplicaView("k0", S.LOADING, clock.now - 3.0)
        pc.replicas = {v.replica_id: Replica(v, None) for v in reps}
        pc.replicas["k0"] = Replica(loading, None, started_at=clock.now - 3.0)
        d = pc.step(Signals(signals(clock.now, reps, running=6.0, waiting=6.0), reps), clock.now)
        assert d.plan.desired >= 3 and d.plan.active == 2
        await pc._publish_arriving(d, clock.now)
        assert 0 < await c.pttl(reg.k_arriving) <= 30_000
        at = await reg.arriving()
        assert len(at) == 1 and at[0][1] == 1 and 5.0 < at[0][0] <= 15.3 + 0.05 - 3.0 + 1e-6

        await activate(reg, 1, 2)
        await a.start()
        ra = a.pools["f"]
        await a._tick(ra)
        assert len(ra.arriving) == 1 and ra.arriving[0][1] == 1
        st = await ra.state.status()
        perms = a.shared._arriving(ra, st)
        # 2 endpoints at a limit of 40: each new one brings 20 permits, due in ~12 s
        assert len(perms) == 1 and perms[0][1] == st.limit // 2 and 5.0 < perms[0][0] <= 12.35 + 1e-6
        # The announcement carries the controller's grace (its tick, 1 s here): a replica past
        # its time within it is still coming, due at the grace's end; past the grace, nothing
        assert json.loads(await c.get(reg.k_arriving))["grace_ms"] == 1000
        await c.set(reg.k_arriving, '{"ttl_ms": 10000, "grace_ms": 500, "at": [[1000, 1]]}', px=8800)  # 0.2 s late
        await a._tick(ra)
        late = a.shared._arriving(ra, st)
        assert len(late) == 1 and late[0][1] == st.limit // 2 and 0.0 < late[0][0] <= 0.3 + 1e-6
        now = a.clock()
        ra.arriving = ((now - 0.6, 1, now - 0.1),)  # late beyond its grace
        assert a.shared._arriving(ra, st) == ()
        await c.set(reg.k_arriving, '{"ttl_ms": 10000, "grace_ms": 500, "at": [[1000, 1]]}', px=8400)  # 0.6 s late
        await a._tick(ra)
        assert ra.arriving == () and a.shared._arriving(ra, st) == ()

        # the pool has what it needs: taken back, and the processor counts nothing
        t = clock.advance(1.0)
        caught_up = views(t, active=d.plan.desired)
        pc.replicas = {v.replica_id: Replica(v, None) for v in caught_up}
        d2 = pc.step(Signals(signals(t, caught_up, running=3.0), caught_up), t)
        await pc._publish_arriving(d2, t)
        assert await reg.arriving() == [] and await c.exists(reg.k_arriving) == 0
        await a._tick(ra)
        assert ra.arriving == ()

        # a write without a TTL (not the controller's way) counts nothing
        await c.set(reg.k_arriving, '{"ttl_ms": 10000, "at": [[5000, 3]]}')
        await a._tick(ra)
        assert ra.arriving == ()
        # off: nothing announced, a left announcement cleared
        await reg.set_arriving([(5.0, 2)], 30)
        off = PoolController(PoolConfig(name="f", actuator=STATIC, policy=policy, forecast=ForecastConfig(enabled=False),
                                        admission_ceiling=AdmissionCeilingConfig(announce_arrivals=False)),
                             StaticActuator(["127.0.0.1:1"]), c, session, ControllerMetrics())
        off.clock, off.start_times = (lambda: clock.now), TIMES
        off.replicas = dict(pc.replicas)
        off.replicas["k0"] = Replica(replace(loading, state_since=t), None, started_at=t)
        await off._publish_arriving(d, t)
        assert await c.exists(reg.k_arriving) == 0
    finally:
        await a.stop()
        await session.close()
        await c.aclose()


async def test_new_endpoints_void_the_snapshot_early_drop_decides_on(stack: LocalStack) -> None:
    """A processor may turn a request away from its last status read (up to a second old)
    without a Redis round trip (`certain_reject`). When the registry refresh brings new active
    endpoints, that read describes the pool before them (the limit they raise, the capacity the
    controller had announced for them and now takes back): the next request must decide on a
    fresh read. Seen in the elastic bench (seed 2, burst 1): four replicas turned active at
    75.9 s, the limit went 42 -> 164 with ~38 in flight, and P2 requests were still turned away
    for 0.7 s while P1s were admitted at once."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    a = picking_admitter(url, c, 4)
    held = []
    waiter = None
    try:
        await activate(reg, 1, 2)
        await a.start()
        ra = a.pools["f"]
        await a._tick(ra)
        limit = int((await ra.state.status()).limit)
        # The pool full of P1 and a P0 waiting: no release will reach a P2 within its 1 s.
        for _ in range(limit):
            p = await a.admit("f", 1, "")
            assert not hasattr(p, "reason"), p
            held.append(p)
        waiter = asyncio.create_task(a.admit("f", 0, ""))
        for _ in range(100):
            if (await ra.state.status()).queued[0] == 1:
                break
            await asyncio.sleep(0.01)
        first = await a.admit("f", 2, "")  # decided on Redis's reply: early drop
        assert getattr(first, "reason", None) == "early_drop"
        # ... and the next one from the snapshot that reply left (no round trip)
        before = a.metrics.local_rejections.labels("f", "2")._value.get()
        again = await a.admit("f", 2, "")
        assert getattr(again, "reason", None) == "early_drop"
        assert a.metrics.local_rejections.labels("f", "2")._value.get() == before + 1
        # Six more endpoints turn active: the limit follows them (the P0 waiter is granted).
        await activate(reg, 3, 8)
        await a._refresh_registry(ra)
        assert (await ra.state.status()).limit > 3 * limit
        p2 = await a.admit("f", 2, "")
        assert not hasattr(p2, "reason"), p2  # granted on a fresh read, not turned away from the old one
        held.append(p2)
        got = await asyncio.wait_for(waiter, 5)
        assert not hasattr(got, "reason"), got
        held.append(got)
    finally:
        if waiter is not None and not waiter.done():
            waiter.cancel()
        for p in held:
            await a.release(p)
        await a.stop()
        await c.aclose()


async def test_a_kick_during_a_tick_starts_the_next_tick_at_once(stack: LocalStack) -> None:
    """A replica that turns warm (or any operation that ends) while a tick runs kicks its
    pool; the loop used to clear that kick after the tick, so the replica waited a whole
    interval for its promotion (the elastic bench: 0.67 s, past the time announced for it, while
    P2s were turned away). With a 60 s interval only the kick can bring the second tick."""
    from floodgate.controller.app import Controller
    from floodgate.controller.config import parse_config

    cfg = parse_config({"redis": {"url": stack.start_redis()}, "tick_interval_s": 60, "metrics_listen": None,
                        "leader": {"enabled": False},
                        "pools": [{"name": "p", "actuator": {"kind": "static", "endpoints": ["127.0.0.1:1"]}}]},
                       env={})
    ctl = Controller(cfg)
    ticks = 0
    second = asyncio.Event()

    async def tick_pool(pc: Any) -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 1:
            await asyncio.sleep(0)
            pc.kick()  # mid-tick: a bring-up's warm-up just finished
            await asyncio.sleep(0.01)
        else:
            second.set()

    ctl.tick_pool = tick_pool  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    try:
        await asyncio.wait_for(second.wait(), 20)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert ticks == 2


def test_later_than_announced() -> None:
    assert not later_than_announced([], [])
    assert not later_than_announced([10.0, 12.0], [10.0, 12.0])  # the same times: nothing moved
    assert later_than_announced([10.0, 12.0], [10.5, 12.0])  # the first one is late
    assert not later_than_announced([10.0, 12.0], [12.0])  # the first was promoted
    assert later_than_announced([10.0, 12.0], [12.5])  # ... and the other one is late
    assert not later_than_announced([10.0], [10.0, 12.0])  # a new replica (the announcement grows)
    assert not later_than_announced([10.0, 12.0], [9.0, 12.0])  # earlier: processors would wait less


async def test_a_late_replica_moves_its_time_and_tells_the_processors(stack: LocalStack) -> None:
    """A replica past its predicted time (a tick late) stays announced, due at the grace's end,
    and the processors are told at once: they hold the time they read until their next
    refresh, and it would pass before the replica serves. On a real Redis: the controller's
    announcement moves, and a message reaches the gateway's channel only then."""
    from floodgate.extproc.schema import gateway_channel

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    await c.zadd(reg.k_gws, {"g": 1e12})  # a live gateway to tell
    pubsub = c.pubsub()
    await pubsub.ssubscribe(gateway_channel("g", "f"))
    policy = PolicyConfig(min_replicas=1, max_replicas=8, target_concurrency=3.0)
    session = aiohttp.ClientSession()
    pc = PoolController(PoolConfig(name="f", actuator=STATIC, policy=policy, forecast=ForecastConfig(enabled=False),
                                   admission_ceiling=AdmissionCeilingConfig(ttl_s=30)),
                        StaticActuator(["127.0.0.1:1"]), c, session, ControllerMetrics(), tick_interval_s=0.5)
    clock = FakeClock()
    pc.clock = lambda: clock.now
    pc.start_times = TIMES

    async def told() -> bool:
        msgs = []
        for _ in range(3):  # (a None may be the subscription's confirmation, ignored)
            m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if m is not None:
                msgs.append(m["data"])
        return b"f|!registry" in msgs

    try:
        reps = views(clock.now, active=2)
        pc.replicas = {v.replica_id: Replica(v, None) for v in reps}
        start = clock.now - 3.0
        pc.replicas["k0"] = Replica(ReplicaView("k0", S.LOADING, start), None, started_at=start)
        due = start + 15.3 + 0.05  # TIMES: the longest cold start + the longest awake promotion

        def plan() -> Any:
            return pc.step(Signals(signals(clock.now, reps, running=6.0, waiting=6.0), reps), clock.now)

        await pc._publish_arriving(plan(), clock.now)
        assert await told()  # a new announcement (it grew from nothing)
        clock.advance(1.0)
        await pc._publish_arriving(plan(), clock.now)
        at = await reg.arriving()
        assert at[0][0] == pytest.approx(due - clock.now, abs=0.05)
        assert not await told()  # the same time, a tick on: nothing to tell
        clock.now = due + 0.2  # a tick late, still loading
        await pc._publish_arriving(plan(), clock.now)
        assert await reg.arriving() == [(pytest.approx(0.3, abs=0.05), 1)]  # due at the grace's end
        assert await told()
        clock.now = due + 0.6  # later than the grace: no time promised, nothing to tell
        await pc._publish_arriving(plan(), clock.now)
        assert await reg.arriving() == [] and not await told()
    finally:
        await pubsub.aclose()
        await session.close()
        await c.aclose()


def test_a_wake_far_past_every_measured_start_is_stalled() -> None:
    # A review: a SIGSTOPped sleeping pool replica, promoted for a burst, held the scale-up for
    # the whole wake timeout (41.3 s at 40 s) while a fresh warm refill was put to sleep.
    from floodgate.controller.policy import stalled_wakes

    asleep = ReplicaView("r0", S.WAKING, 100.0, asleep=True)
    awake = ReplicaView("r1", S.WAKING, 100.0)
    t = StartTimes(cold=(15.1, 15.3), wake_awake=(0.05,), wake_asleep=(1.0, 1.2))
    assert stalled_wakes((asleep, awake), t, 104.0) == frozenset()  # within 5 s: live but slow
    assert stalled_wakes((asleep, awake), t, 105.5) == {"r0", "r1"}  # 3 x 1.2 s and 3 x 0.05 s, at least 5 s
    # no wake from sleep measured yet: longer than a cold start is stalled
    first = StartTimes(cold=(8.0,), wake_awake=(0.05,))
    assert stalled_wakes((asleep,), first, 107.9) == frozenset()
    assert stalled_wakes((asleep,), first, 108.1) == {"r0"}
    assert stalled_wakes((asleep,), StartTimes(), 1e6) == frozenset()  # nothing measured: no claim
    assert stalled_wakes((ReplicaView("r2", S.LOADING, 0.0),), t, 1e6) == frozenset()


def test_the_plan_promotes_the_next_warm_replica_past_a_stalled_wake() -> None:
    from floodgate.controller.config import WarmPoolConfig
    from floodgate.controller.lifecycle import ActionKind, plan_pool

    reps = (ReplicaView("a", S.ACTIVE, 0.0), ReplicaView("hung", S.WAKING, 0.0, asleep=True),
            ReplicaView("w", S.WARM, 0.0))
    cfg = WarmPoolConfig(min_size=1, max_size=1)
    before = plan_pool(2, reps, 1, 50.0, cfg)
    assert not any(a.kind is ActionKind.PROMOTE for a in before.actions)  # the wake counts as serving
    after = plan_pool(2, reps, 1, 50.0, cfg, stalled=frozenset({"hung"}))
    assert [(a.kind, a.replica_id) for a in after.actions if a.kind is ActionKind.PROMOTE] == [(ActionKind.PROMOTE, "w")]
