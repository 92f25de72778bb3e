"""Replica state machine and warm-pool planner."""

from __future__ import annotations

from dataclasses import replace

import pytest
from floodgate.controller.lifecycle import (
    Action,
    ActionKind,
    BurstMemory,
    Event,
    InvalidTransition,
    ShedRecord,
    WarmPoolConfig,
    apply_action,
    apply_event,
    observe_burst,
    plan_pool,
    record_shed,
    reserve_scale,
    returning_replicas,
    transition,
    warm_pool_target,
)
from floodgate.controller.signals import ReplicaState, ReplicaView, engine_held

S = ReplicaState
E = Event
K = ActionKind
CFG = WarmPoolConfig(max_drain_s=300, warm_min_age_s=60, max_total=20)
NOW = 10_000.0


def rv(rid: str, state: ReplicaState, since: float = NOW - 1000, **kw) -> ReplicaView:  # type: ignore[no-untyped-def]
    return ReplicaView(rid, state, since, **kw)


def kinds(plan_actions: tuple[Action, ...]) -> list[tuple[str, str]]:
    return [(a.kind.value, a.replica_id) for a in plan_actions]


# --- transitions -------------------------------------------------------------------------------

def test_cold_start_path_to_active_and_recycle() -> None:
    s = S.COLD
    for ev, expect in (
        (E.START, S.LOADING),
        (E.LOADED, S.WARMING),
        (E.WARMUP_OK, S.WARM),
        (E.PROMOTE, S.WAKING),
        (E.WAKE_OK, S.ACTIVE),
        (E.DRAIN, S.DRAINING),
    ):
        s = transition(s, ev)
        assert s is expect
    assert transition(S.DRAINING, E.DRAINED, recycle=True) is S.WARM
    assert transition(S.DRAINING, E.DRAINED, recycle=False) is S.TERMINATED
    assert transition(S.DRAINING, E.DRAIN_TIMEOUT) is S.TERMINATED


@pytest.mark.parametrize("state", [S.COLD, S.LOADING, S.WARMING, S.WARM, S.WAKING, S.ACTIVE, S.DRAINING])
def test_fail_from_any_live_state(state: ReplicaState) -> None:
    assert transition(state, E.FAIL) is S.FAILED
    assert transition(S.FAILED, E.TERMINATE) is S.TERMINATED


@pytest.mark.parametrize("state", [S.COLD, S.LOADING, S.WARMING, S.WARM, S.WAKING, S.FAILED])
def test_terminate_from_non_serving_states(state: ReplicaState) -> None:
    assert transition(state, E.TERMINATE) is S.TERMINATED


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.ACTIVE, E.TERMINATE),  # must drain first
        (S.DRAINING, E.TERMINATE),  # drained / drain_timeout decide
        (S.COLD, E.PROMOTE),
        (S.LOADING, E.WARMUP_OK),
        (S.WARM, E.WAKE_OK),
        (S.WARM, E.DRAIN),
        (S.ACTIVE, E.START),
        (S.ACTIVE, E.DRAINED),
        (S.TERMINATED, E.START),
        (S.TERMINATED, E.FAIL),
        (S.FAILED, E.FAIL),
    ],
)
def test_invalid_transitions_are_rejected(state: ReplicaState, event: Event) -> None:
    with pytest.raises(InvalidTransition) as err:
        transition(state, event)
    msg = str(err.value)
    assert f"'{event.value}'" in msg and f"'{state.value}'" in msg and "allowed" in msg
    assert err.value.state is state and err.value.event is event


def test_every_state_event_pair_is_either_defined_or_rejected() -> None:
    valid = 0
    for st in S:
        for ev in E:
            try:
                transition(st, ev)
                valid += 1
            except InvalidTransition:
                pass
    assert valid == 9 + 7 + 6  # main path (with undrain) + fail from 7 live states + terminate from 6


def test_apply_event_updates_since_and_sleep() -> None:
    v = rv("r1", S.WARM, asleep=True)
    w = apply_event(v, E.PROMOTE, NOW)
    assert (w.state, w.state_since, w.asleep) == (S.WAKING, NOW, True)
    a = apply_event(w, E.WAKE_OK, NOW + 8)
    assert (a.state, a.asleep) == (S.ACTIVE, False)
    d = apply_event(apply_event(a, E.DRAIN, NOW + 9), E.DRAINED, NOW + 20, recycle=True, asleep=True)
    assert (d.state, d.asleep, d.state_since) == (S.WARM, True, NOW + 20)
    assert v.state is S.WARM  # input untouched


# --- warm pool target -------------------------------------------------------------------------

def test_warm_pool_target_follows_forecast() -> None:
    cfg = WarmPoolConfig(burst_fraction=0.25, min_size=1, max_size=10)
    assert warm_pool_target(8, None, cfg) == 2
    assert warm_pool_target(8, 12, cfg) == 3 + 4  # reserve on 12, plus the 4-replica rise
    assert warm_pool_target(8, 4, cfg) == 2  # forecast below desired: reserve only
    assert warm_pool_target(0, None, cfg) == 1  # min_size
    assert warm_pool_target(100, None, cfg) == 10  # max_size
    assert warm_pool_target(8, 12, cfg.model_copy(update={"enabled": False})) == 0


def test_warm_pool_min_size_above_max_size_is_an_error_not_a_silent_max() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"min_size \(10\) is above max_size \(2\)"):
        WarmPoolConfig(min_size=10, max_size=2)
    with pytest.raises(ValidationError, match="min_size"):
        WarmPoolConfig(min_size=20)  # above the default max_size (16)
    assert warm_pool_target(0, None, WarmPoolConfig(min_size=2, max_size=2)) == 2


def test_warm_pool_target_never_exceeds_the_headroom_to_max_replicas() -> None:
    cfg = WarmPoolConfig(min_size=1, max_size=10)
    assert warm_pool_target(8, None, cfg, largest_burst=12) == 6  # uncapped
    assert warm_pool_target(8, None, cfg, largest_burst=12, max_active=10) == 2  # only 2 could be promoted
    assert warm_pool_target(10, None, cfg, largest_burst=12, max_active=10) == 0  # at max: none, not even min_size
    assert warm_pool_target(2, None, cfg, largest_burst=12, max_active=10) == 6  # headroom 8 is enough


def test_warm_pool_target_covers_half_the_largest_recent_burst() -> None:
    cfg = WarmPoolConfig(burst_fraction=0.25, max_size=16, burst_memory_fraction=0.5)
    assert warm_pool_target(8, None, cfg, largest_burst=12) == 6  # above the 2-replica reserve
    assert warm_pool_target(8, None, cfg, largest_burst=2) == 2  # reserve wins
    assert warm_pool_target(8, None, cfg, largest_burst=50) == 16  # max_size
    assert warm_pool_target(8, None, cfg.model_copy(update={"enabled": False}), largest_burst=12) == 0


def _shed(cfg: WarmPoolConfig, ticks: list[tuple[float, float | None, float]], t0: float = NOW) -> ShedRecord:
    """Ticks of (seconds after the previous one, offered/s or None for a stale tick, turned away/s)."""
    rec, now = ShedRecord(), t0
    rec = record_shed(rec, now, None, 0.0, cfg.reserve_window_s)  # the first tick: nothing to integrate yet
    for dt, offered, turned in ticks:
        now += dt
        rec = record_shed(rec, now, offered, turned, cfg.reserve_window_s)
    return rec


def test_the_reserve_follows_the_share_turned_away_over_the_window() -> None:
    cfg = WarmPoolConfig(reserve_shed_share=0.005, reserve_window_s=3600)
    hour = 3600
    # Nothing turned away for an hour: no constant reserve.
    clean = _shed(cfg, [(1.0, 10.0, 0.0)] * hour)
    assert reserve_scale(clean, NOW + hour, cfg) == 0.0
    # 0.25 % turned away: half of it; 0.5 % or more: all of it.
    assert reserve_scale(_shed(cfg, [(1.0, 10.0, 0.025)] * hour), NOW + hour, cfg) == pytest.approx(0.5)
    assert reserve_scale(_shed(cfg, [(1.0, 10.0, 0.05)] * hour), NOW + hour, cfg) == pytest.approx(1.0)
    assert reserve_scale(_shed(cfg, [(1.0, 10.0, 5.0)] * hour), NOW + hour, cfg) == 1.0
    # One minute of shedding inside a clean hour is read against the whole hour's offered
    # requests: 60 of ~36,000 (0.17 %), a third of the reserve.
    spike = [(1.0, 10.0, 0.0)] * (hour - 60) + [(1.0, 10.0, 1.0)] * 60
    assert reserve_scale(_shed(cfg, spike), NOW + hour, cfg) == pytest.approx(1 / 3, rel=0.03)
    # An idle pool (nothing offered) holds none.
    assert reserve_scale(_shed(cfg, [(1.0, 0.0, 0.0)] * hour), NOW + hour, cfg) == 0.0


def test_the_reserve_is_held_in_full_until_half_the_window_is_measured() -> None:
    cfg = WarmPoolConfig(reserve_shed_share=0.005, reserve_window_s=3600)
    assert reserve_scale(ShedRecord(), NOW, cfg) == 1.0  # just started
    assert reserve_scale(_shed(cfg, [(1.0, 10.0, 0.0)] * 1700), NOW + 1700, cfg) == 1.0
    assert reserve_scale(_shed(cfg, [(1.0, 10.0, 0.0)] * 1900), NOW + 1900, cfg) == 0.0
    # Stale ticks (no counters, or no Floodgate in front) measure nothing: still in full.
    assert reserve_scale(_shed(cfg, [(1.0, None, 0.0)] * 3600), NOW + 3600, cfg) == 1.0
    # A gap between ticks (a stopped controller, a lost leader lease) is not integrated.
    gap = _shed(cfg, [(1.0, 10.0, 0.0)] * 1000 + [(1800.0, 10.0, 0.0)] + [(1.0, 10.0, 0.0)] * 100)
    assert reserve_scale(gap, NOW + 2900, cfg) == 1.0
    # Measurements older than the window are forgotten: an hour clean, then an hour stale.
    old = _shed(cfg, [(1.0, 10.0, 0.0)] * 3600 + [(1.0, None, 0.0)] * 3600)
    assert reserve_scale(old, NOW + 7200, cfg) == 1.0
    assert len(old.minutes) <= 62  # bounded: one entry a minute over the window
    # null: the reserve is always held in full (the behaviour before).
    off = cfg.model_copy(update={"reserve_shed_share": None})
    assert reserve_scale(_shed(off, [(1.0, 10.0, 0.0)] * 3600), NOW + 3600, off) == 1.0


def test_the_reserve_is_measured_at_the_longest_tick_interval() -> None:
    """`tick_interval_s` 60 (its maximum): the live loop's ticks come a little after the
    interval (it waits the interval less the tick's own time, and timers fire late), so the
    gaps are 60.00x s. A bound of exactly 60 s integrated none of them and the reserve stayed
    in full for good."""
    cfg = WarmPoolConfig(reserve_shed_share=0.005, reserve_window_s=3600)
    late = _shed(cfg, [(60.02, 10.0, 0.0)] * 60)
    assert reserve_scale(late, NOW + 60 * 60.02, cfg) == 0.0
    shedding = _shed(cfg, [(60.02, 10.0, 0.1)] * 60)  # 1 % turned away: in full
    assert reserve_scale(shedding, NOW + 60 * 60.02, cfg) == 1.0
    # ... while ticks skipped for minutes (Redis down) still count as not measured.
    # (29 ticks measured, 1,740 s: under half the hour)
    skipped = _shed(cfg, [(60.02, 10.0, 0.0)] * 20 + [(600.0, 10.0, 0.0)] + [(60.02, 10.0, 0.0)] * 9)
    assert reserve_scale(skipped, NOW + 29 * 60.02 + 600, cfg) == 1.0


def test_the_reserve_window_is_several_minutes() -> None:
    """The shed record is kept a minute at a time: a window under two minutes lost its last
    whole minute at each minute's turn and read "under half measured" (the reserve in full)
    on ~47 % of the ticks of a clean pool at 60 s, so the pool target flapped every minute."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        WarmPoolConfig(reserve_window_s=60)
    cfg = WarmPoolConfig(reserve_window_s=300)
    rec, now = record_shed(ShedRecord(), NOW, None, 0.0, 300), NOW
    held = []
    for i in range(900):
        now += 1.0
        rec = record_shed(rec, now, 10.0, 0.0, 300)
        if i > 300:
            held.append(reserve_scale(rec, now, cfg))
    assert max(held) == 0.0


def test_warm_pool_target_scales_only_the_constant_reserve() -> None:
    cfg = WarmPoolConfig(burst_fraction=0.25, max_size=16, burst_memory_fraction=0.5)
    assert warm_pool_target(8, None, cfg, reserve=1.0) == 2
    assert warm_pool_target(8, None, cfg, reserve=0.5) == 1
    assert warm_pool_target(8, None, cfg, reserve=0.0) == 0
    assert warm_pool_target(8, 12, cfg, reserve=0.0) == 4  # the forecast rise stays
    assert warm_pool_target(8, None, cfg, largest_burst=6, reserve=0.0) == 3  # and the burst memory
    assert warm_pool_target(8, None, cfg.model_copy(update={"min_size": 1}), reserve=0.0) == 1  # and min_size


def _feed(cfg: WarmPoolConfig, series: list[tuple[float, int]]) -> BurstMemory:
    mem = BurstMemory()
    for t, d in series:
        mem = observe_burst(mem, t, d, cfg)
    return mem


def test_burst_memory_records_rises_above_the_window_low() -> None:
    cfg = WarmPoolConfig(burst_window_s=300, burst_min_ratio=1.0, burst_memory_s=3600)
    # 10 → 30 within a minute: a burst of 20 (more than the low of 10).
    mem = _feed(cfg, [(0, 10), (30, 10), (60, 30), (90, 30)])
    assert mem.largest() == 20
    # Remembered while the demand falls back, and for burst_memory_s after the rise ...
    mem = _feed(cfg, [(0, 10), (60, 30), (600, 10), (3600, 10)])
    assert mem.largest() == 20
    # ... then forgotten.
    mem = observe_burst(mem, 3661, 10, cfg)
    assert mem.largest() == 0
    # A later, smaller burst does not hide the larger one; a larger one replaces it.
    mem = _feed(cfg, [(0, 10), (60, 30), (900, 5), (960, 12), (1800, 10), (1860, 40)])
    assert mem.largest() == 30
    assert mem.bursts == ((1860, 30),)


def test_burst_memory_ignores_slow_or_small_rises() -> None:
    cfg = WarmPoolConfig(burst_window_s=300, burst_min_ratio=1.0, burst_memory_s=3600)
    # 10 → 15: below the ratio.
    assert _feed(cfg, [(0, 10), (60, 15)]).largest() == 0
    # 10 → 30 spread over 20 minutes: never more than ×2 within the 5-minute window.
    ramp = [(60.0 * i, 10 + i) for i in range(21)]
    assert _feed(cfg, ramp).largest() == 0
    # Off.
    off = cfg.model_copy(update={"burst_memory_s": 0})
    assert _feed(off, [(0, 10), (60, 30)]).largest() == 0
    # The window's low only keeps increasing candidates (bounded state).
    mem = _feed(cfg, [(float(t), 10) for t in range(0, 200, 2)])
    assert len(mem.lows) == 1


def test_returning_replicas_are_a_bursts_rise_while_it_lasts() -> None:
    cfg = WarmPoolConfig(burst_window_s=300, burst_min_ratio=1.0, burst_memory_s=3600)
    assert returning_replicas(BurstMemory(), 0, 5, cfg) == 0
    # 3 -> 8 within the window: the 5 replicas above the low go back to the pool after it,
    # also while the burst subsides.
    assert returning_replicas(_feed(cfg, [(0, 3), (60, 8)]), 60, 8, cfg) == 5
    assert returning_replicas(_feed(cfg, [(0, 3), (60, 8), (120, 6)]), 120, 6, cfg) == 3
    # 4 -> 6 is no burst (not more than a doubling): a level, its pool refills as usual.
    assert returning_replicas(_feed(cfg, [(0, 4), (60, 6)]), 60, 6, cfg) == 0
    # A level held past the window is no longer a burst (the remembered burst stays).
    mem = _feed(cfg, [(0, 3), (60, 8), (200, 8), (400, 8)])
    assert returning_replicas(mem, 400, 8, cfg) == 0 and mem.largest() == 5


# --- planner ----------------------------------------------------------------------------------

def test_no_pool_refill_cold_start_for_replicas_a_burst_hands_back() -> None:
    # A burst took the pool (7 active); the target asks for 2 back. Refills cold-started now
    # would sit warm through the burst and then push its drained replicas out as pool_full.
    reps = tuple(rv(f"a{i}", S.ACTIVE) for i in range(7))
    assert [(a.kind.value, a.reason) for a in plan_pool(7, reps, 2, NOW, CFG).actions] == \
        [("start", "pool_refill")] * 2
    assert plan_pool(7, reps, 2, NOW, CFG, returning=4).actions == ()
    assert [(a.kind.value, a.reason) for a in plan_pool(7, reps, 2, NOW, CFG, returning=1).actions] == \
        [("start", "pool_refill")]
    # Scale-up is never held back by it: what the burst needs is cold-started.
    assert [(a.kind.value, a.reason) for a in plan_pool(9, reps, 2, NOW, CFG, returning=4).actions] == \
        [("start", "scale_up")] * 2
    # When the burst passes, its drained replicas refill the pool (below target: recycled).
    done = rv("d0", S.DRAINING, NOW - 30, inflight=0, running=0)
    p = plan_pool(6, (*reps[:6], done), 2, NOW, CFG, returning=3)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [("recycle", "d0", "pool_refill")]


def test_promotes_warm_first_awake_before_asleep_then_cold_starts() -> None:
    reps = (
        rv("a0", S.ACTIVE),
        rv("w-sleepy", S.WARM, asleep=True),
        rv("w-awake", S.WARM, asleep=False),
    )
    p = plan_pool(5, reps, 0, NOW, CFG, next_seq=7)
    assert kinds(p.actions) == [("promote", "w-awake"), ("promote", "w-sleepy"), ("start", "r7"), ("start", "r8")]
    assert p.next_seq == 9
    assert all(a.reason == "scale_up" for a in p.actions)


def test_loading_replicas_are_counted_before_cold_starting_more() -> None:
    reps = (rv("a0", S.ACTIVE), rv("l0", S.LOADING), rv("l1", S.WARMING), rv("c0", S.COLD))
    p = plan_pool(4, reps, 0, NOW, CFG)
    assert p.actions == ()
    p = plan_pool(6, reps, 0, NOW, CFG)
    assert kinds(p.actions) == [("start", "r0"), ("start", "r1")]


def test_waking_counts_as_serving() -> None:
    reps = (rv("a0", S.ACTIVE), rv("k0", S.WAKING))
    assert plan_pool(2, reps, 0, NOW, CFG).actions == ()


def test_refills_pool_in_background() -> None:
    reps = (rv("a0", S.ACTIVE), rv("a1", S.ACTIVE), rv("w0", S.WARM, asleep=True))
    p = plan_pool(2, reps, 3, NOW, CFG)
    assert [(a.kind, a.reason) for a in p.actions] == [(K.START, "pool_refill")] * 2
    # Promotion uses the pool, then refill makes it up again.
    p = plan_pool(3, reps, 1, NOW, CFG)
    assert [(a.kind.value, a.reason) for a in p.actions] == [("promote", "scale_up"), ("start", "pool_refill")]


def test_pipeline_serves_demand_before_pool() -> None:
    reps = (rv("a0", S.ACTIVE), rv("l0", S.LOADING))
    p = plan_pool(2, reps, 1, NOW, CFG)  # l0 is for demand, the pool still needs one
    assert [(a.kind.value, a.reason) for a in p.actions] == [("start", "pool_refill")]


def test_drains_most_idle_active_one_at_a_time() -> None:
    reps = (
        rv("a0", S.ACTIVE, inflight=3, running=3),
        rv("a1", S.ACTIVE, inflight=0, running=1, last_busy_at=NOW - 5),
        rv("a2", S.ACTIVE, inflight=0, running=1, last_busy_at=NOW - 50),
        rv("a3", S.ACTIVE, inflight=2, running=2),
    )
    p = plan_pool(1, reps, 0, NOW, CFG)
    assert kinds(p.actions) == [("drain", "a2")]  # least loaded, idle longest
    busy_drain = (*reps[:1], rv("a2", S.DRAINING, NOW - 10, inflight=1, running=1), reps[1], reps[3])
    assert kinds(plan_pool(1, busy_drain, 0, NOW, CFG).actions) == []  # one at a time
    two = CFG.model_copy(update={"max_concurrent_drains": 3})
    assert kinds(plan_pool(1, busy_drain, 0, NOW, two).actions) == [("drain", "a1"), ("drain", "a3")]


def test_finished_drain_recycled_when_pool_below_target_else_terminated() -> None:
    done = rv("d0", S.DRAINING, NOW - 30, inflight=0, running=0)
    still = rv("d1", S.DRAINING, NOW - 30, inflight=1, running=0)
    reps = (rv("a0", S.ACTIVE), done, still)
    assert kinds(plan_pool(1, reps, 1, NOW, CFG).actions) == [("recycle", "d0")]
    p = plan_pool(1, reps, 0, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [("terminate", "d0", "pool_full")]
    # Pool disabled: always terminate.
    off = CFG.model_copy(update={"enabled": False})
    assert kinds(plan_pool(1, reps, 5, NOW, off).actions) == [("terminate", "d0")]


def test_a_drain_does_not_end_while_the_engine_still_holds_waiting_requests() -> None:
    # vLLM reported 0 running and 2 waiting (not yet scheduled, or waiting for remote KV): the
    # drain used to end on running 0 alone, and the stop lost those two requests.
    held = engine_held(True, running=0.0, waiting=2.0, previous=0)
    assert held == 2
    draining = rv("d0", S.DRAINING, NOW - 30, inflight=0, running=held)
    assert kinds(plan_pool(1, (rv("a0", S.ACTIVE), draining), 1, NOW, CFG).actions) == []
    assert engine_held(True, running=3.0, waiting=1.0, previous=0) == 4
    assert engine_held(True, running=0.0, waiting=0.0, previous=5) == 0  # idle is idle
    # A failed scrape is unknown, not idle: at least 1, the last reading if higher.
    assert engine_held(False, running=0.0, waiting=0.0, previous=0) == 1
    assert engine_held(False, running=0.0, waiting=0.0, previous=7) == 7


def test_a_drain_is_taken_back_before_a_pool_replica_is_woken_or_one_cold_started() -> None:
    # A drained (idle) or draining (streams still on it) replica is loaded and awake: it serves
    # again at once (undrain). Before, a finished drain was recycled into the pool first, and a
    # busy one sat draining while a cold start was made (a review: 26 s, a needless cold start).
    reps = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 30))
    p = plan_pool(2, reps, 0, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [("undrain", "d0", "scale_up")]
    busy = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 3, inflight=1, running=1),
            rv("w0", S.WARM, asleep=True))
    p = plan_pool(2, busy, 1, NOW, CFG)
    assert kinds(p.actions) == [("undrain", "d0")]  # not a promotion of w0, not a start
    p = plan_pool(3, busy, 1, NOW, CFG)
    assert kinds(p.actions)[:2] == [("undrain", "d0"), ("promote", "w0")]
    # the busiest drain first; the rest drain on
    two = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 3, inflight=1, running=1),
           rv("d1", S.DRAINING, NOW - 3, inflight=3, running=3))
    assert kinds(plan_pool(2, two, 0, NOW, CFG).actions) == [("undrain", "d1")]
    # past max_drain_s it is stuck: force-stopped, not taken back; with an operation in flight, skipped
    stuck = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 301, inflight=2, running=2))
    assert kinds(plan_pool(2, stuck, 0, NOW, CFG).actions) == [("force_stop", "d0"), ("start", "r0")]
    held = (rv("a0", S.ACTIVE), replace(rv("d0", S.DRAINING, NOW - 3), busy=True))
    assert ("undrain", "d0") not in kinds(plan_pool(2, held, 0, NOW, CFG).actions)
    # one whose last scrape failed (hung: it reads as busy) is not taken back; the next one is
    hung = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 3, inflight=5, running=5),
            rv("d1", S.DRAINING, NOW - 3, inflight=1, running=1))
    assert kinds(plan_pool(2, hung, 0, NOW, CFG, unhealthy=frozenset({"d0"})).actions) == [("undrain", "d1")]


def test_undrain_makes_it_active_again() -> None:
    v = apply_action(rv("d0", S.DRAINING, NOW - 3, inflight=1, running=1), ActionKind.UNDRAIN, NOW)
    assert (v.state, v.state_since, v.asleep) == (S.ACTIVE, NOW, False)


def test_force_stop_after_max_drain_time() -> None:
    reps = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 301, inflight=2, running=2))
    p = plan_pool(1, reps, 0, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [("force_stop", "d0", "drain_timeout")]
    reps = (rv("a0", S.ACTIVE), rv("d0", S.DRAINING, NOW - 299, inflight=2, running=2))
    assert plan_pool(1, reps, 0, NOW, CFG).actions == ()


def test_failed_replicas_are_terminated_and_replaced() -> None:
    reps = (rv("a0", S.ACTIVE), rv("f0", S.FAILED))
    p = plan_pool(2, reps, 0, NOW, CFG)
    assert kinds(p.actions) == [("terminate", "f0"), ("start", "r0")]


def test_pool_excess_terminated_longest_idle_first_but_not_fresh_ones() -> None:
    reps = (
        rv("a0", S.ACTIVE),
        rv("w-old", S.WARM, NOW - 500, asleep=True),
        rv("w-mid", S.WARM, NOW - 200, asleep=True),
        rv("w-new", S.WARM, NOW - 10, asleep=True),
    )
    p = plan_pool(1, reps, 0, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [
        ("terminate", "w-old", "pool_excess"),
        ("terminate", "w-mid", "pool_excess"),
    ]


def test_awake_pool_replicas_are_put_to_sleep() -> None:
    reps = (rv("a0", S.ACTIVE), rv("w0", S.WARM, asleep=False), rv("w1", S.WARM, asleep=True))
    assert kinds(plan_pool(1, reps, 2, NOW, CFG).actions) == [("sleep", "w0")]
    nosleep = CFG.model_copy(update={"sleep_enabled": False})
    assert plan_pool(1, reps, 2, NOW, nosleep).actions == ()


def test_max_total_caps_cold_starts() -> None:
    cfg = CFG.model_copy(update={"max_total": 4})
    reps = (rv("a0", S.ACTIVE), rv("a1", S.ACTIVE))
    p = plan_pool(10, reps, 5, NOW, cfg)
    assert kinds(p.actions) == [("start", "r0"), ("start", "r1")]


def test_terminated_replicas_are_ignored_and_plan_is_deterministic() -> None:
    reps = (rv("a0", S.ACTIVE), rv("t0", S.TERMINATED), rv("w1", S.WARM), rv("w0", S.WARM))
    a = plan_pool(2, reps, 0, NOW, CFG)
    b = plan_pool(2, tuple(reversed(reps)), 0, NOW, CFG)
    assert a == b
    assert kinds(a.actions)[0] == ("promote", "w0")


def test_scale_down_refills_the_pool_with_drained_replicas_not_cold_starts() -> None:
    # 4 active → 1 with an empty pool whose target is 1: the drain is the refill.
    reps = tuple(rv(f"a{i}", S.ACTIVE, inflight=1, running=1) for i in range(4))
    p = plan_pool(1, reps, 1, NOW, CFG)
    assert kinds(p.actions) == [("drain", "a0")]
    # While it drains, still no cold start for the pool.
    draining = (rv("a0", S.DRAINING, NOW - 5, inflight=1, running=1), *reps[1:])
    assert kinds(plan_pool(1, draining, 1, NOW, CFG).actions) == []
    # Finished: it becomes the pool; the next drains are terminated (pool full), still no start.
    done = (rv("a0", S.DRAINING, NOW - 5), *reps[1:])
    assert kinds(plan_pool(1, done, 1, NOW, CFG).actions) == [("recycle", "a0"), ("drain", "a1")]
    pooled = (rv("a0", S.WARM, NOW), rv("a1", S.DRAINING, NOW - 5), *reps[2:])
    assert kinds(plan_pool(1, pooled, 1, NOW, CFG).actions) == [("terminate", "a1"), ("drain", "a2"), ("sleep", "a0")]
    # A forced stop is not on its way to the pool: that one is refilled.
    stuck = (rv("a0", S.DRAINING, NOW - 301, inflight=1, running=1), *reps[1:2])
    assert kinds(plan_pool(1, stuck, 1, NOW, CFG).actions) == [("force_stop", "a0"), ("start", "r0")]


# --- outdated replicas (another command than the configured one; review ctl2 S2-1) ---------------

def test_an_outdated_replica_is_drained_first_and_never_recycled() -> None:
    reps = (rv("a0", S.ACTIVE, inflight=0, running=0, last_busy_at=NOW - 50),
            rv("a1", S.ACTIVE, inflight=3, running=3, outdated=True))
    # The busier one goes, being outdated (the idlest would have gone before).
    assert kinds(plan_pool(1, reps, 0, NOW, CFG).actions) == [("drain", "a1")]
    # Its drain finished with the pool below target: retired, not recycled (it would keep the
    # old command); the pool is refilled by a new start instead.
    done = rv("a1", S.DRAINING, NOW - 30, inflight=0, running=0, outdated=True)
    p = plan_pool(1, (reps[0], done), 1, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [
        ("terminate", "a1", "outdated"), ("start", "r0", "pool_refill")]
    # Draining with streams still on it: it refills nothing, so the pool starts one now.
    busy = rv("a1", S.DRAINING, NOW - 30, inflight=2, running=2, outdated=True)
    assert [(a.kind.value, a.reason) for a in plan_pool(1, (reps[0], busy), 1, NOW, CFG).actions] == [
        ("start", "pool_refill")]


def test_outdated_pool_replicas_are_refilled_then_retired_once_the_new_ones_are_warm() -> None:
    active = rv("a0", S.ACTIVE)
    old = rv("w0", S.WARM, asleep=True, outdated=True)
    # The pool of 1 holds only an outdated replica: a replacement starts, the old one stays
    # (the pool keeps its burst capacity meanwhile).
    p = plan_pool(1, (active, old), 1, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [("start", "r0", "pool_refill")]
    loading = rv("r0", S.LOADING, NOW - 5)
    assert kinds(plan_pool(1, (active, old, loading), 1, NOW, CFG).actions) == []
    # The replacement is warm: the outdated one retires, even though it is not old enough for
    # an ordinary trim.
    new = rv("r0", S.WARM, NOW - 1)
    p = plan_pool(1, (active, old, new), 1, NOW, CFG)
    assert [(a.kind.value, a.replica_id, a.reason) for a in p.actions] == [
        ("terminate", "w0", "outdated"), ("sleep", "r0", "pool")]
    # A scale-up promotes the current one first.
    p = plan_pool(2, (active, old, replace(new, asleep=True)), 1, NOW, CFG)
    assert ("promote", "r0") in kinds(p.actions) and ("promote", "w0") not in kinds(p.actions)


def test_a_rise_of_exactly_the_min_ratio_is_not_a_burst() -> None:
    """Mutation review: a burst is a rise that *exceeds* `burst_min_ratio` × the window's low (the
    config's own wording). At ratio 1.0 a doubling from 10 to 20 is a rise of exactly 10: not a
    burst; one replica more is. Read as "at least", every doubling would size the pool's burst
    memory, holding warm replicas (cost) for `burst_memory_s` after an ordinary ramp."""
    cfg = WarmPoolConfig(burst_window_s=300, burst_min_ratio=1.0, burst_memory_s=3600)
    assert _feed(cfg, [(0, 10), (60, 20)]).largest() == 0
    assert _feed(cfg, [(0, 10), (60, 21)]).largest() == 11


def test_retiring_an_outdated_replica_frees_one_place_under_max_total() -> None:
    """Mutation review: `max_total` caps the replicas of every live state together. Retiring
    an outdated drained replica frees one place, so at max_total 2 (one active, the outdated
    one done draining, a pool target of 2) one pool refill starts, not two (3 replicas live)."""
    cfg = CFG.model_copy(update={"max_total": 2})
    done = rv("a1", S.DRAINING, NOW - 30, inflight=0, running=0, outdated=True)
    p = plan_pool(1, (rv("a0", S.ACTIVE), done), 2, NOW, cfg)
    assert [(a.kind.value, a.replica_id) for a in p.actions] == [("terminate", "a1"), ("start", "r0")]


def test_the_first_tick_measures_no_interval_for_the_reserve() -> None:
    """Mutation review: the shed record integrates rates over the time between two ticks; the
    first tick (a boot, a takeover) has no previous one, so it records nothing (read as a 1 s
    interval, every restart added a second of made-up offered and turned-away requests)."""
    first = record_shed(ShedRecord(), NOW, 10.0, 5.0, 3600)
    assert first.minutes == () and first.last_at == NOW
    second = record_shed(first, NOW + 2, 10.0, 5.0, 3600)
    assert second.minutes == ((int((NOW + 2) // 60), 20.0, 10.0, 2.0),)
