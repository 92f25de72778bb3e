"""Every branch of the Vegas update (design §6) and of the sample window, with a fake clock."""

from __future__ import annotations

import math

import pytest
from floodgate.extproc.vegas import Sample, SampleWindow, VegasLimit, VegasState, log10_root

V = VegasLimit(min_limit=1, max_limit=1000, smoothing=1.0, probe_multiplier=30)


def base(limit: float = 100, noload: float = 0.1) -> VegasState:
    return VegasState(limit=limit, rtt_noload=noload, probe_count=0, probe_jitter=1.0)


@pytest.mark.parametrize(("limit", "lg"), [(1, 1), (9, 1), (10, 1), (99, 1), (100, 2), (999, 2), (1000, 3)])
def test_log10_root(limit: float, lg: int) -> None:
    assert log10_root(limit) == lg


def test_first_sample_sets_rtt_noload() -> None:
    s = V.update(VegasState(limit=10), Sample(rtt=0.2, inflight=10), rand=0.5)
    assert s.rtt_noload == 0.2 and s.limit == 10


def test_lower_rtt_becomes_new_noload_without_changing_limit() -> None:
    s = V.update(base(), Sample(rtt=0.05, inflight=100), rand=0.5)
    assert s.rtt_noload == 0.05 and s.limit == 100


def test_drop_decreases_by_lg() -> None:
    s = V.update(base(100), Sample(rtt=0.1, inflight=100, dropped=True), rand=0.5)
    assert s.limit == 98  # lg(100) = 2


def test_drop_only_window_without_rtt_still_decreases() -> None:
    s = V.update(base(50), Sample(rtt=0.0, inflight=50, dropped=True), rand=0.5)
    assert s.limit == 49


def test_app_limited_holds() -> None:
    s = V.update(base(100), Sample(rtt=0.5, inflight=49), rand=0.5)
    assert s.limit == 100


def test_no_queue_increases_by_beta() -> None:
    # rtt == noload => queue = 0 <= threshold => L += 6 lg
    s = V.update(base(100), Sample(rtt=0.1, inflight=100), rand=0.5)
    assert s.limit == 112


def test_small_queue_increases_by_lg() -> None:
    # L=100, lg=2: threshold 2 < queue < alpha 6; queue = ceil(100 * (1 - 0.1/rtt)) = 4
    rtt = 0.1 / (1 - 0.035)
    assert math.ceil(100 * (1 - 0.1 / rtt)) == 4
    s = V.update(base(100), Sample(rtt=rtt, inflight=100), rand=0.5)
    assert s.limit == 102


def test_queue_between_alpha_and_beta_holds() -> None:
    rtt = 0.1 / (1 - 0.085)  # queue = 9, alpha 6 <= 9 <= beta 12
    s = V.update(base(100), Sample(rtt=rtt, inflight=100), rand=0.5)
    assert s.limit == 100


def test_large_queue_decreases_by_lg() -> None:
    s = V.update(base(100), Sample(rtt=0.2, inflight=100), rand=0.5)  # queue = 50 > 12
    assert s.limit == 98


def test_clamped_to_bounds() -> None:
    tight = VegasLimit(min_limit=5, max_limit=20)
    assert tight.update(base(18, 0.1), Sample(rtt=0.1, inflight=18), 0.5).limit == 20
    assert tight.update(base(5, 0.1), Sample(rtt=1.0, inflight=5, dropped=True), 0.5).limit == 5


def test_smoothing_blends_old_and_new() -> None:
    smooth = VegasLimit(max_limit=1000, smoothing=0.5)
    s = smooth.update(base(100), Sample(rtt=0.1, inflight=100), 0.5)
    assert s.limit == pytest.approx(106)


def test_probe_resets_noload_with_jitter() -> None:
    # probe after probe_multiplier * L * jitter samples: 30 * 10 * 1.0 = 300
    s = VegasState(limit=10, rtt_noload=0.1, probe_count=299, probe_jitter=1.0)
    out = V.update(s, Sample(rtt=0.3, inflight=10), rand=0.25)
    assert out.rtt_noload == 0.3 and out.probe_count == 0 and out.probe_jitter == 0.625
    assert out.limit == 10


def test_probe_counts_samples() -> None:
    s = V.update(base(100), Sample(rtt=0.1, inflight=100), 0.5)
    assert s.probe_count == 1


def test_zero_rtt_without_drop_is_ignored() -> None:
    st = base()
    assert V.update(st, Sample(rtt=0.0, inflight=10), 0.5) == st


def test_initial_is_clamped() -> None:
    assert VegasLimit(min_limit=4, max_limit=8).initial(100).limit == 8


def test_window_needs_samples_and_time() -> None:
    w = SampleWindow(min_samples=3, min_duration=1.0, max_duration=10.0)
    assert not w.ready(0.0)
    for t in (0.0, 0.1, 0.2):
        w.add(t, 0.1, inflight=5)
    assert not w.ready(0.5)  # enough samples, too young
    assert w.ready(1.0)
    sample = w.take()
    assert sample == Sample(rtt=pytest.approx(0.1), inflight=5, dropped=False)
    assert not w.ready(100.0)  # a fresh window


def test_window_closes_after_max_duration_with_few_samples() -> None:
    w = SampleWindow(min_samples=10, min_duration=1.0, max_duration=5.0)
    w.add(0.0, 0.2, inflight=3)
    w.add(1.0, 0.4, inflight=7)
    assert not w.ready(4.9)
    assert w.ready(5.0)
    s = w.take()
    assert s is not None and s.rtt == pytest.approx(0.3) and s.inflight == 7


def test_window_records_drops() -> None:
    w = SampleWindow(min_samples=1, min_duration=0.0)
    w.add(0.0, None, inflight=2, dropped=True)
    assert w.ready(0.0)
    s = w.take()
    assert s is not None and s.dropped and s.rtt == 0.0


def test_empty_window_gives_nothing() -> None:
    assert SampleWindow().take() is None


def test_tolerance_treats_moderate_latency_growth_as_no_queue() -> None:
    tolerant = VegasLimit(max_limit=1000, tolerance=2.0)
    # rtt 1.8x noload: Netflix Vegas sees queue = ceil(100 * (1 - 1/1.8)) = 45 > beta -> decrease
    assert V.update(base(100), Sample(rtt=0.18, inflight=100), 0.5).limit == 98
    # with tolerance 2 it is no queue at all -> L += beta
    assert tolerant.update(base(100), Sample(rtt=0.18, inflight=100), 0.5).limit == 112


def test_tolerance_still_backs_off_when_latency_explodes() -> None:
    tolerant = VegasLimit(max_limit=1000, tolerance=2.0)
    # rtt 4x noload: queue = ceil(100 * (1 - 2/4)) = 50 > beta 12 -> decrease
    assert tolerant.update(base(100), Sample(rtt=0.4, inflight=100), 0.5).limit == 98
