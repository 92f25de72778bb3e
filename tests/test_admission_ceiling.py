"""The controller's admission ceiling: the controller publishes per-replica capacity x headroom,
the processors hold their shared Vegas limit at or below it x the active endpoints, so a burst
beyond the active replicas waits in Floodgate's priority queue instead of in the engines'."""

from __future__ import annotations

import asyncio
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
from floodgate.controller.policy import PolicyConfig, admission_ceiling
from floodgate.extproc.limit import LimitState, Sample, cap_to_ceiling, lift_ceiling
from floodgate.extproc.registry import Registry, parse_ceiling
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.controller.conftest import FakeClock, signals, views
from tests.helpers import activate, picking_admitter

STATIC = ActuatorConfig(kind="static", endpoints=["127.0.0.1:1"])  # as the StaticActuator below


def test_ceiling_turns_on_above_what_it_lets_the_active_hold_and_off_within_their_capacity() -> None:
    # 4 active of 7 decided (3 cold starts awaited), 7 per replica x 1.5: on above 42, off at 28.
    def ceil(was_on: bool, demand: float, desired: int = 7, soon: int = 4) -> float | None:
        return admission_ceiling(was_on, desired, soon, 4, demand, 7.0, 1.5)

    assert ceil(False, 42.0) is None and ceil(False, 42.5) == 10.5
    assert ceil(True, 35.0) == 10.5  # inside the band: stays on (no switching every tick) ...
    assert ceil(False, 35.0) is None  # ... or off
    assert ceil(True, 28.0) is None  # back within what the active replicas carry
    assert ceil(True, 60.0, desired=4) is None  # nothing awaited: the decided replicas serve
    assert ceil(True, 60.0, soon=7) is None  # the rest are waking: they serve within a wake
    assert admission_ceiling(True, 7, 4, 4, 60.0, 0.0, 1.5) is None  # no capacity known


def test_lift_gives_back_the_level_per_endpoint() -> None:
    st = LimitState(limit=42.0, endpoints=4)
    assert lift_ceiling(st, 20.0, 10, 1, 512).limit == 200.0  # 20 per endpoint, now 10 of them
    assert lift_ceiling(st, 20.0, 10, 1, 150).limit == 150.0  # within [min, max]
    assert lift_ceiling(st, 5.0, 4, 1, 512) is st  # higher already: Vegas keeps it
    assert lift_ceiling(st, None, 4, 1, 512) is st  # never capped
    assert lift_ceiling(st, 20.0, 0, 1, 512) is st  # no endpoints to size for


def test_cap_only_lowers_and_keeps_the_rest_of_the_state() -> None:
    st = LimitState(limit=154.0, rtt_noload=0.4, probe_count=7, endpoints=4)
    capped = cap_to_ceiling(st, 42.0, 1)
    assert capped == replace(st, limit=42.0)  # the baseline and bookkeeping stay
    assert cap_to_ceiling(st, None, 1) is st  # no controller: no cap
    low = LimitState(limit=20.0)
    assert cap_to_ceiling(low, 42.0, 1) is low  # below the ceiling Vegas decides
    assert cap_to_ceiling(st, 3.0, 8).limit == 8.0  # never below limit.min


@pytest.mark.parametrize(("raw", "want"), [
    (None, None), (b"10.5", 10.5), ("7", 7.0), (b"0", None), (b"-1", None), (b"nan", None),
    (b"inf", None), (b"x", None)])
def test_parse_ceiling(raw: Any, want: float | None) -> None:
    assert parse_ceiling(raw) == want


async def test_controller_ceiling_caps_the_processor_limit(stack: LocalStack) -> None:
    """The live controller's tick publishes capacity x headroom per endpoint (with a TTL); the
    processor's registry refresh caps the shared limit at that x the active endpoints, a
    latency sample cannot raise it past, a new active endpoint raises the cap with the limit,
    a request over the cap waits in Floodgate's queue, and once the controller takes the
    ceiling back the limit returns to its level per endpoint before the cap."""
    from floodgate.extproc.admission import Permit

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    policy = PolicyConfig(min_replicas=1, max_replicas=8, target_concurrency=3.0)
    metrics = ControllerMetrics()
    session = aiohttp.ClientSession()
    pc = PoolController(PoolConfig(name="f", actuator=STATIC, policy=policy, forecast=ForecastConfig(enabled=False),
                                   admission_ceiling=AdmissionCeilingConfig(headroom=1.5, ttl_s=30)),
                        StaticActuator(["127.0.0.1:1"]), c, session, metrics)
    await reg.set_ceiling(99.0, 60)  # a previous leader's
    clock = FakeClock()
    reps = views(clock.now, active=2)
    pc.replicas = {v.replica_id: Replica(v, None) for v in reps}
    d = pc.step(Signals(signals(clock.now, reps, running=6.0), reps), clock.now)
    await pc._publish_ceiling(d)  # a previous leader's ceiling is cleared; this pool is not short
    assert d.plan.desired <= d.plan.active and await reg.ceiling() is None
    d = pc.step(Signals(signals(clock.now, reps, running=6.0, waiting=12.0), reps), clock.now)
    assert d.plan.desired > d.plan.active  # scaling up: short until the new replicas serve
    await pc._publish_ceiling(d)
    assert await reg.ceiling() == pytest.approx(4.5)  # 3 per replica x 1.5
    assert 0 < await c.pttl(reg.k_ceiling) <= 30_000

    a = picking_admitter(url, c, 40)
    waiter: asyncio.Task[Any] | None = None
    held: list[Any] = []
    try:
        await activate(reg, 1, 2)
        await a.start()
        ra = a.pools["f"]
        await a._tick(ra)
        assert ra.ceiling == pytest.approx(9.0)
        assert (await ra.state.get_limit()).state.limit == pytest.approx(9.0)
        # Latency that would raise Vegas (a baseline, then the same latency at the limit).
        await a._apply_sample(ra, Sample(rtt=0.5, inflight=9))
        await a._apply_sample(ra, Sample(rtt=0.5, inflight=9))
        assert (await ra.state.get_limit()).state.limit == pytest.approx(9.0)
        held = [await a.admit("f", 1, "t") for _ in range(9)]
        assert all(isinstance(p, Permit) for p in held)
        waiter = asyncio.create_task(a.admit("f", 0, "t"))  # over the cap: waits in Floodgate's queue
        for _ in range(500):  # (the enqueue is a task: wait for Redis to show it, not for a time)
            if (await ra.state.status()).queued_total == 1:
                break
            await asyncio.sleep(0.02)
        assert (await ra.state.status()).queued_total == 1 and not waiter.done()
        await reg.set("10.0.0.3:8000", "active", "r3")  # a third replica: the cap and the limit follow
        await a._tick(ra)
        assert ra.ceiling == pytest.approx(13.5)
        assert (await ra.state.get_limit()).state.limit == pytest.approx(13.5)
        got = await asyncio.wait_for(waiter, 20)
        assert isinstance(got, Permit)
        held.append(got)
        # The pool caught up (the decided replicas serve): the controller takes the ceiling
        # back and Vegas decides alone again.
        t = clock.advance(1.0)
        caught_up = views(t, active=d.plan.desired)
        pc.replicas = {v.replica_id: Replica(v, None) for v in caught_up}
        d2 = pc.step(Signals(signals(t, caught_up, running=6.0), caught_up), t)
        assert d2.plan.desired <= d2.plan.active
        await pc._publish_ceiling(d2)
        assert await reg.ceiling() is None
        await a._tick(ra)
        assert ra.ceiling is None
        # ... and the limit is back where the cap found it, per endpoint: 40 / 2 x 3.
        before = (await ra.state.get_limit()).state.limit
        assert before == pytest.approx(60.0) and ra.uncapped is None
        await a._apply_sample(ra, Sample(rtt=0.5, inflight=int(before)))
        assert (await ra.state.get_limit()).state.limit > before
    finally:
        if waiter is not None and not waiter.done():
            waiter.cancel()
        for p in held:
            await a.release(p)
        await a.stop()
        await session.close()
        await c.aclose()


async def test_ceiling_counts_the_backlog_a_cold_wave_was_sized_with(stack: LocalStack) -> None:
    """The scale-up's demand counts a cold wave's backlog only up to what the wave was sized
    with (`wave_backlog_once`), and it stood still while vLLM's queue grew behind the active
    replicas. Read as the ceiling's input it kept the ceiling off for a whole cold start when
    the tick that sized the wave was just under the threshold: elastic seed 2, the processors'
    limit 48 -> 158 on 4 replicas of 8 slots, 68 waiting inside them. The ceiling reads what the
    active replicas are offered, the backlog in full (`policy.offered_to_active`)."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    policy = PolicyConfig(min_replicas=1, max_replicas=10, target_concurrency=7.0)
    session = aiohttp.ClientSession()
    pc = PoolController(PoolConfig(name="f", actuator=STATIC, policy=policy, forecast=ForecastConfig(enabled=False),
                                   admission_ceiling=AdmissionCeilingConfig(headroom=1.5, ttl_s=30)),
                        StaticActuator(["127.0.0.1:1"]), c, session, ControllerMetrics())
    clock = FakeClock()
    try:
        reps = views(clock.now, active=3)
        pc.replicas = {v.replica_id: Replica(v, None) for v in reps}
        # 24 running + 5 waiting on 3 replicas of 7: a scale-up, sized with demand 29, under
        # what the ceiling lets 3 hold (3 x 7 x 1.5 = 31.5): no ceiling yet.
        d = pc.step(Signals(signals(clock.now, reps, running=24.0, waiting=5.0), reps), clock.now)
        assert d.plan.desired == 5 and d.plan.demand == pytest.approx(29.0)
        await pc._publish_ceiling(d)
        assert await reg.ceiling() is None
        # Its cold starts load; the backlog inside the 3 active replicas grows to 19.
        t = clock.advance(2.0)
        loading = views(t, active=3, loading=2)
        pc.replicas = {v.replica_id: Replica(v, None) for v in loading}
        d2 = pc.step(Signals(signals(t, loading, running=24.0, waiting=19.0), loading), t)
        assert d2.plan.demand < 31.5  # the wave's backlog, counted once ...
        await pc._publish_ceiling(d2)
        assert await reg.ceiling() == pytest.approx(10.5)  # ... but 43 are offered to the 3 active
    finally:
        await session.close()
        await c.aclose()


async def test_disabled_ceiling_publishes_nothing_and_clears_a_left_one(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    async with aiohttp.ClientSession() as session:
        pc = PoolController(PoolConfig(name="g", actuator=STATIC, forecast=ForecastConfig(enabled=False),
                                       admission_ceiling=AdmissionCeilingConfig(enabled=False)),
                            StaticActuator(["127.0.0.1:1"]), c, session, ControllerMetrics())
        await Registry(c, "g").set_ceiling(99.0, 60)  # left by an earlier controller
        clock = FakeClock()
        reps = views(clock.now, active=1)
        d = pc.step(Signals(signals(clock.now, reps, running=7.0, waiting=14.0), reps), clock.now)
        assert d.plan.desired > d.plan.active
        await pc._publish_ceiling(d)
    assert await Registry(c, "g").ceiling() is None
    await c.aclose()


async def test_only_a_wait_for_cold_starts_publishes(stack: LocalStack) -> None:
    """A warm promotion serves within a wake: the engines may take a second of the burst, and
    holding it in Floodgate's queue instead would read as queue pressure (a doubling) and turn
    sheddable requests away. Cold starts take a model load: then the ceiling is published."""
    from floodgate.controller.signals import ReplicaState

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "h")
    policy = PolicyConfig(min_replicas=1, max_replicas=8, target_concurrency=3.0)
    metrics = ControllerMetrics()
    async with aiohttp.ClientSession() as session:
        pc = PoolController(PoolConfig(name="h", actuator=STATIC, policy=policy, forecast=ForecastConfig(enabled=False)),
                            StaticActuator(["127.0.0.1:1"]), c, session, metrics)
        clock = FakeClock()
        active = views(clock.now, active=2)
        waking = tuple(replace(v, replica_id=f"k{i}", state=ReplicaState.WAKING) for i, v in enumerate(active))
        pc.replicas = {v.replica_id: Replica(v, None) for v in (*active, *waking)}
        # 2 active, 2 waking: demand 12 asks for 4 -> within a wake, nothing published.
        d = pc.step(Signals(signals(clock.now, active + waking, running=6.0, waiting=6.0), active + waking), clock.now)
        assert d.plan.desired == 4 and d.plan.demand > d.plan.active * 3.0
        await pc._publish_ceiling(d)
        assert await reg.ceiling() is None
        # Demand for 6: two more than active + waking must cold-start -> published.
        t = clock.advance(1.0)
        d = pc.step(Signals(signals(t, active + waking, running=6.0, waiting=12.0), active + waking), t)
        assert d.plan.desired == 6
        await pc._publish_ceiling(d)
        assert await reg.ceiling() == pytest.approx(4.5)
    await c.aclose()
    # Operators see it: a gauge and one decision-log event when it turns on.
    assert 'floodgate_admission_ceiling{pool="h"} 4.5' in metrics.render().decode()
    assert [e["per_endpoint"] for e in pc.events if e["event"] == "ceiling"] == [4.5]
