"""The backtest engine: a discrete-event model of replicas serving a workload under one
controller, scored by SLO attainment and replica-seconds.

Model (docs/controller.md, "Backtest"):

* A replica has `slots_per_replica` concurrent slots (continuous batching at the batch size
  that keeps TPOT within budget). A request holds one slot for its service time.
* Requests wait in one FIFO queue per pool (Floodgate's queue) and start on the earliest free
  slot of an *active* replica. SLO: queueing delay (arrival → first slot) ≤ `slo_wait_s`;
  a request queued `queue_timeout_s` is rejected (429) and misses, as does one still queued
  at the end.
* Admission (`SimConfig.admission` and a controller with `admission`, i.e. Floodgate; the
  zero-wait reference and the HPA/KPA baselines run without it): the processor's early drop. A request
  that finds no free slot (the requests queued ahead of it, those arrived before it this tick
  and let in, less the expected starts since the tick, take the free slots first) is judged
  by the processor's own rule, `extproc.policy.WaitEstimate.certainly_over` for a standard
  class (`early_drop_min_chance` 0.5, the release rate at its upper confidence bound): turned
  away when the chance that enough slots free before `queue_timeout_s` is too low; when the
  rate is 0 (at the start, after an idle spell) or rests on fewer than `MIN_RELEASES`
  releases, it waits. The release rate is the engine's recent start rate. A turned-away
  request misses its SLO. What admission turns away is counted the way the
  processors count it in Redis (admitted / early_drop / queue_timeout per pool) and handed to
  the controller with the signals, so the controller sees offered demand, not only the queue
  admission keeps short. The replicas' latency (TTFT = prefill, ITL = `tpot_s`, since the
  queue is held at the gateway) and concurrency go with it, for the learned capacity.
* A request cut off by a forced stop (a drain that outlived `max_drain_s`) misses its SLO
  and is counted in `Result.killed`; so does one still running on a replica the controller
  terminates or recycles before its drain ended (the shipped planners never do: they wait for
  the drain), so that no request is served by a replica that is no longer charged.
* Lifecycle per `controller.lifecycle`, every planned action applied with
  `lifecycle.apply_action` (the mapping the live controller uses): a cold start takes
  U(cold_start_min_s, cold_start_max_s) plus a warm-up; promoting a sleeping warm replica
  takes U(wake_min_s, wake_max_s), an awake one `warmup_s`; drains wait for in-flight requests.
* Time advances in control ticks (`tick_s`): lifecycle events due, then the controller's
  `step(signals, now)` (for Floodgate: `decider.decide`, the live controller's step), then
  every request that can start before the next tick, then accounting.
* The engine runs from `Workload.start` and scores from `Workload.scored_from`, so the
  evaluated window starts from the replicas and warm pool the warm-up left.
* Cost: replica-seconds of every replica that holds its GPU (loading, warming, waking, active,
  draining, awake warm) at weight 1, sleeping warm-pool replicas at `warm_cost_weight`
  (default 1: under Kubernetes with one GPU per pod a sleeping pod keeps its GPU; a value below
  1 is real only if the freed GPU memory is handed to another model, or with sleep level 2 and
  the GPU released). An instant start (the zero-wait reference) is charged `start_cost_s`,
  the lead it would have been started with, but only the part of that lead inside the scored
  window: a start at t is charged min(start_cost_s, t − the first scored tick), as a replica
  started start_cost_s before t would have been by the per-tick accounting.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
from floodgate.controller.backtest.workload import Workload
from floodgate.controller.capacity import TickLatency
from floodgate.controller.decider import DeciderConfig, DeciderState, Signals, decide
from floodgate.controller.demand import ClassCounters, FloodgateCounters
from floodgate.controller.lifecycle import Action, ActionKind, Event, apply_action, apply_event
from floodgate.controller.signals import (
    INCOMING_STATES,
    PoolSignals,
    QueueSignal,
    ReplicaMetrics,
    ReplicaState,
    ReplicaView,
)
from floodgate.controller.vllm import Histogram
from floodgate.extproc.config import AdmissionConfig, ClassConfig, PoolConfig
from floodgate.extproc.policy import RATE_TAU_S, WaitEstimate

S = ReplicaState

# The processor's early-drop threshold for a standard class (not `rejects_fast`).
EARLY_DROP_MIN_CHANCE: float = ClassConfig.model_fields["early_drop_min_chance"].default
SHIPPED_QUEUE_TIMEOUT_S: float = PoolConfig().classes[AdmissionConfig().default_priority].queue_timeout_s


def early_drop(deficit: float, rate: float, samples: float, timeout_s: float) -> bool:
    """The processor's early drop for a standard-class request that finds no free slot:
    `deficit` = requests ahead of it in line beyond the free slots (≥ 0: it needs
    ⌈deficit⌉ + 1 releases), `rate` releases per second, `samples` releases the rate rests on.
    True: turn it away now. False with a rate of 0 or too few samples (when unsure, it waits)."""
    est = WaitEstimate(ahead=math.ceil(deficit - 1e-9), free=0, gap=0, rate=rate, class_rate=0.0,
                       samples=samples, higher_arrivals=0.0)
    return est.certainly_over(timeout_s, EARLY_DROP_MIN_CHANCE)


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
    # Floodgate rejects (429) a request queued this long: the shipped default class's (P1, the
    # class of a request without a priority header: 1.5 s), for every policy alike. It was 15 s,
    # which no class ships (a yardstick review: the results moved with it, floodgate 99.27 ->
    # 99.83 % and HPA 99.01 -> 99.48 % on jumps-x3 seed 1). `--queue-timeout` sets another.
    queue_timeout_s: float = SHIPPED_QUEUE_TIMEOUT_S
    warm_cost_weight: float = 1.0  # cost of a sleeping warm-pool replica-second (see module doc)
    kv_fill_at_full: float = 0.85  # mean KV usage of a replica with every slot busy
    admission: bool = True  # early drop on arrival + demand counters and latency to the controller
    seed: int = 1

    @property
    def start_cost_s(self) -> float:
        """The shortest possible start (fastest cold start + warm-up): what an instant start
        is charged, in replica-seconds."""
        return self.cold_start_min_s + self.warmup_s


class SimController(Protocol):
    name: str
    instant_start: bool  # started replicas serve at once (the zero-wait reference), charged start_cost_s
    admission: bool  # Floodgate's admission in front (early drop, demand counters to the controller)

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        """Replica actions at `now` (ids of new replicas chosen by the controller)."""
        ...


@dataclass
class FloodgateController:
    """The live controller's step (`decider.decide`) fed the engine's signals."""

    name: str
    cfg: DeciderConfig
    state: DeciderState
    instant_start: bool = False
    admission: bool = True
    reasons: dict[str, int] = field(default_factory=dict)
    forecast_reasons: dict[str, int] = field(default_factory=dict)  # ok / high_error / short_history / disabled
    ticks: int = 0

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        self.state, d = decide(self.cfg, self.state, signals, now)
        self.reasons[d.plan.reason] = self.reasons.get(d.plan.reason, 0) + 1
        self.forecast_reasons[d.forecast.reason] = self.forecast_reasons.get(d.forecast.reason, 0) + 1
        self.ticks += 1
        return d.actions


@dataclass
class Result:
    name: str
    requests: int
    slo_ok: int
    rejected: int  # early drops and queue timeouts (429) plus requests still queued at the end
    p50_wait: float
    p99_wait: float
    max_wait: float
    replica_s: float  # replicas holding a GPU (all but sleeping warm), incl. charged starts
    warm_s: float  # sleeping warm-pool replica-seconds
    cost: float  # replica_s + warm_cost_weight × warm_s
    unweighted: float  # replica_s + warm_s
    cold_starts: int
    promotions: int
    wakes: int
    drains: int
    forced_stops: int
    killed: int  # requests cut off by a forced stop, or on a replica terminated or recycled mid-drain: SLO misses
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
    # TTFT is the prompt's prefill (the generated tokens come after it): a review found
    # prompt + generated here, so long outputs read as long prompts to learned capacity.
    prompt_toks = w.prompt if w.prompt is not None else toks
    n = len(arr)
    start_at = np.full(n, np.inf)  # inf: rejected after queue_timeout_s or never started
    timeout = sim.queue_timeout_s
    kv_budget = C * float(toks.mean() if n else 1.0) / sim.kv_fill_at_full
    scored_from = w.scored_from

    # Replica tables by id.
    views: dict[str, ReplicaView] = {}
    due: dict[str, tuple[float, Event]] = {}  # next automatic event per replica
    slots: dict[str, list[float]] = {}
    slot_tok: dict[str, list[float]] = {}
    slot_req: dict[str, list[int]] = {}  # request index in each slot (-1: none yet)
    epoch: dict[str, int] = {}
    heap: list[tuple[float, str, int, int]] = []
    t = w.start

    def new_replica(rid: str, view: ReplicaView, now: float) -> None:
        views[rid] = view
        slots[rid] = [now] * C
        slot_tok[rid] = [0.0] * C
        slot_req[rid] = [-1] * C
        epoch[rid] = 0

    def activate(rid: str, now: float) -> None:
        epoch[rid] += 1
        ep = epoch[rid]
        for c in range(C):
            f = slots[rid][c]
            heapq.heappush(heap, (f if f > now else now, rid, c, ep))

    for k in range(initial_active):
        rid = f"init{k}"
        new_replica(rid, ReplicaView(rid, S.ACTIVE, t), t)
        activate(rid, t)

    cold_starts = promotions = wakes = drains = forced = killed = 0
    # Admission model: early drops, and the per-pool demand counters the processors keep.
    dropped = np.zeros(n, dtype=bool)
    cut_off = np.zeros(n, dtype=bool)  # cut off mid-response by a forced stop
    drops: list[int] = []  # dropped indices, increasing
    decided = 0  # arrivals before this index had their admission decision
    n_started = n_timeout = 0
    grant_rate = 0.0  # recent starts per second (exponentially smoothed per tick)
    tick_ttft: list[float] = []  # replica-side TTFT of the requests started last tick
    last_turned = 0  # drops + timeouts as of the previous tick
    admit = sim.admission and ctl.admission

    def cut_streams(rid: str, now: float) -> int:
        """Cut off the requests still running on `rid` (it stops serving: force-stopped, or
        terminated or recycled before its drain ended): SLO misses, their slots freed. So a
        request that met its SLO was on a charged replica for its whole service time (what the
        lower bounds in oracle.py rest on). Returns how many were cut."""
        cut = 0
        for c, f in enumerate(slots[rid]):
            i = slot_req[rid][c]
            if f > now and i >= 0 and not cut_off[i]:
                cut_off[i] = True
                cut += 1
            slots[rid][c] = min(f, now)
        return cut

    def drops_in(a: int, b: int) -> int:
        return bisect.bisect_left(drops, b) - bisect.bisect_left(drops, a)
    replica_s = warm_s = 0.0
    charged = 0.0
    scored_t0: float | None = None  # the first scored tick
    nxt = 0
    tl: dict[str, list[float]] = {k: [] for k in ("t", "active", "warm", "loading", "demand_slots")}
    next_record = scored_from
    active_sum = 0.0
    ticks = 0
    peak_active = 0
    end = w.end

    while t < end:
        scoring = t >= scored_from - 1e-9
        if scoring and scored_t0 is None:
            scored_t0 = t
        # 1. Lifecycle events that fell due.
        for rid, (when, ev) in list(due.items()):
            if when <= t:
                del due[rid]
                v = apply_event(views[rid], ev, when)
                if ev is Event.LOADED:
                    v = apply_event(v, Event.WARMUP_OK, when)
                views[rid] = v
                if v.state is S.ACTIVE:
                    activate(rid, t)

        # 2. Scrape (vLLM metrics of active and draining replicas, the queue), step, act.
        metrics: list[ReplicaMetrics] = []
        vs: list[ReplicaView] = []
        for rid, v in views.items():
            st = v.state
            if st is S.ACTIVE or st is S.DRAINING:
                sl = slots[rid]
                stk = slot_tok[rid]
                busy = 0
                tok = 0.0
                for c in range(C):
                    if sl[c] > t:
                        busy += 1
                        tok += stk[c]
                if busy != v.running:
                    v = ReplicaView(v.replica_id, st, v.state_since, busy, busy, v.asleep, t if busy else v.last_busy_at)
                    views[rid] = v
                metrics.append(ReplicaMetrics(rid, t, True, 0.0, float(busy), min(1.0, tok / kv_budget)))
            vs.append(v)
        # Queued at t: arrived before t (one arriving at t is decided and started below).
        arrived = int(np.searchsorted(arr, t, "left"))
        cut = int(np.searchsorted(arr, t - timeout, "left"))
        if cut > nxt:  # queue timeouts: 429, they leave the queue
            n_timeout += (cut - nxt) - drops_in(nxt, cut)
            nxt = cut
        queue = arrived - nxt - drops_in(nxt, arrived)
        pool = PoolSignals("sim", tuple(metrics), QueueSignal(float(queue), t))
        if admit:
            turned = len(drops) + n_timeout
            n_active = sum(1 for v in vs if v.state is S.ACTIVE)
            running = sum(m.running for m in metrics if views[m.replica_id].state is S.ACTIVE)
            pool = replace(pool, counters=FloodgateCounters(
                t, True, {1: ClassCounters(admitted=float(n_started), early_drop=float(len(drops)),
                                           queue_timeout=float(n_timeout))}, {1: float(queue)}),
                latency=_latency(tick_ttft, sim, running, n_active, queue > 0 or turned > last_turned)
                if n_active else None)
            last_turned = turned
            tick_ttft = []
        signals = Signals(pool, tuple(vs))
        for a in ctl.step(signals, t):
            rid = a.replica_id
            kind = a.kind
            if kind is ActionKind.START:
                new_replica(rid, apply_action(ReplicaView(rid, S.COLD, t), kind, t), t)
                cold_starts += 1
                if ctl.instant_start:
                    # A clairvoyant schedule began it the shortest start ago: charge that lead's
                    # part inside the scored window (none before it), serve now.
                    if scored_t0 is not None:
                        charged += min(sim.start_cost_s, t - scored_t0)
                    v = views[rid]
                    for ev in (Event.LOADED, Event.WARMUP_OK, Event.PROMOTE, Event.WAKE_OK):
                        v = apply_event(v, ev, t)
                    views[rid] = v
                    activate(rid, t)
                else:
                    due[rid] = (t + _dur(rng, sim.cold_start_min_s, sim.cold_start_max_s) + sim.warmup_s, Event.LOADED)
                continue
            v = views[rid]
            if kind is ActionKind.PROMOTE:
                promotions += 1
                if v.asleep:
                    wakes += 1
                    delay = _dur(rng, sim.wake_min_s, sim.wake_max_s)
                else:
                    delay = sim.warmup_s
                due[rid] = (t + delay, Event.WAKE_OK)
            elif kind is ActionKind.DRAIN:
                drains += 1
                epoch[rid] += 1  # its heap slots are void: no new requests
            elif kind is ActionKind.UNDRAIN:
                views[rid] = apply_action(v, kind, t)
                activate(rid, t)  # its slots take new requests again
                continue
            elif kind is ActionKind.FORCE_STOP:
                forced += 1
                killed += cut_streams(rid, t)
            elif kind is ActionKind.TERMINATE:
                due.pop(rid, None)
                killed += cut_streams(rid, t)  # none when its drain ended (as the planners wait for)
            elif kind is ActionKind.RECYCLE:
                killed += cut_streams(rid, t)  # likewise
            views[rid] = apply_action(v, kind, t)
        for rid in [rid for rid, v in views.items() if v.state is S.TERMINATED]:
            del views[rid]
            slots.pop(rid, None)
            slot_tok.pop(rid, None)
            slot_req.pop(rid, None)

        # 3. Requests that can start before the next tick (FIFO, earliest free slot).
        tend = t + dt
        last = int(np.searchsorted(arr, tend, "left"))
        if admit and decided < last:
            # Early drop (module doc), only for a request that finds no free slot.
            free = sum(C - int(v.running) for v in views.values() if v.state is S.ACTIVE)
            samples = min(float(n_started), grant_rate * RATE_TAU_S) if grant_rate > 0 else 0.0
            accepted = 0
            for i in range(decided, last):
                deficit = queue + accepted - free - grant_rate * max(0.0, arr[i] - t)
                if deficit >= 0 and early_drop(deficit, grant_rate, samples, timeout):
                    dropped[i] = True
                    drops.append(i)
                else:
                    accepted += 1
            decided = last
        started_before = n_started
        while nxt < last and heap:
            f, rid, c, ep = heap[0]
            if ep != epoch.get(rid, -1):
                heapq.heappop(heap)
                continue
            if f >= tend:
                break
            if dropped[nxt]:
                nxt += 1
                continue
            a_ = arr[nxt]
            if f - a_ > timeout:
                n_timeout += 1
                nxt += 1
                continue
            st_ = a_ if a_ > f else f
            e = st_ + svc[nxt]
            heapq.heapreplace(heap, (e, rid, c, ep))
            slots[rid][c] = e
            slot_tok[rid][c] = toks[nxt]
            slot_req[rid][c] = nxt
            start_at[nxt] = st_
            n_started += 1
            if admit:
                tick_ttft.append(sim.prefill_s_per_token * float(prompt_toks[nxt]))
            nxt += 1
        grant_rate = 0.5 * grant_rate + 0.5 * (n_started - started_before) / dt

        # 4. Accounting for [t, t + dt).
        if scoring:
            n_act = n_warm = n_load = 0
            full = 0
            asleep = 0
            for v in views.values():
                st = v.state
                if st is S.WARM:
                    n_warm += 1
                    if v.asleep:
                        asleep += 1
                    else:
                        full += 1  # awake pool replica still holds its GPU memory
                else:
                    full += 1
                    if st is S.ACTIVE:
                        n_act += 1
                    elif st is not S.DRAINING:
                        n_load += 1
            replica_s += full * dt
            warm_s += asleep * dt
            active_sum += n_act
            peak_active = max(peak_active, n_act)
            ticks += 1
            if t >= next_record:
                next_record += record_every_s
                tl["t"].append(t - scored_from)
                tl["active"].append(n_act)
                tl["warm"].append(n_warm)
                tl["loading"].append(n_load)
                tl["demand_slots"].append((sum(m.running for m in metrics) + queue) / C)
        t = tend

    scored = arr >= scored_from
    waits = (start_at - arr)[scored]
    m_ = len(waits)
    ok = int(np.count_nonzero((waits <= sim.slo_wait_s + 1e-9) & ~cut_off[scored]))
    finite = waits[np.isfinite(waits)]
    return Result(
        name=ctl.name,
        requests=m_,
        slo_ok=ok,
        rejected=int(np.count_nonzero(~np.isfinite(waits))),
        # "higher": no interpolation, so a rejected (infinite) wait yields inf, not nan.
        p50_wait=float(np.percentile(waits, 50, method="higher")) if m_ else 0.0,
        p99_wait=float(np.percentile(waits, 99, method="higher")) if m_ else 0.0,
        max_wait=float(finite.max()) if len(finite) else 0.0,
        replica_s=replica_s + charged,
        warm_s=warm_s,
        cost=replica_s + charged + sim.warm_cost_weight * warm_s,
        unweighted=replica_s + charged + warm_s,
        cold_starts=cold_starts,
        promotions=promotions,
        wakes=wakes,
        drains=drains,
        forced_stops=forced,
        killed=killed,
        mean_active=active_sum / max(1, ticks),
        peak_active=peak_active,
        timeline=tl,
    )


_TTFT_LE = (0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, math.inf)
_ITL_LE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, math.inf)


def _latency(ttft: list[float], sim: SimConfig, running: float, active: int, saturated: bool) -> TickLatency:
    """What the replicas' /metrics would show for one tick: TTFT histogram of the requests
    started (prefill only: the queue is held at the gateway), ITL at `tpot_s` (~10 tokens per
    started request), concurrency = running on the active replicas."""
    v = np.asarray(ttft, dtype=float)
    th = Histogram(tuple((le, float(np.count_nonzero(v <= le))) for le in _TTFT_LE), float(v.sum()), float(len(v)))
    k = 10.0 * len(v)
    ih = Histogram(tuple((le, k if sim.tpot_s <= le else 0.0) for le in _ITL_LE), k * sim.tpot_s, k)
    return TickLatency(th, ih, running, active, False, saturated)


def initial_replicas(w: Workload, target_concurrency: float, min_replicas: int, max_replicas: int) -> int:
    """Replicas at the start of the simulation: what its first minute needs at target."""
    first = (w.arrivals >= w.start) & (w.arrivals < w.start + 60)
    conc = float(w.service[first].sum()) / 60.0
    return min(max_replicas, max(min_replicas, math.ceil(conc / target_concurrency)))


def demand_of(signals: Signals) -> tuple[int, int, float]:
    """(active, incoming, running on active replicas + queued) of a tick's signals — what the
    HPA/KPA baselines read."""
    active = {v.replica_id for v in signals.replicas if v.state is S.ACTIVE}
    incoming = sum(1 for v in signals.replicas if v.state in INCOMING_STATES)
    running = sum(m.running for m in signals.pool.replicas if m.replica_id in active)
    q = signals.pool.queue
    return len(active), incoming, running + (q.depth if q is not None else 0.0)
