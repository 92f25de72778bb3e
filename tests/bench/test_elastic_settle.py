"""When rejections stop after a burst (`bench/elastic.py` `rejection_settle`): the moment itself,
not rounded to a 2 s bin edge, so a verdict against a bound is not off by up to a bin."""

from __future__ import annotations

from floodgate.bench.elastic import rejection_settle
from floodgate.sim.loadgen import OK, REJECTED, Record


def _recs(spec: list[tuple[float, str]]) -> list[Record]:
    return [Record(id=i, t_planned=t, priority=2, tenant="t", prompt_tokens=1, output_tokens=1, outcome=o)
            for i, (t, o) in enumerate(spec)]


def _steady(t0: float, t1: float, rate: float) -> list[tuple[float, str]]:
    n = int((t1 - t0) * rate)
    return [(t0 + i / rate, OK) for i in range(n)]


def test_no_rejection_settles_at_once() -> None:
    assert rejection_settle(_recs(_steady(60, 100, 20)), 60, 100) == 0.0


def test_the_last_rejection_that_kept_the_rate_up_is_the_moment() -> None:
    # 20/s served, rejections at 61.0 ... 76.3 s: the last at 76.3 s is 16.3 s after the start.
    # A 2 s bin rounds it up to 18 s; the bound 16.2 s is missed either way, by 0.1 s here.
    spec = _steady(60, 100, 20) + [(61.0 + 0.5 * i, REJECTED) for i in range(31)] + [(76.3, REJECTED)]
    got = rejection_settle(_recs(spec), 60, 100)
    assert got is not None and abs(got - 16.3) < 1e-9


def test_a_trickle_below_the_rate_does_not_count() -> None:
    # 200/s served, a clump of 5 rejections at 61 s (5 of ~205: 2.4 %), then one every 1.5 s
    # after 70 s: 1 of ~400 in any 2 s (0.25 %).
    spec = _steady(60, 100, 200) + [(61.0, REJECTED)] * 5 + [(70 + 1.5 * i, REJECTED) for i in range(15)]
    got = rejection_settle(_recs(spec), 60, 100)
    assert got is not None and abs(got - 1.0) < 1e-9


def test_still_rejecting_at_the_end_is_never() -> None:
    spec = [*_steady(60, 100, 20), (98.5, REJECTED)]
    assert rejection_settle(_recs(spec), 60, 100) is None


def test_rejections_before_the_burst_are_not_its_own() -> None:
    # A rejection at 59.5 s still weighs in the trailing window of the burst's first ones,
    # but is not itself a moment of the burst.
    spec = [*_steady(55, 100, 20), (59.5, REJECTED)]
    assert rejection_settle(_recs(spec), 60, 100) == 0.0


def test_slo_settle_counts_a_late_answer_as_a_miss_where_rejections_see_none() -> None:
    """A pool that queues a burst instead of turning it away has no rejection to settle, but its
    SLO has (a review: scaling only read 0.0 s on rejections, 18 s on the SLO)."""
    from types import SimpleNamespace

    from floodgate.bench.elastic import slo_settle

    slow = {61.0 + 0.5 * i for i in range(30)}  # served, late: 61.0 ... 75.5 s
    spec = sorted([*_steady(60, 100, 20), *((t, OK) for t in slow)])
    recs = _recs(spec)
    late = {r.id for r in recs if r.t_planned in slow}
    met = SimpleNamespace(met=lambda r: r.id not in late)
    assert rejection_settle(recs, 60, 100) == 0.0
    got = slo_settle(recs, 60, 100, met)
    assert got is not None and abs(got - 15.5) < 1e-9
    assert slo_settle(recs, 60, 100, SimpleNamespace(met=lambda r: True)) == 0.0


def test_a_later_detection_does_not_move_the_deadline() -> None:
    """The deadlines count the controller's detection only up to two ticks (a review: with the
    measured detection as the allowance, a slower detector scored better)."""
    from floodgate.bench.elastic import DETECTION_ALLOWANCE_S, TICK_S, allowed_detection

    assert DETECTION_ALLOWANCE_S == 2 * TICK_S
    assert allowed_detection(0.3) == 0.3
    assert allowed_detection(5.0) == allowed_detection(None) == DETECTION_ALLOWANCE_S
