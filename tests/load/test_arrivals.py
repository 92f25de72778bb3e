"""Arrival shapes and trace replay, checked statistically with fixed seeds."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from floodgate.sim.arrivals import (
    DEFAULT_TRACE,
    LengthDist,
    Mix,
    PlannedRequest,
    arrival_times,
    burst_profile,
    constant_profile,
    load_trace,
    step_profile,
    synthetic_plan,
    trace_plan,
)

TRACE = DEFAULT_TRACE  # shipped with the package (floodgate/sim/data)
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"


def test_the_bundled_trace_is_the_published_one() -> None:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not present (the project's shared data directory)")
    a, b = load_trace(TRACE), load_trace(SHARED)
    assert np.array_equal(a.t, b.t) and np.array_equal(a.prompt_tokens, b.prompt_tokens) and \
        np.array_equal(a.output_tokens, b.output_tokens)


def counts(times: np.ndarray, t0: float, t1: float) -> int:
    return int(((times >= t0) & (times < t1)).sum())


def within(n: float, expected: float, sigmas: float = 5.0) -> bool:
    # Poisson counts: sd = sqrt(mean); 5 sigma keeps fixed-seed tests far from flaky.
    return abs(n - expected) <= sigmas * math.sqrt(expected)


def test_poisson_counts_mean_and_variance() -> None:
    times = arrival_times(constant_profile(50.0, 400.0), "poisson", seed=1)
    per_s = np.histogram(times, bins=np.arange(0, 401))[0]
    assert abs(per_s.mean() - 50) < 1.5
    # Index of dispersion of a Poisson process is 1 (a uniform process would give ~0).
    assert 0.85 < per_s.var() / per_s.mean() < 1.15
    gaps = np.diff(times)
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # exponential gaps: CV = 1
    assert np.all(np.diff(times) >= 0) and times.min() >= 0 and times.max() < 400


def test_uniform_is_evenly_spaced() -> None:
    times = arrival_times(constant_profile(10.0, 5.0), "uniform")
    assert len(times) == 50
    assert np.allclose(np.diff(times), 0.1)


def test_same_seed_same_plan() -> None:
    prof = burst_profile(10, 30, 10, 5, 4)
    assert synthetic_plan(prof, seed=7) == synthetic_plan(prof, seed=7)
    assert synthetic_plan(prof, seed=7) != synthetic_plan(prof, seed=8)


def test_step_phases_have_their_rates() -> None:
    prof = step_profile([(40, 5), (40, 50), (40, 10)])
    assert prof.duration == 120
    assert prof.rate_at(50) == 50 and prof.rate_at(119) == 10 and prof.rate_at(200) == 0
    times = arrival_times(prof, "poisson", seed=2)
    for (t0, t1), rate in (((0, 40), 5), ((40, 80), 50), ((80, 120), 10)):
        assert within(counts(times, t0, t1), rate * 40), (t0, t1)


def test_burst_multiplies_the_rate_inside_the_window() -> None:
    prof = burst_profile(base_rate=20, duration=90, burst_start=30, burst_duration=30, multiplier=5)
    assert prof.expected_count(30, 60) == 3000 and prof.expected_count() == 4200
    times = arrival_times(prof, "poisson", seed=3)
    assert within(counts(times, 30, 60), 3000)
    assert within(counts(times, 0, 30), 600) and within(counts(times, 60, 90), 600)
    uniform = arrival_times(prof, "uniform")
    assert counts(uniform, 30, 60) == 3000


def test_burst_window_must_fit() -> None:
    with pytest.raises(ValueError):
        burst_profile(10, 30, 20, 20, 2)


def test_mix_shares_and_lengths() -> None:
    mix = Mix(
        priority_shares=(0.2, 0.5, 0.3),
        tenants=(("a", 3.0), ("b", 1.0)),
        prompt=LengthDist(mean=400, sigma=0.5, max=100_000),
        output=LengthDist(mean=50, sigma=0, max=1000),
    )
    plan = synthetic_plan(constant_profile(200, 100), mix, seed=4)
    n = len(plan)
    prios = np.bincount([r.priority for r in plan], minlength=3) / n
    assert np.allclose(prios, [0.2, 0.5, 0.3], atol=0.02)
    assert abs(sum(r.tenant == "a" for r in plan) / n - 0.75) < 0.02
    assert abs(np.mean([r.prompt_tokens for r in plan]) / 400 - 1) < 0.05
    assert {r.output_tokens for r in plan} == {50}
    clipped = LengthDist(mean=1000, sigma=1.5, min=10, max=2000).sample(np.random.default_rng(0), 5000)
    assert clipped.min() >= 10 and clipped.max() <= 2000
    assert all(isinstance(r, PlannedRequest) for r in plan[:5])
    assert [r.t_offset for r in plan] == sorted(r.t_offset for r in plan)


needs_trace = pytest.mark.skipif(
    not TRACE.exists(), reason=f"trace replay tests need the Azure trace at {TRACE} (shared data dir absent)"
)


@needs_trace
def test_trace_loads() -> None:
    tr = load_trace(str(TRACE))
    assert 19_000 < len(tr) < 20_000
    assert 3000 < tr.span < 3700  # about one hour
    assert tr.t[0] == 0 and np.all(np.diff(tr.t) >= 0)
    assert tr.prompt_tokens.min() >= 1 and tr.output_tokens.min() >= 1


@needs_trace
def test_trace_speedup_compresses_time_and_keeps_requests() -> None:
    tr = load_trace(str(TRACE))
    plan = trace_plan(tr, speedup=10, seed=1)
    assert len(plan) == len(tr)
    assert plan[-1].t_offset == pytest.approx(tr.span / 10)
    # Same requests, same lengths: replay at scale 1 preserves the multiset of lengths.
    assert sorted(r.output_tokens for r in plan) == sorted(tr.output_tokens.tolist())
    mid = tr.t[len(tr) // 2] / 10
    assert plan[len(plan) // 2].t_offset == pytest.approx(mid)


@needs_trace
def test_trace_rate_scale_thins_and_duplicates() -> None:
    tr = load_trace(str(TRACE))
    n = len(tr)
    assert len(trace_plan(tr, speedup=10, rate_scale=2.0, seed=1)) == 2 * n
    half = len(trace_plan(tr, speedup=10, rate_scale=0.5, seed=1))
    assert within(half, n / 2)
    one_and_half = len(trace_plan(tr, speedup=10, rate_scale=1.5, seed=1))
    assert within(one_and_half, 1.5 * n)
    dup = trace_plan(tr, speedup=10, rate_scale=3.0, seed=1)
    # Copies are jittered, not stacked on the same instant.
    assert len({r.t_offset for r in dup}) > 0.99 * len(dup)
    assert all(0 <= r.t_offset <= tr.span / 10 + 1 for r in dup)


@needs_trace
def test_trace_window_and_length_clipping() -> None:
    tr = load_trace(str(TRACE))
    plan = trace_plan(tr, speedup=10, start=600, duration=30, max_output_tokens=100, seed=2)
    expected = int(((tr.t >= 600) & (tr.t < 900)).sum())
    assert len(plan) == expected
    assert all(0 <= r.t_offset < 30 for r in plan)
    assert max(r.output_tokens for r in plan) <= 100
    assert trace_plan(tr, start=10 * tr.span) == []
