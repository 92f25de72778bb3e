"""Concurrency limits (pure), in the shape of Netflix concurrency-limits.

A `Limit` maps the shared limiter state and one `Sample` to the next state; it does no I/O
and reads no clock, so the same function runs against the state held in Redis (read,
update, compare-and-set) and in the local fallback. `FixedLimit` holds a configured value;
`VegasLimit` (vegas.py) adapts to latency. `WindowedLimit` is the decorator that aggregates
per-request outcomes into window samples (Netflix `WindowedLimit`), and `limit_for` builds
the pool's limit from its configuration — the one place that reads `limit.mode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from floodgate.extproc.config import PoolConfig

Outcome = Literal["success", "dropped", "ignored"]


COMBINED_TOKENS = 32  # the `combined` signal: time to the 32nd token (TTFT + 31 x TPOT)


@dataclass(frozen=True)
class Latency:
    """What was measured of one request: time to first token after admission, and mean time
    per output token (None with fewer than two tokens)."""

    ttft: float
    tpot: float | None

    def signal(self, name: str) -> float | None:
        if name == "ttft":
            return self.ttft
        if self.tpot is None:
            return None
        return self.tpot if name == "tpot" else self.ttft + (COMBINED_TOKENS - 1) * self.tpot


@dataclass(frozen=True)
class LimitState:
    """The limiter state shared by every processor of a pool (stored in Redis)."""

    limit: float
    rtt_noload: float = 0.0  # 0 = not measured yet
    probe_count: int = 0
    probe_jitter: float = 1.0  # in [0.5, 1)
    noload_inflight: int = 0  # peak in-flight of the window that set rtt_noload
    epoch_rtt: float = 0.0  # lowest rtt since the last probe among low in-flight windows (0 = none)
    epoch_inflight: int = 0


@dataclass(frozen=True)
class Sample:
    """One window's aggregate: mean rtt (seconds, 0 = none measured), peak in-flight seen, and
    the share of its finished requests that were drops (upstream 5xx)."""

    rtt: float
    inflight: int
    dropped: bool = False
    drop_share: float = 0.0  # 0..1; a sample with `dropped` and no share counts as all drops

    @property
    def drops(self) -> float:
        if not self.dropped:
            return 0.0
        return self.drop_share if self.drop_share > 0 else 1.0


class Limit(Protocol):
    @property
    def adaptive(self) -> bool:
        """False: the limit never moves, so latency need not be measured."""
        ...

    def initial(self, limit: int) -> LimitState: ...

    def update(self, state: LimitState, sample: Sample, rand: float) -> LimitState:
        """`rand` in [0, 1) for any randomness (passed in to keep this pure)."""
        ...


@dataclass(frozen=True)
class FixedLimit:
    limit: int

    @property
    def adaptive(self) -> bool:
        return False

    def initial(self, limit: int) -> LimitState:
        return LimitState(limit=float(self.limit))

    def update(self, state: LimitState, sample: Sample, rand: float) -> LimitState:
        return state if state.limit == self.limit else LimitState(limit=float(self.limit))


@dataclass
class SampleWindow:
    """Aggregates per-request outcomes into one sample (Netflix WindowedLimit).

    Every finished request counts (success or drop), whether or not its latency was measured,
    so the drop share is not skewed by sampling. A window closes when it has `min_samples`
    finished requests (at least one measured or dropped) and is at least `min_duration` old —
    as Netflix's, where every request is a sample: with `sample_rate` 0.5, counting only the
    measured ones would halve how fast the limit follows the load — or when it is
    `max_duration` old with at least one, so a quiet pool still learns.
    """

    min_samples: int = 10
    min_duration: float = 1.0
    max_duration: float = 10.0
    started: float | None = None
    count: int = 0  # measured latencies
    ok: int = 0  # successful requests (measured or not)
    rtt_sum: float = 0.0
    max_inflight: int = 0
    drops: int = 0

    @property
    def dropped(self) -> bool:
        return self.drops > 0

    def add(self, now: float, rtt: float | None, inflight: int, dropped: bool = False) -> None:
        if self.started is None:
            self.started = now
        if dropped:
            self.drops += 1
        else:
            self.ok += 1
            if rtt is not None and rtt > 0:
                self.count += 1
                self.rtt_sum += rtt
        self.max_inflight = max(self.max_inflight, inflight)

    def ready(self, now: float) -> bool:
        if self.started is None:
            return False
        age = now - self.started
        has_any = self.count > 0 or self.dropped
        return (has_any and self.ok + self.drops >= self.min_samples and age >= self.min_duration) or (
            has_any and age >= self.max_duration)

    def take(self) -> Sample | None:
        """Close the window and return its sample (None if it holds nothing usable)."""
        sample: Sample | None = None
        if self.count or self.drops:
            rtt = self.rtt_sum / self.count if self.count else 0.0
            share = self.drops / max(1, self.drops + self.ok)
            sample = Sample(rtt=rtt, inflight=self.max_inflight, dropped=self.drops > 0, drop_share=share)
        self.started, self.count, self.ok, self.rtt_sum, self.max_inflight, self.drops = None, 0, 0, 0.0, 0, 0
        return sample


@dataclass
class WindowedLimit:
    """A `Limit` fed per request: outcomes go into a window, each closed window updates the
    delegate. `record` returns the sample to apply (the caller applies it to the shared state
    with `update`), or None while the window is open."""

    delegate: Limit
    window: SampleWindow

    @property
    def adaptive(self) -> bool:
        return self.delegate.adaptive

    def initial(self, limit: int) -> LimitState:
        return self.delegate.initial(limit)

    def update(self, state: LimitState, sample: Sample, rand: float) -> LimitState:
        return self.delegate.update(state, sample, rand)

    def record(self, now: float, outcome: Outcome, rtt: float | None, inflight: int) -> Sample | None:
        if outcome == "ignored" or not self.adaptive:
            return None
        self.window.add(now, rtt, inflight, dropped=outcome == "dropped")
        return self.window.take() if self.window.ready(now) else None


def limit_for(pool: PoolConfig) -> WindowedLimit:
    """The pool's limit as configured: `static` holds `initial`, `vegas` adapts (vegas.py)."""
    from floodgate.extproc.vegas import VegasLimit

    c = pool.limit
    inner: Limit
    if c.mode == "static":
        inner = FixedLimit(c.initial)
    else:
        inner = VegasLimit(c.min, c.max, c.smoothing, c.probe_multiplier, c.rtt_tolerance, c.flavor,
                           pool.latency_target() if c.flavor == "floodgate" else 0.0)
    return WindowedLimit(inner, SampleWindow(c.window_min_samples, c.window_s, c.window_max_s))
