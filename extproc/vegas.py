"""The Vegas concurrency limit, with Netflix concurrency-limits semantics (pure).

`VegasLimit.update(state, sample, rand)` maps the shared state and one aggregated window
sample to the next state. It does no I/O and reads no clock, so the same function runs
against the state held in Redis (read, update, compare-and-set) and in the local fallback.

Per sample (design §6): queue = ceil(L * (1 - tolerance * rtt_noload / rtt)) (tolerance 1 is
Netflix's formula; see `tolerance`); lg = max(1, floor(log10 L));
alpha = 3 lg, beta = 6 lg, threshold = lg. Drop: L -= lg. App-limited (inflight * 2 < L): no
change. queue <= threshold: L += beta; queue < alpha: L += lg; queue > beta: L -= lg. Clamp to
[min, max], then smooth. rtt_noload is a running minimum, reset to the current rtt every
jitter(0.5..1) * probe_multiplier * L samples so it can follow a slower model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class VegasState:
    limit: float
    rtt_noload: float = 0.0  # 0 = not measured yet
    probe_count: int = 0
    probe_jitter: float = 1.0  # in [0.5, 1)


@dataclass(frozen=True)
class Sample:
    """One window's aggregate: mean rtt (seconds), peak in-flight seen, any drop in it."""

    rtt: float
    inflight: int
    dropped: bool = False


def log10_root(limit: float) -> int:
    return max(1, int(math.log10(max(1.0, limit))))


@dataclass(frozen=True)
class VegasLimit:
    min_limit: int = 1
    max_limit: int = 512
    smoothing: float = 1.0
    probe_multiplier: int = 30
    # Latency up to tolerance x rtt_noload counts as no queue. 1.0 is Netflix's Vegas; an LLM
    # engine's TTFT/TPOT grow with batch size long before anything queues, so Floodgate's
    # config defaults to 3.0 (see docs/benchmarks.md, Overload).
    tolerance: float = 1.0

    def initial(self, limit: int) -> VegasState:
        return VegasState(limit=float(max(self.min_limit, min(self.max_limit, limit))))

    def update(self, state: VegasState, sample: Sample, rand: float) -> VegasState:
        """`rand` in [0, 1) picks the next probe jitter (passed in to keep this pure)."""
        if sample.rtt <= 0:
            # A window of drops only (every sampled request failed): no latency to learn from.
            if sample.dropped:
                return replace(state, limit=self._next_limit(state.limit, state.rtt_noload, sample))
            return state
        probe_count = state.probe_count + 1
        if probe_count >= self.probe_multiplier * state.limit * state.probe_jitter:
            # Periodic probe: forget the minimum so a permanently slower model is re-learnt.
            return replace(state, rtt_noload=sample.rtt, probe_count=0, probe_jitter=0.5 + rand * 0.5)
        if state.rtt_noload == 0 or sample.rtt < state.rtt_noload:
            return replace(state, rtt_noload=sample.rtt, probe_count=probe_count)
        new_limit = self._next_limit(state.limit, state.rtt_noload, sample)
        return replace(state, limit=new_limit, probe_count=probe_count)

    def _next_limit(self, limit: float, rtt_noload: float, sample: Sample) -> float:
        lg = log10_root(limit)
        if sample.dropped:
            target = limit - lg
        elif sample.inflight * 2 < limit:
            return limit  # app-limited: the latency says nothing about the limit
        else:
            queue = max(0, math.ceil(limit * (1 - self.tolerance * rtt_noload / sample.rtt)))
            alpha, beta, threshold = 3 * lg, 6 * lg, lg
            if queue <= threshold:
                target = limit + beta
            elif queue < alpha:
                target = limit + lg
            elif queue > beta:
                target = limit - lg
            else:
                return limit
        target = max(float(self.min_limit), min(float(self.max_limit), target))
        return (1 - self.smoothing) * limit + self.smoothing * target


@dataclass
class SampleWindow:
    """Aggregates per-request measurements into one Vegas sample (Netflix WindowedLimit).

    A window closes when it has `min_samples` and is at least `min_duration` old, or when it
    is `max_duration` old with at least one sample (so a quiet pool still learns).
    """

    min_samples: int = 10
    min_duration: float = 1.0
    max_duration: float = 10.0
    started: float | None = None
    count: int = 0
    rtt_sum: float = 0.0
    max_inflight: int = 0
    dropped: bool = False
    drops: int = 0

    def add(self, now: float, rtt: float | None, inflight: int, dropped: bool = False) -> None:
        if self.started is None:
            self.started = now
        if dropped:
            self.dropped = True
            self.drops += 1
        elif rtt is not None and rtt > 0:
            self.count += 1
            self.rtt_sum += rtt
        self.max_inflight = max(self.max_inflight, inflight)

    def ready(self, now: float) -> bool:
        if self.started is None:
            return False
        age = now - self.started
        has_any = self.count > 0 or self.dropped
        return (self.count + self.drops >= self.min_samples and age >= self.min_duration) or (
            has_any and age >= self.max_duration)

    def take(self) -> Sample | None:
        """Close the window and return its sample (None if it holds nothing usable)."""
        sample: Sample | None = None
        if self.count or self.dropped:
            rtt = self.rtt_sum / self.count if self.count else 0.0
            sample = Sample(rtt=rtt, inflight=self.max_inflight, dropped=self.dropped)
        self.started, self.count, self.rtt_sum, self.max_inflight = None, 0, 0.0, 0
        self.dropped, self.drops = False, 0
        return sample
