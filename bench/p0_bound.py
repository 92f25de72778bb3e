"""How fast can P0's first token be in the burst, whatever the admission policy? On the pool's
own engine model (`sim/engine.py`, pure, virtual clock), at the overload bench's burst.

An admission policy decides only which requests reach the engines, when, and (with endpoint
picking) where. The shipped deployment runs the engines FIFO (vLLM's default `fcfs`): a P0
joins the end of its engine's waiting queue, behind every prompt admitted before it. `FIFO_NOTE`
says what this module computes for that case: a floor no policy beats (the burst's P0s alone)
and the best point of an oracle pacing policy (an achievable P0 TTFT p99 at the goodput target,
so the optimum lies between the two).

`ideal_policy` is the engine-priority case (vLLM's `--scheduling-policy priority`, P0 first in
its engine's waiting queue) with a steady backlog of lower classes at N sequences per replica.
It is NOT a bound: it refills the batch only when a lower-class request finishes and never paces
prompts, and the FIFO oracle (no reordering at all) beats it at the same goodput (its 1.86x at
48 sequences, 467 ms, against the FIFO oracle's ~1.3x; docs/benchmarks.md "Overload").
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BoundPoint:
    n_per_replica: int
    goodput_tok_s: float  # output tokens/s of all requests meeting the SLO (TTFT from admission)
    p0_ttft_p99_s: float  # from arrival: zero queue wait, first in the engine's queue
    p0_ttft_p50_s: float
    p0_count: int


def _percentile(vals: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(vals, q)) if vals else math.inf


def _point(n_per_replica: int, arrived: dict[str, tuple[float, int]], times: Any, duration: float,
           slo_ttft: float, slo_tpot: float, *, arrived_by: float, done_by: float, samples: bool) -> Any:
    """The BoundPoint of one run, over requests that arrived in [0.2 x duration, arrived_by):
    goodput over the last 80 % of the run (tokens of requests within the SLO that finished by
    `done_by`), P0's TTFT from arrival; with `samples`, (point, the P0 TTFTs)."""
    start, span = 0.2 * duration, 0.8 * duration
    good = 0
    p0_ttft: list[float] = []
    for rid, (t0, cls) in arrived.items():
        if t0 < start or t0 >= arrived_by or rid not in times.first:
            continue
        ttft = times.first[rid] - t0
        if cls == 0:
            p0_ttft.append(ttft)
        if ttft <= slo_ttft and times.tpot(rid) <= slo_tpot and times.last[rid] <= done_by:
            good += times.count[rid]
    point = BoundPoint(n_per_replica, good / span, _percentile(p0_ttft, 99), _percentile(p0_ttft, 50),
                       len(p0_ttft))
    return (point, p0_ttft) if samples else point


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
    from floodgate.sim.engine import Engine, TokenTimes

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
    times = TokenTimes()
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
                times.record(ev)
                rid = ev.seq.request_id
                if ev.finished and n_per_replica is not None and arrived[rid][1] != 0:
                    if e.num_running + e.num_waiting < n_per_replica:
                        add(e, 1, ev.time)
        while heap and heap[0][0] <= now:
            t, cls = heapq.heappop(heap)
            add(min(engines, key=lambda e: e.num_running + e.num_waiting), cls, t)
        if not heap and not nexts:
            break
    return _point(n_per_replica or 0, arrived, times, duration, slo_ttft, slo_tpot,
                  arrived_by=math.inf, done_by=duration, samples=samples)


FIFO_NOTE = """On a FIFO engine (vLLM's default `fcfs` policy, the shipped deployment) no admission
policy can put a P0 ahead of a prompt already in the engine: the P0 joins the end of the waiting
queue. What a policy still controls is how much lower-class prefill is in the engine when a P0
comes, and how big the batch is.

* Floor (`fifo_policy` with N = 0): the burst's P0s alone, each admitted the moment it arrives
  to the replica with the least prefill left. No policy that serves lower classes does better,
  assuming (a) a lower-class request never makes a P0's first token earlier on this engine (it
  only adds prefill ahead of or beside the P0 and decodes to every step; checked on the model
  by tests/bench/test_p0_fifo_bound.py with the same P0s) and (b) least-prefill routing is as
  good for P0 alone as any other (asserted, not proven: a clairvoyant router could beat greedy
  routing at the p99). It is a bound on the engine model for these arrivals; for a live run
  with other arrivals it is an estimate.
* Achievable (`fifo_policy` with N, K): an oracle that knows each engine's queue admits every P0
  at once to the replica with the least prefill left, and lets a lower-class request (the
  burst's backlog: one always waits) into a replica only at the start of one of its steps, only
  while that replica runs fewer than N sequences and has at most K prompt tokens left to
  prefill (waiting or mid-prefill, P0s included). Sweeping N and K, the lowest P0 TTFT p99 among
  the points reaching the goodput target is a P0 TTFT some policy reaches on FIFO engines: an
  upper bound on the optimum, not a lower bound.

Lower classes are served in arrival order with the workload's lengths (no choosing short
prompts); their TTFT counts from admission. The optimum lies between the floor and the best
point; when both are under the target ratio, the FIFO engine does not rule the target out."""


class _SteppedEngine:
    """An Engine whose owner may add requests at the start of each step, before it is scheduled
    (`before_step(engine, start)`), as an admission oracle synchronised with the engine would."""

    @staticmethod
    def make(cfg: Any, before_step: Any) -> Any:
        from floodgate.sim.engine import Engine

        class Stepped(Engine):
            def _schedule(self, start: float) -> Any:
                before_step(self, start)
                return super()._schedule(start)

        return Stepped(cfg)


def prefill_backlog(e: Any) -> int:
    """Prompt tokens an engine still has to compute (waiting, or running mid-prefill); a P0
    joining its FIFO queue waits for all of them (a step in flight counts until it ends)."""
    return (sum(max(0, s.prompt_tokens - s.num_computed) for s in e.waiting)
            + sum(max(0, s.prompt_tokens - s.num_computed) for s in e.running))


def fifo_policy(w: Any, n_per_replica: int, backlog_cap: float, p0_rate: float, duration: float,
                slo_ttft: float, slo_tpot: float, *, seed: int = 0, samples: bool = False,
                observe: Any = None) -> Any:
    """Run the FIFO pacing oracle (`FIFO_NOTE`) on `w.replicas` FIFO engines for `duration`
    virtual seconds: P0 Poisson at `p0_rate`, admitted at once to the replica with the least
    prefill backlog (then the fewest sequences) and joining its FIFO queue; lower-class requests
    from an endless backlog enter a replica at a step's start while it runs < `n_per_replica`
    sequences and its prefill backlog is <= `backlog_cap` tokens (`n_per_replica` 0: P0 alone,
    the lower bound). Statistics over the last 80 % of the run, as `ideal_policy`. `observe(engine,
    cls, backlog)` is told of every admission with the engine's prefill backlog just before it."""
    import numpy as np
    from floodgate.sim.engine import TokenTimes

    rng = np.random.default_rng(seed)
    mix = w.mix()
    cfg = w.engine_config()
    # P0's lengths from their own stream: the same P0s (times and lengths) at every N and K, so
    # the points and the P0-alone floor differ only by the lower classes
    p0_rng = np.random.default_rng(seed + 7_000_000)
    lengths = (iter(zip(mix.prompt.sample(p0_rng, 100_000), mix.output.sample(p0_rng, 100_000), strict=True)),
               iter(zip(mix.prompt.sample(rng, 400_000), mix.output.sample(rng, 400_000), strict=True)))
    arrived: dict[str, tuple[float, int]] = {}
    times = TokenTimes()
    seq_no = 0

    def add(e: Any, cls: int, now: float) -> None:
        nonlocal seq_no
        seq_no += 1
        rid = f"{cls}-{seq_no}"
        prompt, output = next(lengths[min(cls, 1)])
        if observe is not None:
            observe(e, cls, prefill_backlog(e))
        e.add_request(rid, int(prompt), int(output), now)
        arrived[rid] = (now, cls)

    def fill(e: Any, now: float) -> None:
        while (n_per_replica > 0 and len(e.running) + len(e.waiting) < n_per_replica
               and prefill_backlog(e) <= backlog_cap and now < duration):
            add(e, 1, now)

    engines = [_SteppedEngine.make(cfg, fill) for _ in range(w.replicas)]
    p0_times: list[float] = []
    t = 0.0
    while p0_rate > 0:
        t += float(rng.exponential(1 / p0_rate))
        if t >= duration:
            break
        p0_times.append(t)
    k = 0
    now = 0.0
    for e in engines:
        fill(e, 0.0)
    while True:
        nexts = [x for x in (e.next_event_time() for e in engines) if x is not None]
        cand = nexts + ([p0_times[k]] if k < len(p0_times) else [])
        if not cand:
            break
        now = max(now, min(cand))
        if now > duration + 60.0:
            break
        for e in engines:
            for ev in e.advance(now):
                times.record(ev)
        while k < len(p0_times) and p0_times[k] <= now:
            e = min(engines, key=lambda e: (prefill_backlog(e), len(e.running) + len(e.waiting)))
            add(e, 0, p0_times[k])
            k += 1
        for e in engines:  # an idle engine starts no step: admit into it now
            if not e.step_in_flight:
                fill(e, now)
    return _point(n_per_replica, arrived, times, duration, slo_ttft, slo_tpot,
                  arrived_by=duration, done_by=math.inf, samples=samples)


@dataclass(frozen=True)
class FifoPoint:
    n_per_replica: int
    backlog_cap: float  # K: prompt tokens left to prefill at or under which a lower class enters
    goodput_tok_s: float  # mean over seeds
    p0_ttft_p99_s: float  # pooled over seeds
    p0_ttft_p99_seeds_s: tuple[float, ...]  # each seed's own
    p0_count: int


@dataclass(frozen=True)
class FifoBound:
    p0_share: float
    target_goodput_tok_s: float
    unloaded_p0_ttft_p99_s: float  # the same engines at the unloaded phase's load
    p0_alone: FifoPoint  # the lower bound: the burst's P0s on engines serving nothing else
    points: tuple[FifoPoint, ...]
    best: FifoPoint | None  # lowest P0 TTFT p99 among points reaching the target goodput

    @property
    def floor_ratio(self) -> float:
        return self.p0_alone.p0_ttft_p99_s / self.unloaded_p0_ttft_p99_s

    @property
    def ratio(self) -> float | None:
        return None if self.best is None else self.best.p0_ttft_p99_s / self.unloaded_p0_ttft_p99_s

    def to_dict(self) -> dict[str, Any]:
        return {"p0_share": self.p0_share, "target_goodput_tok_s": self.target_goodput_tok_s,
                "unloaded_p0_ttft_p99_s": self.unloaded_p0_ttft_p99_s, "p0_alone": asdict(self.p0_alone),
                "points": [asdict(p) for p in self.points], "best": asdict(self.best) if self.best else None,
                "ratio": self.ratio, "floor_ratio": self.floor_ratio}


def p0_fifo_bound(w: Any, capacity_rps: float, best_goodput_tok_s: float, slo_ttft: float, slo_tpot: float,
                  *, target_share: float = 0.95, duration: float = 300.0, seeds: Sequence[int] = (1, 2, 3),
                  ns: Sequence[int] = (24, 32, 40, 48, 64),
                  caps: Sequence[float] = (0, 512, 2048, math.inf)) -> FifoBound:
    """`fifo_policy` over N x K for the workload's P0 share at the burst's load, every point
    pooled over `seeds` (P0 TTFT p99 over all their P0s; goodput their mean), beside the P0-alone
    floor and the unloaded reference (the unloaded phase's load, all classes, FIFO)."""
    import numpy as np

    shares = w.priority_shares
    burst = max(w.phases, key=lambda p: p.load)
    unloaded = min(w.phases, key=lambda p: p.load)
    p0_rate = shares[0] * burst.load * capacity_rps

    def pooled(n: int, cap: float) -> FifoPoint:
        runs = [fifo_policy(w, n, cap, p0_rate, duration, slo_ttft, slo_tpot, seed=w.seed * 1000 + s, samples=True)
                for s in seeds]
        ttft = [t for r in runs for t in r[1]]
        return FifoPoint(n, cap, float(np.mean([r[0].goodput_tok_s for r in runs])), _percentile(ttft, 99),
                         tuple(r[0].p0_ttft_p99_s for r in runs), len(ttft))

    # the bench's reference pass: every request a P0 at the unloaded phase's load, FIFO engines
    # (least-backlog routing here: a lower reference than Envoy's, so a higher ratio)
    ref_runs = [fifo_policy(w, 0, 0, unloaded.load * capacity_rps, duration, slo_ttft, slo_tpot,
                            seed=w.seed * 1000 + 500 + s, samples=True)[1] for s in seeds]
    ref = _percentile([t for r in ref_runs for t in r], 99)
    alone = pooled(0, 0)
    points = tuple(pooled(n, cap) for n in ns for cap in caps)
    target = target_share * best_goodput_tok_s
    ok = [p for p in points if p.goodput_tok_s >= target]
    best = min(ok, key=lambda p: p.p0_ttft_p99_s) if ok else None
    return FifoBound(shares[0], target, ref, alone, points, best)


def main(argv: list[str] | None = None) -> None:
    """Print the FIFO bound per P0 share: `python -m floodgate.bench.p0_bound --shares 0.1 0.2 0.3`."""
    import argparse

    from floodgate.bench.overload import Workload

    ap = argparse.ArgumentParser(description="P0 TTFT bound for admission policies on FIFO engines")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.2, 0.3], help="P0 shares of the load")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--capacity", type=float, default=19.1)
    ap.add_argument("--best", type=float, default=1222.0, help="best steady goodput, tok/s")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--ns", type=int, nargs="+", default=[24, 32, 40, 48, 64])
    ap.add_argument("--caps", type=float, nargs="+", default=[0, 512, 2048, math.inf])
    args = ap.parse_args(argv)
    for share in args.shares:
        rest = 1.0 - share
        w = Workload(priority_shares=(share, rest * 0.625, rest * 0.375))
        b = p0_fifo_bound(w, args.capacity, args.best, 2.0, 0.1, duration=args.duration, seeds=args.seeds,
                          ns=args.ns, caps=args.caps)
        unl = b.unloaded_p0_ttft_p99_s
        print(f"\nP0 share {share:.2f}: unloaded TTFT p99 {1000 * unl:.0f} ms; target {b.target_goodput_tok_s:.0f} "
              f"tok/s; P0 alone (floor) {1000 * b.p0_alone.p0_ttft_p99_s:.0f} ms = {b.floor_ratio:.2f}x")
        print("| N per replica | K tokens | goodput tok/s | P0 TTFT p99 ms (per seed) | vs unloaded |")
        print("|---:|---:|---:|---:|---:|")
        for p in b.points:
            mark = " **best**" if p is b.best else ""
            print(f"| {p.n_per_replica} | {p.backlog_cap:g} | {p.goodput_tok_s:.0f} | {1000 * p.p0_ttft_p99_s:.0f} ("
                  + " / ".join(f"{1000 * x:.0f}" for x in p.p0_ttft_p99_seeds_s)
                  + f") | {p.p0_ttft_p99_s / unl:.2f}x{mark} |", flush=True)


__all__ = ["FIFO_NOTE", "BoundPoint", "FifoBound", "FifoPoint", "fifo_policy", "ideal_policy", "p0_fifo_bound",
           "prefill_backlog"]


if __name__ == "__main__":
    main()
