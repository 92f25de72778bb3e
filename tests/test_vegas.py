"""Every branch of the Vegas update (design §6) and of the sample window, with a fake clock;
the `netflix` flavor against a transcription of Netflix's VegasLimit.java on identical
sequences; the `floodgate` flavor's fixes (baseline, drop share, truncated log10, jitter)."""

from __future__ import annotations

import functools
import math
import random
from dataclasses import replace

import pytest
from floodgate.extproc.config import LimitConfig, PoolConfig
from floodgate.extproc.limit import (
    FixedLimit,
    LatencyMeter,
    WindowedLimit,
    follow_endpoints,
    limit_for,
    sse_tokens,
)
from floodgate.extproc.vegas import Sample, SampleWindow, VegasLimit, VegasState, log10_root

V = VegasLimit(min_limit=1, max_limit=1000, smoothing=1.0, probe_multiplier=30)
N = VegasLimit(min_limit=1, max_limit=1000, probe_multiplier=30, flavor="netflix")


def base(limit: float = 100, noload: float = 0.1) -> VegasState:
    return VegasState(limit=limit, rtt_noload=noload, probe_count=0, probe_jitter=0.9, noload_inflight=1)


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


def test_a_large_queue_lowers_the_limit_in_proportion_to_its_excess() -> None:
    p = VegasLimit(max_limit=1000, decrease_gain=0.25)
    # queue = ceil(100 x (1 - 0.1 / 0.2)) = 50, beta = 12: down by 0.25 x 38 = 9.5, not lg = 2
    assert p.update(base(100), Sample(rtt=0.2, inflight=100), 0.5).limit == pytest.approx(90.5)
    # just above beta (queue 14): the proportional part is under lg, so lg as Netflix
    rtt = 0.1 / (1 - 0.135)
    assert p.update(base(100), Sample(rtt=rtt, inflight=100), 0.5).limit == 98
    # the other branches are Netflix's: no queue raises by beta, between alpha and beta holds
    assert p.update(base(100), Sample(rtt=0.1, inflight=100), 0.5).limit == 112
    assert p.update(base(100), Sample(rtt=0.1 / (1 - 0.085), inflight=100), 0.5).limit == 100
    # app-limited still holds, however large the queue
    assert p.update(base(100), Sample(rtt=0.5, inflight=40), 0.5).limit == 100
    # the Netflix flavor ignores the gain: lg per window
    assert replace(p, flavor="netflix").update(base(100), Sample(rtt=0.2, inflight=100), 0.5).limit == 98


def test_clamped_to_bounds() -> None:
    tight = VegasLimit(min_limit=5, max_limit=20)
    assert tight.update(base(18, 0.1), Sample(rtt=0.1, inflight=18), 0.5).limit == 20
    assert tight.update(base(5, 0.1), Sample(rtt=1.0, inflight=5, dropped=True), 0.5).limit == 5


def test_smoothing_blends_old_and_new() -> None:
    smooth = VegasLimit(max_limit=1000, smoothing=0.5)
    s = smooth.update(base(100), Sample(rtt=0.1, inflight=100), 0.5)
    assert s.limit == pytest.approx(106)


def test_netflix_probe_resets_noload_to_the_current_rtt() -> None:
    # probe after probe_multiplier * L * jitter samples: 30 * 10 * 0.9 = 270
    s = VegasState(limit=10, rtt_noload=0.1, probe_count=269, probe_jitter=0.9)
    out = N.update(s, Sample(rtt=0.3, inflight=10), rand=0.25)
    assert out.rtt_noload == 0.3 and out.probe_count == 0 and out.probe_jitter == 0.625
    assert out.limit == 10


def test_floodgate_probe_keeps_the_baseline_under_sustained_load() -> None:
    s = VegasState(limit=10, rtt_noload=0.1, probe_count=269, probe_jitter=0.9, noload_inflight=2)
    out = V.update(s, Sample(rtt=0.3, inflight=10), rand=0.25)  # saturated: not a low window
    assert out.rtt_noload == 0.1 and out.probe_count == 0 and out.probe_jitter == 0.625


def test_floodgate_probe_takes_the_lowest_rtt_seen_at_low_inflight() -> None:
    # the model got slower: windows at low in-flight (<= 2 x 2) show 0.15 at best
    st = VegasState(limit=10, rtt_noload=0.1, probe_count=0, probe_jitter=0.9, noload_inflight=2)
    for rtt, inflight in [(0.2, 3), (0.15, 4), (0.5, 10), (0.17, 2)]:
        st = V.update(st, Sample(rtt=rtt, inflight=inflight), 0.5)
    assert st.epoch_rtt == 0.15 and st.rtt_noload == 0.1
    st = V.update(replace(st, probe_count=269), Sample(rtt=0.4, inflight=10), 0.5)
    assert st.rtt_noload == 0.15 and st.noload_inflight == 4 and st.epoch_rtt == 0.0


def test_a_fresh_state_draws_its_probe_jitter() -> None:
    st = V.update(VegasState(limit=10), Sample(rtt=0.2, inflight=10), rand=0.5)
    assert st.probe_jitter == 0.75


def test_drops_weigh_by_their_share_of_the_window() -> None:
    # no queue: L would go 100 -> 112; a drop takes it to 98; 5 % drops: 0.95 * 112 + 0.05 * 98
    s = V.update(base(100), Sample(rtt=0.1, inflight=100, dropped=True, drop_share=0.05), 0.5)
    assert s.limit == pytest.approx(111.3)
    # Netflix: any drop in the window is a drop
    assert N.update(base(100), Sample(rtt=0.1, inflight=100, dropped=True, drop_share=0.05), 0.5).limit == 98


def test_log10_of_the_truncated_limit() -> None:
    # log10(99.99999999999999) rounds to 2.0 in floating point; Netflix takes log10(99) = 1
    assert log10_root(99.99999999999999) == 1
    assert log10_root(999.9999999999999) == 2


def test_slo_target_counts_latency_below_it_as_no_queue() -> None:
    slo = VegasLimit(max_limit=1000, tolerance=1.0, target=0.3)
    # rtt 2.5 x noload but under the target: no queue, L += beta
    assert slo.update(base(100), Sample(rtt=0.25, inflight=100), 0.5).limit == 112
    # above the target: queue = ceil(100 * (1 - 0.3 / 0.5)) = 40 > beta -> decrease
    assert slo.update(base(100), Sample(rtt=0.5, inflight=100), 0.5).limit == 98
    # a target below the no-load latency is unreachable: the tolerance applies instead
    low = VegasLimit(max_limit=1000, tolerance=3.0, target=0.05)
    assert low.update(base(100), Sample(rtt=0.25, inflight=100), 0.5).limit == 112


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
    assert sample == Sample(rtt=pytest.approx(0.1), inflight=5, dropped=False, drop_share=0.0)
    assert not w.ready(100.0)  # a fresh window


def test_window_counts_every_finished_request_but_needs_a_measured_one() -> None:
    # sample_rate 0.5: 10 finished requests, 5 with a latency, close a window of 10
    w = SampleWindow(min_samples=10, min_duration=0.0, max_duration=10.0)
    for i in range(9):
        w.add(0.0, 0.2 if i % 2 else None, inflight=8)
    assert not w.ready(0.0)
    w.add(0.0, None, inflight=8)
    assert w.ready(0.0)
    s = w.take()
    assert s is not None and s.rtt == pytest.approx(0.2)
    # unmeasured successes alone say nothing about latency: the window stays open
    for _ in range(20):
        w.add(1.0, None, inflight=8)
    assert not w.ready(1.0)


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
    assert s is not None and s.dropped and s.rtt == 0.0 and s.drop_share == 1.0


def test_window_drop_share_counts_unmeasured_successes() -> None:
    # 20 successes (half of them measured, as with sample_rate 0.5) and one 5xx: share 1/21
    w = SampleWindow(min_samples=5, min_duration=0.0)
    for i in range(20):
        w.add(0.0, 0.1 if i % 2 else None, inflight=5)
    w.add(0.0, None, inflight=5, dropped=True)
    s = w.take()
    assert s is not None and s.drop_share == pytest.approx(1 / 21) and s.rtt == pytest.approx(0.1)


def test_windowed_limit_records_outcomes_and_fixed_limit_ignores_them() -> None:
    wl = WindowedLimit(VegasLimit(), SampleWindow(min_samples=2, min_duration=0.0))
    assert wl.record(0.0, "success", 0.1, 4) is None
    sample = wl.record(0.1, "dropped", None, 4)
    assert sample is not None and sample.drop_share == 0.5
    assert wl.record(0.2, "ignored", None, 4) is None
    fixed = WindowedLimit(FixedLimit(96), SampleWindow(min_samples=1, min_duration=0.0))
    assert not fixed.adaptive and fixed.record(0.0, "success", 0.1, 4) is None
    assert fixed.update(VegasState(limit=50), Sample(0.1, 4), 0.5).limit == 96


def test_limit_for_reads_the_mode_once() -> None:
    assert isinstance(limit_for(PoolConfig(limit=LimitConfig(mode="static", initial=64))).delegate, FixedLimit)
    v = limit_for(PoolConfig()).delegate
    # shipped signal `combined`: 0.75 x (2 s x 1/4 of TTFT left after the queue + 31 x 0.1 s)
    assert isinstance(v, VegasLimit) and v.flavor == "floodgate" and v.target == pytest.approx(2.7)
    t = limit_for(PoolConfig(limit=LimitConfig(signal="tpot"))).delegate
    assert isinstance(t, VegasLimit) and t.target == pytest.approx(0.075)
    assert v.decrease_gain == LimitConfig().decrease_gain > 0
    n = limit_for(PoolConfig(limit=LimitConfig(flavor="netflix", rtt_tolerance=1.0))).delegate
    assert isinstance(n, VegasLimit) and n.target == 0.0 and n.decrease_gain == 0.0


def test_empty_window_gives_nothing() -> None:
    assert SampleWindow().take() is None


def test_tolerance_treats_moderate_latency_growth_as_no_queue() -> None:
    tolerant = VegasLimit(max_limit=1000, tolerance=2.0)
    V = N  # Netflix's formula, no tolerance
    # rtt 1.8x noload: Netflix Vegas sees queue = ceil(100 * (1 - 1/1.8)) = 45 > beta -> decrease
    assert V.update(base(100), Sample(rtt=0.18, inflight=100), 0.5).limit == 98
    # with tolerance 2 it is no queue at all -> L += beta
    assert tolerant.update(base(100), Sample(rtt=0.18, inflight=100), 0.5).limit == 112


def test_tolerance_still_backs_off_when_latency_explodes() -> None:
    tolerant = VegasLimit(max_limit=1000, tolerance=2.0)
    # rtt 4x noload: queue = ceil(100 * (1 - 2/4)) = 50 > beta 12 -> decrease
    assert tolerant.update(base(100), Sample(rtt=0.4, inflight=100), 0.5).limit == 98


class JavaVegasLimit:
    """VegasLimit.java (Netflix concurrency-limits, default builder), transcribed line by line:
    rtt in nanoseconds (long), estimatedLimit a double, Log10RootFunction with its lookup
    below 1000 and sqrt above, probe jitter from a supplied random stream."""

    def __init__(self, initial: int, max_limit: int, smoothing: float, probe_multiplier: int,
                 rand: random.Random) -> None:
        self.estimated = float(initial)
        self.rtt_noload = 0
        self.max_limit = max_limit
        self.smoothing = smoothing
        self.probe_multiplier = probe_multiplier
        self.probe_count = 0
        self.rand = rand
        self.probe_jitter = 0.5 + rand.random() * 0.5

    @staticmethod
    def log10(t: int) -> int:
        if t < 1000:
            return max(1, int(math.log10(t))) if t > 0 else 1
        return int(math.sqrt(t))

    def update(self, rtt: int, inflight: int, did_drop: bool) -> int:
        self.probe_count += 1
        if self.probe_jitter * self.probe_multiplier * self.estimated <= self.probe_count:
            self.probe_jitter = 0.5 + self.rand.random() * 0.5
            self.probe_count = 0
            self.rtt_noload = rtt
            return int(self.estimated)
        if self.rtt_noload == 0 or rtt < self.rtt_noload:
            self.rtt_noload = rtt
            return int(self.estimated)
        queue = math.ceil(self.estimated * (1 - self.rtt_noload / rtt))
        if did_drop:
            new = self.estimated - self.log10(int(self.estimated))
        elif inflight * 2 < self.estimated:
            return int(self.estimated)
        else:
            lim = int(self.estimated)
            alpha, beta, threshold = 3 * self.log10(lim), 6 * self.log10(lim), self.log10(lim)
            if queue <= threshold:
                new = self.estimated + beta
            elif queue < alpha:
                new = self.estimated + self.log10(int(self.estimated))
            elif queue > beta:
                new = self.estimated - self.log10(int(self.estimated))
            else:
                return int(self.estimated)
        new = max(1.0, min(float(self.max_limit), new))
        self.estimated = (1 - self.smoothing) * self.estimated + self.smoothing * new
        return int(self.estimated)


@pytest.mark.parametrize("seed", range(12))
def test_netflix_flavor_equals_the_java_transcription(seed: int) -> None:
    rng = random.Random(seed)
    smoothing = rng.choice([1.0, 0.5, 0.2])
    initial = rng.choice([20, 100, 990])
    # Identical random streams for the probe jitter on both sides.
    java = JavaVegasLimit(initial, 1000, smoothing, 30, random.Random(seed + 1))
    py = VegasLimit(min_limit=1, max_limit=1000, smoothing=smoothing, probe_multiplier=30, tolerance=1.0,
                    flavor="netflix")
    jitters = random.Random(seed + 1)
    state = VegasState(limit=float(initial), probe_jitter=0.5 + jitters.random() * 0.5)
    base_ns = rng.randint(5_000_000, 50_000_000)
    for step in range(20_000):
        load = 1 + abs(math.sin(step / 500)) * rng.uniform(0, 3)
        rtt = int(base_ns * load * rng.uniform(0.9, 1.1))
        inflight = int(java.estimated * rng.uniform(0.3, 1.1))
        drop = rng.random() < 0.02
        before = state.probe_count
        expected = java.update(rtt, inflight, drop)
        state = py.update(state, Sample(rtt=float(rtt), inflight=inflight, dropped=drop),
                          jitters.random() if before + 1 >= state.probe_jitter * 30 * state.limit else 0.0)
        assert int(state.limit) == expected and state.limit == java.estimated, step
        assert state.rtt_noload == java.rtt_noload and state.probe_count == java.probe_count


# --- limit.follow_endpoints: the pool-wide limit follows the active endpoint count


def test_new_endpoints_get_their_share_of_the_limit_at_once() -> None:
    st = VegasState(limit=24.0, rtt_noload=0.5, endpoints=3)
    grown = follow_endpoints(st, 10, 1, 512)
    assert grown.limit == pytest.approx(80.0) and grown.endpoints == 10
    assert (grown.rtt_noload, grown.probe_count) == (st.rtt_noload, st.probe_count)  # only the limit moves
    # Vegas alone grows by beta = 6 per window below 100: the same capacity takes 10 windows.
    v, s, windows = VegasLimit(tolerance=3.0), st, 0
    while s.limit < 80:
        s = v.update(s, Sample(rtt=0.5, inflight=int(s.limit)), 0.5)
        windows += 1
    assert windows >= 9


def test_drained_endpoints_take_their_share_away() -> None:
    st = VegasState(limit=40.0, endpoints=4)
    assert follow_endpoints(st, 3, 1, 512).limit == pytest.approx(30.0)
    assert follow_endpoints(st, 1, 16, 512).limit == 16.0  # clamped to [min, max]
    assert follow_endpoints(st, 40, 1, 100).limit == 100.0


def test_follow_endpoints_is_idempotent_and_records_the_first_count() -> None:
    fresh = VegasState(limit=16.0)
    first = follow_endpoints(fresh, 2, 1, 512)
    assert first == replace(fresh, endpoints=2)  # nothing to scale from: only recorded
    assert follow_endpoints(first, 2, 1, 512) is first  # every processor may apply it; one change
    assert follow_endpoints(first, 0, 1, 512) is first  # no endpoints: nothing to size for
    # Round trip 2 -> 5 -> 2 returns to the same limit.
    assert follow_endpoints(follow_endpoints(first, 5, 1, 512), 2, 1, 512).limit == pytest.approx(16.0)


def test_vegas_updates_keep_the_endpoint_count() -> None:
    st = VegasState(limit=24.0, rtt_noload=0.5, probe_jitter=0.9, endpoints=3)
    after = VegasLimit(tolerance=3.0).update(st, Sample(rtt=0.5, inflight=24), 0.5)
    assert after.limit > st.limit and after.endpoints == 3


# --- WindowedLimit(fresh_only): once per round trip, on requests admitted under the current limit


def _windowed(fresh_only: bool = True) -> WindowedLimit:
    return WindowedLimit(VegasLimit(tolerance=3.0), SampleWindow(10, 1.0, 10.0), fresh_only=fresh_only)


def test_requests_admitted_before_a_limit_change_may_lower_but_not_raise_it() -> None:
    lim, st = _windowed(), VegasState(limit=30.0, rtt_noload=0.5, probe_jitter=0.9)
    lim.limit_changed(2.0)
    old = [lim.record(2.0 + 0.12 * i, "success", 0.5, 30, admitted_at=1.9 if i == 0 else 2.1) for i in range(10)]
    assert old[9] is not None and not old[9].fresh  # one request of the window predates the change
    assert lim.update(st, old[9], 0.5).limit == 30.0  # latency fine, but not about this limit: hold
    slow = Sample(rtt=5.0, inflight=30, fresh=False)
    assert lim.update(st, slow, 0.5).limit == 29.0  # a queue is evidence whatever the limit was
    new = [lim.record(4.0 + 0.12 * i, "success", 0.5, 30, admitted_at=2.5) for i in range(10)]
    assert new[9] is not None and new[9].fresh
    assert lim.update(st, new[9], 0.5).limit == 36.0  # fresh: + beta


def test_a_burst_cannot_raise_the_limit_faster_than_its_requests_report() -> None:
    """Fake clock. Requests take 3 s from admission to their latency sample; latency looks
    fine for 10 s (the queue inside the engine builds, but what finishes was admitted
    before). Per-window Vegas adds beta every second; once per round trip adds it about
    every 3 s."""

    def run(fresh_only: bool) -> float:
        lim, st = _windowed(fresh_only), VegasState(limit=30.0, rtt_noload=0.5, probe_jitter=0.9)
        t = 0.0
        while t < 10.0:
            t += 0.05
            s = lim.record(t, "success", 0.5, int(st.limit), admitted_at=t - 3.0)
            if s is not None:
                new = lim.update(st, s, 0.5)
                if int(new.limit) != int(st.limit):
                    lim.limit_changed(t)
                st = new
        return st.limit

    assert run(False) >= 30 + 6 * 9
    assert run(True) <= 30 + 6 * 3


def test_netflix_flavor_and_static_limits_keep_every_window() -> None:
    assert not limit_for(PoolConfig(limit=LimitConfig(flavor="netflix"))).fresh_only
    assert not limit_for(PoolConfig(limit=LimitConfig(mode="static"))).fresh_only
    assert not limit_for(PoolConfig()).fresh_only  # opt-in: it slows the climb out of `initial`
    assert limit_for(PoolConfig(limit=LimitConfig(rise_once_per_rtt=True))).fresh_only
    assert not limit_for(PoolConfig(limit=LimitConfig(rise_once_per_rtt=True, flavor="netflix"))).fresh_only
    lim = _windowed(False)
    lim.limit_changed(5.0)
    got = [lim.record(6.0 + 0.12 * i, "success", 0.5, 20, admitted_at=0.0) for i in range(10)]
    assert got[9] is not None and got[9].fresh


def _sse(*tokens: str, usage: bool = False) -> bytes:
    out = b"".join(b'data: {"choices":[{"index":0,"text":"%s"}]}\n\n' % t.encode() for t in tokens)
    if usage:
        out += b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    return out


def test_sse_tokens_counts_token_events_only() -> None:
    assert sse_tokens(_sse("a")) == 1
    assert sse_tokens(_sse("a", "b", "c")) == 3  # one chunk may carry several tokens
    assert sse_tokens(_sse("z", usage=True)) == 1  # the usage event and [DONE] are not tokens
    assert sse_tokens(b"data: [DONE]\n\n") == 0


def test_a_short_answer_in_one_chunk_has_no_tpot() -> None:
    """Two tokens that reach the processor in one chunk: TTFT is measured, TPOT is not (it read 0
    before, and the `combined` signal then was the TTFT alone: a 2-token answer at 0.2 s in a
    window of 3.4 s ones)."""
    m = LatencyMeter(admitted_at=10.0)
    m.chunk(10.2, _sse("a", "b", usage=True))
    lat = m.latency()
    assert lat is not None and lat.ttft == pytest.approx(0.2) and lat.tpot is None
    assert lat.signal("combined") is None and lat.signal("ttft") == pytest.approx(0.2)


def test_latency_counts_from_the_body_end_not_from_admission() -> None:
    """A client that takes 2 s to send its body: the server starts at the body's end, so TTFT
    (and a whole response's time) count from there (they read the upload too before). A body
    end seen after the response began, or before admission, moves nothing."""
    m = LatencyMeter(admitted_at=1.0)
    m.uploaded(3.0)
    m.chunk(3.1, _sse("a"))
    m.chunk(3.3, _sse("b"))
    lat = m.latency()
    assert lat is not None and lat.ttft == pytest.approx(0.1) and lat.tpot == pytest.approx(0.2)
    w = LatencyMeter(admitted_at=1.0)
    w.uploaded(3.0)
    w.chunk(4.6, _whole(64))
    lat = w.latency()
    assert lat is not None and lat.whole == pytest.approx(1.6)
    late = LatencyMeter(admitted_at=1.0)
    late.chunk(1.5, _sse("a"))
    late.uploaded(2.0)  # (a server that answered before reading the body)
    lat = late.latency()
    assert lat is not None and lat.ttft == pytest.approx(0.5)
    early = LatencyMeter(admitted_at=1.0)
    early.uploaded(0.5)
    early.chunk(1.2, _sse("a"))
    lat = early.latency()
    assert lat is not None and lat.ttft == pytest.approx(0.2)


def test_tpot_counts_the_tokens_after_the_first_chunk() -> None:
    m = LatencyMeter(admitted_at=0.0)
    m.chunk(0.5, _sse("a", "b"))  # first chunk: two tokens (one engine step wrote both)
    m.chunk(0.6, _sse("c"))
    m.chunk(0.8, _sse("d", "e"))  # two more joined
    lat = m.latency()
    # 3 tokens in 0.3 s after the first chunk: 0.1 s each (dividing by 4 tokens read 0.075)
    assert lat is not None and lat.ttft == 0.5 and lat.tpot == pytest.approx(0.1)



def test_n_choices_give_no_latency_sample() -> None:
    """`n: 4` streams 4 events per engine step and counts 4 choices' tokens in `usage`: read as
    tokens, any client's `n: 64` showed a time per token 64x too short, dragging the pool's
    no-load latency and the shared limit down (an attacker review); divided by the choices,
    choices that stop at different lengths read it up to 5x too long (a review of that fix).
    A response with several choices is no latency sample; one choice is measured as before
    (a tool call's own `index` is not a choice)."""
    def ev(i: int, t: str) -> bytes:
        return b'data: {"id":"x","choices":[{"index":%d,"text":"%s","logprobs":null}]}\n\n' % (i, t.encode())

    def chat(i: int) -> bytes:
        return (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":%d,"delta":'
                b'{"tool_calls":[{"index":3,"function":{"arguments":"{}"}}]},"finish_reason":null}]}\n\n' % i)

    for make in (lambda i: ev(i, "a"), chat):
        for n in (1, 4, 64):
            m = LatencyMeter(admitted_at=0.0)
            m.chunk(0.5, b"".join(make(i) for i in range(n)))
            for k in range(1, 5):  # 4 more steps, 0.1 s apart
                m.chunk(0.5 + 0.1 * k, b"".join(make(i) for i in range(n)))
            lat = m.latency()
            if n == 1:
                assert lat is not None and lat.tpot == pytest.approx(0.1), (n, lat)
            else:
                assert lat is None, (n, lat)
    import json
    for choices in (1, 4):
        body = json.dumps({"choices": [{"index": i, "text": "x"} for i in range(choices)],
                           "usage": {"completion_tokens": choices * 40}}).encode()
        m = LatencyMeter(admitted_at=0.0)
        m.chunk(2.0, body)
        lat = m.latency()
        assert (lat is None) == (choices > 1) and (lat is None or lat.tokens == 40), (choices, lat)


def _whole(tokens: int, text: str = "hello") -> bytes:
    """A non-streamed completion as vLLM writes it: usage after the choices."""
    import json

    return json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text}],
                       "usage": {"prompt_tokens": 7, "total_tokens": 7 + tokens, "completion_tokens": tokens,
                                 "prompt_tokens_details": None}, "kv_transfer_params": None}).encode()


def test_a_whole_json_response_is_measured_per_token() -> None:
    """A non-streamed response (one JSON body): no first token to time, so its time per token
    (admission to the body's end over `usage.completion_tokens`) stands in for TPOT, 32 of them
    for the `combined` signal. Before, it gave no sample at all: a pool whose clients never
    stream never moved its Vegas limit."""
    body = _whole(64, text="x" * 5000)  # usage beyond the first chunk, in the tail
    m = LatencyMeter(admitted_at=1.0)
    m.chunk(3.0, body[:4000])
    m.chunk(4.2, body[4000:])
    lat = m.latency()
    assert lat is not None and lat.ttft is None and lat.tpot is None
    assert lat.whole == pytest.approx(3.2) and lat.tokens == 64
    assert lat.signal("tpot") == pytest.approx(3.2 / 64)
    assert lat.signal("combined") == pytest.approx(32 * 3.2 / 64)
    assert lat.signal("ttft") is None  # no first token was timed


def test_a_short_whole_response_gives_no_combined_sample() -> None:
    # 4 tokens in 0.5 s is mostly TTFT: 32 x 0.125 s would read as congestion
    m = LatencyMeter(admitted_at=0.0)
    m.chunk(0.5, _whole(4))
    lat = m.latency()
    assert lat is not None and lat.signal("combined") is None and lat.signal("tpot") is None


@pytest.mark.parametrize("body", [b'{"error": {"message": "bad", "type": "invalid_request_error"}}',
                                  b'{"usage": {"completion_tokens": "many"}}', b"{not json"])
def test_a_whole_response_without_a_token_count_is_not_measured(body: bytes) -> None:
    m = LatencyMeter(admitted_at=0.0)
    m.chunk(0.5, body)
    assert m.latency() is None


def test_an_sse_stream_is_not_taken_for_a_whole_response() -> None:
    m = LatencyMeter(admitted_at=0.0)
    m.chunk(0.1, b"\n")  # blank keep-alive bytes decide nothing
    m.chunk(0.3, _sse("a"))
    m.chunk(0.5, _sse("b", usage=True) + b'{"completion_tokens": 99}')
    lat = m.latency()
    assert lat is not None and lat.ttft == pytest.approx(0.3) and lat.tokens == 0


def _responses_event(kind: str, with_event_line: bool = True, **fields: object) -> bytes:
    """One Responses API SSE event as vLLM writes it: `event:` line, data with `type` last."""
    import json

    data = json.dumps({**fields, "sequence_number": 1, "type": kind}, separators=(",", ":"))
    return (f"event: {kind}\n" if with_event_line else "").encode() + f"data: {data}\n\n".encode()


@pytest.mark.parametrize("event_lines", [True, False])
def test_responses_api_streams_count_only_delta_events(event_lines: bool) -> None:
    """`/v1/responses` opens with `response.created` / `response.in_progress` (and output item and
    content part events) before any token: counted as tokens, the first of them read a TTFT of
    about 0 and fed Vegas a fast sample for every such request."""
    ev = functools.partial(_responses_event, with_event_line=event_lines)
    opening = (ev("response.created", response={"id": "r", "status": "in_progress", "output": []})
               + ev("response.in_progress", response={"id": "r"})
               + ev("response.output_item.added", item={"type": "message"})
               + ev("response.content_part.added", part={"type": "output_text", "text": ""}))
    assert sse_tokens(opening) == 0
    assert sse_tokens(ev("response.output_text.delta", delta="Hi") + ev("response.output_text.delta", delta="!")) == 2
    assert sse_tokens(ev("response.reasoning_text.delta", delta="hmm")) == 1
    closing = ev("response.output_text.done", text="Hi!") + ev("response.completed", response={"id": "r"})
    assert sse_tokens(closing) == 0
    m = LatencyMeter(admitted_at=0.0)
    m.chunk(0.01, opening)  # at once: no token yet
    m.chunk(0.40, ev("response.output_text.delta", delta="Hi"))
    m.chunk(0.50, ev("response.output_text.delta", delta="!") + closing)
    lat = m.latency()
    assert lat is not None and lat.ttft == pytest.approx(0.40) and lat.tpot == pytest.approx(0.10)


def test_a_whole_responses_api_reply_counts_its_output_tokens() -> None:
    import json

    body = json.dumps({"id": "r", "object": "response", "output": [{"type": "message", "content": []}],
                       "usage": {"input_tokens": 9, "output_tokens": 40, "total_tokens": 49}}).encode()
    m = LatencyMeter(admitted_at=0.0)
    m.chunk(2.0, body)
    lat = m.latency()
    assert lat is not None and lat.tokens == 40 and lat.signal("tpot") == pytest.approx(2.0 / 40)


def test_floodgate_probe_counts_windows_up_to_twice_the_noload_inflight_as_low() -> None:
    """Mutation review: a window is "at low in-flight" up to max(4, 2 × the in-flight the no-load
    latency was seen at). The probe test above has a no-load in-flight of 2, where max and min
    of (4, 4) agree; at 10, a window at 16 in flight is low, and a probe with no earlier low
    window re-learns a slower model's latency from its own sample (0.1 -> 0.15)."""
    st = VegasState(limit=100, rtt_noload=0.1, probe_count=2699, probe_jitter=0.9, noload_inflight=10)
    out = V.update(st, Sample(rtt=0.15, inflight=16), rand=0.5)  # the probe: 0.9 × 30 × 100 = 2700
    assert out.probe_count == 0
    assert out.rtt_noload == 0.15 and out.noload_inflight == 16
    # above twice the no-load in-flight: loaded latency, the baseline stays
    out = V.update(st, Sample(rtt=0.15, inflight=21), rand=0.5)
    assert out.rtt_noload == 0.1


def test_netflix_flavor_steps_by_the_square_root_from_a_limit_of_1000() -> None:
    """Mutation review: Netflix's Log10RootFunction is a log10 lookup below 1000 and sqrt from
    1000 on; the drop step at a limit of 1000 is 31, at 999 it is 2 (only the floodgate
    flavor's log10_root was tested at the boundary)."""
    drop = Sample(rtt=0.0, inflight=0, dropped=True)
    assert N.update(VegasState(limit=1000, rtt_noload=0.1), drop, 0.5).limit == 1000 - 31
    assert N.update(VegasState(limit=999, rtt_noload=0.1), drop, 0.5).limit == 999 - 2


def test_a_window_after_a_take_starts_with_no_successes() -> None:
    """Mutation review: `take` resets the window; a next window holding only a drop is all drops
    (share 1, Vegas's full decrease), not half (a success carried over from the reset)."""
    w = SampleWindow(min_samples=1, min_duration=0.0, max_duration=10.0)
    w.add(0.0, 0.2, 5)
    assert w.take() is not None
    w.add(1.0, None, 5, dropped=True)
    s = w.take()
    assert s is not None and s.dropped and s.drops == 1.0
