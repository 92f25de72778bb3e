"""The best P0 TTFT any admission policy can give in the burst, on the pool's own engine model.

An admission policy decides only which requests reach the engines and when. The best it can
do for P0 is an ideal one: every P0 goes to an engine the moment it arrives (zero queue wait)
and goes first in that engine's waiting queue, while lower classes — backlogged in the burst —
are fed so that each replica runs N sequences (a finished one is replaced at once). That
policy is run here on the replicas' own model (`sim/engine.py`, pure, virtual clock) at the
burst's P0 arrival rate for a range of N; the smallest N whose goodput reaches the target
share of the best steady goodput gives the lowest P0 TTFT p99 compatible with that goodput
(goodput rises with N and so does the engine's step time, hence TTFT). Divided by the P0 TTFT
p99 of the same engines unloaded, that is the ratio no admission policy can beat on this
engine while keeping the goodput: if it is above the target (2x), the target is unattainable.

It is a bound for policies that hold a steady batch; a policy could also vary the batch over
time, but it cannot know when the next P0 arrives, and the mean batch needed for the goodput
is what sets the step time.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BoundPoint:
    n_per_replica: int
    goodput_tok_s: float  # output tokens/s of all requests meeting the SLO (TTFT from admission)
    p0_ttft_p99_s: float  # from arrival: zero queue wait, first in the engine's queue
    p0_ttft_p50_s: float
    p0_count: int


@dataclass(frozen=True)
class P0Bound:
    target_goodput_tok_s: float
    unloaded_p0_ttft_p99_s: float  # the same engines at the unloaded phase's load
    points: tuple[BoundPoint, ...]
    best: BoundPoint | None  # smallest N reaching the target goodput (None: none does)

    @property
    def ratio(self) -> float | None:
        if self.best is None or self.unloaded_p0_ttft_p99_s <= 0:
            return None
        return self.best.p0_ttft_p99_s / self.unloaded_p0_ttft_p99_s

    def to_dict(self) -> dict[str, Any]:
        return {"target_goodput_tok_s": self.target_goodput_tok_s,
                "unloaded_p0_ttft_p99_s": self.unloaded_p0_ttft_p99_s,
                "points": [asdict(p) for p in self.points],
                "best": asdict(self.best) if self.best else None, "ratio": self.ratio}


def _percentile(vals: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(vals, q)) if vals else math.inf


def ideal_policy(w: Any, n_per_replica: int | None, p0_rate: float, duration: float,
                 slo_ttft: float, slo_tpot: float, *, background_rate: float = 0.0,
                 seed: int = 0, samples: bool = False) -> Any:
    """Run the ideal policy on `w.replicas` engines for `duration` virtual seconds.

    P0 arrives Poisson at `p0_rate` and is admitted at once, first in the least-loaded engine's
    queue. With `n_per_replica`, lower-class requests keep every replica at that many sequences
    (replaced as they finish); without, they arrive Poisson at `background_rate` (an open load,
    for the unloaded reference). Statistics over the last 80 % of the run; with `samples`,
    returns (point, the P0 TTFTs)."""
    import numpy as np
    from floodgate.sim.engine import Engine

    rng = np.random.default_rng(seed)
    mix = w.mix()
    cfg = w.engine_config()
    engines = [Engine(cfg) for _ in range(w.replicas)]
    arrivals: list[tuple[float, int]] = []  # (time, class) of open arrivals
    for rate, cls in ((p0_rate, 0), (background_rate if n_per_replica is None else 0.0, 1)):
        t = 0.0
        while rate > 0:
            t += float(rng.exponential(1 / rate))
            if t >= duration:
                break
            arrivals.append((t, cls))
    arrivals.sort()
    lengths = iter(zip(mix.prompt.sample(rng, 200_000),
                       mix.output.sample(rng, 200_000), strict=True))
    arrived: dict[str, tuple[float, int]] = {}  # request -> (arrival, class)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    seq_no = 0

    def add(e: Engine, cls: int, now: float) -> None:
        nonlocal seq_no
        seq_no += 1
        rid = f"{cls}-{seq_no}"
        prompt, output = next(lengths)
        seq = e.add_request(rid, int(prompt), int(output), now)
        if cls == 0:  # first in the engine's waiting queue
            e.waiting.remove(seq)
            e.waiting.appendleft(seq)
        arrived[rid] = (now, cls)

    if n_per_replica is not None:
        for e in engines:
            for _ in range(n_per_replica):
                add(e, 1, 0.0)
    heap = list(arrivals)
    heapq.heapify(heap)
    now = 0.0
    while now < duration:
        nexts = [t for t in (e.next_event_time() for e in engines) if t is not None]
        t_next = min(nexts + ([heap[0][0]] if heap else []), default=duration)
        now = max(now, min(t_next, duration))
        for e in engines:
            for ev in e.advance(now):
                rid = ev.seq.request_id
                first.setdefault(rid, ev.time)
                last[rid] = ev.time
                count[rid] = ev.index + 1
                if ev.finished and n_per_replica is not None and arrived[rid][1] != 0:
                    if e.num_running + e.num_waiting < n_per_replica:
                        add(e, 1, ev.time)
        while heap and heap[0][0] <= now:
            t, cls = heapq.heappop(heap)
            add(min(engines, key=lambda e: e.num_running + e.num_waiting), cls, t)
        if not heap and not nexts:
            break
    start, span = 0.2 * duration, 0.8 * duration
    good = 0
    p0_ttft: list[float] = []
    for rid, (t0, cls) in arrived.items():
        if t0 < start or rid not in first:
            continue
        ttft = first[rid] - t0
        if cls == 0:
            p0_ttft.append(ttft)
        n = count[rid]
        tpot = (last[rid] - first[rid]) / (n - 1) if n > 1 else 0.0
        if ttft <= slo_ttft and tpot <= slo_tpot and last[rid] <= duration:
            good += n
    point = BoundPoint(n_per_replica or 0, good / span, _percentile(p0_ttft, 99), _percentile(p0_ttft, 50),
                       len(p0_ttft))
    return (point, p0_ttft) if samples else point


def p0_ttft_bound(w: Any, capacity_rps: float, best_goodput_tok_s: float, slo_ttft: float, slo_tpot: float,
                  *, target_share: float = 0.95, duration: float = 400.0, seeds: int = 3,
                  ns: tuple[int, ...] = (24, 32, 36, 40, 44, 48, 52, 56, 64)) -> P0Bound:
    """The bound for the overload bench's workload: P0 at its burst rate (its share of the
    burst phase's load), the unloaded reference at the unloaded phase's load (all classes).
    Each point pools `seeds` runs of `duration` virtual seconds (a p99 over thousands of P0s)."""
    import numpy as np

    shares = w.priority_shares
    burst = max(w.phases, key=lambda p: p.load)
    unloaded = min(w.phases, key=lambda p: p.load)
    p0_rate = shares[0] * burst.load * capacity_rps

    def pooled(n: int | None, rate: float, background: float) -> BoundPoint:
        runs = [ideal_policy(w, n, rate, duration, slo_ttft, slo_tpot, background_rate=background,
                             seed=w.seed * 1000 + s, samples=True) for s in range(seeds)]
        ttft = [t for r in runs for t in r[1]]
        return BoundPoint(n or 0, float(np.mean([r[0].goodput_tok_s for r in runs])), _percentile(ttft, 99),
                          _percentile(ttft, 50), len(ttft))

    ref = pooled(None, shares[0] * unloaded.load * capacity_rps, (1 - shares[0]) * unloaded.load * capacity_rps)
    points = tuple(pooled(n, p0_rate, 0.0) for n in ns)
    target = target_share * best_goodput_tok_s
    best = next((p for p in points if p.goodput_tok_s >= target), None)
    return P0Bound(target, ref.p0_ttft_p99_s, points, best)


__all__ = ["BoundPoint", "P0Bound", "ideal_policy", "p0_ttft_bound"]
