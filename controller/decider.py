"""The decider: one pure step per pool per tick, called by the live controller AND the backtest.

    decide(cfg, state, signals, now) -> (state, decision)

(Knative's `Scale(now)` shape: no I/O, no clock of its own.) It composes, in this order:

    policy.decide        signals + replica views + forecast floor -> desired active replicas
    forecast recording   this tick's demand into the per-minute history (fresh ticks only)
    forecast             once per minute: the policy floor (lead window) and the pool forecast
                         (0 .. warm_pool.forecast_horizon_s)
    burst memory         lifecycle.observe_burst on the desired count
    shed record          lifecycle.record_shed: requests offered and turned away or served late
                         (the queue's mean wait past the TTFT SLO: _shed_rates), warm_pool.reserve_window_s
    warm-pool target     lifecycle.warm_pool_target(desired, pool forecast, largest burst, max,
                         the reserve's share: lifecycle.reserve_scale of the shed record)
    plan                 lifecycle.plan_pool -> replica actions with ids (a burst's own replicas,
                         lifecycle.returning_replicas, count toward the pool's refills)

Everything the step remembers lives in `DeciderState` (policy window, burst memory, demand
history, the next replica id), so the live shell only persists what changed (`Decision.recorded`
→ the history in Redis, `DeciderState.next_seq`) and the backtest runs exactly this code.

`Signals` is the one input record; new measurements (e.g. offered demand, learned per-replica
capacity) are added as fields here, with defaults, so both callers keep working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from floodgate.controller import capacity as cap
from floodgate.controller import demand as dm
from floodgate.controller import forecast as fc
from floodgate.controller.lifecycle import (
    Action,
    BurstMemory,
    ShedRecord,
    WarmPoolConfig,
    observe_burst,
    plan_pool,
    record_shed,
    reserve_scale,
    returning_replicas,
    warm_pool_target,
)
from floodgate.controller.policy import PolicyConfig, PolicyState, ScalePlan
from floodgate.controller.policy import decide as policy_decide
from floodgate.controller.signals import PoolSignals, QueueSignal, ReplicaState, ReplicaView


@dataclass(frozen=True, slots=True)
class DeciderConfig:
    """The settings of one pool's decider (the live PoolConfig's policy/forecast/warm_pool)."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    forecast: fc.ForecastConfig = field(default_factory=fc.ForecastConfig)
    warm_pool: WarmPoolConfig = field(default_factory=WarmPoolConfig)
    id_prefix: str = "r"  # new replicas are named f"{id_prefix}{seq}"
    demand: dm.DemandConfig = field(default_factory=dm.DemandConfig)
    capacity: cap.CapacityConfig = field(default_factory=cap.CapacityConfig)


@dataclass(frozen=True, slots=True)
class Signals:
    """Everything measured about one pool at one tick, as the decider reads it.

    `pool`: vLLM scrapes of the serving replicas and Floodgate's queue (each with its scrape
    time, so stale values are never read as zero); `replicas`: the lifecycle view (state,
    in-flight, running, asleep) of every replica the controller knows.
    """

    pool: PoolSignals
    replicas: tuple[ReplicaView, ...]
    stalled: frozenset[str] = frozenset()  # waking replicas not counted as serving (policy.stalled_wakes)
    unhealthy: frozenset[str] = frozenset()  # draining replicas whose last scrape failed: not taken back


_NO_FORECAST = fc.Forecast(False, "short_history", None, 0, None)


@dataclass(frozen=True, slots=True)
class DeciderState:
    """What the decider remembers between ticks (per pool)."""

    policy: PolicyState = field(default_factory=PolicyState)
    bursts: BurstMemory = field(default_factory=BurstMemory)
    shed: ShedRecord = field(default_factory=ShedRecord)  # offered / turned away: the pool's reserve
    history: fc.DemandHistory | None = None  # None: created empty at the first tick
    acc: fc.MinuteAccumulator = field(default_factory=fc.MinuteAccumulator)
    # (minute, history end) the cached forecasts were made for: they change only when the
    # minute turns or a minute closes into the history.
    forecast_key: tuple[int, int] | None = None
    forecast: fc.Forecast = field(default=_NO_FORECAST)  # [lead_min_s, lead_max_s]: policy floor
    pool_forecast: fc.Forecast = field(default=_NO_FORECAST)  # [0, warm_pool.forecast_horizon_s]: pool target
    next_seq: int = 0
    demand: dm.DemandWindow = field(default_factory=dm.DemandWindow)  # recent counter reads
    service_s: float | None = None  # last measured seconds per admitted request (Little's law)
    # The same, averaged over the ticks when no request waited inside the replicas (admitted =
    # started, so running / admitted rate is the time a request holds a slot); sizes the burst.
    slot: dm.SlotTime | None = None
    capacity: cap.CapacityState = field(default_factory=cap.CapacityState)  # learned per-replica capacity
    active: int = 0  # active replicas at the last tick
    grown_at: float = -math.inf  # when the active set last grew (`_measured`: turned-away demand since)


@dataclass(frozen=True, slots=True)
class Decision:
    """One step's output: the policy's plan, the forecasts it used and the replica actions."""

    plan: ScalePlan
    forecast: fc.Forecast
    floor: int | None  # policy floor in replicas (None: forecaster not engaged)
    pool_floor: int | None  # forecast replicas the warm pool is sized for
    warm_target: int
    actions: tuple[Action, ...]
    recorded: tuple[int, float] | None  # (minute, mean demand) closed into the history this tick
    offered: dm.OfferedDemand | None = None  # reconciled offered demand (None: not wired)
    per_replica: float = 0.0  # the capacity the pool was sized with (learned or the prior)
    reserve: float = 1.0  # the share of the pool's constant reserve held (lifecycle.reserve_scale)


def decide(cfg: DeciderConfig, state: DeciderState, signals: Signals, now: float) -> tuple[DeciderState, Decision]:
    """The next state and the decision for one pool at `now` (pure)."""
    history = state.history
    if history is None:
        history = fc.DemandHistory.empty(cfg.forecast.retention_days * fc.MINUTES_PER_DAY, fc.minute_of(now))

    key = (fc.minute_of(now), history.end_minute)
    fcast, pool_fcast = state.forecast, state.pool_forecast
    if key != state.forecast_key:
        fcast = fc.predict(history, now, cfg.forecast)
        pool_fcast = fc.predict(history, now, cfg.forecast, 0.0, cfg.warm_pool.forecast_horizon_s)
    active = sum(1 for r in signals.replicas if r.state is ReplicaState.ACTIVE)
    grown_at = now if active > state.active and state.policy.desired is not None else state.grown_at
    pool, dwin, service_s, slot, cstate, off = _measured(cfg, state, signals.pool, now, grown_at)
    tc = pool.capacity or cfg.policy.target_concurrency
    floor = fc.floor_replicas(fcast, tc, cfg.forecast.headroom)
    pool_floor = fc.floor_replicas(pool_fcast, tc, cfg.forecast.headroom)

    plan, pstate = policy_decide(cfg.policy, pool, signals.replicas, state.policy, now, floor, stalled=signals.stalled)

    # A stale tick only knows a lower bound of demand: it is not a sample (the minute stays
    # NaN rather than reading low). The history holds offered demand, so a day of shedding
    # does not lower tomorrow's forecast (`offered_concurrency`).
    acc, recorded = state.acc, None
    if not plan.stale:
        acc, recorded = fc.accumulate(acc, now, offered_concurrency(plan))
        if recorded is not None:
            history = history.record(*recorded)

    bursts = observe_burst(state.bursts, now, plan.desired, cfg.warm_pool)
    shed = record_shed(state.shed, now, *_shed_rates(off, cfg.demand.exclude_classes, signals.pool.queue, now,
                                                     cfg.capacity.slo_ttft_s, cfg.demand.stale_after_s),
                       cfg.warm_pool.reserve_window_s)
    reserve = reserve_scale(shed, now, cfg.warm_pool)
    target = warm_pool_target(plan.desired, pool_floor, cfg.warm_pool, bursts.largest(), cfg.policy.max_replicas,
                              reserve=reserve)
    pp = plan_pool(plan.desired, signals.replicas, target, now, cfg.warm_pool, state.next_seq, cfg.id_prefix,
                   returning=returning_replicas(bursts, now, plan.desired, cfg.warm_pool),
                   stalled=signals.stalled, unhealthy=signals.unhealthy)

    new_state = replace(
        state,
        policy=pstate,
        bursts=bursts,
        shed=shed,
        history=history,
        acc=acc,
        forecast_key=key,
        forecast=fcast,
        pool_forecast=pool_fcast,
        next_seq=pp.next_seq,
        demand=dwin,
        service_s=service_s,
        slot=slot,
        capacity=cstate,
        active=active,
        grown_at=grown_at,
    )
    return new_state, Decision(plan, fcast, floor, pool_floor, pp.warm_target, pp.actions, recorded, off, tc, reserve)


def _shed_rates(off: dm.OfferedDemand | None, exclude: tuple[int, ...], queue: QueueSignal | None,
                now: float, late_wait_s: float, stale_after_s: float) -> tuple[float | None, float]:
    """(offered, turned away or served late) requests/s of the classes not excluded; offered
    None when the tick measured neither (stale counters, or no Floodgate in front).

    Served late: while the mean wait in Floodgate's queue (Little's law: its depth over the
    offered rate) is past the TTFT SLO (`capacity.slo_ttft_s`), the tick's offered requests
    all count, served or not. A class whose `queue_timeout_s` is above that (P0's 20 s) waits
    through a burst instead of being turned away: counting only the turned away, a pool of
    such traffic read "none" and dropped the reserve (a review's backtest at a 15 s queue
    timeout: azure-tiled seed 1 99.93 -> 98.76 % SLO). Waits under the SLO (P1's 1.5 s) never
    reach it."""
    if off is None or off.stale:
        return None, 0.0
    offered = sum(v for c, v in off.offered_rate.items() if c not in exclude)
    away = off.lacking_rate(exclude)
    if (queue is not None and queue.ok and now - queue.scraped_at <= stale_after_s and queue.depth > 0
            and off.offered_total > 0 and queue.depth / off.offered_total > late_wait_s):
        away = max(away, offered)
    return offered, away


def offered_concurrency(plan: ScalePlan) -> float:
    """The demand a tick records into the forecast history: the offered concurrency.

    Without requests turned away, what runs and waits (`plan.demand`). While admission turns
    requests away, what runs plus what is turned away (as concurrency, Little's law): that is
    the offered rate x the slot time, and a queue that stays meanwhile is a backlog admission
    bounds (docs/controller.md, "Offered demand"), not more offered work. The policy sizes on
    the larger of the queue and the turned-away demand (`plan.demand`), which is right for a
    scale-up; recorded, it made a pool capped at `max_replicas` and shedding read running +
    queue (81 where ~50 was offered) and tomorrow's floor 1.6x too high."""
    if plan.lacking > 0:
        return plan.running + plan.lacking
    return plan.demand


def _measured(cfg: DeciderConfig, state: DeciderState, pool: PoolSignals, now: float, grown_at: float = -math.inf
              ) -> tuple[PoolSignals, dm.DemandWindow, float | None, dm.SlotTime | None, cap.CapacityState,
                         dm.OfferedDemand | None]:
    """Offered demand (`controller.demand`) and learned capacity (`controller.capacity`) from
    this tick's raw inputs, folded into the signals the policy reads (`lacking`, `capacity`)."""
    dwin, service_s, slot, off = state.demand, state.service_s, state.slot, None
    lacking, lacking_stale, burst, burst_low = pool.lacking, pool.lacking_stale, pool.burst, pool.burst_low
    burst_mid, burst_high, burst_shed = pool.burst_mid, pool.burst_high, pool.burst_shed
    wired = pool.counters is not None or pool.gateway is not None
    if cfg.demand.enabled and wired:
        running = sum(m.running for m in pool.replicas if m.ok)
        dwin = dm.observe(dwin, now, cfg.demand, pool.counters, pool.gateway)
        dwin = dm.observe_running(dwin, now, running, cfg.demand)
        off = dm.offered(dwin, now, cfg.demand)
        measured = dm.service_time(off, running, cfg.demand)
        service_s = measured or service_s
        lacking_stale = off.stale
        waiting = sum(m.waiting for m in pool.replicas if m.ok and now - m.scraped_at <= cfg.demand.stale_after_s)
        # A burst that admission lets in waits inside vLLM: admitted counts it before it runs
        # (running is capped by the slots), so running / admitted reads short exactly while
        # the step is sized. The step is sized with the slot time of the ticks nothing waited
        # inside the replicas (admitted = started there), averaged (`demand.SlotTime`).
        # Little's law holds for averages over one span: the admitted rate is over the rate
        # window, so running is its mean over the same span, not this tick's count. At a plan's
        # start the window still holds the idle seconds before the first arrivals: this tick's
        # running over that diluted rate read 21 s per request at 1x (elastic bench, seed 3,
        # 00:10 run) and the burst estimate, 24 concurrent at a demand of 11, sized 2 -> 4.
        # Without a slot time measured that way there is no burst estimate (no baseline yet).
        span = dm.rate_span(dwin, now, cfg.demand)
        mean = dm.mean_running(dwin, *span) if span else None
        if measured is not None and waiting == 0 and mean is not None:
            slot = dm.update_slot(slot, now, mean, off.admitted_total, cfg.demand)
        slot_s = min(slot.seconds, cfg.demand.max_service_s) if slot else None
        lacking = dm.lacking_concurrency(off, running, cfg.demand, service_s, slot_s)
        est = dm.burst_concurrency(dwin, now, cfg.demand, slot_s, waiting)
        # Up on the short window too (Knative's panic window), never down on it; sized with
        # the averaged slot time where there is one (this tick's ratio scatters, and reads
        # long while a lumpy admitted counter lags), as the burst estimate is.
        if now - grown_at >= cfg.demand.window_s:
            lacking = max(lacking, dm.scale_up_lacking(dwin, now, cfg.demand, slot_s or service_s))
        else:
            # The active set grew within the rate window: what was turned away before it grew
            # is what the smaller pool lacked, and the replicas that joined now run (part of)
            # it, so `running` counts it already. Read only the reads since, at the short
            # window's lower confidence bound (0 until two reads span some time): a window
            # reaching back across the promotion asked for replicas the new ones had already
            # covered (the elastic bench, seed 1, first burst: 8 -> 10 at 77.9 s, demand 65 =
            # running 47 on 6 replicas, 2 of them active for under a second, + turned away
            # 18 from the 5 s before, when 4 were; both cold starts arrived near the burst's end).
            lacking = dm.scale_up_lacking(dm.since(dwin, grown_at), now, cfg.demand, slot_s or service_s)
        burst, burst_low = est.size, est.low
        burst_mid, burst_high, burst_shed = est.mid, est.high, est.shed
        if (lacking == 0 and slot_s is None and service_s is None and not off.stale
                and off.lacking_rate(cfg.demand.exclude_classes) > 0):
            # Turned away with nothing ever admitted (a pool at 0 replicas answers `503
            # no_endpoints`): no service time to size it with, but at least one request lacks a
            # slot. Without this a min_replicas 0 pool never left 0 (a review: 1,541 of 1,541
            # requests refused while the controller read 38 turned away per second). The first
            # replica measures the service time; sizing goes on from there.
            lacking = 1.0
    prior = cfg.policy.target_concurrency
    cstate = state.capacity
    if pool.latency is not None:
        cstate = cap.update(cstate, pool.latency, now, prior, cfg.capacity)
    per = cap.capacity(cstate, prior, cfg.capacity) if cstate.estimate is not None else pool.capacity
    return replace(pool, lacking=lacking, lacking_stale=lacking_stale, burst=burst, burst_low=burst_low,
                   burst_mid=burst_mid, burst_high=burst_high, burst_shed=burst_shed, capacity=per), dwin, service_s, slot, cstate, off
