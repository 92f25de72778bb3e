"""The yardstick: an exact zero-wait oracle and a rigorous lower bound on cost.

* `zero_wait_schedule`: for every tick, the fewest replicas whose slots cover the *exact*
  peak concurrency inside the tick if every request started on arrival (arrivals and
  departures within the tick are swept in time order, a departure freeing its slot before an
  arrival at the same instant). A level that would be off for a gap shorter than the shortest
  start is kept on (cheaper than stopping and restarting it).
* `OracleController`: follows that schedule through the same engine as every policy, over a
  plain ReplicaSet; its starts are instant and each is charged `SimConfig.start_cost_s` (the
  fastest cold start + warm-up — it would have been started that much earlier). It has no
  sleep state. Zero wait holds by construction: at every arrival fewer than active×slots
  requests run on active replicas, so a slot is free (`tests/controller/test_backtest.py`).
* `lower_bound_s`: Σ service / slots — every served request holds one slot for its service
  time, with no idle slot, no start cost, no drain. No policy that serves every request can
  cost less, at any sleeping weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from floodgate.controller.backtest.baselines import plan_replicaset
from floodgate.controller.backtest.engine import SimConfig
from floodgate.controller.backtest.workload import Workload
from floodgate.controller.decider import Signals
from floodgate.controller.lifecycle import Action


def peak_concurrency(arrivals: np.ndarray, service: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Exact max concurrency within each [edges[k], edges[k+1]) when every request runs from
    its arrival for its service time."""
    ends = arrivals + service
    times = np.concatenate([ends, arrivals])
    delta = np.concatenate([-np.ones(len(ends), np.int64), np.ones(len(arrivals), np.int64)])
    # Departures first at equal times: a slot freed at t serves an arrival at t (as the engine).
    order = np.lexsort((delta, times))
    times, delta = times[order], delta[order]
    conc = np.cumsum(delta)
    nbin = len(edges) - 1
    # Concurrency at each bin's start: after every event before it.
    first = np.searchsorted(times, edges[:-1], "left")
    at_start = np.where(first > 0, conc[np.maximum(first - 1, 0)], 0)
    peak = at_start.copy()
    inside = (times >= edges[0]) & (times < edges[-1])
    b = np.searchsorted(edges, times[inside], "right") - 1
    np.maximum.at(peak, b, conc[inside])
    return peak[:nbin]


def sliding_max(a: np.ndarray, w: int, forward: bool) -> np.ndarray:
    """max(a[k..k+w]) (forward) or max(a[k-w..k]) (backward) for non-negative `a`."""
    cur = a.copy()
    span = 1  # cur[k] covers `span` elements
    while span < w + 1:
        step = min(span, w + 1 - span)
        sh = np.zeros_like(cur)
        if forward:
            sh[:-step] = cur[step:]
        else:
            sh[step:] = cur[:-step]
        cur = np.maximum(cur, sh)
        span += step
    return cur


def zero_wait_schedule(w: Workload, sim: SimConfig) -> np.ndarray:
    """Active replicas per tick from `w.start` for the exact zero-wait oracle."""
    n_ticks = math.ceil((w.end - w.start) / sim.tick_s) + 1
    edges = w.start + np.arange(n_ticks + 1) * sim.tick_s
    need = np.ceil(peak_concurrency(w.arrivals, w.service, edges) / sim.slots_per_replica).astype(np.int64)
    bridge = math.ceil(sim.start_cost_s / sim.tick_s)
    return np.asarray(np.minimum(sliding_max(need, bridge, True), sliding_max(need, bridge, False)))


def lower_bound_s(w: Workload, sim: SimConfig) -> float:
    """Σ service / slots over the scored requests (replica-seconds)."""
    scored = w.arrivals >= w.scored_from
    return float(w.service[scored].sum()) / sim.slots_per_replica


@dataclass
class OracleController:
    name: str
    schedule: np.ndarray
    t0: float
    tick_s: float
    instant_start: bool = True
    admission: bool = False  # no Floodgate admission in front
    seq: int = 0

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        k = min(len(self.schedule) - 1, max(0, round((now - self.t0) / self.tick_s)))
        p = plan_replicaset(int(self.schedule[k]), signals.replicas, now, math.inf, self.seq)
        self.seq = p.next_seq
        return p.actions
