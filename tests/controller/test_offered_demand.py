"""The decider with offered demand and learned capacity: turned-away demand drives scale-up
where served demand reads as a pool that is merely full; P2 shedding can be excluded; stale
counters hold scale-down; the forecaster records offered demand; sizing uses learned capacity."""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import pytest
from floodgate.controller.actuators.static import StaticActuator
from floodgate.controller.app import PoolController
from floodgate.controller.capacity import CapacityConfig, TickLatency
from floodgate.controller.config import PoolConfig
from floodgate.controller.decider import DeciderConfig, DeciderState, Signals, decide
from floodgate.controller.demand import (
    ClassCounters,
    DemandConfig,
    FloodgateCounters,
    GatewayCounters,
)
from floodgate.controller.forecast import DemandHistory, ForecastConfig
from floodgate.controller.lifecycle import WarmPoolConfig
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.policy import PolicyConfig
from floodgate.controller.vllm import Histogram
from floodgate.extproc.state import redis_client

from tests.controller.conftest import FakeClock, signals, views

POLICY = PolicyConfig(min_replicas=1, max_replicas=20, target_concurrency=7.0)


def cfg(**demand: object) -> DeciderConfig:
    return DeciderConfig(POLICY, ForecastConfig(enabled=False), WarmPoolConfig(enabled=False),
                         demand=DemandConfig(**demand))  # type: ignore[arg-type]


def counters(t: float, admitted: float, away: dict[int, float]) -> FloodgateCounters:
    return FloodgateCounters(t, True, {c: ClassCounters(admitted=admitted if c == 1 else 0.0,
                                                       early_drop=away.get(c, 0.0)) for c in (0, 1, 2)})


def run(c: DeciderConfig, clock: FakeClock, seconds: int, away_rate: dict[int, float],
        counters_ok: bool = True, state: DeciderState | None = None) -> tuple[DeciderState, object]:
    """2 active replicas running 14 (full at 7 each), no queue (admission sheds instead of
    queueing), 7 admitted/s (2 s per request), `away_rate` turned away per second."""
    st = state or DeciderState(history=DemandHistory.empty(8 * 1440))
    reps = views(clock.now, active=2)
    d = None
    for _ in range(seconds):
        t = clock.advance(1.0)
        k = t - 1_000_000.0
        fc = counters(t, 7.0 * k, {c: r * k for c, r in away_rate.items()}) if counters_ok \
            else FloodgateCounters(t, ok=False)
        ps = replace(signals(t, reps, running=14.0), counters=fc)
        st, d = decide(c, st, Signals(ps, reps), t)
    return st, d


def test_turned_away_demand_drives_scale_up(clock: FakeClock) -> None:
    # Served demand alone: 14 on 2 replicas at target 7 -> exactly full, steady.
    _, d = run(cfg(enabled=False), clock, 10, {1: 7.0})
    assert d.plan.desired == 2 and d.plan.lacking == 0  # type: ignore[attr-defined]
    # Offered: 7/s turned away x 2 s per request = 14 more concurrent -> 4 replicas.
    _, d = run(cfg(), FakeClock(), 10, {1: 7.0})
    assert d.plan.lacking == pytest.approx(14.0) and d.plan.demand == pytest.approx(28.0)  # type: ignore[attr-defined]
    assert d.plan.desired == 4 and d.offered.source == "floodgate"  # type: ignore[attr-defined]


def test_p2_shed_excluded_by_configuration(clock: FakeClock) -> None:
    _, d = run(cfg(), clock, 10, {2: 7.0})
    assert d.plan.desired == 4  # type: ignore[attr-defined]  # default: every class counts
    _, d = run(cfg(exclude_classes=(2,)), FakeClock(), 10, {2: 7.0})
    assert d.plan.desired == 2 and d.plan.lacking == 0  # type: ignore[attr-defined]
    assert d.offered.turned_away_rate[2] == pytest.approx(7.0)  # type: ignore[attr-defined]  # still measured
    _, d = run(cfg(exclude_classes=(2,)), FakeClock(), 10, {0: 3.5, 2: 7.0})
    assert d.plan.desired == 3  # type: ignore[attr-defined]  # P0 shed is capacity lacking


def test_stale_counters_hold_scale_down(clock: FakeClock) -> None:
    c = DeciderConfig(POLICY.model_copy(update={"stabilization_window_s": 0, "scale_down_interval_s": 0,
                                                "panic_window_s": 0}),
                      ForecastConfig(enabled=False), WarmPoolConfig(enabled=False),
                      demand=DemandConfig(stale_after_s=0.5))
    st, d = run(c, clock, 5, {1: 14.0})
    assert d.plan.desired == 6  # type: ignore[attr-defined]
    # Counters unreadable from now on, served demand tiny: without them a scale-down would be
    # due; with them stale the tick is stale and the policy holds.
    reps = views(clock.now, active=6)
    for _ in range(15):
        t = clock.advance(1.0)
        ps = replace(signals(t, reps, running=2.0), counters=FloodgateCounters(t, ok=False))
        st, d = decide(c, st, Signals(ps, reps), t)
    assert d.plan.stale and d.plan.desired == 6 and d.plan.reason == "hold_stale"  # type: ignore[attr-defined]


def test_forecaster_records_offered_demand(clock: FakeClock) -> None:
    c = replace(cfg(), forecast=ForecastConfig())
    clock.now = 60.0 * 100_000  # minute boundary
    st = DeciderState(history=DemandHistory.empty(8 * 1440))
    reps = views(clock.now, active=2)
    recorded = []
    for _ in range(130):
        t = clock.advance(1.0)
        k = t - 6_000_000.0
        ps = replace(signals(t, reps, running=14.0), counters=counters(t, 7.0 * k, {1: 7.0 * k}))
        st, d = decide(c, st, Signals(ps, reps), t)
        if d.recorded is not None:
            recorded.append(d.recorded[1])
    # Served demand is 14; offered is 28 (after the first seconds of the minute fill the window).
    assert recorded and recorded[-1] == pytest.approx(28.0, rel=0.02)


def test_sizing_uses_learned_capacity(clock: FakeClock) -> None:
    """Replicas saturated at 5 in flight (admission holds a queue), latency well inside the SLO:
    the prior of 7 is corrected to 7/8 of 5, so 35 of demand needs 8 replicas, not 5."""
    c = replace(cfg(enabled=False), capacity=CapacityConfig(window_s=10.0, min_ttft=5, min_itl=20))
    st = DeciderState(history=DemandHistory.empty(8 * 1440))
    reps = views(clock.now, active=5)
    ttft = Histogram(((0.5, 10.0), (float("inf"), 10.0)), 2.0, 10.0)
    itl = Histogram(((0.05, 100.0), (float("inf"), 100.0)), 3.0, 100.0)
    d = None
    for _ in range(200):
        t = clock.advance(1.0)
        lat = TickLatency(ttft, itl, 25.0, 5, False, saturated=True)
        ps = replace(signals(t, reps, running=25.0, queue=10.0), latency=lat)
        st, d = decide(c, st, Signals(ps, reps), t)
    assert d is not None
    assert d.per_replica == pytest.approx(0.875 * 5.0, rel=0.02) and st.capacity.accepted > 5
    assert d.plan.desired == 8 and d.plan.per_replica == d.per_replica  # ceil((25 + 10) / 4.375)


async def test_live_step_exports_offered_demand_and_capacity() -> None:
    metrics = ControllerMetrics()
    client = redis_client("redis://127.0.0.1:1/0")  # never contacted: step() does no I/O
    async with aiohttp.ClientSession() as session:
        pc = PoolController(PoolConfig(name="p", policy=POLICY, forecast=ForecastConfig(enabled=False)),
                            StaticActuator(["127.0.0.1:1"]), client, session, metrics)
        clock = FakeClock()
        reps = views(clock.now, active=2)
        for _ in range(10):
            t = clock.advance(1.0)
            k = t - 1_000_000.0
            ps = replace(signals(t, reps, running=14.0), counters=counters(t, 7.0 * k, {1: 7.0 * k}))
            d = pc.step(Signals(ps, reps), t)
    await client.aclose()
    assert d.plan.desired == 4
    text = metrics.render().decode()
    assert 'floodgate_turned_away_requests_per_second{pool="p",priority="1"} 7.0' in text
    assert 'floodgate_demand_turned_away{pool="p"} 14.0' in text
    assert 'floodgate_replica_capacity{pool="p"} 7.0' in text
    assert any(e["event"] == "decision" and e["lacking"] == 14.0 for e in pc.events)


def _step(c: DeciderConfig, clock: FakeClock, before: int, after: int, rate_after: float,
          admit_all: bool = False) -> list[object]:
    """4 active replicas, 14 req/s offered and admitted (2 s each: running 28 = 4 x 7) for
    `before` ticks of 1 s, then `rate_after` req/s offered for `after` ticks; admission admits
    14/s (all of them with `admit_all`) and turns the rest away. Returns the decisions."""
    st = DeciderState(history=DemandHistory.empty(8 * 1440))
    reps = views(clock.now, active=4)
    adm = away = 0.0
    out: list[object] = []
    for i in range(before + after):
        t = clock.advance(1.0)
        rate = 14.0 if i < before else rate_after
        a = rate if admit_all else min(rate, 14.0)
        adm, away = adm + a, away + rate - a
        fc = FloodgateCounters(t, True, {1: ClassCounters(admitted=adm, early_drop=away)})
        ps = replace(signals(t, reps, running=28.0), counters=fc)
        st, d = decide(c, st, Signals(ps, reps), t)
        out.append(d)
    return out


def test_burst_sized_on_the_first_decision_that_sees_it(clock: FakeClock) -> None:
    # Step 14 -> 42 req/s at 2 s per request: 84 concurrent -> 12 replicas of 7. With one tick
    # of evidence the first decision after the step asks for all 12.
    ds = _step(cfg(burst_ticks=1), clock, 10, 1, 42.0)
    before, first = ds[-2], ds[-1]
    assert before.plan.desired == 4 and before.plan.burst == 0  # type: ignore[attr-defined]
    assert first.plan.burst == pytest.approx(84.0)  # type: ignore[attr-defined]
    assert first.plan.desired == 12 and first.plan.reason == "burst_demand"  # type: ignore[attr-defined]
    # Scale-up only: the stabilization window holds the 5 s-window recommendation, not the
    # burst estimate (28 running + 28/5 s turned away x 2 s = 39.2 -> 6).
    assert first.plan.stabilized == 6 and first.plan.panic  # type: ignore[attr-defined]
    # Without it the 5 s rate window dilutes the step: the same tick asks for 6.
    ds = _step(cfg(burst=False), FakeClock(), 10, 1, 42.0)
    assert ds[-1].plan.desired == 6 and ds[-1].plan.burst == 0  # type: ignore[attr-defined]


def test_burst_needs_the_step_to_persist_by_default(clock: FakeClock) -> None:
    # Shipped default: two ticks of evidence. The first tick of the step is diluted (6), the
    # second asks for the full 12 — not a 5 s window later.
    ds = _step(cfg(), clock, 10, 2, 42.0)
    assert ds[-2].plan.burst == 0 and ds[-2].plan.desired == 6  # type: ignore[attr-defined]
    assert ds[-1].plan.burst == pytest.approx(84.0) and ds[-1].plan.desired == 12  # type: ignore[attr-defined]
    # One tick of a clump that does not persist: no burst.
    ds = _step(cfg(), FakeClock(), 10, 1, 42.0)
    assert ds[-1].plan.burst == 0  # type: ignore[attr-defined]


def test_burst_estimate_ignores_noise(clock: FakeClock) -> None:
    # Ticks of 30 req/s that admission admitted as they came: not capacity the pool lacks.
    ds = _step(cfg(burst_ticks=1), clock, 10, 1, 30.0, admit_all=True)
    assert ds[-1].plan.burst == 0 and ds[-1].plan.desired == 4  # type: ignore[attr-defined]
    # 14 -> 18 req/s is within 2 Poisson standard deviations of 14 per tick: not a step.
    ds = _step(cfg(burst_ticks=1), FakeClock(), 10, 1, 18.0)
    assert ds[-1].plan.burst == 0  # type: ignore[attr-defined]
    ds = _step(cfg(burst_ticks=1, burst_sigma=0.0), FakeClock(), 10, 1, 18.0)
    assert ds[-1].plan.burst == pytest.approx(36.0)  # type: ignore[attr-defined]


def test_burst_counts_a_backlog_inside_the_replicas_as_behind(clock: FakeClock) -> None:
    # Admission whose limit is above what the replicas run admits the whole step: nothing is
    # turned away and Floodgate's queue stays empty, but the requests wait inside vLLM. That
    # is a pool behind its arrivals: the step is sized at its full height (42/s x 2 s = 84 ->
    # 12 replicas) on the second tick, as when admission queues or sheds it.
    def run_step(c: DeciderConfig, clk: FakeClock, waiting_after: float) -> list[object]:
        st = DeciderState(history=DemandHistory.empty(8 * 1440))
        reps = views(clk.now, active=4)
        adm = 0.0
        out: list[object] = []
        for i in range(12):
            t = clk.advance(1.0)
            adm += 14.0 if i < 10 else 42.0
            fc = FloodgateCounters(t, True, {1: ClassCounters(admitted=adm)})
            ps = replace(signals(t, reps, running=28.0, waiting=waiting_after if i >= 10 else 0.0), counters=fc)
            st, d = decide(c, st, Signals(ps, reps), t)
            out.append(d)
        return out

    ds = run_step(cfg(), clock, 20.0)
    assert ds[-2].plan.burst == 0  # type: ignore[attr-defined]  # one step tick: not yet
    # 42/s x the slot time measured before the step (28 running / 14 admitted/s = 2 s): the
    # admitted rate over the 5 s window already counts the step's waiting requests (28 / 25.2
    # = 1.1 s would size 7).
    assert ds[-1].plan.burst == pytest.approx(84.0)  # type: ignore[attr-defined]
    assert ds[-1].plan.desired == 12 and ds[-1].plan.reason == "burst_demand"  # type: ignore[attr-defined]
    # Admitted and served as they come (no one waits anywhere): no burst.
    ds = run_step(cfg(), FakeClock(), 0.0)
    assert ds[-1].plan.burst == 0  # type: ignore[attr-defined]


def test_burst_estimate_settles_on_the_rate_of_the_whole_step(clock: FakeClock) -> None:
    # 14 req/s, then a step whose first two ticks bring 42 and later ones 60 (noise, or a step
    # that keeps climbing): each tick is still a step against the window before it. The
    # lowest of the last two ticks would size 60/s x 2 s = 120 (18 replicas); the rate over
    # the whole step so far, (42 + 42 + 60 + 60) / 4 s = 51/s, sizes 102 (15).
    st = DeciderState(history=DemandHistory.empty(8 * 1440))
    reps = views(clock.now, active=4)
    adm = away = 0.0
    ds: list[object] = []
    for rate in [14.0] * 10 + [42.0, 42.0, 60.0, 60.0]:
        t = clock.advance(1.0)
        adm, away = adm + min(rate, 14.0), away + rate - min(rate, 14.0)
        fc = FloodgateCounters(t, True, {1: ClassCounters(admitted=adm, early_drop=away)})
        ps = replace(signals(t, reps, running=28.0), counters=fc)
        st, d = decide(cfg(), st, Signals(ps, reps), t)
        ds.append(d)
    assert ds[-3].plan.burst == pytest.approx(84.0)  # type: ignore[attr-defined]  # two ticks of 42
    assert ds[-1].plan.burst == pytest.approx(102.0)  # type: ignore[attr-defined]
    assert ds[-1].plan.desired == 15  # type: ignore[attr-defined]


def test_burst_estimate_leaves_excluded_classes_out(clock: FakeClock) -> None:
    # The same step, all of it P1 here; with P1 excluded its turned-away part drives nothing.
    ds = _step(cfg(burst_ticks=1, exclude_classes=(1,)), clock, 10, 1, 42.0)
    assert ds[-1].plan.burst == pytest.approx(28.0) and ds[-1].plan.desired == 4  # type: ignore[attr-defined]


def test_burst_counts_arrivals_from_envoy_when_redis_counters_are_batched(clock: FakeClock) -> None:
    # The processors flush their Redis counters every other tick (batches), Envoy's listener
    # counters are live. Step 14 -> 42 req/s, 14/s admitted, the rest turned away (429).
    def run_step(c: DeciderConfig, clk: FakeClock) -> list[object]:
        st = DeciderState(history=DemandHistory.empty(8 * 1440))
        reps = views(clk.now, active=4)
        total = adm = away = 0.0
        flushed = (0.0, 0.0)
        out: list[object] = []
        for i in range(12):
            t = clk.advance(1.0)
            rate = 14.0 if i < 10 else 42.0
            total, adm, away = total + rate, adm + 14.0, away + rate - 14.0
            if i % 2 == 0:
                flushed = (adm, away)
            fc = FloodgateCounters(t, True, {1: ClassCounters(admitted=flushed[0], early_drop=flushed[1])})
            gw = GatewayCounters(t, True, rq_total=total, rejected=away)
            ps = replace(signals(t, reps, running=28.0), counters=fc, gateway=gw)
            st, d = decide(c, st, Signals(ps, reps), t)
            out.append(d)
        return out

    ds = run_step(cfg(), clock)
    assert ds[-2].plan.burst == 0  # type: ignore[attr-defined]  # one step tick: not yet
    # 42/s x the measured service time (2 s; read as up to 2.5 s through the batched admitted
    # counter over the 5 s window).
    assert 84.0 <= ds[-1].plan.burst <= 105.0  # type: ignore[attr-defined]
    assert ds[-1].plan.desired >= 12 and ds[-1].plan.reason == "burst_demand"  # type: ignore[attr-defined]
    # Redis counters alone: the batched ticks are no step (one of the two is empty).
    ds = run_step(cfg(use_envoy=False), FakeClock())
    assert ds[-1].plan.burst == 0  # type: ignore[attr-defined]
