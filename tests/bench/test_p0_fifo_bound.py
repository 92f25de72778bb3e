"""The FIFO bound's model (bench/p0_bound.py `fifo_policy`): what it assumes, checked on the
replicas' own engine model (pure, virtual clock)."""

from __future__ import annotations

import math

import numpy as np
from floodgate.bench import overload
from floodgate.bench.p0_bound import fifo_policy, p0_fifo_bound

P0_RATE = 0.2 * 3.0 * 19.1  # the overload bench's burst: P0 20 % of 3x capacity


def test_fifo_policy_keeps_the_engines_fifo_and_its_cap() -> None:
    """No request ever enters ahead of one already waiting (the engines run fcfs and nothing
    reorders them), and a lower-class request enters only a replica with at most K prompt
    tokens left to prefill and fewer than N sequences."""
    w = overload.Workload()
    seen = {"lower": 0, "p0": 0}

    def observe(e, cls: int, backlog: int) -> None:  # type: ignore[no-untyped-def]
        assert e.config.scheduling_policy == "fcfs"
        arrivals = [s.arrival_order for s in e.waiting]
        assert arrivals == sorted(arrivals)
        if cls == 0:
            seen["p0"] += 1
        else:
            seen["lower"] += 1
            assert backlog <= 512
            assert len(e.running) + len(e.waiting) < 32

    fifo_policy(w, 32, 512, P0_RATE, 30.0, 2.0, 0.1, seed=3, observe=observe)
    assert seen["p0"] > 200 and seen["lower"] > 100


def test_p0_alone_is_below_every_paced_point() -> None:
    """The lower bound's assumption: lower-class requests only add work ahead of or beside a P0,
    so the same P0s (times and lengths) on engines serving nothing else are never slower. And
    the pacing is what the achievable point buys: at the same batch, K = 0 beats no cap."""
    w = overload.Workload()

    def p99(n: int, k: float) -> float:
        runs = [fifo_policy(w, n, k, P0_RATE, 60.0, 2.0, 0.1, seed=s, samples=True)[1] for s in (1, 2)]
        return float(np.percentile([t for r in runs for t in r], 99))

    alone = p99(0, 0)
    paced, unpaced = p99(48, 0), p99(48, math.inf)
    assert alone <= paced <= unpaced
    assert unpaced > 1.1 * paced


def test_fifo_bound_picks_the_best_point_reaching_the_goodput() -> None:
    w = overload.Workload()
    b = p0_fifo_bound(w, 19.1, 1222.0, 2.0, 0.1, duration=40.0, seeds=(1,), ns=(8, 48), caps=(0, math.inf))
    small = [p for p in b.points if p.n_per_replica == 8]
    assert all(p.goodput_tok_s < b.target_goodput_tok_s for p in small)  # 8 a replica cannot reach it
    assert b.best is not None and b.best.n_per_replica == 48
    assert b.best.p0_ttft_p99_s == min(p.p0_ttft_p99_s for p in b.points if p.n_per_replica == 48)
    assert b.ratio is not None and b.ratio >= b.floor_ratio > 0
    assert b.to_dict()["best"]["backlog_cap"] == b.best.backlog_cap
