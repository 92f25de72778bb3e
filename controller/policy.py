"""The scaling policy: a pure function from (signals, replicas, state, now) to a plan.

Modelled on Knative's autoscaler: one `decide(...)` per pool per tick, no I/O, no clock of its
own (`now` is an argument), returning the desired number of *active* replicas with a reason,
plus the new policy state to feed into the next call. The warm-pool planner
(`controller.lifecycle.plan_pool`) turns the desired count into replica actions.

Rules (docs/controller.md):

* Demand = vLLM running + the larger of (vLLM waiting + Floodgate's queue for the pool) and
  `signals.lacking`: pressure held in Floodgate's queue never reaches vLLM's waiting queue, so
  both queues are counted; demand admission turned away (`controller.demand`, as concurrency)
  is the same excess seen from the other side while admission sheds (what runs plus what is
  turned away is the offered concurrency; a queue that stays meanwhile is a backlog admission
  bounds), so the larger of the two counts, not their sum.
* Recommendation = ceil(demand / per-replica capacity) — `signals.capacity` when learned
  (`controller.capacity`), else `target_concurrency` — unless within the tolerance band of the
  current size (no flapping on noise); demand above the current size with requests turned
  away always scales up.
* Queue pressure: waiting per replica > `queue_pressure_per_replica` ⇒ multiply by
  `scale_up_factor` (double) at once — when Floodgate's queue alone is above the threshold,
  or the backlog is above the one the last scale-up was sized with and demand exceeds what the
  current size (incoming included) carries: a backlog draining inside the old replicas after
  a wave turned active is not a new burst.
  KV-cache pressure (mean usage over active replicas above `kv_pressure_threshold`, while
  requests wait: `kv_pressure_needs_waiting`) is a second scale-up trigger; a scale-down that
  would leave the remaining replicas above the threshold is held (`hold_kv`).
* Loading / warming / waking replicas count as incoming capacity: triggers are sized on the
  active replicas and compared with the current size (which includes the incoming ones), so
  a queue that is still waiting for the first wave asks for the same wave again, not a second
  one (no cold-start cascade). The backlog itself is bounded by Floodgate's queue timeouts.
* Scale-down only to the max recommendation over the last `stabilization_window_s`, one
  replica per `scale_down_interval_s`.
* Burst estimate (`signals.burst`, `controller.demand.burst_concurrency`): offered concurrency
  at the rate of the last ticks, so a step is sized on the first decision that sees it rather
  than after the 5 s rate window catches up. Outside the tolerance band it raises the
  recommendation (reason `burst_demand`) and enters panic; it never enters the stabilization
  window, so it sizes scale-up only, never holds the pool up.
* First reaction (`burst_reaction`): once per panic window, a confirmed step (its point
  estimate beyond the current size, requests turned away since it, a backlog) is sized on the
  upper confidence bound of its rate (capped at a multiple of the point estimate): a replica
  decided now serves a cold start later, and a top-up decided later serves a cold start after
  that, so the first decision is sized for the whole step.
* Panic: a burst (any scale-up trigger, or demand ≥ `panic_threshold` × current capacity)
  forbids scale-down for `panic_window_s`.
* Stale or failed scrapes are never read as zero: the policy computes everything from fresh
  values only (a lower bound of the true load); a lower bound may justify a scale-up but never
  a scale-down, so any stale input turns a would-be scale-down into a hold.
* The predictive floor (from `controller.forecast`) raises the desired count but never lowers
  it; it enters the stabilization window, so its own decline is smoothed like any other.
* `min_replicas` / `max_replicas` bound the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from floodgate.controller.signals import INCOMING_STATES, PoolSignals, ReplicaState, ReplicaView
from pydantic import BaseModel, Field, model_validator

from floodgate.yamlconfig import STRICT

# Reason strings (decision log and the `reason` label of scale-event metrics).
REASON_QUEUE = "queue_pressure"
REASON_KV = "kv_pressure"
REASON_DEMAND = "demand"
REASON_BURST = "burst_demand"
REASON_REACTION = "burst_reaction"
REASON_FLOOR = "forecast_floor"
REASON_DOWN = "stabilized_down"
REASON_STEADY = "steady"
REASON_HOLD_WINDOW = "hold_window"
REASON_HOLD_STALE = "hold_stale"
REASON_HOLD_PANIC = "hold_panic"
REASON_HOLD_STEP = "hold_step"
REASON_HOLD_KV = "hold_kv"
REASON_BOUNDS = "bounds"
REASONS: tuple[str, ...] = (
    REASON_QUEUE,
    REASON_KV,
    REASON_DEMAND,
    REASON_BURST,
    REASON_REACTION,
    REASON_FLOOR,
    REASON_DOWN,
    REASON_STEADY,
    REASON_HOLD_WINDOW,
    REASON_HOLD_STALE,
    REASON_HOLD_PANIC,
    REASON_HOLD_STEP,
    REASON_HOLD_KV,
    REASON_BOUNDS,
)


class PolicyConfig(BaseModel):
    """Every threshold of the scaling policy. Defaults are the ones tuned with
    `floodgate controller simulate` (docs/controller.md)."""

    model_config = STRICT

    min_replicas: int = Field(default=1, ge=0, description="Fewest active replicas.")
    max_replicas: int = Field(default=64, ge=1, description="Most active replicas.")
    target_concurrency: float = Field(
        default=7.0,
        gt=0,
        description="Requests (running + waiting) one active replica should carry; "
        "sizes the proportional recommendation and the forecast floor.",
    )
    tolerance: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="No proportional change while demand/(current×target) is within 1±tolerance.",
    )
    queue_pressure_per_replica: float = Field(
        default=2.0, gt=0, description="Waiting requests per replica above which the pool is multiplied."
    )
    scale_up_factor: float = Field(
        default=2.0, ge=1, description="Multiplier applied at once on queue pressure (2 = double)."
    )
    kv_pressure_threshold: float = Field(
        default=0.9, gt=0, le=1, description="Mean KV-cache usage over active replicas that triggers a scale-up."
    )
    kv_target: float = Field(
        default=0.75, gt=0, le=1, description="KV usage the kv_pressure scale-up sizes the pool for."
    )
    kv_pressure_needs_waiting: bool = Field(
        default=True,
        description="KV pressure scales up only while requests wait (vLLM's queue or Floodgate's) or are "
        "turned away: KV "
        "usage near full with nothing waiting is a pool that still starts every request (a full replica "
        "sits near the threshold, so token-size noise alone fired the trigger on a steady load). "
        "Scale-down is held whenever removing a replica would put the mean KV usage of the rest above "
        "`kv_pressure_threshold` while any request runs or waits (idle KV moves nowhere). "
        "False: the trigger fires on usage alone.",
    )
    stabilization_window_s: float = Field(
        default=300.0, ge=0, description="Scale down only to the max recommendation over this window."
    )
    scale_down_step: int = Field(default=1, ge=1, description="Replicas removed per scale-down step.")
    scale_down_interval_s: float = Field(
        default=30.0, ge=0, description="Shortest time between two scale-down steps."
    )
    panic_threshold: float = Field(
        default=2.0, gt=1, description="Demand ≥ this × current capacity × target enters panic."
    )
    panic_window_s: float = Field(
        default=60.0, ge=0, description="No scale-down for this long after the last panic trigger."
    )
    wave_backlog_once: bool = Field(
        default=True,
        description="The backlog a scale-up waiting on cold starts was sized with counts once: while those "
        "replicas load (the queue grows at the arrival rate) and while they drain it, for at most "
        "`panic_window_s` after they serve (docs/controller.md, rule 5). False: every tick counts the whole "
        "backlog, as an HPA on queue length does.",
    )
    stale_after_s: float = Field(
        default=10.0, gt=0, description="A scrape older than this is stale (never read as zero)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> PolicyConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be ≤ max_replicas")
        return self


@dataclass(frozen=True, slots=True)
class Wave:
    """A scale-up waiting on cold starts, whose backlog counts once (`decide`, rule 5)."""

    backlog: float  # the backlog it was sized with
    top: float  # the highest backlog seen while its replicas loaded
    size: int  # the replicas it asked for
    demand: float  # the demand it counted: running + that backlog
    served_at: float | None = None  # when its replicas were first all serving (or waking)


@dataclass(frozen=True, slots=True)
class PolicyState:
    """What the policy remembers between ticks (per pool).

    `window` holds (time, recommendation) pairs of the stabilization window, pruned to a
    decreasing sequence: a recommendation followed by a larger one can never be the window's
    max again, so only O(distinct levels) entries are kept.
    """

    desired: int | None = None
    window: tuple[tuple[float, int], ...] = ()
    panic_until: float = -math.inf
    last_scale_down_at: float = -math.inf
    sized_backlog: float = 0.0  # waiting at the last scale-up (0 once panic ends)
    wave: Wave | None = None  # the scale-up whose backlog counts once (`decide`, rule 5); None: no wave
    react_until: float = -math.inf  # no second first reaction (`burst_reaction`) before this


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """One decision: desired active replicas, why, and the inputs that led to it."""

    desired: int
    previous: int
    reason: str
    cause: str  # the rule that set the value before bounds were applied (== reason if unbounded)
    recommendation: int  # this tick's recommendation (incl. triggers and floor)
    stabilized: int  # max recommendation over the stabilization window
    floor: int | None
    active: int
    incoming: int
    demand: float
    waiting: float
    running: float
    kv_mean: float | None
    stale: bool
    panic: bool
    lacking: float = 0.0  # turned-away demand counted in `demand` (concurrency)
    per_replica: float = 0.0  # capacity per replica the recommendation used
    burst: float = 0.0  # the burst estimate (offered concurrency since a step: the size)
    burst_low: float = 0.0  # its confident lower bound (what the policy acts on)
    burst_mid: float = 0.0  # the step at its rate's point estimate (the first reaction acts on it)
    burst_high: float = 0.0  # ... and at its upper bound (the first reaction sizes on it)

    @property
    def direction(self) -> str:
        if self.desired > self.previous:
            return "up"
        if self.desired < self.previous:
            return "down"
        return "none"


def _fresh(scraped_at: float, ok: bool, now: float, cfg: PolicyConfig) -> bool:
    return ok and now - scraped_at <= cfg.stale_after_s


def _push_window(
    window: tuple[tuple[float, int], ...], now: float, rec: int, span: float
) -> tuple[tuple[float, int], ...]:
    # Drop expired entries and entries dominated by the new one (max-queue invariant).
    kept = [(t, r) for (t, r) in window if now - t < span and r > rec]
    kept.append((now, rec))
    return tuple(kept)


def _kv_after_down(cfg: PolicyConfig, kv_mean: float | None, active: int, current: int, live: float) -> float:
    """Mean KV usage of the active replicas once one scale-down step has removed its replicas
    (the KV they hold now, spread over the rest). 0 when unknown, when the step removes no
    active replica (it only cancels incoming ones), when it leaves none (a stabilized 0 is a
    window of no demand), or when no request runs or waits (`live` 0): idle KV moves nowhere,
    and an idle engine need not read 0 (a never-freed null block, cached prefixes, a stuck
    per-process gauge), which would otherwise hold the pool up for ever."""
    if kv_mean is None or active <= 0 or live <= 0:
        return 0.0
    left = min(active, max(current - cfg.scale_down_step, cfg.min_replicas))
    if left >= active or left <= 0:
        return 0.0
    return kv_mean * active / left


def burst_reaction(cfg: PolicyConfig, mid: float, high: float, shed: bool, backlog: bool, current: int,
                   per_replica: float, reachable: int | None = None, demand: float = 0.0,
                   active: int | None = None, waiting: float = 0.0) -> int | None:
    """The first reaction to a confirmed step: the replicas to ask for, or None (pure;
    docs/controller.md, "First reaction").

    A replica decided now serves a cold start later, and every later decision adds replicas a
    cold start after *it*: the first scale-up after a step is the only one that can end the
    rejections within one cold start, so it is sized for the whole step, not for its lower
    bound. Confirmed means: the step's point estimate (`mid`, offered concurrency at the rate
    since the change point) is beyond what the current size carries (outside the tolerance
    band), a backlog waits (`backlog`: Floodgate's queue or vLLM's, or KV pressure), and the
    pool is measurably past its size: admission has turned requests away since the step
    (`shed`), or the concurrency the pool holds now (`demand`: running + waiting) is itself
    beyond what its `active` replicas carry (those ordered a tick ago serve a cold start
    later, so they do not count here) with a queue past the queue-pressure threshold
    (`waiting` above `queue_pressure_per_replica` per active replica: one or two requests
    waiting behind a full pool on a ramp is a clump, elastic seed 1 at 37 s: 17 held where 2
    replicas carry 14, 1 waiting, asked 2 -> 5). (Shedding alone made the rule depend on how long
    admission queues before it sheds: with a larger limit the first rejection came 1.3 s
    after detection and the reaction never fired.) Then the size is
    ceil(`high` / per_replica): the step rate's upper confidence bound, itself capped at a
    multiple of the point estimate (`demand.burst_react_sigma`, `burst_react_max_ratio`), so
    it is never more than the offered rate justifies; `max_replicas` bounds it as any rule.

    Only when the point estimate needs more replicas than the pool reaches without a cold
    start (`reachable`: the replicas serving within a wake: active, waking and warm ones and the
    drains a scale-up takes back; a replica still loading is a cold start under way, not
    counted): a shortfall the warm pool can
    fill is made up within a wake by the next decision, so the costs are no longer lopsided
    and the lower-bound rules size it (the elastic bench's burst 2, which its pool holds: the
    reaction asked 4 -> 7, 3 -> 7, 3 -> 6 where 4-5 carried it, with cold starts)."""
    band = 1.0 + cfg.tolerance
    act = max(current if active is None else active, 1)
    over = demand > band * act * per_replica and waiting > cfg.queue_pressure_per_replica * act
    if per_replica <= 0 or high <= 0 or not backlog or not (shed or over):
        return None
    if mid <= band * max(current, 1) * per_replica:
        return None
    if reachable is not None and math.ceil(mid / per_replica - 1e-9) <= reachable:
        return None
    return math.ceil(max(high, mid) / per_replica - 1e-9)


def decide(
    cfg: PolicyConfig,
    signals: PoolSignals,
    replicas: tuple[ReplicaView, ...],
    state: PolicyState,
    now: float,
    forecast_floor: int | None = None,
    stalled: frozenset[str] = frozenset(),
) -> tuple[ScalePlan, PolicyState]:
    """Desired active replicas for one pool at `now`, and the next policy state.

    `replicas` is the lifecycle view (states decide active vs incoming capacity); `signals`
    carries the measurements. `forecast_floor` (replicas, from `controller.forecast`) may only
    raise the result. `stalled`: waking replicas past their measured wake (`stalled_wakes`):
    still incoming, but not serving within a wake (the first reaction's gate).
    """
    active_ids: set[str] = set()
    draining_ids: set[str] = set()
    idle_drains: set[str] = set()  # draining with no operation in flight (`lifecycle.plan_pool` takes those back)
    incoming = 0
    waking = 0  # of `incoming`, the promotions under way: serving within a wake
    warm = 0  # the warm pool: promoted within a wake, no cold start
    for r in replicas:
        if r.state is ReplicaState.ACTIVE:
            active_ids.add(r.replica_id)
        elif r.state is ReplicaState.DRAINING:
            draining_ids.add(r.replica_id)
            if not r.busy:
                idle_drains.add(r.replica_id)
        elif r.state in INCOMING_STATES:
            incoming += 1
            waking += r.state is ReplicaState.WAKING and r.replica_id not in stalled
        elif r.state is ReplicaState.WARM:
            warm += 1
    active = len(active_ids)
    capacity = active + incoming
    current = state.desired if state.desired is not None else capacity
    current = min(max(current, cfg.min_replicas), cfg.max_replicas)
    # The last decision's count (a boot or a takeover has none: it starts from the bounds)
    before = state.desired if state.desired is not None else current

    # Fresh values only; anything missing or stale for an active replica marks the tick stale.
    waiting = 0.0
    running = 0.0
    kv_sum = 0.0
    kv_n = 0
    fresh_active: set[str] = set()
    takeable = 0  # drains a scale-up takes back: idle, their last scrape fresh (not `unhealthy`)
    for m in signals.replicas:
        is_active = m.replica_id in active_ids
        if not (is_active or m.replica_id in draining_ids):
            continue
        if not _fresh(m.scraped_at, m.ok, now, cfg):
            continue
        takeable += m.replica_id in idle_drains
        waiting += m.waiting
        running += m.running
        if is_active:
            fresh_active.add(m.replica_id)
            kv_sum += m.kv_cache_usage
            kv_n += 1
    stale = len(fresh_active) < active or signals.lacking_stale
    q = signals.queue
    queued = 0.0  # Floodgate's queue alone (the rest of `waiting` is inside the replicas)
    if q is not None:
        if _fresh(q.scraped_at, q.ok, now, cfg):
            queued = q.depth
            waiting += q.depth
        else:
            stale = True
    kv_mean = kv_sum / kv_n if kv_n else None
    # Offered demand: what runs and waits, plus what admission turned away (as concurrency,
    # `controller.demand`); sized with the learned per-replica capacity when there is one.
    lacking = signals.lacking
    # While admission turns requests away, the requests the pool cannot start now leave as
    # turned away or wait in a queue (Floodgate's or vLLM's): two views of one excess. What
    # runs plus what is turned away, at the measured slot time, is the offered concurrency
    # (Little's law); a queue that stays while requests are shed is a standing backlog that
    # admission bounds, not more offered work. So the larger of the two is counted, not their
    # sum: the sum asked for replicas a step never needed (elastic bench, seed 1, the first
    # burst: 8 -> 9 -> 10 at demand 57 = running 32 + waiting 12 + turned away 13, cold starts
    # that arrived after the rejections had ended on the replicas already coming). Without
    # requests turned away, the queue is the whole excess and counts in full, as before.
    # The same wave: while replicas a scale-up ordered are on their way (`incoming`), the backlog
    # it was sized with keeps growing at the arrival rate, because they do not serve yet; once
    # they serve, they drain it. Neither is more demand than that scale-up counted, so the
    # proportional rule counts the backlog up to what it did then. Counted in full, every tick of
    # a cold start asked for more: a review's step from 2 to 20 req/s (~25 concurrent, 4 replicas)
    # with one replica active went 1 -> 7 -> 12 -> ... -> 38 on `demand` alone, 30 of them active
    # after the need was gone (5x the replica-hours of a fixed set of 4). The wave ends once its
    # replicas serve and the backlog is back to what it was sized with, or grows past the highest
    # it reached while they loaded (they do not suffice: what grows past that top counts). Rates
    # are the channels for more demand meanwhile (the burst estimate, turned-away demand), and so
    # is the queue trigger below while the wave loads: it doubles the *active* replicas and is
    # compared with the size asked for, so it cannot cascade on a backlog, and a queue growing
    # past twice the active replicas is still what sized the elastic bench's first burst
    # (6 -> 8 at 63 s, 8 -> 10 at 77 s, the second a cold start before the first had arrived).
    wave = state.wave if cfg.wave_backlog_once else None
    counted = waiting
    loading = False  # a cold wave on its way
    if wave is not None:
        # Of the demand the wave was sized for, what does not run now: replicas of the wave that
        # turn active take their requests from that backlog (counted once, not again as running).
        left = max(0.0, wave.demand - running)
        # Its replicas still on their way, more of them than wakes bring (a wake serves within
        # seconds: the backlog of those seconds is small, and the warm-pool burst rules size on
        # it; a pool refill loading meanwhile is no part of the wave: elastic seed 1's first
        # burst, 3 active + 1 waking of 4 asked for, a refill loading, queue pressure to 6 is
        # still new evidence). A replica that ends its cold start is warm for a tick before its
        # promotion.
        if active + waking + warm < wave.size <= capacity + warm:
            loading = True
            wave = replace(wave, top=max(wave.top, waiting))
            counted = min(waiting, left)
        elif (waiting <= wave.backlog or capacity + warm < wave.size  # drained, or replicas gone
              or (wave.served_at is not None and now - wave.served_at > cfg.panic_window_s)):
            # (A backlog its replicas have served for a panic window and not drained is the
            # pool's own: counted in full again, as is one the wave's replicas never reached.)
            wave = None
        else:
            counted = min(waiting, left + max(0.0, waiting - wave.top))
    demand = running + max(counted, lacking)
    tc = signals.capacity or cfg.target_concurrency

    # Proportional recommendation with a tolerance band around the current size.
    base = max(capacity, 1)
    ratio = demand / (max(current, 1) * tc)
    if current > 0 and abs(ratio - 1.0) <= cfg.tolerance and not (lacking > 0 and ratio > 1.0):
        rec = current
    else:
        rec = math.ceil(demand / tc - 1e-9)
    cause = REASON_DEMAND

    # Burst triggers, sized on *active* replicas and compared with the current size, which
    # already counts loading ones: while the first wave loads, the queue (still growing) asks
    # for the same wave again, not for a second one (cascade prevention).
    panic = False
    act = max(active, 1)
    # Requests queued inside the old replicas (vLLM `waiting`) stay there when a new wave turns
    # active, so `active` grows within a second of a promotion while that backlog drains at the
    # old replicas' pace: doubling the new `active` on it starts a second wave nobody asked for
    # (the elastic bench's burst 2: 2 -> 4 -> 5 -> 8 -> 10 in 2 s). Every scale-up was sized
    # with the backlog it saw (demand counts it: `sized_backlog`, forgotten when panic ends), so
    # only a backlog above it, with demand that the size already asked for (current, incoming
    # included) does not cover, is new evidence. Floodgate's own queue is different: any
    # replica, the new ones included, takes from it, so that queue alone above the threshold
    # still doubles, as before.
    sized = state.sized_backlog if now < state.panic_until else 0.0
    if waiting / act > cfg.queue_pressure_per_replica:
        panic = True
        shared = queued / act > cfg.queue_pressure_per_replica
        # (Once a cold wave serves, the queue that grew while it loaded and that it now drains is
        # no pressure: only a queue past the top it reached. Doubling the new active count on it
        # at the wave's arrival was the cascade again, 7 -> 14 on a draining queue.)
        if wave is not None and not loading:  # a wave that serves
            fire = waiting > wave.top and (shared or demand > max(current, 1) * tc)
        else:
            fire = shared or (waiting > sized and running + max(waiting, lacking) > max(current, 1) * tc)
        if fire:
            up = math.ceil(act * cfg.scale_up_factor - 1e-9)
            if up > rec:
                rec, cause = up, REASON_QUEUE
    # KV pressure: usage above the threshold *and* requests waiting (KV constrains only when a
    # replica cannot start what it is offered; a full replica sits near the threshold, and on a
    # steady load token-size noise alone fired it: 6 -> 8 -> 6 cycles, docs/controller.md).
    kv_high = kv_mean is not None and kv_mean > cfg.kv_pressure_threshold
    # (Requests turned away count as waiting: admission that rejects at the door leaves every
    # queue empty while the pool cannot start what it is offered.)
    if kv_mean is not None and kv_high and (waiting > 0 or lacking > 0 or not cfg.kv_pressure_needs_waiting):
        up = max(active + 1, math.ceil(active * kv_mean / cfg.kv_target - 1e-9))
        panic = True
        if up > rec:
            rec, cause = up, REASON_KV
    if demand >= cfg.panic_threshold * base * tc:
        panic = True

    if forecast_floor is not None and forecast_floor > rec:
        rec, cause = forecast_floor, REASON_FLOOR
    # A stale tick only knows a lower bound: never let it pull the window down.
    window_rec = max(rec, current) if stale else rec
    window = _push_window(state.window, now, window_rec, cfg.stabilization_window_s)
    stabilized = max(r for _, r in window)

    # Burst estimate (Knative's panic window on offered demand): the step at its full height
    # on the first tick that sees it, outside the tolerance band. Scale-up only: it stays out
    # of the stabilization window, so it never holds the pool up once the step has passed
    # (panic holds it for `panic_window_s`, then the stable window decides).
    # It acts on the confident bound (`burst_low`) and sizes on `burst` (a looser bound, at
    # least as large): a clump of arrivals does not pass the first, and the first decision
    # after a step is not left at the second's timid size (`demand.burst_concurrency`).
    burst = signals.burst
    if signals.burst_low > (1.0 + cfg.tolerance) * max(current, 1) * tc:
        up = math.ceil(burst / tc - 1e-9)
        panic = True
        if up > rec:
            rec, cause = up, REASON_BURST

    # First reaction: once per panic window, the first confirmed step sizes the pool on the
    # upper bound of its rate (a later top-up would serve a whole cold start after this one).
    react_until = state.react_until
    if now >= react_until:
        backlog = waiting > 0 or kv_high
        # What serves within a wake without a cold start: the active, waking (not stalled: a hung
        # pool replica's wake serves nothing, `stalled_wakes`) and warm replicas
        # and the drains a scale-up takes back (idle, scraped: `lifecycle.plan_pool`; a busy or
        # unanswering one is not, and counted it kept the reaction from firing where only cold
        # starts could serve, a review). A replica loading (a pool refill, or one
        # ordered a tick ago) serves at the end of its cold start, not within a wake: counted
        # here, a pool refill started by the step's first promotion kept the reaction from
        # firing (elastic seed 1: 3 active + 1 waking + 1 refill loading "reached" the point
        # estimate's 5, and the sixth replica was decided 1.6 s later by the queue rule).
        wakeable = active + waking + warm + takeable
        react = burst_reaction(cfg, signals.burst_mid, signals.burst_high, signals.burst_shed, backlog, current, tc,
                               wakeable, demand, active, waiting)
        if react is not None:
            panic = True
            react_until = now + cfg.panic_window_s
            if react > rec:
                rec, cause = react, REASON_REACTION

    panic_until = now + cfg.panic_window_s if panic else state.panic_until
    in_panic = now < panic_until
    last_down = state.last_scale_down_at

    if rec > current:
        desired = min(rec, cfg.max_replicas)
        reason = cause if rec <= cfg.max_replicas else REASON_BOUNDS
    elif max(stabilized, cfg.min_replicas) < current:
        if stale:
            desired, reason = current, REASON_HOLD_STALE
        elif in_panic:
            desired, reason = current, REASON_HOLD_PANIC
        elif now - last_down < cfg.scale_down_interval_s:
            desired, reason = current, REASON_HOLD_STEP
        elif _kv_after_down(cfg, kv_mean, active, current, running + waiting) > cfg.kv_pressure_threshold:
            # The replicas left would carry the KV held now above the trigger: the next waiting
            # request would scale straight back up.
            desired, reason = current, REASON_HOLD_KV
        else:
            desired = max(stabilized, cfg.min_replicas, current - cfg.scale_down_step)
            reason = REASON_DOWN
            last_down = now
    else:
        desired = current
        if stale and rec < current:
            reason = REASON_HOLD_STALE
        elif rec < current:
            reason = REASON_BOUNDS if stabilized < cfg.min_replicas <= current else REASON_HOLD_WINDOW
        else:
            reason = REASON_STEADY
    if desired == current != before:
        # Only the bounds moved it (min_replicas or max_replicas changed under a running pool): a
        # change like any other in the log and `floodgate_scale_events_total`, not a hold (an
        # operator review: a raised min_replicas started replicas on a tick logged "none",
        # `hold_stale`, previous 3).
        reason = REASON_BOUNDS
    if reason not in (REASON_BOUNDS, REASON_QUEUE, REASON_KV, REASON_DEMAND, REASON_BURST, REASON_REACTION,
                      REASON_FLOOR):
        cause = reason

    plan = ScalePlan(
        desired=desired,
        previous=before,
        reason=reason,
        cause=cause,
        recommendation=rec,
        stabilized=stabilized,
        floor=forecast_floor,
        active=active,
        incoming=incoming,
        demand=demand,
        waiting=waiting,
        running=running,
        kv_mean=kv_mean,
        stale=stale,
        panic=in_panic,
        lacking=lacking,
        per_replica=tc,
        burst=burst,
        burst_low=signals.burst_low,
        burst_mid=signals.burst_mid,
        burst_high=signals.burst_high,
    )
    if desired > current:  # a new scale-up: a new wave (whether it waits on cold starts shows next tick)
        next_wave: Wave | None = Wave(backlog=counted, top=waiting, size=desired, demand=running + counted)
    elif wave is not None and not loading and wave.served_at is None:
        next_wave = replace(wave, served_at=now)  # its replicas serve from now
    else:
        next_wave = wave
    new_state = replace(
        state, desired=desired, window=window, panic_until=panic_until, last_scale_down_at=last_down,
        sized_backlog=waiting if desired > current else sized, react_until=react_until,
        wave=next_wave,
    )
    return plan, new_state


def offered_to_active(running: float, waiting: float, lacking: float) -> float:
    """What the active replicas are offered, for the admission ceiling (pure): what runs, plus
    the backlog in full — the engines' queues and Floodgate's, or what admission turned away,
    whichever is larger (`decide`'s two views of one excess). Not the plan's `demand`: that
    counts a cold wave's backlog only up to what the wave was sized with (`wave_backlog_once`:
    right for sizing, since those replicas drain it), so while the wave loads the demand stood
    still as vLLM's queue grew behind it. The ceiling then never turned on when the tick that
    sized the wave was just under its threshold (elastic bench, seed 2 on 98ad419: demand 31
    against 31.5, then 32 while the 4 active replicas held 32 running and 19 -> 68 waiting, the
    processors' limit 48 -> 158 and P0's SLO 91.5 %)."""
    return running + max(waiting, lacking)


def admission_ceiling(was_on: bool, desired: int, soon: int, active: int, demand: float, per_replica: float,
                      headroom: float) -> float | None:
    """The admission ceiling per active endpoint to publish for the processors, or None (pure;
    docs/controller.md, "Admission ceiling").

    Only while cold starts are awaited: more replicas decided (`desired`) than are active or
    waking (`soon`: a promotion serves within a wake). It turns on when the offered `demand` is
    above what the ceiling lets the `active` replicas hold (active x per_replica x headroom: below
    that it would not bind, and a limit held near the replicas' capacity only shrinks what is
    sized from it, such as the onset ramp's bucket), and stays on until demand is back within
    active x per_replica: between the two it keeps its state. Without the band, demand
    hovering around one threshold switched it every tick (elastic bench, burst 2, 23:35 run:
    the processors' limit 52 <-> 115 each second). `demand`: `offered_to_active`."""
    if per_replica <= 0 or desired <= soon:
        return None
    carried = active * per_replica
    on = demand > carried * headroom or (was_on and demand > carried)
    return per_replica * headroom if on else None


@dataclass(frozen=True, slots=True)
class StartTimes:
    """How long the pool's replicas took to serve, as this controller measured them (the last
    few of each; `due` reads the longest: a prediction late rather than early, since the
    processors let requests wait for it until their deadlines)."""

    cold: tuple[float, ...] = ()  # start -> warm (model load, /health, warm-up)
    wake_awake: tuple[float, ...] = ()  # promotion -> active of a replica that was awake
    wake_asleep: tuple[float, ...] = ()  # the same from sleep (wake_up + warm-up)

    KEEP = 3

    def observe(self, kind: str, seconds: float) -> StartTimes:
        if seconds < 0 or not math.isfinite(seconds):
            return self
        kept = (*getattr(self, kind), seconds)[-self.KEEP:]
        return replace(self, **{kind: kept})


def replica_due(view: ReplicaView, started_at: float | None, times: StartTimes) -> float | None:
    """When a replica on its way serves (controller clock), or None when unknown: a waking one
    at its promotion + the measured wake (from sleep or awake, as it was); a loading or warming
    one at its start + the measured cold start + the promotion of an awake replica (the plan
    promotes a needed replica as soon as it is warm). None without a measurement, for a
    replica this controller did not start, and in every other state."""
    if view.state is ReplicaState.WAKING:
        seen = times.wake_asleep if view.asleep else times.wake_awake
        return view.state_since + max(seen) if seen else None
    if view.state in (ReplicaState.LOADING, ReplicaState.WARMING):
        if started_at is None or not times.cold or not times.wake_awake:
            return None
        return started_at + max(times.cold) + max(times.wake_awake)
    return None


# A loading replica's /health is polled at most this far apart from a second before the
# shortest cold start measured to a second after the longest: the poll's pause is how late a
# loaded replica is noticed.
HEALTH_POLL_FAST_S = 0.05
HEALTH_POLL_LEAD_S = 1.0


def health_poll_pause(backoff: float, now: float, started_at: float | None, times: StartTimes) -> float:
    """The pause before the next /health poll of a replica in its cold start (pure): the
    bring-up's backoff (`backoff`, growing to `timeouts.health_poll_s`), but from
    `HEALTH_POLL_LEAD_S` before the shortest cold start this controller measured to as long
    after the longest, `HEALTH_POLL_FAST_S` (and no pause running past the window's start). A
    load of minutes polled every 0.25 s noticed the loaded replica 0.125 s late on average:
    time a burst waits for capacity that is there (the elastic bench's first burst ends its
    rejections a cold start after detection, when the replicas serve). A start slower than
    any measured goes back to the backoff (polled fast for its whole length, a 10-minute load
    after one fast measured start took 12,000 polls: a review). Without a measurement, or a
    start this controller did not make, the backoff alone."""
    if started_at is None or not times.cold:
        return backoff
    fast_from = started_at + min(times.cold) - HEALTH_POLL_LEAD_S
    fast_until = started_at + max(times.cold) + HEALTH_POLL_LEAD_S
    if now >= fast_until:
        return backoff
    if now >= fast_from:
        return min(backoff, HEALTH_POLL_FAST_S)
    return min(backoff, max(HEALTH_POLL_FAST_S, fast_from - now))


# A wake is stalled once it has run this many times the longest wake of its kind measured, or
# longer than the longest cold start measured (the warm pool exists because a wake is faster),
# and at least STALLED_WAKE_MIN_S: a live but slow wake still has `timeouts.wake_s`, but the plan
# stops counting a stalled one as serving and promotes the next warm replica meanwhile.
STALLED_WAKE_FACTOR = 3.0
STALLED_WAKE_MIN_S = 5.0


def stalled_wakes(views: Sequence[ReplicaView], times: StartTimes, now: float) -> frozenset[str]:
    """Replicas waking for much longer than this controller measured such a start to take
    (pure): a hung pool replica (a review's SIGSTOPped sleeper held a burst's scale-up for the
    whole 40 s wake timeout, and a fresh warm refill was put to sleep meanwhile). None without a
    measurement of either kind."""
    out = []
    for v in views:
        if v.state is not ReplicaState.WAKING:
            continue
        seen = times.wake_asleep if v.asleep else times.wake_awake
        bounds = ([STALLED_WAKE_FACTOR * max(seen)] if seen else []) + ([max(times.cold)] if times.cold else [])
        if bounds and now - v.state_since > max(min(bounds), STALLED_WAKE_MIN_S):
            out.append(v.replica_id)
    return frozenset(out)


def arriving_capacity(desired: int, active: int, due: list[float | None], now: float,
                      grace_s: float = 0.0) -> list[tuple[float, int]]:
    """The capacity on its way to announce to the processors (pure; docs/controller.md,
    "Capacity on its way"): (seconds from now until it serves, replicas), earliest first.

    `due`: when each replica that is cold-starting or waking serves (`replica_due`; None =
    unknown). Only as many as the plan still needs (`desired` - `active`) are on their way to
    the active set; the others refill the warm pool. Those taken are the earliest, an unknown
    one counting as the latest. A prediction already past is announced until `grace_s` after
    it, as due at its end: the prediction leaves out the wait for the controller's next look
    (a replica warm during a tick is promoted by the one after it), so one a tick late is on
    time, and announcing nothing in that gap turned requests away in the moment before it
    served. Later still, a start slower than measured holds its place but promises no time."""
    need = max(0, desired - active)
    if need == 0:
        return []
    order = sorted(due, key=lambda t: math.inf if t is None else t)[:need]
    out: dict[float, int] = {}
    for t in order:
        if t is not None and t <= now < t + grace_s:
            t += grace_s
        if t is not None and t > now:
            s = round(t - now, 3)
            out[s] = out.get(s, 0) + 1
    return sorted(out.items())


def later_than_announced(before: list[float], now_due: list[float]) -> bool:
    """Did a replica's announced time move later (pure)? `before` and `now_due`: the times
    announced (one per replica, sorted) at the last tick and now. Replicas leave the
    announcement earliest first (promoted), so the ones still announced are compared with the
    latest of `before`; a longer announcement is a new replica (told anyway)."""
    if not now_due or len(now_due) > len(before):
        return False
    return any(new > old + 1e-3 for new, old in zip(now_due, before[len(before) - len(now_due):], strict=True))
