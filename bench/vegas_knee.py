"""Does Vegas hold the knee? Hours of saturation against the pure engine model, fake time.

One emulated replica (`sim/engine.py`, the code `floodgate sim` runs) is kept saturated: the
gateway always has more requests than the limit lets in, so in-flight = the current limit.
Every finished request feeds the pool's limit exactly as the processor does (a window of
outcomes, half of them with a measured latency, closed windows update the shared state),
with the shipped `LimitConfig` and class SLOs unless told otherwise.

The knee is measured first on the same engine: fixed concurrency N, goodput = output tokens/s
of requests that met the shipped SLO (TTFT from admission <= slo_ttft_s, TPOT <= slo_tpot_s,
times scaled with the engine); the knee is the N with the highest goodput.

    floodgate bench vegas-knee                       # 8 simulated hours per run, ~3-5 min
    floodgate bench vegas-knee --hours 1 --no-netflix
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from floodgate.extproc.config import LimitConfig, PoolConfig
from floodgate.extproc.limit import Latency, LimitState, WindowedLimit, limit_for
from floodgate.sim.engine import Engine, EngineConfig

SUMMARY = "vegas-knee: the Vegas limit under hours of saturation vs the pool's goodput-maximising concurrency"


@dataclass
class Setup:
    time_scale: float = 4.0  # engine timings x this (fewer steps per simulated hour)
    max_num_seqs: int = 256
    prompt_mean: int = 512
    output_mean: int = 64
    sigma: float = 0.5
    sample_rate: float = 0.5
    seed: int = 1

    def engine(self) -> Engine:
        return Engine(EngineConfig(max_num_seqs=self.max_num_seqs).scaled(self.time_scale))


@dataclass
class Finished:
    admitted: float
    first: float
    last: float
    tokens: int


@dataclass
class _Runner:
    setup: Setup
    rng: random.Random
    engine: Engine = field(init=False)
    started: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    seq: int = 0

    def __post_init__(self) -> None:
        self.engine = self.setup.engine()

    def _length(self, mean: int) -> int:
        s = self.setup.sigma
        return max(1, min(4 * mean, int(self.rng.lognormvariate(math.log(mean) - s * s / 2, s))))

    def start(self, now: float) -> None:
        self.seq += 1
        rid = str(self.seq)
        self.engine.add_request(rid, self._length(self.setup.prompt_mean), self._length(self.setup.output_mean), now)
        self.started[rid] = now

    def run_until(self, t: float) -> list[Finished]:
        out = []
        for ev in self.engine.advance(t):
            rid = ev.seq.request_id
            if ev.index == 0:
                self.first[rid] = ev.time
            if ev.finished:
                out.append(Finished(self.started.pop(rid), self.first.pop(rid), ev.time, ev.index + 1))
        return out

    def inflight(self) -> int:
        return len(self.started)


def _good(f: Finished, slo_ttft: float, slo_tpot: float) -> bool:
    tpot = (f.last - f.first) / (f.tokens - 1) if f.tokens > 1 else 0.0
    return f.first - f.admitted <= slo_ttft and tpot <= slo_tpot


def goodput_at(setup: Setup, n: int, seconds: float, slo_ttft: float, slo_tpot: float) -> float:
    """Output tokens/s meeting the SLO with exactly `n` requests in flight (after a warm-up)."""
    r = _Runner(setup, random.Random(setup.seed + n))
    for _ in range(n):
        r.start(0.0)
    t, dt, good, warm = 0.0, 0.5 * setup.time_scale, 0, 0.25 * seconds
    while t < seconds:
        t += dt
        for f in r.run_until(t):
            if f.admitted >= warm and _good(f, slo_ttft, slo_tpot):
                good += f.tokens
            r.start(f.last)
    return good / (seconds - warm)


def find_knee(setup: Setup, slo_ttft: float, slo_tpot: float, seconds: float,
              grid: list[int]) -> tuple[int, dict[int, float]]:
    curve = {n: goodput_at(setup, n, seconds, slo_ttft, slo_tpot) for n in grid}
    # Refine around the best coarse point.
    best = max(curve, key=lambda n: curve[n])
    step = max(1, (grid[1] - grid[0]) // 4) if len(grid) > 1 else 1
    for n in range(max(1, best - 3 * step), best + 3 * step + 1, step):
        if n not in curve:
            curve[n] = goodput_at(setup, n, seconds, slo_ttft, slo_tpot)
    best = max(curve, key=lambda n: curve[n])
    return best, dict(sorted(curve.items()))


@dataclass
class Trace:
    times: list[float]
    limits: list[float]
    windows: int
    noload: list[float]


def saturate(setup: Setup, pool: PoolConfig, hours: float, error_rate: float = 0.0) -> Trace:
    """Hold the engine saturated for `hours` of simulated time under the pool's limit."""
    rng = random.Random(setup.seed * 7 + int(error_rate * 1000))
    lim: WindowedLimit = limit_for(pool)
    state: LimitState = lim.initial(pool.limit.initial)
    signal = pool.limit.signal
    r = _Runner(setup, random.Random(setup.seed))
    t, dt, end = 0.0, 0.25 * setup.time_scale, hours * 3600
    times, limits, noload = [0.0], [state.limit], [0.0]
    windows = 0
    while t < end:
        t += dt
        for f in r.run_until(t):
            if rng.random() < error_rate:
                outcome, rtt = "dropped", None
            else:
                outcome = "success"
                rtt = None
                if rng.random() < setup.sample_rate:  # as the processor: Latency.signal
                    tpot = (f.last - f.first) / (f.tokens - 1) if f.tokens > 1 else None
                    rtt = Latency(f.first - f.admitted, tpot).signal(signal)
            sample = lim.record(f.last, outcome, rtt, r.inflight() + 1, f.admitted)  # type: ignore[arg-type]
            if sample is not None:
                new = lim.update(state, sample, rng.random())
                if max(1, int(new.limit)) != max(1, int(state.limit)):
                    lim.limit_changed(f.last)  # as the processor (Admitter._limit_seen)
                state = new
                windows += 1
                times.append(f.last)
                limits.append(state.limit)
                noload.append(state.rtt_noload)
        while r.inflight() < max(1, int(state.limit)):
            r.start(t)
    return Trace(times, limits, windows, noload)


def summarize(trace: Trace, knee: int, warmup_s: float) -> dict[str, Any]:
    pts = [(t, v) for t, v in zip(trace.times, trace.limits, strict=True) if t >= warmup_s]
    if len(pts) < 2:
        return {"windows": trace.windows}
    # Time-weighted: each limit holds until the next window.
    total = inside = above80 = 0.0
    lo, hi = float("inf"), 0.0
    weighted = 0.0
    for (t0, v), (t1, _) in itertools.pairwise(pts):
        d = t1 - t0
        total += d
        weighted += v * d
        inside += d if 0.75 * knee <= v <= 1.25 * knee else 0.0
        above80 += d if v >= 0.8 * knee else 0.0
        lo, hi = min(lo, v), max(hi, v)
    return {"windows": trace.windows, "mean": weighted / total, "min": lo, "max": hi,
            "within_25pct": inside / total, "above_80pct": above80 / total,
            "final": trace.limits[-1], "final_noload": trace.noload[-1]}


def _pool(limit: dict[str, Any], setup: Setup) -> PoolConfig:
    base = PoolConfig()
    classes = {k: c.model_copy(update={"slo_ttft_s": c.slo_ttft_s * setup.time_scale,
                                       "slo_tpot_s": c.slo_tpot_s * setup.time_scale})
               for k, c in base.classes.items()}
    return PoolConfig(limit=LimitConfig(**limit), classes=classes)


def run(args: argparse.Namespace) -> int:
    setup = Setup(time_scale=args.time_scale, seed=args.seed)
    shipped = PoolConfig()
    c1 = shipped.classes[1]
    slo_ttft = c1.slo_ttft_s * setup.time_scale
    slo_tpot = c1.slo_tpot_s * setup.time_scale
    t0 = time.monotonic()
    knee, curve = find_knee(setup, slo_ttft, slo_tpot, args.knee_seconds * setup.time_scale,
                            list(range(10, 161, 10)))
    best = curve[knee]
    print(f"engine x{setup.time_scale:g}, SLO TTFT (from admission) <= {slo_ttft:.2f} s, TPOT <= {slo_tpot:.3f} s")
    print("goodput by concurrency: " + ", ".join(f"{n}: {g:.0f}" for n, g in curve.items()))
    print(f"knee = {knee} (goodput {best:.0f} tok/s)  [{time.monotonic() - t0:.0f} s]")
    rows = [("floodgate (shipped)", {"signal": args.signal}, 0.0),
            ("floodgate, 5% 5xx", {"signal": args.signal}, 0.05)]
    if not args.no_netflix:
        rows.append(("netflix flavor, tolerance 3", {"signal": args.signal, "flavor": "netflix"}, 0.0))
        rows.append(("netflix flavor, 5% 5xx", {"signal": args.signal, "flavor": "netflix"}, 0.05))
    print(f"\n{args.hours:g} simulated hours of saturation, signal {args.signal}, warm-up 10 min:")
    print("| limit | mean | min | max | time within ±25 % of knee | time ≥ 80 % of knee | windows |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ok = True
    for name, limit, err in rows:
        t = time.monotonic()
        s = summarize(saturate(setup, _pool(limit, setup), args.hours, err), knee, 600)
        print(f"| {name} | {s['mean']:.0f} | {s['min']:.0f} | {s['max']:.0f} | {100 * s['within_25pct']:.1f} % "
              f"| {100 * s['above_80pct']:.1f} % | {s['windows']} |  ({time.monotonic() - t:.0f} s)", flush=True)
        if name.startswith("floodgate"):
            ok &= (s["within_25pct"] >= 0.99) if err == 0 else (s["above_80pct"] >= 0.99)
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hours", type=float, default=8.0, help="simulated hours of saturation per run (default 8)")
    p.add_argument("--signal", choices=["tpot", "ttft", "combined"], default=PoolConfig().limit.signal,
                   help="latency signal the limit follows (default %(default)s: the shipped pool's)")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="multiply the engine's step times and the SLOs: fewer steps per simulated hour (default 4)")
    p.add_argument("--knee-seconds", type=float, default=300.0,
                   help="simulated seconds per knee point (x time scale; default 300)")
    p.add_argument("--seed", type=int, default=1, help="random seed of the request lengths and errors (default 1)")
    p.add_argument("--no-netflix", action="store_true", help="skip the Netflix-flavor comparison rows")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
