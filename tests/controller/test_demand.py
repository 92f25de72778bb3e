"""Offered demand: Floodgate's per-class counters reconciled with Envoy's gateway listener,
rates over a sliding window, counter resets, staleness, and Little's-law concurrency."""

from __future__ import annotations

import math

import pytest
from floodgate.controller.demand import (
    ClassCounters,
    DemandConfig,
    DemandWindow,
    FloodgateCounters,
    GatewayCounters,
    OfferedDemand,
    lacking_concurrency,
    mean_running,
    observe,
    observe_running,
    offered,
    recent,
    scale_up_lacking,
)

CFG = DemandConfig(window_s=10.0, stale_after_s=5.0)


def fg(t: float, per_class: dict[int, tuple[float, float, float, float]], queued: dict[int, float] | None = None,
       ok: bool = True) -> FloodgateCounters:
    """per class: (admitted, queued, early_drop, queue_timeout) cumulative."""
    return FloodgateCounters(t, ok, {c: ClassCounters(admitted=a, queued=q, early_drop=e, queue_timeout=to)
                                     for c, (a, q, e, to) in per_class.items()}, queued or {})


def feed(steps: list[tuple[float, FloodgateCounters | None, GatewayCounters | None]],
         cfg: DemandConfig = CFG) -> DemandWindow:
    w = DemandWindow()
    for t, f, g in steps:
        w = observe(w, t, cfg, f, g)
    return w


def test_floodgate_counters_give_per_class_offered_and_turned_away() -> None:
    # 10 s: P0 admitted 20; P1 admitted 50, 30 early-dropped, 10 timed out in the queue;
    # P1's queue grew by 5 (arrived, not yet decided); P2 60 early-dropped.
    a = fg(100.0, {0: (0, 0, 0, 0), 1: (0, 0, 0, 0), 2: (0, 0, 0, 0)})
    b = fg(110.0, {0: (20, 0, 0, 0), 1: (50, 20, 30, 10), 2: (0, 0, 60, 0)}, {1: 5})
    d = offered(feed([(100.0, a, None), (110.0, b, None)]), 110.0, CFG)
    assert not d.stale and d.source == "floodgate"
    assert d.offered_rate == pytest.approx({0: 2.0, 1: 9.5, 2: 6.0})
    assert d.admitted_rate == pytest.approx({0: 2.0, 1: 5.0, 2: 0.0})
    assert d.turned_away_rate == pytest.approx({0: 0.0, 1: 4.0, 2: 6.0})
    assert d.lacking_rate() == pytest.approx(10.0)
    assert d.lacking_rate((2,)) == pytest.approx(4.0)  # P2 shed by choice: not capacity lacking
    # Little's law: 35 running at 7 admitted/s -> 5 s per request -> 4/s lacking = 20 slots.
    assert lacking_concurrency(d, 35.0, CFG.model_copy(update={"exclude_classes": (2,)})) == pytest.approx(20.0)
    assert lacking_concurrency(d, 35.0, CFG) == pytest.approx(50.0)


def test_envoy_excess_is_spread_and_envoy_alone_is_unclassed() -> None:
    a = fg(100.0, {0: (0, 0, 0, 0), 1: (0, 0, 0, 0)})
    b = fg(110.0, {0: (10, 0, 10, 0), 1: (10, 0, 30, 0)})
    ga, gb = GatewayCounters(100.0, True, 1000, 500), GatewayCounters(110.0, True, 1160, 580)
    # Envoy turned away 8/s, Floodgate recorded 4/s (e.g. a Redis outage): +4/s spread 1:3.
    d = offered(feed([(100.0, a, ga), (110.0, b, gb)]), 110.0, CFG)
    assert d.source == "floodgate+envoy" and d.envoy_excess_rate == pytest.approx(4.0)
    assert d.turned_away_rate == pytest.approx({0: 2.0, 1: 6.0})
    assert d.offered_rate == pytest.approx({0: 3.0, 1: 7.0})
    # Floodgate's counters unreadable (Redis down): Envoy alone, attributed to the default class.
    w2 = feed([(100.0, None, ga), (110.0, fg(110.0, {}, ok=False), gb)])
    d = offered(w2, 110.0, CFG)
    assert d.source == "envoy" and d.turned_away_rate == {1: pytest.approx(8.0)}
    assert d.offered_rate == {1: pytest.approx(16.0)} and d.admitted_rate == {1: pytest.approx(8.0)}
    # Envoy disabled for a listener shared by several pools: Floodgate only.
    d = offered(feed([(100.0, a, ga), (110.0, b, gb)]), 110.0, CFG.model_copy(update={"use_envoy": False}))
    assert d.source == "floodgate" and d.turned_away_rate == pytest.approx({0: 1.0, 1: 3.0})


def test_envoy_excess_with_none_counted_goes_to_the_default_class_alone() -> None:
    # The processors turned nothing away that they counted, and counted no request of the
    # default class at all (only P0 admitted): Envoy's 8/s of immediate responses are the
    # default class's, exactly — not on top of a made-up share of a class with no counters
    # (a mutation review: the default class's missing entry read as 1/s survived every test).
    a = fg(100.0, {0: (0, 0, 0, 0)})
    b = fg(110.0, {0: (40, 0, 0, 0)})
    ga, gb = GatewayCounters(100.0, True, 1000, 500), GatewayCounters(110.0, True, 1120, 580)
    d = offered(feed([(100.0, a, ga), (110.0, b, gb)]), 110.0, CFG)
    assert d.source == "floodgate+envoy" and d.envoy_excess_rate == pytest.approx(8.0)
    assert d.turned_away_rate == pytest.approx({0: 0.0, 1: 8.0})
    assert d.offered_rate == pytest.approx({0: 4.0, 1: 8.0})


def test_retries_turned_away_again_are_no_demand_in_either_source() -> None:
    # 10 s: P1 admitted 40, 20 first attempts turned away, and their 40 retries turned away
    # again (OpenAI's SDKs retry a 429 twice). Envoy saw every one of the 60 immediate
    # responses. Offered is the 60 requests, not the 100 attempts; the retries are not Envoy
    # "excess" either (turned away without the processors counting them).
    a = FloodgateCounters(100.0, True, {1: ClassCounters()})
    b = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=20, retried=40)})
    ga, gb = GatewayCounters(100.0, True, 0, 0), GatewayCounters(110.0, True, 100, 60)
    d = offered(feed([(100.0, a, ga), (110.0, b, gb)]), 110.0, CFG)
    assert d.source == "floodgate+envoy" and d.envoy_excess_rate == 0.0
    assert d.turned_away_rate == pytest.approx({1: 2.0}) and d.offered_rate == pytest.approx({1: 6.0})
    # Without the processors' `retried` count (a processor before it, or the header off), the
    # same attempts read as 6/s turned away: 3x the requests that went unserved.
    b_old = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=60)})
    d = offered(feed([(100.0, a, ga), (110.0, b_old, gb)]), 110.0, CFG)
    assert d.turned_away_rate == pytest.approx({1: 6.0})


def test_a_retry_admitted_takes_its_first_attempt_back_in_either_source() -> None:
    # 10 s: P1 admitted 40, of them 15 retries whose first attempts (among the 20 turned away)
    # were counted: 45 requests came, 5 of them unserved. Envoy saw 60 attempts, 20 immediate
    # responses: no excess (the retries took nothing from what Floodgate turned away that Envoy
    # answered). Without the count, 60 requests and 20 turned away.
    a = FloodgateCounters(100.0, True, {1: ClassCounters()})
    b = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=20, retried_admitted=15)})
    ga, gb = GatewayCounters(100.0, True, 0, 0), GatewayCounters(110.0, True, 60, 20)
    for use_envoy in (True, False):
        d = offered(feed([(100.0, a, ga), (110.0, b, gb)]), 110.0, CFG.model_copy(update={"use_envoy": use_envoy}))
        assert d.source == ("floodgate+envoy" if use_envoy else "floodgate")
        assert d.turned_away_rate == pytest.approx({1: 0.5}) and d.offered_rate == pytest.approx({1: 4.5})
        assert d.admitted_rate == pytest.approx({1: 4.0}) and d.envoy_excess_rate == 0.0
    # At most what the class turned away in the window: retries admitted now of first attempts
    # counted in an earlier window leave it at 0 turned away, never below what was admitted.
    b2 = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=5, retried_admitted=15)})
    d = offered(feed([(100.0, a, ga), (110.0, b2, GatewayCounters(110.0, True, 45, 5))]), 110.0, CFG)
    assert d.turned_away_rate == pytest.approx({1: 0.0}) and d.offered_rate == pytest.approx({1: 4.0})
    b_old = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=20)})
    d = offered(feed([(100.0, a, ga), (110.0, b_old, gb)]), 110.0, CFG)
    assert d.turned_away_rate == pytest.approx({1: 2.0}) and d.offered_rate == pytest.approx({1: 6.0})

def test_floodgate_counters_never_claim_more_turned_away_than_envoy_answered() -> None:
    # The processors' Redis user can write the demand counters: a review wrote them and the
    # controller read the forged rates. Every request a processor turns away (but one whose
    # client left while queued) gets an immediate response through Envoy, so Floodgate's
    # turned-away rate is held to what Envoy answered, with room for the reads' misalignment.
    a = FloodgateCounters(100.0, True, {1: ClassCounters(), 2: ClassCounters()})
    forged = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=1000),
                                             2: ClassCounters(early_drop=1000, abandoned=10)})
    ga, gb = GatewayCounters(100.0, True, 0, 0), GatewayCounters(110.0, True, 100, 60)  # 6/s answered
    d = offered(feed([(100.0, a, ga), (110.0, forged, gb)]), 110.0, CFG)
    left = 1.0  # abandoned/s: no reply, not held to Envoy's count
    assert sum(d.turned_away_rate.values()) == pytest.approx(6 * 1.25 + 1.0 + left)
    assert d.unanswered_rate == pytest.approx(200 - 6 * 1.25 - 1.0)
    assert d.turned_away_rate[2] / d.turned_away_rate[1] == pytest.approx(101 / 100)  # split as claimed
    # Honest counters a little off Envoy's (read at another moment) are left alone.
    honest = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=65), 2: ClassCounters()})
    d = offered(feed([(100.0, a, ga), (110.0, honest, gb)]), 110.0, CFG)
    assert d.unanswered_rate == 0.0 and d.turned_away_rate[1] == pytest.approx(6.5)


def test_abandoned_is_held_to_the_arrivals_envoy_saw_unanswered() -> None:
    # `abandoned` (a client that left while queued) gets no immediate response, so the bound
    # above leaves it out; a review forged 20,000/s of it and the controller read it as offered
    # and turned-away demand. It is one of the arrivals Envoy counted that got no immediate
    # response, and not one of the admitted ones.
    a = FloodgateCounters(100.0, True, {1: ClassCounters(), 2: ClassCounters()})
    ga, gb = GatewayCounters(100.0, True, 0, 0), GatewayCounters(110.0, True, 100, 60)  # 10/s in, 6/s answered
    forged = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=40, early_drop=60, abandoned=150_000),
                                             2: ClassCounters(abandoned=50_000)})
    d = offered(feed([(100.0, a, ga), (110.0, forged, gb)]), 110.0, CFG)
    room = (10 - 6) * 1.25 + 1.0 - 4  # 2 abandoned/s at most
    assert sum(d.turned_away_rate.values()) == pytest.approx(6.0 + room)
    assert sum(d.offered_rate.values()) == pytest.approx(4.0 + 6.0 + room)
    assert d.turned_away_rate[2] == pytest.approx(room / 4)  # split as claimed (1 : 3)
    assert d.unanswered_rate == pytest.approx(20_000 - room)
    # Honest: 3/s left while queued out of 10/s arriving, 7/s admitted, none answered.
    honest = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=70, abandoned=30), 2: ClassCounters()})
    d = offered(feed([(100.0, a, ga), (110.0, honest, GatewayCounters(110.0, True, 100, 0))]), 110.0, CFG)
    assert d.turned_away_rate[1] == pytest.approx(3.0) and d.unanswered_rate == 0.0
    # A queue that drains across the window: 200 queued at its start, 50 arrivals, 80 admitted,
    # 100 left while queued, 70 still queued, no 429 (a review: the bound without the queue at
    # the start read the honest abandonment as forged).
    a_q = FloodgateCounters(100.0, True, {1: ClassCounters(), 2: ClassCounters()}, {1: 200.0})
    draining = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=80, abandoned=100), 2: ClassCounters()},
                                 {1: 70.0})
    d = offered(feed([(100.0, a_q, ga), (110.0, draining, GatewayCounters(110.0, True, 50, 0))]), 110.0, CFG)
    assert d.turned_away_rate[1] == pytest.approx(10.0) and d.unanswered_rate == 0.0
    assert d.offered_rate[1] == pytest.approx(5.0)  # 8 admitted + 10 left - 13 the queue shrank, per s
    # Without Envoy's counters there is nothing to hold them to (`demand.use_envoy: false`).
    d = offered(feed([(100.0, a, ga), (110.0, forged, gb)]), 110.0, CFG.model_copy(update={"use_envoy": False}))
    assert d.turned_away_rate[1] == pytest.approx(6.0 + 15_000)


def test_stale_and_missing_are_never_zero() -> None:
    a = fg(100.0, {1: (0, 0, 0, 0)})
    b = fg(110.0, {1: (10, 0, 90, 0)})
    w = feed([(100.0, a, None), (110.0, b, None)])
    assert not offered(w, 115.0, CFG).stale
    d = offered(w, 115.1, CFG)  # last read older than stale_after_s
    assert d.stale and d.source == "none" and lacking_concurrency(d, 50.0, CFG) == 0.0
    # One read is no rate.
    assert offered(feed([(100.0, a, None)]), 100.0, CFG).stale
    # Failed reads leave a gap, not zeros: the rate spans the gap.
    w = feed([(100.0, a, None), (105.0, fg(105.0, {}, ok=False), None), (110.0, b, None)])
    assert offered(w, 110.0, CFG).turned_away_rate == {1: pytest.approx(9.0)}


def test_window_slides_and_resets_restart_it() -> None:
    steps = []
    for i in range(31):  # 1 req/s turned away for 15 s, then 5/s
        t = 100.0 + i
        away = i if i <= 15 else 15 + 5 * (i - 15)
        steps.append((t, fg(t, {1: (10 * i, 0, away, 0)}), None))
    d = offered(feed(steps), 130.0, CFG)
    assert d.turned_away_rate[1] == pytest.approx(5.0)  # only the last 10 s count
    # Redis flushed (counters back to 0): no negative rates; the window restarts.
    w = feed([*steps, (131.0, fg(131.0, {1: (3, 0, 1, 0)}), None)])
    assert offered(w, 131.0, CFG).stale
    w = observe(w, 132.0, CFG, fg(132.0, {1: (6, 0, 3, 0)}))
    assert offered(w, 132.0, CFG).turned_away_rate[1] == pytest.approx(2.0)
    # Envoy restarted: same.
    g = feed([(100.0, None, GatewayCounters(100.0, True, 500, 100)), (101.0, None, GatewayCounters(101.0, True, 3, 1))])
    assert offered(g, 101.0, CFG).stale


def test_no_admitted_requests_means_no_service_time() -> None:
    a = fg(100.0, {1: (0, 0, 0, 0)})
    b = fg(110.0, {1: (0, 0, 50, 0)})
    d = offered(feed([(100.0, a, None), (110.0, b, None)]), 110.0, CFG)
    assert d.lacking_rate() == pytest.approx(5.0) and lacking_concurrency(d, 10.0, CFG) == 0.0
    assert lacking_concurrency(d, 10.0, CFG, service_s_hint=2.0) == pytest.approx(10.0)


def test_mean_running_is_over_the_rate_span() -> None:
    # Idle until 100, then 8 running from 102 on: over [98, 108] the trapezoid of the reads
    # (0 at 100, 8 at 102) is 8 (ramp) + 48 (flat) = 56 -> 5.6, the same dilution as the
    # admitted rate over that span; reads older than the window are pruned (one kept before it).
    w = DemandWindow()
    for t, r in ((90.0, 0.0), (96.0, 0.0), (100.0, 0.0), (102.0, 8.0), (105.0, 8.0), (108.0, 8.0)):
        w = observe_running(w, t, r, CFG)
    assert [r.taken_at for r in w.running] == [96.0, 100.0, 102.0, 105.0, 108.0]
    assert mean_running(w, 98.0, 108.0) == pytest.approx(5.6)
    assert mean_running(w, 102.0, 108.0) == pytest.approx(8.0)
    assert mean_running(w, 108.0, 108.0) is None and mean_running(DemandWindow(), 0.0, 1.0) is None


def test_scale_up_window_reads_a_step_in_turned_away_demand_sooner() -> None:
    """A step from 0 to 14 turned away per second (2 s per request: 28 concurrent lacking),
    counters read every 0.5 s. One second in, the 5 s rate window holds a fifth of the step
    (5.6 concurrent), the 2 s scale-up window half of it at its 1-sigma lower bound; two seconds
    in, the short window holds the whole step and the long one still two fifths."""
    cfg = DemandConfig(window_s=5.0, stale_after_s=5.0, up_window_s=2.0, up_sigma=1.0)
    w = DemandWindow()
    away = 0.0
    t = 100.0
    for i in range(20):  # 10 s before the step: admitted only
        t = 100.0 + 0.5 * i
        w = observe(w, t, cfg, fg(t, {1: (7.0 * (t - 100.0), 0, away, 0)}))
    start = t
    reads = {}
    for k in range(1, 5):
        t = start + 0.5 * k
        away = 14.0 * (t - start)
        w = observe(w, t, cfg, fg(t, {1: (7.0 * (t - 100.0), 0, away, 0)}))
        reads[t - start] = (lacking_concurrency(offered(w, t, cfg), 14.0, cfg), scale_up_lacking(w, t, cfg, 2.0))
    long1, short1 = reads[1.0]
    assert long1 == pytest.approx(14.0 / 5 * 2.0)
    assert short1 == pytest.approx((14.0 - math.sqrt(14.0)) / 2.0 * 2.0)
    long2, short2 = reads[2.0]
    assert long2 == pytest.approx(28.0 / 5 * 2.0)
    assert short2 == pytest.approx((28.0 - math.sqrt(28.0)) / 2.0 * 2.0) and short2 > 2 * long2
    # off, stale, or without a slot time: nothing
    assert scale_up_lacking(w, t, cfg.model_copy(update={"up_window_s": 0.0}), 2.0) == 0.0
    assert scale_up_lacking(w, t + 5.1, cfg, 2.0) == 0.0
    assert scale_up_lacking(w, t, cfg, None) == 0.0
    # excluded classes stay out, as in `lacking`
    assert scale_up_lacking(w, t, cfg.model_copy(update={"exclude_classes": (1,)}), 2.0) == 0.0


def test_recent_keeps_one_read_at_or_before_the_short_window() -> None:
    cfg = DemandConfig(window_s=5.0, stale_after_s=5.0)
    w = feed([(float(t), fg(float(t), {1: (float(t), 0, 0, 0)}), None) for t in range(100, 106)], cfg)
    assert [s.taken_at for s in recent(w, 105.0, 2.0).floodgate] == [103.0, 104.0, 105.0]
    assert [s.taken_at for s in recent(w, 105.0, 1.5).floodgate] == [103.0, 104.0, 105.0]
    assert [s.taken_at for s in recent(w, 105.0, 0.5).floodgate] == [104.0, 105.0]


def test_turned_away_demand_is_sized_with_the_averaged_slot_time_before_the_windows_ratio() -> None:
    """A full pool admits only as requests finish: with long requests a 5 s window holds a few
    admissions and its running / admitted ratio scatters. Read high, it multiplied every request
    turned away (the backtest's smooth-long day: 72 s where the slot time read 28 s, 9 -> 18
    replicas); the averaged slot time, where there is one, sizes the turned-away demand."""
    d = OfferedDemand(False, "floodgate", {1: 2.0}, {1: 1 / 3}, {1: 5 / 3})
    assert lacking_concurrency(d, 24.0, CFG) == pytest.approx(5 / 3 * 72.0)  # the window's ratio: 24 / (1/3)
    assert lacking_concurrency(d, 24.0, CFG, service_s_hint=30.0, slot_s=28.0) == pytest.approx(5 / 3 * 28.0)
    # Without a slot time, the window's ratio, then the last one measured.
    assert lacking_concurrency(d, 24.0, CFG, service_s_hint=30.0) == pytest.approx(5 / 3 * 72.0)
    none_admitted = OfferedDemand(False, "floodgate", {1: 2.0}, {1: 0.0}, {1: 2.0})
    assert lacking_concurrency(none_admitted, 24.0, CFG, service_s_hint=30.0) == pytest.approx(60.0)
    assert lacking_concurrency(none_admitted, 24.0, CFG, service_s_hint=30.0, slot_s=20.0) == pytest.approx(40.0)


def test_retries_admitted_are_read_as_the_counters_increase_not_their_total() -> None:
    """Mutation review: the counters are cumulative since the pool's first request. The retry
    test above starts them at 0, where the increase and the sum of the two reads agree; a pool
    that has run a while (300 retries admitted, 100 malformed requests refused and 50 clients
    gone while queued, all before the window) reads the same 10 s: 15 retries took back 15 of
    the 20 turned away, 0.5/s turned away, 4.5/s offered."""
    before = ClassCounters(admitted=1000, early_drop=500, retried_admitted=300, refused=100, abandoned=50)
    a = FloodgateCounters(100.0, True, {1: before})
    b = FloodgateCounters(110.0, True, {1: ClassCounters(admitted=1040, early_drop=520, retried_admitted=315,
                                                         refused=100, abandoned=50)})
    ga, gb = GatewayCounters(100.0, True, 5000, 2000), GatewayCounters(110.0, True, 5060, 2020)
    for use_envoy in (True, False):
        d = offered(feed([(100.0, a, ga), (110.0, b, gb)]), 110.0, CFG.model_copy(update={"use_envoy": use_envoy}))
        assert d.turned_away_rate == pytest.approx({1: 0.5}) and d.offered_rate == pytest.approx({1: 4.5})
