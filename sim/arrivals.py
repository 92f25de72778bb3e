"""Open-loop arrival plans: when each request is sent and what it asks for.

Pure and seeded: every function here takes a seed (or a numpy Generator) and returns the same
plan for the same inputs, so benchmarks compare configurations on identical traffic. Nothing
here does I/O except `load_trace`, which only reads the CSV.

A plan is a list of `PlannedRequest` sorted by `t_offset` (seconds after the run starts). The
load generator sends each one at its time whether or not earlier ones finished (open loop):
a closed-loop client slows down when the server does and hides overload.

Shapes are piecewise-constant rate profiles (`RateProfile`): constant, step (phases) and burst
(a base rate with a multiplied window). Arrivals over a profile are either a Poisson process
(exact per segment, since exponential gaps are memoryless) or uniformly spaced. Trace replay
reads the Azure LLM inference trace and compresses it in time and scales it in rate.
"""

from __future__ import annotations

import csv
import functools
import gzip
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Literal

import numpy as np

Process = Literal["poisson", "uniform"]

# The Azure LLM inference trace 2023 (conversation), shipped with the package (CC-BY 4.0,
# attribution in data/README.md).
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "AzureLLMInferenceTrace_conv.csv.gz"


def open_trace(path: str | Path) -> IO[str]:
    """A trace CSV for reading, plain or gzip-compressed (by its `.gz` suffix)."""
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, "rt", newline="")
    return p.open(newline="")


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of an open-loop plan."""

    t_offset: float  # seconds after run start
    priority: int  # 0 critical, 1 standard, 2 sheddable (docs/admission.md)
    tenant: str
    prompt_tokens: int
    output_tokens: int


# --------------------------------------------------------------------------- rate profiles


@dataclass(frozen=True)
class RateProfile:
    """A piecewise-constant request rate: consecutive (duration_s, rate_per_s) segments."""

    segments: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        for d, r in self.segments:
            if d < 0 or r < 0 or not math.isfinite(d) or not math.isfinite(r):
                raise ValueError(f"bad segment (duration={d}, rate={r}): both must be finite and >= 0")

    @property
    def duration(self) -> float:
        return float(sum(d for d, _ in self.segments))

    def rate_at(self, t: float) -> float:
        start = 0.0
        for d, r in self.segments:
            if start <= t < start + d:
                return r
            start += d
        return 0.0

    def expected_count(self, t0: float = 0.0, t1: float | None = None) -> float:
        """Integral of the rate over [t0, t1)."""
        t1 = self.duration if t1 is None else t1
        total, start = 0.0, 0.0
        for d, r in self.segments:
            lo, hi = max(t0, start), min(t1, start + d)
            if hi > lo:
                total += r * (hi - lo)
            start += d
        return total


def constant_profile(rate: float, duration: float) -> RateProfile:
    return RateProfile(((duration, rate),))


def step_profile(phases: Sequence[tuple[float, float]]) -> RateProfile:
    """Phases [(duration_s, rate_per_s), ...] run one after another."""
    if not phases:
        raise ValueError("step profile needs at least one (duration, rate) phase")
    return RateProfile(tuple((float(d), float(r)) for d, r in phases))


def burst_profile(
    base_rate: float, duration: float, burst_start: float, burst_duration: float, multiplier: float
) -> RateProfile:
    """`base_rate` for `duration` seconds, times `multiplier` during [burst_start, +burst_duration)."""
    if burst_start < 0 or burst_duration < 0 or burst_start + burst_duration > duration:
        raise ValueError(
            f"burst window [{burst_start}, {burst_start + burst_duration}) must lie inside [0, {duration}]"
        )
    segs = [
        (burst_start, base_rate),
        (burst_duration, base_rate * multiplier),
        (duration - burst_start - burst_duration, base_rate),
    ]
    return RateProfile(tuple((d, r) for d, r in segs if d > 0))


def arrival_times(
    profile: RateProfile, process: Process = "poisson", seed: int | np.random.Generator = 0
) -> np.ndarray:
    """Sorted arrival offsets (s) over the profile."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    start = 0.0
    for d, r in profile.segments:
        if d > 0 and r > 0:
            if process == "poisson":
                # Draw a comfortable surplus of gaps, then extend if unlucky; exact per segment.
                n_guess = int(r * d + 6 * math.sqrt(r * d) + 10)
                gaps = rng.exponential(1.0 / r, n_guess)
                ts = np.cumsum(gaps)
                while ts[-1] < d:
                    more = np.cumsum(rng.exponential(1.0 / r, n_guess)) + ts[-1]
                    ts = np.concatenate([ts, more])
                out.append(start + ts[ts < d])
            elif process == "uniform":
                # Half-gap phase so a segment of rate r and length d yields round(r*d) requests
                # and adjacent segments do not collide at the boundary.
                n = math.floor(r * d + 0.5)
                out.append(start + (np.arange(n) + 0.5) / r)
            else:
                raise ValueError(f"unknown arrival process {process!r}")
        start += d
    return np.sort(np.concatenate(out)) if out else np.zeros(0)


# --------------------------------------------------------------------------- request mix


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: lognormal with the given arithmetic mean, clipped to [min, max].

    sigma=0 gives a fixed length. Clipping shifts the realised mean a little; that is fine for
    load shaping and keeps lengths inside the model's context.
    """

    mean: float
    sigma: float = 0.8
    min: int = 1
    max: int = 4096

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma <= 0:
            vals = np.full(n, self.mean)
        else:
            # E[lognormal(mu, s)] = exp(mu + s^2/2), so mu makes the arithmetic mean `mean`.
            mu = math.log(max(self.mean, 1e-9)) - self.sigma**2 / 2
            vals = rng.lognormal(mu, self.sigma, n)
        return np.clip(np.rint(vals), self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class Mix:
    """Who sends what: priority shares (P0, P1, P2), tenant shares, synthetic lengths."""

    priority_shares: tuple[float, float, float] = (0.2, 0.5, 0.3)
    tenants: tuple[tuple[str, float], ...] = (("tenant-a", 1.0),)
    prompt: LengthDist = field(default_factory=lambda: LengthDist(mean=512, sigma=0.8, max=4096))
    output: LengthDist = field(default_factory=lambda: LengthDist(mean=128, sigma=0.8, max=1024))

    def __post_init__(self) -> None:
        if len(self.priority_shares) != 3 or min(self.priority_shares) < 0 or sum(self.priority_shares) <= 0:
            raise ValueError(f"priority shares must be 3 non-negative numbers, got {self.priority_shares}")
        if not self.tenants or min(s for _, s in self.tenants) < 0 or sum(s for _, s in self.tenants) <= 0:
            raise ValueError(f"tenant shares must be non-negative with a positive sum, got {self.tenants}")


def _normalized(shares: Sequence[float]) -> np.ndarray:
    p = np.asarray(shares, dtype=float)
    return p / p.sum()


def assign(
    times: np.ndarray,
    mix: Mix,
    rng: np.random.Generator,
    prompt_tokens: np.ndarray | None = None,
    output_tokens: np.ndarray | None = None,
) -> list[PlannedRequest]:
    """Attach priority, tenant and lengths to arrival times (lengths sampled unless given)."""
    n = len(times)
    prios = rng.choice(3, size=n, p=_normalized(mix.priority_shares))
    names = [t for t, _ in mix.tenants]
    tidx = rng.choice(len(names), size=n, p=_normalized([s for _, s in mix.tenants]))
    pt = mix.prompt.sample(rng, n) if prompt_tokens is None else prompt_tokens
    ot = mix.output.sample(rng, n) if output_tokens is None else output_tokens
    return [
        PlannedRequest(float(times[i]), int(prios[i]), names[tidx[i]], int(pt[i]), int(ot[i]))
        for i in range(n)
    ]


def synthetic_plan(
    profile: RateProfile, mix: Mix | None = None, process: Process = "poisson", seed: int = 0
) -> list[PlannedRequest]:
    """Arrivals over `profile` with the request mix; same seed, same plan."""
    rng = np.random.default_rng(seed)
    times = arrival_times(profile, process, rng)
    return assign(times, mix or Mix(), rng)


# --------------------------------------------------------------------------- trace replay


@dataclass(frozen=True)
class Trace:
    """The trace as arrays: arrival offsets from the first request (s), context and output lengths."""

    t: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    @property
    def span(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0

    def __len__(self) -> int:
        return len(self.t)


def _parse_ts(s: str) -> float:
    # The trace has 7 fractional digits, which datetime does not parse; split them off.
    whole, _, frac = s.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


@functools.lru_cache(maxsize=4)
def load_trace(path: str | Path = DEFAULT_TRACE) -> Trace:
    """Read a TIMESTAMP,ContextTokens,GeneratedTokens CSV (cached per path)."""
    ts: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    # Every way the file can fail to be such a CSV is a ValueError naming it (a binary or
    # non-UTF-8 file, a corrupt .gz, a malformed row), so a caller reports it in one line.
    try:
        with open_trace(path) as f:
            reader = csv.DictReader(f)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: missing columns {sorted(missing)}")
            for row in reader:
                try:
                    ts.append(_parse_ts(row["TIMESTAMP"]))
                    ctx.append(int(row["ContextTokens"]))
                    gen.append(int(row["GeneratedTokens"]))
                except (TypeError, ValueError, AttributeError) as exc:
                    raise ValueError(f"{path}: line {reader.line_num}: bad row ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 text CSV (byte 0x{exc.object[exc.start]:02x}: {exc.reason})") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: not a CSV ({exc})") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: not a readable gzip file ({exc})") from None
    t = np.asarray(ts)
    order = np.argsort(t, kind="stable")
    t = t[order] - (t[order][0] if len(t) else 0.0)
    return Trace(t, np.asarray(ctx)[order], np.asarray(gen)[order])


def trace_plan(
    trace: Trace,
    *,
    speedup: float = 1.0,
    rate_scale: float = 1.0,
    start: float = 0.0,
    duration: float | None = None,
    mix: Mix | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    seed: int = 0,
) -> list[PlannedRequest]:
    """Replay the trace: window, compress in time, scale in rate, attach priority/tenant.

    start: window start in trace seconds. duration: window length in *replay* seconds (after
    compression), so `duration=60, speedup=10` replays 600 s of the trace in one minute.
    speedup: divides inter-arrival times (and multiplies the rate) by this factor.
    rate_scale: multiplies the rate without changing the time axis: < 1 keeps each request
    with that probability (thinning), > 1 adds floor(s)-1 copies plus one more with
    probability frac(s). Copies are jittered by up to half the mean gap so they do not arrive
    in lockstep with their original. Lengths come from the trace (clipped if asked);
    priority and tenant from `mix`.
    """
    if speedup <= 0 or rate_scale < 0:
        raise ValueError("speedup must be > 0 and rate_scale >= 0")
    rng = np.random.default_rng(seed)
    end = math.inf if duration is None else start + duration * speedup
    sel = (trace.t >= start) & (trace.t < end)
    t = (trace.t[sel] - start) / speedup
    pt, ot = trace.prompt_tokens[sel], trace.output_tokens[sel]
    n = len(t)
    if n == 0:
        return []

    whole, frac = math.floor(rate_scale), rate_scale - math.floor(rate_scale)
    copies = np.full(n, whole, dtype=np.int64) + (rng.random(n) < frac)
    idx = np.repeat(np.arange(n), copies)
    # 0 for the first copy of each request, 1.. for the duplicates.
    first = np.zeros(len(idx), dtype=bool)
    if len(idx):
        first[np.r_[0, np.cumsum(copies)[:-1]][copies > 0]] = True
    span = (duration if duration is not None else float(t[-1])) or 1.0
    half_gap = 0.5 * span / max(n, 1)
    jitter = np.where(first, 0.0, rng.uniform(-half_gap, half_gap, len(idx)))
    hi = duration if duration is not None else math.inf
    times = np.clip(t[idx] + jitter, 0.0, np.nextafter(hi, 0) if math.isfinite(hi) else None)
    order = np.argsort(times, kind="stable")
    times, idx = times[order], idx[order]

    p, o = pt[idx], ot[idx]
    if max_prompt_tokens is not None:
        p = np.minimum(p, max_prompt_tokens)
    if max_output_tokens is not None:
        o = np.minimum(o, max_output_tokens)
    return assign(times, mix or Mix(), rng, np.maximum(p, 1), np.maximum(o, 1))


# --------------------------------------------------------------------------- plan statistics


def plan_rate(plan: Sequence[PlannedRequest], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, requests per second) histogram of a plan."""
    if not plan:
        return np.zeros(0), np.zeros(0)
    t = np.array([r.t_offset for r in plan])
    edges = np.arange(0.0, float(t.max()) + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    counts, _ = np.histogram(t, bins=edges)
    return edges[:-1], counts / bin_s
