"""Trace backtest: replay requests through a discrete-event model of replicas under several
scaling policies, side by side, and report SLO attainment against replica-seconds.

Model (docs/controller.md, "Backtest"):

* A replica has `slots_per_replica` concurrent slots (continuous batching at the batch size
  that keeps TPOT within budget). A request holds one slot for
  `prefill_s_per_token·ContextTokens + tpot_s·GeneratedTokens` seconds.
* Requests wait in one FIFO queue per pool (Floodgate's queue) and start on the earliest free
  slot of an *active* replica. SLO: queueing delay (arrival → first slot) ≤ `slo_wait_s`.
  A request still queued when the run ends misses the SLO.
* Lifecycle per `controller.lifecycle`: a cold start takes U(cold_start_min_s,
  cold_start_max_s) plus a warm-up; promoting a sleeping warm replica takes
  U(wake_min_s, wake_max_s), an awake one `warmup_s`; drains wait for in-flight requests.
* Time advances in control ticks (`tick_s`): lifecycle events due, then the policy and the
  planner, then every request that can start before the next tick, then accounting.
* Cost: replica-seconds of every loading, warming, waking, active or draining replica at
  weight 1, warm-pool replicas at `warm_cost_weight` (a sleeping vLLM has released its GPU
  memory but the node is still held). Both the weighted and the unweighted sums are reported.

Policies: Floodgate (`controller.policy.decide` + forecast floor + warm-pool planner, with and
without warm pool / forecast), an HPA-style policy, a Knative-KPA-style policy and a
perfect-foresight oracle that knows every future request, provisions exactly the slots they
need and pays each replica's cold start as replica-seconds without ever waiting for it.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from floodgate.controller import forecast as fc
from floodgate.controller.lifecycle import (
    ActionKind,
    BurstMemory,
    Event,
    WarmPoolConfig,
    apply_event,
    observe_burst,
    plan_pool,
    warm_pool_target,
)
from floodgate.controller.policy import PolicyConfig, PolicyState, decide
from floodgate.controller.signals import (
    INCOMING_STATES,
    PoolSignals,
    QueueSignal,
    ReplicaMetrics,
    ReplicaState,
    ReplicaView,
)

S = ReplicaState
DAY_S = 86400.0

# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class SimConfig:
    """Replica model and accounting. Defaults: an 8B-class model on one GPU."""

    tick_s: float = 2.0  # control tick of the engine and of Floodgate/KPA
    slots_per_replica: int = 8  # concurrent sequences per replica within the TPOT budget
    prefill_s_per_token: float = 0.00025  # 4k prompt tokens/s
    tpot_s: float = 0.03  # 30 ms per generated token
    cold_start_min_s: float = 120.0
    cold_start_max_s: float = 300.0
    wake_min_s: float = 5.0  # vLLM sleep level 1 wake + warm-up
    wake_max_s: float = 15.0
    warmup_s: float = 1.0  # one-token warm-up request
    slo_wait_s: float = 2.0  # queueing delay budget (TTFT minus prefill)
    queue_timeout_s: float = 15.0  # Floodgate rejects (429) a request queued this long
    warm_cost_weight: float = 0.25
    kv_fill_at_full: float = 0.85  # mean KV usage of a replica with every slot busy
    seed: int = 1


@dataclass(frozen=True)
class Workload:
    """Requests of the evaluated window plus the demand history of the days before it."""

    name: str
    arrivals: np.ndarray  # absolute seconds, sorted
    service: np.ndarray  # slot-seconds per request
    tokens: np.ndarray  # prompt + generated tokens (KV footprint)
    start: float
    end: float
    history: fc.DemandHistory | None
    description: str


# ---------------------------------------------------------------------------------------------
# Workloads


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from first request, context tokens, generated tokens) of an Azure LLM trace CSV."""
    from datetime import datetime

    ts: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            # Timestamps carry 7 fractional digits; fromisoformat takes 6.
            raw = row["TIMESTAMP"].strip()
            if "." in raw:
                head, frac = raw.split(".", 1)
                raw = f"{head}.{frac[:6]}"
            ts.append(datetime.fromisoformat(raw).timestamp())
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    t = np.asarray(ts, dtype=float)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return t, np.asarray(ctx, dtype=float)[order], np.asarray(gen, dtype=float)[order]


def _synthetic_tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    # Lognormals matched to the Azure conversation trace (means ≈ 1155 and 211 tokens).
    ctx = np.clip(rng.lognormal(6.8, 0.75, n), 8, 8192)
    gen = np.clip(rng.lognormal(5.05, 0.7, n), 1, 2048)
    return ctx, gen


@dataclass(frozen=True)
class DayShape:
    """Diurnal demand shape with a recurring morning peak and random bursts."""

    trough: float = 0.3  # rate at 03:00 relative to the 15:00 peak
    event_hour: float = 9.0  # a daily job that repeats every day (forecastable)
    event_minutes: float = 40.0
    event_mult: float = 1.6
    bursts_per_day: float = 6.0  # Poisson count of unforecastable bursts per day
    burst_mult: tuple[float, float] = (1.5, 2.5)
    burst_s: tuple[float, float] = (120.0, 600.0)
    ramp_s: float = 30.0
    day_noise: float = 0.05  # day-to-day amplitude noise (std, relative)


def _ramp_window(t: np.ndarray, start: float, dur: float, ramp: float) -> np.ndarray:
    up = np.clip((t - start) / ramp, 0, 1)
    down = np.clip((start + dur - t) / ramp, 0, 1)
    return np.minimum(up, down)


def day_shape(t_in_day: np.ndarray, shape: DayShape, rng: np.random.Generator) -> np.ndarray:
    """Rate multiplier (peak = 1, without events) at seconds-of-day `t_in_day` for one day."""
    h = t_in_day / 3600.0
    s = shape.trough + (1 - shape.trough) * 0.5 * (1 - np.cos(2 * np.pi * (h - 3.0) / 24.0))
    s = s * max(0.5, rng.normal(1.0, shape.day_noise))
    ev = _ramp_window(t_in_day, shape.event_hour * 3600, shape.event_minutes * 60, 60.0)
    mult = 1 + (shape.event_mult - 1) * ev
    for _ in range(rng.poisson(shape.bursts_per_day)):
        start = rng.uniform(0, DAY_S)
        dur = rng.uniform(*shape.burst_s)
        m = rng.uniform(*shape.burst_mult)
        mult = np.maximum(mult, 1 + (m - 1) * _ramp_window(t_in_day, start, dur, shape.ramp_s))
    return np.asarray(s * mult)


def make_day_workload(
    *,
    days: int,
    peak_rps: float,
    sim: SimConfig,
    trace: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    tile: bool,
    shape: DayShape = DayShape(),
    eval_hours: float = 24.0,
    seed: int = 1,
) -> Workload:
    """`days` days of diurnal + burst traffic; the last day (first `eval_hours` of it) is
    evaluated, the earlier ones become per-minute demand history for the forecaster.

    `tile=True` takes arrivals from the trace (time-compressed and tiled, so its own
    minute-scale burstiness survives) and thins them to the day shape; otherwise arrivals are
    Poisson. Tokens come from the trace when given (resampled), else from matched lognormals.
    """
    rng = np.random.default_rng(seed)
    grid = np.arange(0.0, DAY_S, 1.0)
    all_t: list[np.ndarray] = []
    all_c: list[np.ndarray] = []
    all_g: list[np.ndarray] = []
    for d in range(days):
        shp = day_shape(grid, shape, rng)
        smax = float(shp.max())
        lam_max = peak_rps * smax
        if tile and trace is not None:
            tt, _, _ = trace
            span = float(tt[-1]) + 1.0
            k = (len(tt) / span) / lam_max  # compress the trace so its mean rate is lam_max
            period = span * k
            reps = math.ceil(DAY_S / period) + 1
            off = rng.uniform(0, period)
            cand = (tt[None, :] * k + (np.arange(reps)[:, None] * period) - off).ravel()
            cand = np.sort(cand[(cand >= 0) & (cand < DAY_S)])
        else:
            n = rng.poisson(lam_max * DAY_S)
            cand = np.sort(rng.uniform(0, DAY_S, n))
        keep = rng.random(len(cand)) < shp[cand.astype(np.int64)] / smax
        t = cand[keep]
        if trace is not None:
            idx = rng.integers(0, len(trace[1]), len(t))
            c, g = trace[1][idx], trace[2][idx]
        else:
            c, g = _synthetic_tokens(rng, len(t))
        all_t.append(t + d * DAY_S)
        all_c.append(c)
        all_g.append(g)
    service_all = [c * sim.prefill_s_per_token + g * sim.tpot_s for c, g in zip(all_c, all_g, strict=True)]
    # History: offered concurrency per minute (Little: Σ service of the minute's arrivals / 60).
    hist: fc.DemandHistory | None = None
    if days > 1:
        ht = np.concatenate(all_t[:-1])
        hs = np.concatenate(service_all[:-1])
        n_min = int((days - 1) * DAY_S // 60)
        per_min = np.bincount((ht // 60).astype(np.int64), weights=hs, minlength=n_min)[:n_min] / 60.0
        hist = fc.DemandHistory.empty(max(n_min, 8 * 1440), end_minute=n_min - 1)
        vals = np.array(hist.values)
        vals[-n_min:] = per_min
        vals.flags.writeable = False
        hist = fc.DemandHistory(n_min - 1, vals)
    start = (days - 1) * DAY_S
    end = start + eval_hours * 3600.0
    t = all_t[-1]
    sel = t < end
    kind = "tiled Azure trace" if (tile and trace is not None) else "Poisson"
    return Workload(
        name=f"{'tile' if tile and trace is not None else 'synthetic'}-{days}d",
        arrivals=t[sel],
        service=service_all[-1][sel],
        tokens=(all_c[-1] + all_g[-1])[sel],
        start=start,
        end=end,
        history=hist,
        description=(
            f"{days} days of diurnal traffic ({kind} arrivals, peak {peak_rps:g} req/s, "
            f"daily {shape.event_hour:g}:00 peak ×{shape.event_mult:g}, "
            f"~{shape.bursts_per_day:g} random bursts/day ×{shape.burst_mult[0]:g}–{shape.burst_mult[1]:g}); "
            f"day {days} evaluated ({eval_hours:g} h, {int(sel.sum())} requests)"
        ),
    )


def make_replay_workload(
    trace: tuple[np.ndarray, np.ndarray, np.ndarray], sim: SimConfig, rate_scale: float = 1.0, seed: int = 1
) -> Workload:
    """The trace as recorded; `rate_scale` > 1 superposes jittered copies (rate × k, same shape)."""
    rng = np.random.default_rng(seed)
    t, c, g = trace
    copies = [np.arange(len(t))] * int(rate_scale)
    frac = rate_scale - int(rate_scale)
    if frac > 0:
        copies.append(np.flatnonzero(rng.random(len(t)) < frac))
    idx = np.concatenate(copies) if copies else np.arange(len(t))
    jitter = np.where(np.arange(len(idx)) < len(t), 0.0, rng.uniform(0, 1.0, len(idx)))
    tt = t[idx] + jitter
    order = np.argsort(tt, kind="stable")
    tt, idx = tt[order], idx[order]
    svc = c[idx] * sim.prefill_s_per_token + g[idx] * sim.tpot_s
    return Workload(
        name="replay",
        arrivals=tt,
        service=svc,
        tokens=c[idx] + g[idx],
        start=0.0,
        end=float(tt[-1]) + 1.0,
        history=None,
        description=f"Azure trace replayed as recorded (rate ×{rate_scale:g}, {len(tt)} requests, no history)",
    )


# ---------------------------------------------------------------------------------------------
# Controllers under test


@dataclass
class Observation:
    """What a controller sees at a tick (the simulator's scrape)."""

    now: float
    replicas: tuple[ReplicaView, ...]
    running: list[int]  # per active replica, aligned with `active_ids`
    kv: list[float]
    active_ids: list[str]
    queue: int  # Floodgate queue (requests not yet started)
    active: int
    incoming: int


class SimController(Protocol):
    name: str
    pool: WarmPoolConfig
    instant_start: bool

    def step(self, obs: Observation) -> tuple[int, int]:
        """(desired active replicas, warm-pool target) at `obs.now`."""
        ...


@dataclass
class FloodgateController:
    """The real policy, forecaster and warm-pool target, fed simulated scrapes."""

    name: str
    policy: PolicyConfig
    forecast: fc.ForecastConfig
    pool: WarmPoolConfig
    history: fc.DemandHistory | None
    pool_horizon_s: float = 1800.0
    instant_start: bool = False
    state: PolicyState = field(default_factory=PolicyState)
    acc: fc.MinuteAccumulator = field(default_factory=fc.MinuteAccumulator)
    _minute: int | None = None
    _floor: int | None = None
    _pool_f: int | None = None
    bursts: BurstMemory = field(default_factory=BurstMemory)
    reasons: dict[str, int] = field(default_factory=dict)
    forecast_engaged_ticks: int = 0
    ticks: int = 0

    def step(self, obs: Observation) -> tuple[int, int]:
        now = obs.now
        metrics = tuple(
            ReplicaMetrics(rid, now, True, 0.0, float(r), k)
            for rid, r, k in zip(obs.active_ids, obs.running, obs.kv, strict=True)
        )
        signals = PoolSignals("sim", metrics, QueueSignal(float(obs.queue), now))
        # History: the demand the live controller would record (running + waiting).
        if self.history is not None:
            self.acc, done = fc.accumulate(self.acc, now, float(sum(obs.running) + obs.queue))
            if done is not None:
                self.history = self.history.record(*done)
        m = fc.minute_of(now)
        if m != self._minute and self.history is not None and self.forecast.enabled:
            self._minute = m
            f = fc.predict(self.history, now, self.forecast)
            self._floor = fc.floor_replicas(f, self.policy.target_concurrency, self.forecast.headroom)
            pf = fc.predict(self.history, now, self.forecast, 0.0, self.pool_horizon_s)
            self._pool_f = fc.floor_replicas(pf, self.policy.target_concurrency, self.forecast.headroom)
        plan, self.state = decide(self.policy, signals, obs.replicas, self.state, now, self._floor)
        self.reasons[plan.reason] = self.reasons.get(plan.reason, 0) + 1
        self.ticks += 1
        if self._floor is not None:
            self.forecast_engaged_ticks += 1
        self.bursts = observe_burst(self.bursts, now, plan.desired, self.pool)
        return plan.desired, warm_pool_target(plan.desired, self._pool_f, self.pool, self.bursts.largest())


@dataclass
class HPAController:
    """Kubernetes HPA semantics on a concurrency metric: every `sync_s`,
    desired = ceil(current × metric/target) outside a ±tolerance band (unready pods count as
    zero usage on scale-up, as the HPA does), scale-up limited to max(4 pods, 100%) per sync,
    scale-down to the max recommendation of the last `down_stabilization_s`."""

    name: str
    target: float
    min_replicas: int
    max_replicas: int
    pool: WarmPoolConfig
    sync_s: float = 15.0
    tolerance: float = 0.1
    down_stabilization_s: float = 300.0
    instant_start: bool = False
    desired: int | None = None
    last_sync: float = -math.inf
    recs: list[tuple[float, int]] = field(default_factory=list)

    def step(self, obs: Observation) -> tuple[int, int]:
        current = obs.active + obs.incoming
        if self.desired is None:
            self.desired = max(current, self.min_replicas)
        if obs.now - self.last_sync < self.sync_s - 1e-9:
            return self.desired, 0
        self.last_sync = obs.now
        demand = sum(obs.running) + obs.queue
        base = max(current, 1)
        ratio = demand / (base * self.target)
        rec = current if abs(ratio - 1) <= self.tolerance else math.ceil(base * ratio - 1e-9)
        rec = min(rec, max(2 * current, current + 4))
        self.recs = [(t, r) for t, r in self.recs if obs.now - t < self.down_stabilization_s]
        self.recs.append((obs.now, rec))
        stab = max(r for _, r in self.recs)
        desired = rec if rec > self.desired else min(self.desired, stab)
        self.desired = min(max(desired, self.min_replicas), self.max_replicas)
        return self.desired, 0


@dataclass
class KPAController:
    """Knative KPA semantics: concurrency averaged over a 60 s stable and a 6 s panic window;
    panic when the panic-window recommendation is ≥ 2× the ready pods; in panic never scale
    down; leave panic after a stable window without the condition; scale down at most to half
    per tick; no scale-down delay (Knative's default)."""

    name: str
    target: float
    min_replicas: int
    max_replicas: int
    pool: WarmPoolConfig
    stable_s: float = 60.0
    panic_s: float = 6.0
    panic_threshold: float = 2.0
    max_scale_down_rate: float = 2.0
    instant_start: bool = False
    samples: list[tuple[float, float]] = field(default_factory=list)
    desired: int | None = None
    panic_since: float | None = None

    def step(self, obs: Observation) -> tuple[int, int]:
        now = obs.now
        demand = float(sum(obs.running) + obs.queue)
        self.samples = [(t, v) for t, v in self.samples if now - t < self.stable_s]
        self.samples.append((now, demand))
        stable = sum(v for _, v in self.samples) / len(self.samples)
        recent = [v for t, v in self.samples if now - t < self.panic_s]
        panic_avg = sum(recent) / len(recent)
        want_stable = math.ceil(stable / self.target - 1e-9)
        want_panic = math.ceil(panic_avg / self.target - 1e-9)
        ready = max(obs.active, 1)
        if self.desired is None:
            self.desired = max(obs.active + obs.incoming, self.min_replicas)
        if want_panic / ready >= self.panic_threshold:
            self.panic_since = now
        elif self.panic_since is not None and now - self.panic_since >= self.stable_s:
            self.panic_since = None
        if self.panic_since is not None:
            desired = max(want_panic, self.desired)
        else:
            desired = max(want_stable, math.floor(ready / self.max_scale_down_rate))
        self.desired = min(max(desired, self.min_replicas), self.max_replicas)
        return self.desired, 0


@dataclass
class OracleController:
    """Perfect foresight: at each tick exactly the replicas whose slots cover the peak
    concurrency of that tick if every request started on arrival; gaps shorter than a cold
    start are bridged (cheaper than restarting). Starts are instant, and each start is charged
    the mean cold start in replica-seconds (it would have been started that much earlier)."""

    name: str
    schedule: np.ndarray  # desired active per tick
    t0: float
    tick_s: float
    pool: WarmPoolConfig
    instant_start: bool = True

    def step(self, obs: Observation) -> tuple[int, int]:
        k = min(len(self.schedule) - 1, max(0, round((obs.now - self.t0) / self.tick_s)))
        return int(self.schedule[k]), 0


def _sliding_max(a: np.ndarray, w: int, forward: bool) -> np.ndarray:
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


def oracle_schedule(w: Workload, sim: SimConfig) -> np.ndarray:
    """Desired active replicas per tick for the perfect-foresight oracle."""
    n_ticks = math.ceil((w.end - w.start) / sim.tick_s) + 1
    edges = w.start + np.arange(n_ticks + 1) * sim.tick_s
    ends = np.sort(w.arrivals + w.service)
    running_at = np.searchsorted(w.arrivals, edges[:-1], "right") - np.searchsorted(ends, edges[:-1], "right")
    arriving = np.diff(np.searchsorted(w.arrivals, edges, "left"))
    need = np.ceil((running_at + arriving) / sim.slots_per_replica).astype(np.int64)
    bridge = round((sim.cold_start_min_s + sim.cold_start_max_s) / 2 / sim.tick_s)
    return np.asarray(np.minimum(_sliding_max(need, bridge, True), _sliding_max(need, bridge, False)))


# ---------------------------------------------------------------------------------------------
# Engine


@dataclass
class Result:
    name: str
    requests: int
    slo_ok: int
    rejected: int  # queue timeouts (429) plus requests still queued at the end
    p50_wait: float
    p99_wait: float
    max_wait: float
    replica_s: float  # loading + warming + waking + active + draining
    warm_s: float
    cost: float  # replica_s + warm_cost_weight × warm_s (+ oracle's cold starts)
    unweighted: float
    cold_starts: int
    promotions: int
    wakes: int
    drains: int
    mean_active: float
    peak_active: int
    timeline: dict[str, list[float]] = field(default_factory=dict, repr=False)
    notes: str = ""

    @property
    def slo(self) -> float:
        return self.slo_ok / self.requests if self.requests else 1.0


def _dur(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi)) if hi > lo else lo


def run_policy(
    w: Workload,
    ctl: SimController,
    sim: SimConfig,
    initial_active: int,
    record_every_s: float = 60.0,
) -> Result:
    """Simulate `w` under `ctl`; deterministic for a given `sim.seed`."""
    rng = np.random.default_rng(sim.seed)
    C = sim.slots_per_replica
    dt = sim.tick_s
    arr = w.arrivals
    svc = w.service
    toks = w.tokens
    n = len(arr)
    start_at = np.full(n, np.inf)  # inf: rejected after queue_timeout_s or never started
    timeout = sim.queue_timeout_s
    rejected = 0
    kv_budget = C * float(toks.mean() if n else 1.0) / sim.kv_fill_at_full

    # Replica tables, indexed by sequence number (= id suffix).
    views: dict[int, ReplicaView] = {}
    due: dict[int, tuple[float, Event]] = {}  # next automatic event per replica
    slots: dict[int, list[float]] = {}
    slot_tok: dict[int, list[float]] = {}
    epoch: dict[int, int] = {}
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    t = w.start

    def new_replica(now: float, state: ReplicaState) -> int:
        nonlocal seq
        i = seq
        seq += 1
        views[i] = ReplicaView(f"r{i}", state, now)
        slots[i] = [now] * C
        slot_tok[i] = [0.0] * C
        epoch[i] = 0
        return i

    def activate(i: int, now: float) -> None:
        epoch[i] += 1
        ep = epoch[i]
        for c in range(C):
            f = slots[i][c]
            heapq.heappush(heap, (f if f > now else now, i, c, ep))

    for _ in range(initial_active):
        i = new_replica(t, S.ACTIVE)
        activate(i, t)

    cold_starts = promotions = wakes = drains = 0
    replica_s = warm_s = 0.0
    extra_cost = 0.0
    nxt = 0
    tl: dict[str, list[float]] = {k: [] for k in ("t", "active", "warm", "loading", "demand_slots", "desired")}
    next_record = t
    desired_log = 0
    active_sum = 0.0
    ticks = 0
    peak_active = 0
    next_seq_for_plan = 0
    end = w.end

    while t < end:
        # 1. Lifecycle events that fell due.
        for i, (when, ev) in list(due.items()):
            if when <= t:
                del due[i]
                v = apply_event(views[i], ev, when)
                if ev is Event.LOADED:
                    v = apply_event(v, Event.WARMUP_OK, when)
                views[i] = v
                if v.state is S.ACTIVE:
                    activate(i, t)

        # 2. Scrape, decide, plan, act.
        active_ids: list[str] = []
        running: list[int] = []
        kv: list[float] = []
        vs: list[ReplicaView] = []
        incoming = 0
        for i, v in views.items():
            st = v.state
            if st is S.ACTIVE or st is S.DRAINING:
                sl = slots[i]
                busy = 0
                tok = 0.0
                stk = slot_tok[i]
                for c in range(C):
                    if sl[c] > t:
                        busy += 1
                        tok += stk[c]
                if busy != v.running:
                    v = ReplicaView(v.replica_id, st, v.state_since, busy, busy, v.asleep, t if busy else v.last_busy_at)
                    views[i] = v
                if st is S.ACTIVE:
                    active_ids.append(v.replica_id)
                    running.append(busy)
                    kv.append(min(1.0, tok / kv_budget))
            elif st in INCOMING_STATES:
                incoming += 1
            vs.append(v)
        replicas = tuple(vs)
        arrived = int(np.searchsorted(arr, t, "right"))
        cut = int(np.searchsorted(arr, t - timeout, "left"))
        if cut > nxt:  # queue timeouts: 429, they leave the queue
            rejected += cut - nxt
            nxt = cut
        queue = arrived - nxt
        obs = Observation(t, replicas, running, kv, active_ids, queue, len(active_ids), incoming)
        desired, warm_target = ctl.step(obs)
        desired_log = desired
        plan = plan_pool(desired, replicas, warm_target, t, ctl.pool, next_seq_for_plan)
        for a in plan.actions:
            if a.kind is ActionKind.START:
                i = new_replica(t, S.COLD)
                next_seq_for_plan = max(next_seq_for_plan, i + 1)
                views[i] = apply_event(views[i], Event.START, t)
                cold_starts += 1
                if ctl.instant_start:
                    # The oracle started it a cold start ago: charge that, make it serve now.
                    extra_cost += (sim.cold_start_min_s + sim.cold_start_max_s) / 2
                    v = views[i]
                    for ev in (Event.LOADED, Event.WARMUP_OK, Event.PROMOTE, Event.WAKE_OK):
                        v = apply_event(v, ev, t)
                    views[i] = v
                    activate(i, t)
                else:
                    due[i] = (t + _dur(rng, sim.cold_start_min_s, sim.cold_start_max_s) + sim.warmup_s, Event.LOADED)
                continue
            i = int(a.replica_id[1:])
            v = views[i]
            if a.kind is ActionKind.PROMOTE:
                promotions += 1
                if v.asleep:
                    wakes += 1
                    delay = _dur(rng, sim.wake_min_s, sim.wake_max_s)
                else:
                    delay = sim.warmup_s
                views[i] = apply_event(v, Event.PROMOTE, t)
                due[i] = (t + delay, Event.WAKE_OK)
            elif a.kind is ActionKind.SLEEP:
                views[i] = ReplicaView(v.replica_id, v.state, v.state_since, 0, 0, True, v.last_busy_at)
            elif a.kind is ActionKind.DRAIN:
                drains += 1
                epoch[i] += 1  # its heap slots are void: no new requests
                views[i] = apply_event(v, Event.DRAIN, t)
            elif a.kind is ActionKind.RECYCLE:
                views[i] = apply_event(v, Event.DRAINED, t, recycle=True, asleep=False)
            elif a.kind is ActionKind.FORCE_STOP:
                views[i] = apply_event(v, Event.DRAIN_TIMEOUT, t)
            elif a.kind is ActionKind.TERMINATE:
                if v.state is S.DRAINING:
                    views[i] = apply_event(v, Event.DRAINED, t, recycle=False)
                else:
                    views[i] = apply_event(v, Event.TERMINATE, t)
                due.pop(i, None)
        # Drop terminated replicas from the tables.
        for i in [i for i, v in views.items() if v.state is S.TERMINATED]:
            del views[i]
            slots.pop(i, None)
            slot_tok.pop(i, None)

        # 3. Requests that can start before the next tick (FIFO, earliest free slot).
        tend = t + dt
        last = int(np.searchsorted(arr, tend, "left"))
        while nxt < last and heap:
            f, i, c, ep = heap[0]
            if ep != epoch.get(i, -1):
                heapq.heappop(heap)
                continue
            if f >= tend:
                break
            a_ = arr[nxt]
            if f - a_ > timeout:
                rejected += 1
                nxt += 1
                continue
            st_ = a_ if a_ > f else f
            e = st_ + svc[nxt]
            heapq.heapreplace(heap, (e, i, c, ep))
            slots[i][c] = e
            slot_tok[i][c] = toks[nxt]
            start_at[nxt] = st_
            nxt += 1

        # 4. Accounting for [t, t + dt).
        n_act = n_warm = n_load = 0
        full = 0
        warm_w = 0
        for v in views.values():
            st = v.state
            if st is S.WARM:
                n_warm += 1
                if v.asleep:
                    warm_w += 1
                else:
                    full += 1  # awake pool replica still holds its GPU memory
            else:
                full += 1
                if st is S.ACTIVE:
                    n_act += 1
                elif st is not S.DRAINING:
                    n_load += 1
        replica_s += full * dt
        warm_s += warm_w * dt
        active_sum += n_act
        peak_active = max(peak_active, n_act)
        ticks += 1
        if t >= next_record:
            next_record += record_every_s
            tl["t"].append(t - w.start)
            tl["active"].append(n_act)
            tl["warm"].append(n_warm)
            tl["loading"].append(n_load)
            tl["demand_slots"].append((sum(running) + queue) / C)
            tl["desired"].append(desired_log)
        t = tend

    waits = start_at - arr
    ok = int(np.count_nonzero(waits <= sim.slo_wait_s + 1e-9))
    finite = waits[np.isfinite(waits)]
    cost = replica_s + sim.warm_cost_weight * warm_s + extra_cost
    return Result(
        name=ctl.name,
        requests=n,
        slo_ok=ok,
        rejected=int(np.count_nonzero(~np.isfinite(waits))),
        # "higher": no interpolation, so a rejected (infinite) wait yields inf, not nan.
        p50_wait=float(np.percentile(waits, 50, method="higher")) if n else 0.0,
        p99_wait=float(np.percentile(waits, 99, method="higher")) if n else 0.0,
        max_wait=float(finite.max()) if len(finite) else 0.0,
        replica_s=replica_s + extra_cost,
        warm_s=warm_s,
        cost=cost,
        unweighted=replica_s + warm_s + extra_cost,
        cold_starts=cold_starts,
        promotions=promotions,
        wakes=wakes,
        drains=drains,
        mean_active=active_sum / max(1, ticks),
        peak_active=peak_active,
        timeline=tl,
    )


# ---------------------------------------------------------------------------------------------
# The comparison


POLICY_NAMES: tuple[str, ...] = (
    "floodgate",
    "floodgate-no-forecast",
    "floodgate-no-warm-pool",
    "floodgate-reactive",
    "hpa",
    "kpa",
    "oracle",
)


def build_controllers(
    w: Workload,
    sim: SimConfig,
    policy: PolicyConfig,
    forecast: fc.ForecastConfig,
    pool: WarmPoolConfig,
    names: Sequence[str] = POLICY_NAMES,
) -> list[SimController]:
    no_pool = pool.model_copy(update={"enabled": False})
    # Kubernetes removes surplus pods at once: no one-at-a-time drain for the baselines.
    k8s_pool = no_pool.model_copy(update={"max_concurrent_drains": 10_000})
    no_fc = forecast.model_copy(update={"enabled": False})
    out: list[SimController] = []
    for name in names:
        if name == "floodgate":
            out.append(FloodgateController(name, policy, forecast, pool, w.history))
        elif name == "floodgate-no-forecast":
            out.append(FloodgateController(name, policy, no_fc, pool, w.history))
        elif name == "floodgate-no-warm-pool":
            out.append(FloodgateController(name, policy, forecast, no_pool, w.history))
        elif name == "floodgate-reactive":
            out.append(FloodgateController(name, policy, no_fc, no_pool, w.history))
        elif name == "hpa":
            out.append(HPAController(name, policy.target_concurrency, policy.min_replicas, policy.max_replicas, k8s_pool))
        elif name == "kpa":
            out.append(KPAController(name, policy.target_concurrency, policy.min_replicas, policy.max_replicas, k8s_pool))
        elif name == "oracle":
            out.append(OracleController(name, oracle_schedule(w, sim), w.start, sim.tick_s, k8s_pool))
        else:
            raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return out


def initial_replicas(w: Workload, sim: SimConfig, policy: PolicyConfig) -> int:
    """Replicas at the start of the evaluated window: what the first minute needs at target."""
    first = w.arrivals < w.start + 60
    conc = float(w.service[first].sum()) / 60.0
    return min(policy.max_replicas, max(policy.min_replicas, math.ceil(conc / policy.target_concurrency)))


def compare(
    w: Workload,
    sim: SimConfig,
    policy: PolicyConfig,
    forecast: fc.ForecastConfig,
    pool: WarmPoolConfig,
    names: Sequence[str] = POLICY_NAMES,
    progress: Callable[[str], None] | None = None,
) -> list[Result]:
    results = []
    init = initial_replicas(w, sim, policy)
    for ctl in build_controllers(w, sim, policy, forecast, pool, names):
        t0 = time.perf_counter()
        r = run_policy(w, ctl, sim, init)
        if isinstance(ctl, FloodgateController):
            engaged = ctl.forecast_engaged_ticks / max(1, ctl.ticks)
            r.notes = f"forecast floor engaged {engaged:.0%} of ticks" if ctl.forecast.enabled else ""
        if progress:
            progress(f"{ctl.name}: {time.perf_counter() - t0:.1f}s")
        results.append(r)
    return results


def _fmt_wait(x: float, sim: SimConfig) -> str:
    return f"{x:.2f}" if math.isfinite(x) else f"> {sim.queue_timeout_s:g} (429)"


def markdown_table(results: Sequence[Result], sim: SimConfig) -> str:
    oracle = next((r for r in results if r.name == "oracle"), None)
    head = (
        f"| policy | SLO ≤{sim.slo_wait_s:g}s wait | p99 wait (s) | replica-h | warm-h | "
        f"cost (warm ×{sim.warm_cost_weight:g}) | cost / oracle | unweighted / oracle | "
        "rejected | mean active | cold starts | pool wakes |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        rel = f"{r.cost / oracle.cost:.3f}" if oracle and oracle.cost else "–"
        relu = f"{r.unweighted / oracle.unweighted:.3f}" if oracle and oracle.unweighted else "–"
        lines.append(
            f"| {r.name} | {r.slo * 100:.2f}% | {_fmt_wait(r.p99_wait, sim)} | {r.replica_s / 3600:.1f} | "
            f"{r.warm_s / 3600:.1f} | {r.cost / 3600:.1f} | {rel} | {relu} | "
            f"{r.rejected / max(1, r.requests) * 100:.2f}% | {r.mean_active:.1f} | {r.cold_starts} | {r.wakes} |"
        )
    return "\n".join(lines)


def write_outputs(out: Path, w: Workload, sim: SimConfig, results: Sequence[Result], meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "workload": w.description,
        "sim": asdict(sim),
        **meta,
        "results": [
            {k: v for k, v in asdict(r).items() if k != "timeline"} | {"slo": r.slo} for r in results
        ],
    }
    (out / "simulate.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "timeline.json").write_text(json.dumps({r.name: r.timeline for r in results}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.0 * len(results)), sharex=True)
    axes_list = list(np.atleast_1d(axes))
    for ax, r in zip(axes_list, results, strict=True):
        tl = r.timeline
        hours = np.asarray(tl["t"]) / 3600.0
        ax.plot(hours, tl["demand_slots"], color="0.6", lw=0.8, label="demand / slots")
        ax.plot(hours, tl["active"], color="C0", lw=1.0, label="active")
        ax.plot(hours, np.asarray(tl["active"]) + np.asarray(tl["warm"]), color="C2", lw=0.8, label="active + warm")
        ax.plot(hours, tl["loading"], color="C3", lw=0.8, label="loading")
        ax.set_ylabel(r.name, fontsize=8)
        ax.set_title(f"{r.name}: SLO {r.slo * 100:.2f}%, cost {r.cost / 3600:.0f} replica-h", fontsize=8)
    axes_list[0].legend(fontsize=7, ncol=4, loc="upper left")
    axes_list[-1].set_xlabel("hours into the evaluated window")
    fig.tight_layout()
    fig.savefig(out / "replicas.png", dpi=110)
    plt.close(fig)
