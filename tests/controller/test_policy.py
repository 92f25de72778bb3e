"""Scripted-signal tests for every rule of the scaling policy (fake clock, no I/O)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from floodgate.controller.policy import (
    REASON_BOUNDS,
    REASON_DEMAND,
    REASON_DOWN,
    REASON_FLOOR,
    REASON_HOLD_KV,
    REASON_HOLD_PANIC,
    REASON_HOLD_STALE,
    REASON_HOLD_STEP,
    REASON_HOLD_WINDOW,
    REASON_KV,
    REASON_QUEUE,
    REASON_STEADY,
    PolicyConfig,
    PolicyState,
    ScalePlan,
    Wave,
    _kv_after_down,
    decide,
)
from floodgate.controller.signals import PoolSignals, ReplicaState, ReplicaView
from pydantic import ValidationError

from .conftest import FakeClock, signals, views

CFG = PolicyConfig(min_replicas=1, max_replicas=64, target_concurrency=10.0)


def step(
    cfg: PolicyConfig,
    state: PolicyState,
    now: float,
    reps: tuple[ReplicaView, ...],
    sig: PoolSignals,
    floor: int | None = None,
) -> tuple[ScalePlan, PolicyState]:
    return decide(cfg, sig, reps, state, now, floor)


def run_steady(cfg: PolicyConfig, clock: FakeClock, n: int, running: float, seconds: float,
               state: PolicyState, tick: float = 2.0) -> tuple[ScalePlan, PolicyState]:
    """Tick for `seconds` with `n` active replicas and constant load; returns the last plan."""
    plan = None
    end = clock.now + seconds
    while clock.now < end:
        reps = views(clock.now, active=n)
        plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=running))
        n = plan.desired
        clock.advance(tick)
    assert plan is not None
    return plan, state


def test_steady_load_keeps_size(clock: FakeClock) -> None:
    reps = views(clock.now, active=4)
    plan, st = step(CFG, PolicyState(), clock.now, reps, signals(clock.now, reps, running=40))
    assert (plan.desired, plan.reason, plan.direction) == (4, REASON_STEADY, "none")
    assert st.desired == 4


def test_tolerance_band_absorbs_small_changes(clock: FakeClock) -> None:
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4)
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=43))  # ratio 1.075
    assert plan.desired == 4
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=46))  # ratio 1.15
    assert (plan.desired, plan.reason) == (5, REASON_DEMAND)


def test_queue_pressure_doubles_at_once_counting_floodgate_queue(clock: FakeClock) -> None:
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4)
    # 4 waiting in vLLM + 5 in Floodgate's queue = 9 > 2 per replica: double.
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=36, waiting=4, queue=5))
    assert (plan.desired, plan.reason, plan.waiting) == (8, REASON_QUEUE, 9)
    # Exactly 2 per replica is not above the threshold: proportional only.
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=36, waiting=4, queue=4))
    assert (plan.desired, plan.reason) == (5, REASON_DEMAND)


def test_doubling_factor_is_configurable(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"scale_up_factor": 1.5})
    reps = views(clock.now, active=4)
    plan, _ = step(cfg, PolicyState(desired=4), clock.now, reps, signals(clock.now, reps, running=40, queue=20))
    assert plan.desired == 6


def test_loading_replicas_prevent_a_cold_start_cascade(clock: FakeClock) -> None:
    state = PolicyState(desired=4)
    reps = views(clock.now, active=4)
    plan, state = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=40, queue=12))
    assert plan.desired == 8
    # The first wave is loading for minutes; the queue keeps growing meanwhile.
    for queue in (20, 30, 40):  # 10 waiting per active replica: "double" = the same 8
        now = clock.advance(2)
        reps = views(now, active=4, loading=4)
        plan, state = step(CFG, state, now, reps, signals(now, reps, running=40, queue=queue))
        assert plan.desired == 8, queue
        assert plan.incoming == 4
    # A backlog that grows while the wave loads is the shortfall the wave was ordered for (it
    # grows at the arrival rate until the replicas serve), not more demand: before, every tick
    # of a cold start asked for more (a review: 1 -> 38 replicas for a need of 4).
    now = clock.advance(2)
    reps = views(now, active=4, loading=4)
    plan, state = step(CFG, state, now, reps, signals(now, reps, running=40, queue=100))
    assert plan.desired == 8
    # But demand that really outgrows active + incoming still scales: its rate (here requests
    # turned away, as concurrency) is new evidence.
    now = clock.advance(2)
    sig = dataclasses.replace(signals(now, reps, running=40, queue=100), lacking=100.0)
    plan, state = step(CFG, state, now, reps, sig)
    assert (plan.desired, plan.reason) == (14, REASON_DEMAND)


def test_the_wave_drains_its_backlog_before_more_is_asked_for(clock: FakeClock) -> None:
    """Once the wave's replicas serve, a backlog that falls is being drained (a scale-up now
    would arrive after it is gone); one that grows past its top while they serve is a shortfall:
    only that growth counts."""
    state = PolicyState(desired=4)
    reps = views(clock.now, active=4)
    plan, state = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=40, queue=12))
    assert plan.desired == 8
    for queue in (40, 80, 120):  # the cold start: the queue grows to 120
        now = clock.advance(2)
        plan, state = step(CFG, state, now, views(now, active=4, loading=4),
                           signals(now, views(now, active=4, loading=4), running=40, queue=queue))
        assert plan.desired == 8
    for queue in (110, 80, 40):  # the wave serves and drains it: no second wave
        now = clock.advance(2)
        reps = views(now, active=8)
        plan, state = step(CFG, state, now, reps, signals(now, reps, running=70, queue=queue))
        assert plan.desired == 8, queue
    now = clock.advance(2)
    reps = views(now, active=8)
    plan, state = step(CFG, state, now, reps, signals(now, reps, running=70, queue=10))  # drained to the wave's
    assert plan.desired == 8
    # A new step with the wave served: the backlog counts again in full.
    now = clock.advance(2)
    plan, state = step(CFG, state, now, reps, signals(now, reps, running=80, queue=60))
    assert plan.desired >= 14  # demand 140 (14) or the queue trigger (16)


def _waking(now: float, active: int, waking: int) -> tuple[ReplicaView, ...]:
    return views(now, active=active) + tuple(
        ReplicaView(f"p{i}", ReplicaState.WAKING, now - 0.5) for i in range(waking))


def test_backlog_draining_in_old_replicas_does_not_start_a_second_wave(clock: FakeClock) -> None:
    """The elastic bench's burst 2 (07:07 run): 2 active + a warm pool, a 4x burst. Promotions
    turn active within a second while ~16 requests still wait inside the two old replicas
    (vLLM does not move them). Before: queue pressure doubled the new active count on that
    backlog at every promotion, 2 -> 4 -> 5 -> 8 -> 10 in 2 s (5 cold starts where the pool
    held the burst)."""
    cfg = PolicyConfig(min_replicas=2, max_replicas=10, target_concurrency=7.0)
    t0 = clock.now
    reps = views(t0, active=2)
    plan, state = step(cfg, PolicyState(desired=2), t0, reps, signals(t0, reps, running=16, waiting=7))
    assert plan.desired == 4  # the burst: 7 waiting on 2 replicas, demand 23 > 14
    reps = _waking(t0 + 1, active=2, waking=2)
    plan, state = step(cfg, state, t0 + 1, reps, signals(t0 + 1, reps, running=16, waiting=16))
    assert (plan.desired, plan.reason) == (5, REASON_DEMAND)  # demand 32: ceil(32 / 7)
    # The two promoted replicas are active; the backlog is still inside the old two.
    reps = _waking(t0 + 1.1, active=4, waking=1)
    plan, state = step(cfg, state, t0 + 1.1, reps, signals(t0 + 1.1, reps, running=16, waiting=16))
    assert (plan.desired, plan.recommendation) == (5, 5), "16 waiting on 4 active: 8 before"
    # All five active, backlog draining (16 -> 11): demand 43 asks for 7, no doubling to 10.
    reps = views(t0 + 2, active=5)
    plan, state = step(cfg, state, t0 + 2, reps, signals(t0 + 2, reps, running=32, waiting=11))
    assert (plan.desired, plan.reason) == (7, REASON_DEMAND)
    assert plan.panic  # still a burst: no scale-down meanwhile


def test_floodgate_queue_after_a_wave_turned_active_still_doubles(clock: FakeClock) -> None:
    """The same burst with the backlog in Floodgate's queue instead of inside the replicas:
    the promoted replicas take from that queue at once, so 16 still queued on 4 active
    replicas is pressure the wave did not answer (the backtest, whose queue is at the gateway,
    runs this path)."""
    cfg = PolicyConfig(min_replicas=2, max_replicas=10, target_concurrency=7.0)
    t0 = clock.now
    reps = views(t0, active=2)
    plan, state = step(cfg, PolicyState(desired=2), t0, reps, signals(t0, reps, running=16, queue=7))
    reps = _waking(t0 + 1, active=2, waking=2)
    plan, state = step(cfg, state, t0 + 1, reps, signals(t0 + 1, reps, running=16, queue=16))
    reps = _waking(t0 + 1.1, active=4, waking=1)
    plan, state = step(cfg, state, t0 + 1.1, reps, signals(t0 + 1.1, reps, running=16, queue=16))
    assert (plan.desired, plan.reason) == (8, REASON_QUEUE)


def test_backlog_growing_past_the_sized_one_still_doubles(clock: FakeClock) -> None:
    cfg = PolicyConfig(min_replicas=2, max_replicas=64, target_concurrency=7.0)
    t0 = clock.now
    reps = views(t0, active=4)
    plan, state = step(cfg, PolicyState(desired=4), t0, reps, signals(t0, reps, running=32, waiting=16))
    assert (plan.desired, plan.reason) == (8, REASON_QUEUE)
    reps = views(t0 + 2, active=8)
    # The wave is active and the backlog drains: nothing more.
    plan, state = step(cfg, state, t0 + 2, reps, signals(t0 + 2, reps, running=48, waiting=12))
    assert plan.desired == 8
    # Demand keeps growing: the backlog passes the one the doubling was sized with (16), with
    # demand above 8 x 7.
    reps = views(t0 + 4, active=8)
    plan, state = step(cfg, state, t0 + 4, reps, signals(t0 + 4, reps, running=56, waiting=20))
    assert (plan.desired, plan.reason) == (16, REASON_QUEUE)  # proportional alone: 11
    # A backlog above that (20) which the size already asked for covers does not double.
    reps = views(t0 + 6, active=8, loading=8)
    plan, state = step(cfg, state, t0 + 6, reps, signals(t0 + 6, reps, running=64, waiting=40))
    assert plan.desired == 16


def test_sized_backlog_is_forgotten_when_panic_ends(clock: FakeClock) -> None:
    cfg = PolicyConfig(min_replicas=2, max_replicas=64, target_concurrency=7.0, panic_window_s=60.0,
                       stabilization_window_s=0.0, scale_down_interval_s=0.0)
    t0 = clock.now
    reps = views(t0, active=4)
    plan, state = step(cfg, PolicyState(desired=4), t0, reps, signals(t0, reps, running=32, waiting=40))
    assert plan.desired == 11 and state.sized_backlog == 40  # demand 72: ceil(72 / 7)
    reps = views(t0 + 61, active=2)
    state = dataclasses.replace(state, desired=2)
    # A later, smaller burst: 5 waiting on 2 replicas is pressure again, though below 40
    # (proportional alone: ceil(21 / 7) = 3).
    plan, state = step(cfg, state, t0 + 61, reps, signals(t0 + 61, reps, running=16, waiting=5))
    assert (plan.desired, plan.reason) == (4, REASON_QUEUE)


def test_loading_replicas_count_as_capacity_for_demand(clock: FakeClock) -> None:
    reps = views(clock.now, active=4, loading=4)
    state = PolicyState(desired=8, window=((clock.now - 1, 8),))
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=40, queue=8))
    # Demand 48 → 5 replicas, less than the 8 active + incoming: nothing new is started.
    assert (plan.desired, plan.reason, plan.incoming) == (8, REASON_HOLD_WINDOW, 4)


def test_kv_pressure_is_a_second_trigger(clock: FakeClock) -> None:
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4)
    # KV near full with a request waiting (below the queue-pressure threshold): KV constrains.
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=40, waiting=1, kv=0.95))
    assert (plan.desired, plan.reason) == (6, REASON_KV)  # ceil(4 × 0.95 / 0.75)
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=40, waiting=1, kv=0.9))
    assert plan.desired == 4  # at the threshold, not above
    cfg = CFG.model_copy(update={"kv_target": 0.94})
    plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=40, waiting=1, kv=0.95))
    assert plan.desired == 5  # always at least one more


def test_kv_pressure_with_nothing_waiting_does_not_scale_up(clock: FakeClock) -> None:
    """A full replica sits near the KV threshold; with every request started, usage above it
    is token-size noise, not a constraint (steady 5 req/s in the backtest: 5 of 8 scale-ups)."""
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4)
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=40, kv=0.95))
    assert (plan.desired, plan.reason) == (4, REASON_STEADY)
    cfg = CFG.model_copy(update={"kv_pressure_needs_waiting": False})  # the old trigger, on usage alone
    plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=40, kv=0.95))
    assert (plan.desired, plan.reason) == (6, REASON_KV)


def test_kv_bound_burst_is_caught_below_the_concurrency_target(clock: FakeClock) -> None:
    # Long contexts fill the KV cache with few requests running: the proportional rule sees
    # 12 of 40 and a short queue (3 < 2 per replica), only KV says the pool is full.
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4)
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=12, waiting=3, kv=0.97))
    assert (plan.desired, plan.reason) == (6, REASON_KV)  # ceil(4 × 0.97 / 0.75)


def test_no_scale_down_that_would_push_kv_over_the_trigger(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"panic_window_s": 0.0})
    reps = views(clock.now, active=4)
    # Demand alone would step down (12 running carry on 2), the window has expired.
    state = PolicyState(desired=4, window=((clock.now - 400, 4),))
    # 4 × 0.8 / 3 = 1.07 on the replicas left: the next waiting request would scale back up.
    plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=12, kv=0.8))
    assert (plan.desired, plan.reason) == (4, REASON_HOLD_KV)
    # 4 × 0.6 / 3 = 0.8: the step down is fine.
    plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=12, kv=0.6))
    assert (plan.desired, plan.reason) == (3, REASON_DOWN)


def test_kv_pressure_while_requests_are_turned_away_scales_up(clock: FakeClock) -> None:
    """Admission that rejects at the door leaves every queue empty: with KV full and requests
    turned away, the pool cannot start what it is offered (3 running per replica, below the
    target of 10; the demand rule reads 12 + 6 against 40 and would hold)."""
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4)
    sig = dataclasses.replace(signals(clock.now, reps, running=12, kv=0.97), lacking=6.0)
    plan, _ = step(CFG, state, clock.now, reps, sig)
    assert (plan.desired, plan.reason) == (6, REASON_KV)  # ceil(4 × 0.97 / 0.75)


@pytest.mark.parametrize("kv", [1 / 17000, 0.01, 0.5])
def test_idle_kv_does_not_hold_the_pool_up(clock: FakeClock, kv: float) -> None:
    """An idle engine need not read KV 0 (a null block never freed, cached prefixes, a stuck
    gauge): with nothing running or waiting the pool still steps down, to 0 if allowed. (The
    KV hold returned infinity for any KV above 0 when the step left no replica, and held two
    idle replicas at 0.5 for ever.)"""
    cfg = CFG.model_copy(update={"panic_window_s": 0.0, "min_replicas": 0})
    for n in (1, 2):
        reps = views(clock.now, active=n)
        state = PolicyState(desired=n, window=((clock.now - 400, n),))
        plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, kv=kv))
        assert (plan.desired, plan.reason) == (n - 1, REASON_DOWN), (n, plan)
    # With requests running the same KV still holds: it would move to the replicas left.
    reps = views(clock.now, active=2)
    state = PolicyState(desired=2, window=((clock.now - 400, 2),))
    plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=2, kv=0.5))
    assert (plan.desired, plan.reason) == (2, REASON_HOLD_KV)


def test_scale_down_waits_for_the_five_minute_window(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"panic_window_s": 0.0})
    t0 = clock.now
    plan, state = run_steady(cfg, clock, 10, 100, 2, PolicyState())
    assert plan.desired == 10
    # Load drops to 2 replicas' worth; hold until the high recommendation leaves the window.
    while clock.now < t0 + 298:
        reps = views(clock.now, active=10)
        plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=20))
        assert (plan.desired, plan.reason) == (10, REASON_HOLD_WINDOW), clock.now - t0
        clock.advance(2)
    assert clock.now == t0 + 298
    reps = views(clock.now, active=10)
    plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=20))
    assert plan.desired == 10
    clock.advance(2)  # t0 + 300: the t0 sample has left the window
    reps = views(clock.now, active=10)
    plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=20))
    assert (plan.desired, plan.reason, plan.direction) == (9, REASON_DOWN, "down")


def test_window_uses_the_max_recommendation(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"panic_window_s": 0.0, "scale_down_interval_s": 0.0})
    state = PolicyState(desired=10)
    reps = views(clock.now, active=10)
    t0 = clock.now
    # 100 s in: a recommendation of 7; everything else 2.
    for dt, running in ((0, 20), (100, 70), (200, 20)):
        plan, state = step(cfg, state, t0 + dt, reps, signals(t0 + dt, reps, running=running))
    downs = []
    for dt in range(300, 420, 2):
        plan, state = step(cfg, state, t0 + dt, views(t0 + dt, active=state.desired or 0),
                           signals(t0 + dt, reps, running=20))
        downs.append(plan.desired)
    assert min(downs[:50]) == 7  # the 7 from t0+100 holds until t0+400
    assert downs[-1] < 7


def test_scale_down_one_replica_per_step(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"panic_window_s": 0.0, "stabilization_window_s": 0.0, "scale_down_interval_s": 10.0})
    state = PolicyState(desired=10)
    seen = []
    for _ in range(16):
        reps = views(clock.now, active=state.desired or 0)
        plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=0))
        seen.append((plan.desired, plan.reason))
        clock.advance(2)
    assert seen[0] == (9, REASON_DOWN)
    assert seen[1:5] == [(9, REASON_HOLD_STEP)] * 4
    assert seen[5] == (8, REASON_DOWN)
    assert all(b[0] >= a[0] - 1 for a, b in itertools.pairwise(seen))


def test_panic_window_forbids_scale_down_after_a_burst(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"stabilization_window_s": 0.0, "panic_window_s": 60.0, "scale_down_interval_s": 0.0})
    reps = views(clock.now, active=4)
    t0 = clock.now
    plan, state = step(cfg, PolicyState(desired=4), t0, reps, signals(t0, reps, running=40, queue=20))
    assert plan.desired == 8 and plan.panic
    for dt in range(2, 60, 2):
        reps = views(t0 + dt, active=8)
        plan, state = step(cfg, state, t0 + dt, reps, signals(t0 + dt, reps, running=5))
        assert (plan.desired, plan.reason) == (8, REASON_HOLD_PANIC)
    reps = views(t0 + 60, active=8)
    plan, state = step(cfg, state, t0 + 60, reps, signals(t0 + 60, reps, running=5))
    assert (plan.desired, plan.reason) == (7, REASON_DOWN)


def test_demand_spike_enters_panic_without_queue(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"stabilization_window_s": 0.0, "scale_down_interval_s": 0.0})
    reps = views(clock.now, active=4)
    plan, state = step(cfg, PolicyState(desired=4), clock.now, reps, signals(clock.now, reps, running=80))
    assert plan.panic and plan.desired == 8
    now = clock.advance(10)
    plan, _ = step(cfg, state, now, views(now, active=8), signals(now, views(now, active=8), running=0))
    assert plan.reason == REASON_HOLD_PANIC


def test_bounds(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"max_replicas": 6, "min_replicas": 2, "panic_window_s": 0.0, "stabilization_window_s": 0.0})
    reps = views(clock.now, active=4)
    plan, _ = step(cfg, PolicyState(desired=4), clock.now, reps, signals(clock.now, reps, running=40, queue=20))
    assert (plan.desired, plan.reason, plan.cause) == (6, REASON_BOUNDS, REASON_QUEUE)
    reps = views(clock.now, active=2)
    plan, _ = step(cfg, PolicyState(desired=2), clock.now, reps, signals(clock.now, reps, running=0))
    assert (plan.desired, plan.reason) == (2, REASON_BOUNDS)
    # A previous desired outside new bounds is clamped.
    plan, _ = step(cfg, PolicyState(desired=50), clock.now, views(clock.now, active=50),
                   signals(clock.now, views(clock.now, active=50), running=500))
    assert plan.desired == 6


def test_scale_from_zero(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"min_replicas": 0})
    plan, _ = step(cfg, PolicyState(desired=0), clock.now, (), signals(clock.now, (), queue=1))
    assert plan.desired == 1
    plan, _ = step(cfg, PolicyState(desired=0), clock.now, (), signals(clock.now, (), queue=0))
    assert plan.desired == 0


@pytest.mark.parametrize("how", ["stale_replica", "failed_replica", "missing_replica", "queue_failed", "queue_stale"])
def test_stale_signals_never_read_as_zero(clock: FakeClock, how: str) -> None:
    cfg = CFG.model_copy(update={"panic_window_s": 0.0, "stabilization_window_s": 0.0})
    reps = views(clock.now, active=6)
    kw: dict[str, object] = {}
    if how == "stale_replica":
        kw["stale_ids"] = frozenset({"a0"})
    elif how == "failed_replica":
        kw["failed_ids"] = frozenset({"a0"})
    elif how == "queue_failed":
        kw["queue_ok"] = False
    elif how == "queue_stale":
        kw["queue_age"] = 30.0
    sig = signals(clock.now, reps, running=0, **kw)  # type: ignore[arg-type]
    if how == "missing_replica":
        sig = dataclasses.replace(sig, replicas=sig.replicas[1:])
    plan, _ = step(cfg, PolicyState(desired=6), clock.now, reps, sig)
    assert plan.stale
    assert (plan.desired, plan.reason) == (6, REASON_HOLD_STALE)
    # Fresh evidence of pressure still scales up while another signal is stale.
    sig = signals(clock.now, reps, running=60, waiting=30, stale_ids=frozenset({"a0"}))
    plan, _ = step(cfg, PolicyState(desired=6), clock.now, reps, sig)
    assert plan.stale and plan.desired == 12 and plan.reason == REASON_QUEUE


def test_stale_period_does_not_pull_the_window_down(clock: FakeClock) -> None:
    cfg = CFG.model_copy(update={"panic_window_s": 0.0, "scale_down_interval_s": 0.0})
    state = PolicyState(desired=6)
    reps = views(clock.now, active=6)
    t0 = clock.now
    for dt in range(0, 400, 2):  # 400 s of outage: everything stale
        sig = signals(t0 + dt, reps, running=0, failed_ids=frozenset(r.replica_id for r in reps))
        plan, state = step(cfg, state, t0 + dt, reps, sig)
        assert (plan.desired, plan.reason) == (6, REASON_HOLD_STALE)
    # Scrapes recover showing low load: still a full window before the first step down.
    plan, state = step(cfg, state, t0 + 400, reps, signals(t0 + 400, reps, running=0))
    assert (plan.desired, plan.reason) == (6, REASON_HOLD_WINDOW)
    plan, state = step(cfg, state, t0 + 700, reps, signals(t0 + 700, reps, running=0))
    assert (plan.desired, plan.reason) == (5, REASON_DOWN)


def test_forecast_floor_raises_but_never_scales_in(clock: FakeClock) -> None:
    reps = views(clock.now, active=4)
    plan, state = step(CFG, PolicyState(desired=4), clock.now, reps, signals(clock.now, reps, running=40), floor=12)
    assert (plan.desired, plan.reason) == (12, REASON_FLOOR)
    # A floor below the reactive size changes nothing.
    reps = views(clock.now, active=10)
    plan, _ = step(CFG, PolicyState(desired=10), clock.now, reps, signals(clock.now, reps, running=100), floor=3)
    assert (plan.desired, plan.reason) == (10, REASON_STEADY)
    # When the floor goes away, the window smooths the way down like any recommendation.
    now = clock.advance(2)
    reps = views(now, active=12)
    plan, state = step(CFG, state, now, reps, signals(now, reps, running=40), floor=None)
    assert (plan.desired, plan.reason) == (12, REASON_HOLD_WINDOW)


def test_decide_is_pure_and_deterministic(clock: FakeClock) -> None:
    reps = views(clock.now, active=4, loading=2, warm=3, draining=1)
    sig = signals(clock.now, reps, running=33, waiting=7, queue=11, kv=0.5)
    state = PolicyState(desired=6, window=((clock.now - 10, 9),))
    a = decide(CFG, sig, reps, state, clock.now, 5)
    b = decide(CFG, sig, reps, state, clock.now, 5)
    assert a == b
    assert state == PolicyState(desired=6, window=((clock.now - 10, 9),))
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.desired = 3  # type: ignore[misc]


def test_draining_replicas_are_not_capacity_but_their_load_counts(clock: FakeClock) -> None:
    reps = views(clock.now, active=2, draining=1)
    sig = signals(clock.now, reps, running=20)
    sig = dataclasses.replace(sig, replicas=(*sig.replicas, dataclasses.replace(sig.replicas[0], replica_id="d0", running=10)))
    plan, _ = step(CFG, PolicyState(desired=2), clock.now, reps, sig)
    assert plan.active == 2 and plan.running == 30 and plan.desired == 3


def test_window_is_compact() -> None:
    cfg = CFG
    state = PolicyState(desired=10)
    reps = views(0, active=10)
    for k in range(150):  # a decreasing recommendation over 300 s
        _, state = decide(cfg, signals(k * 2.0, reps, running=max(0, 100 - k)), reps, state, k * 2.0)
    assert len(state.window) <= 12


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="min_replicas"):
        PolicyConfig(min_replicas=5, max_replicas=2)
    with pytest.raises(ValidationError, match="bogus"):
        PolicyConfig(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="kv_pressure_threshold"):
        PolicyConfig(kv_pressure_threshold=1.5)
    assert PolicyConfig().stabilization_window_s == 300.0
    assert PolicyConfig().queue_pressure_per_replica == 2.0
    assert PolicyConfig().scale_up_factor == 2.0


def test_a_backlog_the_wave_has_served_for_a_panic_window_counts_again(clock: FakeClock) -> None:
    """A queue that stands below the top it reached while the wave loaded, neither drained nor
    growing, is the pool's own backlog once the wave has served it for a panic window: counted in
    full again (never a wave for ever)."""
    cfg = CFG.model_copy(update={"panic_window_s": 60.0})
    state = PolicyState(desired=4)
    reps = views(clock.now, active=4)
    plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=40, queue=12))
    assert plan.desired == 8
    now = clock.advance(2)
    loading = views(now, active=4, loading=4)
    plan, state = step(cfg, state, now, loading, signals(now, loading, running=40, queue=120))
    for _ in range(25):  # served for 50 s: a queue of 60 (below the top, above the wave's 12) counts as the wave
        now = clock.advance(2)
        reps = views(now, active=8)
        plan, state = step(cfg, state, now, reps, signals(now, reps, running=70, queue=60))
        assert plan.desired == 8
    for _ in range(10):  # past the panic window: the pool's own backlog
        now = clock.advance(2)
        plan, state = step(cfg, state, now, reps, signals(now, reps, running=70, queue=60))
    assert plan.desired > 8


def test_the_wave_can_be_switched_off_as_an_hpa_on_queue_length(clock: FakeClock) -> None:
    """`wave_backlog_once: false` counts the whole backlog every tick, as an HPA on queue length
    does (the elastic bench's scaling-only baseline runs so)."""
    cfg = CFG.model_copy(update={"wave_backlog_once": False})
    state = PolicyState(desired=4)
    reps = views(clock.now, active=4)
    plan, state = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=40, queue=12))
    now = clock.advance(2)
    reps = views(now, active=4, loading=4)
    plan, state = step(cfg, state, now, reps, signals(now, reps, running=40, queue=100))
    assert (plan.desired, plan.reason) == (14, REASON_DEMAND)


def test_a_change_of_the_bounds_is_a_change_in_the_plan(clock: FakeClock) -> None:
    """Raising min_replicas (or lowering max_replicas) under a running pool moves the desired
    count: the plan says so (previous, direction, reason `bounds`) even on a stale tick, so the
    decision log and floodgate_scale_events_total show it (an operator review: logged as "none",
    `hold_stale`, previous 3, while replicas were started or drained)."""
    t = clock.now
    reps = views(t, active=2)
    state = PolicyState(desired=2)
    stale = signals(t, reps, running=10, stale_ids=frozenset(r.replica_id for r in reps))
    for sig in (signals(t, reps, running=10), stale):
        plan, _ = step(PolicyConfig(min_replicas=3, max_replicas=5, target_concurrency=10.0), state, t, reps, sig)
        assert (plan.previous, plan.desired, plan.direction, plan.reason) == (2, 3, "up", REASON_BOUNDS), plan
    reps = views(t, active=5)
    plan, _ = step(PolicyConfig(min_replicas=1, max_replicas=1, target_concurrency=10.0), PolicyState(desired=5), t,
                   reps, signals(t, reps, running=40))
    assert (plan.previous, plan.desired, plan.direction, plan.reason) == (5, 1, "down", REASON_BOUNDS), plan


# --- Added by the mutation review: each test below kills a mutant the suite let through. ---


def test_kv_sizes_the_scale_up_for_kv_target_on_a_larger_pool(clock: FakeClock) -> None:
    """KV pressure asks for ceil(active × kv_mean / kv_target). On 4 replicas `active / kv_mean`
    rounds to the same 6, so a wrong formula hid; on 10 it does not (13, not 15)."""
    reps = views(clock.now, active=10)
    plan, _ = step(CFG, PolicyState(desired=10), clock.now, reps,
                   signals(clock.now, reps, running=100, waiting=1, kv=0.95))
    assert (plan.desired, plan.reason) == (13, REASON_KV)  # ceil(10 × 0.95 / 0.75) = ceil(12.67)


def test_panic_threshold_is_measured_against_the_whole_pool(clock: FakeClock) -> None:
    """Panic (which forbids scale-down for a whole panic window) starts at demand ≥
    panic_threshold × capacity × target: 25 running on 4 replicas of 10 is below the size,
    not a panic (measured against one replica it would be, and the pool would never shrink)."""
    reps = views(clock.now, active=4)
    plan, _ = step(CFG, PolicyState(desired=4), clock.now, reps, signals(clock.now, reps, running=25))
    assert not plan.panic
    plan, _ = step(CFG, PolicyState(desired=4), clock.now, reps, signals(clock.now, reps, running=80))
    assert plan.panic  # 80 ≥ 2 × 4 × 10


def test_a_step_that_only_cancels_incoming_replicas_is_not_held_by_kv() -> None:
    """The KV hold asks what the active replicas would carry after the step; a step down from 4
    to 3 with 2 active and 2 loading removes no active replica, so it moves no KV and must not
    be held however full the KV is (else a pool that over-asked keeps its cold starts coming)."""
    cfg = PolicyConfig(min_replicas=1, max_replicas=64, target_concurrency=10.0)
    assert _kv_after_down(cfg, kv_mean=0.95, active=2, current=4, live=10.0) == 0.0
    # the same KV with the step taking an active replica: 0.95 × 2 / 1 would be held
    assert _kv_after_down(cfg, kv_mean=0.95, active=2, current=2, live=10.0) == pytest.approx(1.9)


def test_kv_hold_counts_waiting_requests_as_live_load(clock: FakeClock) -> None:
    """Mutation review: the KV hold is skipped only for an idle pool (nothing running *or
    waiting*). Long contexts: 2 running and 3 waiting on 4 replicas at KV 0.8 — one replica
    fewer would carry 4 × 0.8 / 3 = 1.07, so the step down is held (with `running - waiting`
    as the live load, the pool read as idle and stepped down into KV pressure)."""
    cfg = CFG.model_copy(update={"panic_window_s": 0.0})
    reps = views(clock.now, active=4)
    state = PolicyState(desired=4, window=((clock.now - 400, 4),))
    plan, _ = step(cfg, state, clock.now, reps, signals(clock.now, reps, running=2, waiting=3, kv=0.8))
    assert (plan.desired, plan.reason) == (4, REASON_HOLD_KV)


def test_a_serving_waves_queue_past_its_top_doubles_only_with_demand_past_the_size(clock: FakeClock) -> None:
    """Mutation review: once a cold wave serves, a vLLM queue past the top it reached doubles the
    pool only if the demand is also past what the current size carries (rule 5). Here 12 wait
    inside 4 replicas (top 10) but running + counted backlog is 32 of the 40 the 4 carry: no
    new wave. (Compared with one replica's worth, 10, it doubled to 8: the cascade again.)"""
    reps = views(clock.now, active=4)
    wave = Wave(backlog=5.0, top=10.0, size=4, demand=30.0, served_at=clock.now - 5)
    state = PolicyState(desired=4, wave=wave, panic_until=clock.now + 50)
    plan, _ = step(CFG, state, clock.now, reps, signals(clock.now, reps, running=28, waiting=12))
    assert plan.demand == pytest.approx(32.0)
    assert plan.desired == 4 and plan.reason != REASON_QUEUE
