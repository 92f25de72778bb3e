"""The processor's event-loop probes (extproc/loopwatch.py) and the reject benchmark's histogram
arithmetic, on fake clocks: no wall-clock assertions."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest
from floodgate.bench.reject_latency import histogram_delta, quantile
from floodgate.extproc.loopwatch import GcPauses, LoopLagProbe, tune_runtime
from floodgate.extproc.metrics import Metrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_loop_lag_probe_records_how_late_each_wake_up_was() -> None:
    clock = FakeClock()
    late = iter([0.0, 0.004, 0.030, 0.0])
    seen: list[float] = []

    async def sleep(s: float) -> None:  # the loop wakes the probe `s` plus some lateness later
        clock.now += s + next(late)

    asyncio.run(LoopLagProbe(seen.append, 0.05, clock=clock, sleep=sleep).run(rounds=4))
    assert seen == pytest.approx([0.0, 0.004, 0.030, 0.0])


def test_loop_lag_is_never_negative() -> None:
    clock = FakeClock()
    seen: list[float] = []

    async def early(s: float) -> None:  # a coarse timer may fire a hair early
        clock.now += s - 0.001

    asyncio.run(LoopLagProbe(seen.append, 0.05, clock=clock, sleep=early).run(rounds=2))
    assert seen == [0.0, 0.0]


def test_loop_lag_probe_rejects_a_useless_interval() -> None:
    with pytest.raises(ValueError):
        LoopLagProbe(lambda _s: None, 0)


def test_gc_pauses_times_each_collection_by_generation() -> None:
    clock = FakeClock()
    seen: list[tuple[int, float]] = []
    hook = GcPauses(lambda gen, s: seen.append((gen, s)), clock=clock)
    hook("start", {"generation": 2})
    clock.now += 0.042
    hook("stop", {"generation": 2, "collected": 10, "uncollectable": 0})
    hook("stop", {"generation": 0})  # a stop without a start (installed mid-collection): ignored
    assert seen == [(2, pytest.approx(0.042))]


def test_gc_pauses_sees_real_collections_once_installed() -> None:
    seen: list[tuple[int, float]] = []
    hook = GcPauses(lambda gen, s: seen.append((gen, s)))
    hook.install()
    hook.install()  # idempotent: one hook, one observation per collection
    try:
        gc.collect(1)
    finally:
        hook.uninstall()
    assert [gen for gen, _ in seen] == [1]
    assert seen[0][1] >= 0
    gc.collect(1)
    assert len(seen) == 1  # uninstalled


def test_tune_runtime_applies_and_freezes() -> None:
    thresholds, interval = gc.get_threshold(), sys.getswitchinterval()
    try:
        tune_runtime(gc_freeze=True, gc_threshold=(5000, 20, 30), switch_interval_s=0.002)
        assert gc.get_threshold() == (5000, 20, 30)
        assert sys.getswitchinterval() == pytest.approx(0.002)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        sys.setswitchinterval(interval)


def test_tune_runtime_leaves_the_interpreter_alone_by_default() -> None:
    thresholds, interval, frozen = gc.get_threshold(), sys.getswitchinterval(), gc.get_freeze_count()
    tune_runtime(gc_freeze=False, gc_threshold=None, switch_interval_s=None)
    assert (gc.get_threshold(), sys.getswitchinterval(), gc.get_freeze_count()) == (thresholds, interval, frozen)


def test_metrics_expose_the_probes() -> None:
    m = Metrics()
    m.loop_lag.observe(0.003)
    m.gc_pause.labels("2").observe(0.04)
    assert m.registry.get_sample_value("floodgate_event_loop_lag_seconds_count") == 1
    assert m.registry.get_sample_value("floodgate_event_loop_lag_seconds_bucket", {"le": "0.005"}) == 1
    assert m.registry.get_sample_value("floodgate_event_loop_lag_seconds_bucket", {"le": "0.002"}) == 0
    assert m.registry.get_sample_value("floodgate_gc_pause_seconds_count", {"generation": "2"}) == 1


def test_histogram_delta_and_quantile() -> None:
    name = "h"
    key = [(name + "_bucket", (("le", le), ("p", "2"))) for le in ("0.001", "0.01", "+Inf")]
    before = {key[0]: 1.0, key[1]: 1.0, key[2]: 1.0}
    after = {key[0]: 1.0, key[1]: 101.0, key[2]: 101.0,
             (name + "_bucket", (("le", "+Inf"), ("p", "1"))): 50.0}  # another series, filtered out
    d = histogram_delta(before, after, name, {"p": "2"})
    assert d == [(0.001, 0.0), (0.01, 100.0), (float("inf"), 100.0)]
    assert quantile(d, 0.5) == pytest.approx(0.001 + 0.009 * 0.5)
    assert quantile(d, 0.99) == pytest.approx(0.001 + 0.009 * 0.99)
    assert quantile([(0.01, 0.0), (float("inf"), 0.0)], 0.99) is None
    assert quantile([(0.01, 1.0), (float("inf"), 3.0)], 0.99) == 0.01  # beyond the last bound
