"""Replica lifecycle: the state machine and the warm-pool planner (both pure).

    cold ─start→ loading ─loaded→ warming ─warmup_ok→ warm ─promote→ waking ─wake_ok→ active
    active ─drain→ draining ─drained→ warm (recycle, asleep where sleep mode is on)
                            ─drained→ terminated (pool full)
                            ─drain_timeout→ terminated (force-stopped)
    any live state ─fail→ failed ─terminate→ terminated
    cold|loading|warming|warm|waking ─terminate→ terminated

A cold start ends in `warm` only after its warm-up request succeeded (the seeds' "dummy
request before the readiness probe"), and every promotion goes through `waking` (wake from
sleep if asleep, one-token warm-up, then mark active), so no replica enters the registry as
active before it has served a token. `active` cannot be terminated directly: it must drain.

`plan_pool` turns the policy's desired active count into actions with replica ids:
promote warm replicas first, cold-start only the remainder (counting replicas already loading),
refill the warm pool in the background (replicas being drained count toward it: they join it
when their drain ends, so a scale-down never cold-starts a pool replica while loaded ones are
on their way out; so do the active replicas a burst will hand back, `returning_replicas`),
drain the most idle active replica (one at a time by default), recycle a
finished drain into the pool when it is below target (else terminate), and force-stop a drain
that outlives `max_drain_s` (default 300 s, not the design's 60 s: see docs/controller.md,
"Drain").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from floodgate.controller.signals import ReplicaState, ReplicaView
from pydantic import BaseModel, Field, model_validator

from floodgate.yamlconfig import STRICT

S = ReplicaState


class Event(StrEnum):
    START = "start"
    LOADED = "loaded"
    WARMUP_OK = "warmup_ok"
    PROMOTE = "promote"
    WAKE_OK = "wake_ok"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    DRAINED = "drained"
    DRAIN_TIMEOUT = "drain_timeout"
    FAIL = "fail"
    TERMINATE = "terminate"


class InvalidTransition(ValueError):
    """An event that is not allowed in the replica's current state."""

    def __init__(self, state: ReplicaState, event: Event) -> None:
        allowed = sorted(e.value for (s, e) in _TABLE if s is state)
        super().__init__(
            f"invalid replica transition: event '{event.value}' in state '{state.value}' "
            f"(allowed: {', '.join(allowed) or 'none'})"
        )
        self.state = state
        self.event = event


_LIVE = (S.COLD, S.LOADING, S.WARMING, S.WARM, S.WAKING, S.ACTIVE, S.DRAINING)
_TABLE: dict[tuple[ReplicaState, Event], ReplicaState] = {
    (S.COLD, Event.START): S.LOADING,
    (S.LOADING, Event.LOADED): S.WARMING,
    (S.WARMING, Event.WARMUP_OK): S.WARM,
    (S.WARM, Event.PROMOTE): S.WAKING,
    (S.WAKING, Event.WAKE_OK): S.ACTIVE,
    (S.ACTIVE, Event.DRAIN): S.DRAINING,
    (S.DRAINING, Event.UNDRAIN): S.ACTIVE,  # wanted again before its drain ended: loaded, awake
    (S.DRAINING, Event.DRAINED): S.WARM,  # or TERMINATED when not recycled, see transition()
    (S.DRAINING, Event.DRAIN_TIMEOUT): S.TERMINATED,
    **{(s, Event.FAIL): S.FAILED for s in _LIVE},
    **{
        (s, Event.TERMINATE): S.TERMINATED
        for s in (S.COLD, S.LOADING, S.WARMING, S.WARM, S.WAKING, S.FAILED)
    },
}


def allows(state: ReplicaState, event: Event) -> bool:
    """Is `event` allowed in `state` (`transition` would not raise)?"""
    return (state, event) in _TABLE


def transition(state: ReplicaState, event: Event, *, recycle: bool = False) -> ReplicaState:
    """Next state, or `InvalidTransition`. `recycle` picks warm vs terminated after a drain."""
    nxt = _TABLE.get((state, event))
    if nxt is None:
        raise InvalidTransition(state, event)
    if event is Event.DRAINED and not recycle:
        return S.TERMINATED
    return nxt


def apply_event(
    view: ReplicaView, event: Event, now: float, *, recycle: bool = False, asleep: bool | None = None
) -> ReplicaView:
    """`view` after `event` at `now` (state_since reset; `asleep` updated when given)."""
    nxt = transition(view.state, event, recycle=recycle)
    if asleep is None:
        # Waking clears sleep; anything else keeps the flag unless told.
        asleep = False if nxt is S.ACTIVE else view.asleep
    return replace(view, state=nxt, state_since=now, asleep=asleep)


class WarmPoolConfig(BaseModel):
    """Warm pool and drain settings."""

    model_config = STRICT

    enabled: bool = Field(default=True, description="Keep drained/refilled replicas warm instead of terminating them.")
    min_size: int = Field(default=0, ge=0, description="Smallest warm-pool target: at most `max_size` and "
                          "`policy.max_replicas`. The target never exceeds `policy.max_replicas` − desired, so "
                          "at rest the pool holds at most `max_replicas` − `min_replicas`.")
    max_size: int = Field(default=16, ge=0, description="Largest warm-pool target.")
    burst_fraction: float = Field(
        default=0.25, ge=0, description="Pool target = ceil(burst_fraction × max(desired, forecast)) + forecast rise "
        "(never above max_replicas − desired)."
    )
    sleep_enabled: bool = Field(default=True, description="Put pool replicas to sleep (vLLM sleep level 1).")
    max_drain_s: float = Field(default=300.0, gt=0, description="Force-stop a drain after this long.")
    max_concurrent_drains: int = Field(default=1, ge=1, description="Drains in progress at once.")
    max_total: int = Field(default=128, ge=1, description="Most replicas of any live state together (at least "
                           "`policy.min_replicas`; below `policy.max_replicas` it stops scale-ups at this many).")
    warm_min_age_s: float = Field(
        default=120.0, ge=0, description="A warm replica above target is kept at least this long (anti-churn)."
    )
    burst_window_s: float = Field(
        default=300.0, gt=0, description="A burst is a rise of the desired count within this window."
    )
    burst_min_ratio: float = Field(
        default=1.0, ge=0, description="A rise counts as a burst when it exceeds this × the window's lowest desired count."
    )
    burst_memory_s: float = Field(
        default=5400.0, ge=0, description="How long the largest recent burst sizes the pool (0: off)."
    )
    burst_memory_fraction: float = Field(
        default=0.5, ge=0, description="Pool target ≥ floor(this × the largest burst remembered)."
    )
    forecast_horizon_s: float = Field(
        default=1800.0, ge=0, description="The pool is sized for the forecast peak over [now, now + this]."
    )
    reserve_shed_share: float | None = Field(
        default=0.005, gt=0, le=1, description="The constant reserve (`burst_fraction`) is insurance against "
        "requests turned away: it is held in full once admission turns away this share of the requests offered "
        "over `reserve_window_s` (classes in `demand.exclude_classes` left out), and in proportion below it "
        "(none turned away: no constant reserve; the forecast rise and the burst memory still size the pool). "
        "Held in full while the controller has measured less than half the window (just started, counters "
        "stale, or no Floodgate in front). A tick whose queue's mean wait is past `capacity.slo_ttft_s` counts all "
        "it offered as turned away; still, a pool whose traffic mostly waits past the SLO rather than being turned "
        "away (a class whose `queue_timeout_s` is above it, P0's 20 s) and bursts rarer than the window loses SLO "
        "without the reserve: null for such a pool. null: always in full."
    )
    reserve_window_s: float = Field(
        default=21600.0, ge=300, description="The window of offered and turned-away requests `reserve_shed_share` "
        "reads (kept a minute at a time: at least 5 minutes). 6 h: the reserve a burst's shedding brings back is held "
        "for the next bursts of a day (1 h lost 0.01-0.21 pt more SLO on the backtest's bursty traffic)."
    )

    @model_validator(mode="after")
    def _sizes(self) -> WarmPoolConfig:
        # Without this, `warm_pool_target` silently lets max_size win.
        if self.min_size > self.max_size:
            raise ValueError(f"min_size ({self.min_size}) is above max_size ({self.max_size})")
        return self


@dataclass(frozen=True, slots=True)
class BurstMemory:
    """Recent desired counts and burst sizes, as monotonic queues of (time, value): `lows`
    holds the candidates for the window's minimum (values increasing), `bursts` the candidates
    for the largest burst within the memory (values decreasing)."""

    lows: tuple[tuple[float, int], ...] = ()
    bursts: tuple[tuple[float, int], ...] = ()

    def largest(self) -> int:
        return self.bursts[0][1] if self.bursts else 0


def observe_burst(mem: BurstMemory, now: float, desired_active: int, cfg: WarmPoolConfig) -> BurstMemory:
    """Record this tick's desired count. A burst is the rise of the desired count above its
    lowest value within `burst_window_s`, when that rise exceeds `burst_min_ratio` × the low;
    bursts are remembered for `burst_memory_s`."""
    lows = [(t, d) for t, d in mem.lows if now - t <= cfg.burst_window_s and d < desired_active]
    lows.append((now, desired_active))
    low = lows[0][1]
    bursts = [(t, b) for t, b in mem.bursts if now - t <= cfg.burst_memory_s]
    rise = desired_active - low
    if cfg.burst_memory_s > 0 and rise > 0 and rise > cfg.burst_min_ratio * low:
        while bursts and bursts[-1][1] <= rise:
            bursts.pop()
        bursts.append((now, rise))
    return BurstMemory(tuple(lows), tuple(bursts))


def returning_replicas(mem: BurstMemory, now: float, desired_active: int, cfg: WarmPoolConfig) -> int:
    """Active replicas a burst in progress will hand back to the pool: the desired count above
    the window's lowest value, while a burst (`observe_burst`; `mem` already holds this tick)
    was seen within `burst_window_s`. `plan_pool` counts them toward the pool the way it
    counts drains in progress, so it does not cold-start pool refills for them: a refill
    started at a burst's onset sits warm through the burst and, when the burst's replicas
    drain, pushes them out as `pool_full` (elastic bench, 15:20 run: the two refills
    cold-started in the first burst were pooled ~80 s each through the burst and the recovery
    while six drained replicas were terminated). A level that outlasts `burst_window_s` is no
    longer a burst (the window's low rises to it): its pool is refilled as usual."""
    if not mem.lows or not mem.bursts or now - mem.bursts[-1][0] > cfg.burst_window_s:
        return 0
    return max(0, desired_active - mem.lows[0][1])


@dataclass(frozen=True, slots=True)
class ShedRecord:
    """Requests offered and turned away (classes not excluded) per minute, over the last
    `reserve_window_s`: (minute, offered, turned away, seconds measured) oldest first, and when
    the last tick was recorded. Integrated from each tick's offered-demand rates."""

    minutes: tuple[tuple[int, float, float, float], ...] = ()
    last_at: float | None = None


# A gap between two ticks longer than this is not integrated (ticks skipped: Redis down, a
# tick that hung): the minutes it spans count as not measured. Twice the longest tick
# (`tick_interval_s` ≤ 60): a tick comes a little after its interval, never before it (the
# loop waits the interval less the tick's own time, and asyncio's timers fire late), so at
# 60 s nearly every gap was 60.00x s and a bound of exactly 60 s integrated none of them: the
# reserve stayed in full (a review).
_SHED_MAX_GAP_S = 120.0


def record_shed(rec: ShedRecord, now: float, offered: float | None, turned_away: float,
                window_s: float) -> ShedRecord:
    """`rec` with this tick: `offered` and `turned_away` are rates (requests/s) over the demand
    window, None when they are stale or not measured (that time counts as not measured)."""
    minutes = [m for m in rec.minutes if (now - m[0] * 60.0) <= window_s + 60.0]
    dt = 0.0 if rec.last_at is None else now - rec.last_at
    if offered is not None and 0.0 < dt <= _SHED_MAX_GAP_S:
        minute = int(now // 60)
        if minutes and minutes[-1][0] == minute:
            _, o, t, c = minutes[-1]
            minutes[-1] = (minute, o + offered * dt, t + turned_away * dt, c + dt)
        else:
            minutes.append((minute, offered * dt, turned_away * dt, dt))
    return ShedRecord(tuple(minutes), now)


def reserve_scale(rec: ShedRecord, now: float, cfg: WarmPoolConfig) -> float:
    """The share of the constant reserve to hold (`reserve_shed_share`): 1 until half the
    window is measured; else the window's turned-away share over `reserve_shed_share`, at most 1."""
    if cfg.reserve_shed_share is None:
        return 1.0
    inside = [m for m in rec.minutes if now - m[0] * 60.0 <= cfg.reserve_window_s]
    if sum(m[3] for m in inside) < cfg.reserve_window_s / 2:
        return 1.0
    offered = sum(m[1] for m in inside)
    if offered <= 0.0:
        return 0.0
    return min(1.0, sum(m[2] for m in inside) / offered / cfg.reserve_shed_share)


def warm_pool_target(
    desired_active: int,
    forecast_replicas: int | None,
    cfg: WarmPoolConfig,
    largest_burst: int = 0,
    max_active: int | None = None,
    reserve: float = 1.0,
) -> int:
    """Pool size that follows the forecast: a burst reserve proportional to the expected size
    (times `reserve`, `reserve_scale`: the share of it the recent turned-away requests call for),
    plus the forecast rise above the current desired count (so pre-scaling wakes instead of
    cold-starting); at least `burst_memory_fraction` of the largest recent burst
    (`BurstMemory.largest()`), so a burst that repeats is answered by wakes.

    Never more than `max_active - desired_active` (the policy's `max_replicas`): a pool replica
    can only ever be promoted into that headroom, so one beyond it is pure cost. At the maximum
    the target is 0 and the pool refills from the drains on the way down."""
    if not cfg.enabled:
        return 0
    f = forecast_replicas or 0
    target = math.ceil(reserve * cfg.burst_fraction * max(desired_active, f) - 1e-9) + max(0, f - desired_active)
    target = max(target, int(cfg.burst_memory_fraction * largest_burst + 1e-9))
    target = min(max(target, cfg.min_size), cfg.max_size)
    if max_active is not None:
        target = min(target, max(0, max_active - desired_active))
    return target


class ActionKind(StrEnum):
    START = "start"  # cold start a new replica (ends warm after its warm-up)
    PROMOTE = "promote"  # warm → waking → active
    SLEEP = "sleep"  # put an awake pool replica to sleep
    DRAIN = "drain"  # active → draining
    UNDRAIN = "undrain"  # draining → active: a scale-up takes a replica being drained back first
    RECYCLE = "recycle"  # finished drain → warm pool
    TERMINATE = "terminate"  # stop a non-serving replica
    FORCE_STOP = "force_stop"  # drain exceeded max_drain_s


# The one mapping from a planned action to the lifecycle event it applies (live and backtest).
# SLEEP changes no state (only the `asleep` flag); TERMINATE of a draining replica is a drain
# that ended without recycling.
_ACTION_EVENT: dict[ActionKind, Event] = {
    ActionKind.START: Event.START,
    ActionKind.PROMOTE: Event.PROMOTE,
    ActionKind.DRAIN: Event.DRAIN,
    ActionKind.UNDRAIN: Event.UNDRAIN,
    ActionKind.RECYCLE: Event.DRAINED,
    ActionKind.FORCE_STOP: Event.DRAIN_TIMEOUT,
}


def action_event(view: ReplicaView, kind: ActionKind) -> Event | None:
    """The lifecycle event that carrying out `kind` on `view` applies (None: SLEEP)."""
    if kind is ActionKind.TERMINATE:
        return Event.DRAINED if view.state is S.DRAINING else Event.TERMINATE
    return _ACTION_EVENT.get(kind)


def apply_action(view: ReplicaView, kind: ActionKind, now: float) -> ReplicaView:
    """`view` after the planner's action `kind` was carried out at `now`."""
    ev = action_event(view, kind)
    if ev is None:
        return replace(view, asleep=True)
    if kind is ActionKind.RECYCLE:
        return apply_event(view, ev, now, recycle=True, asleep=False)
    return apply_event(view, ev, now)


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    replica_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class PoolPlan:
    actions: tuple[Action, ...]
    next_seq: int  # feed back in for the next fresh replica id
    warm_target: int


def plan_pool(
    desired_active: int,
    replicas: tuple[ReplicaView, ...],
    warm_target: int,
    now: float,
    cfg: WarmPoolConfig,
    next_seq: int = 0,
    id_prefix: str = "r",
    returning: int = 0,
    stalled: frozenset[str] = frozenset(),
    unhealthy: frozenset[str] = frozenset(),
) -> PoolPlan:
    """Actions that move `replicas` toward `desired_active` serving replicas and a warm pool of
    `warm_target`. New replicas get ids `f"{id_prefix}{seq}"` from `next_seq` on. `returning`:
    active replicas expected back in the pool (`returning_replicas`), counted toward it for
    refills like drains in progress. `stalled`: waking replicas that are not counted as serving
    (`policy.stalled_wakes`): the next warm replica is promoted in their place. `unhealthy`:
    draining replicas whose last scrape failed, never taken back (a hung one reads as busy)."""
    if not cfg.enabled:
        warm_target = 0
    acts: list[Action] = []
    serving = 0
    warm: list[ReplicaView] = []
    pipeline = 0
    active: list[ReplicaView] = []
    draining_busy = 0
    retiring = 0  # of those draining or drained now, the outdated ones: retired, they refill nothing
    finished: list[ReplicaView] = []
    undrainable: list[ReplicaView] = []  # draining, within max_drain_s, no operation in flight
    live = 0
    for r in replicas:
        st = r.state
        if st is S.TERMINATED:
            continue
        live += 1
        if st is S.FAILED:
            acts.append(Action(ActionKind.TERMINATE, r.replica_id, "failed"))
        elif st is S.ACTIVE:
            serving += 1
            active.append(r)
        elif st is S.WAKING:
            serving += r.replica_id not in stalled
        elif st is S.WARM:
            warm.append(r)
        elif st in (S.COLD, S.LOADING, S.WARMING):
            pipeline += 1
        elif st is S.DRAINING:
            if now - r.state_since >= cfg.max_drain_s:
                acts.append(Action(ActionKind.FORCE_STOP, r.replica_id, "drain_timeout"))
                continue
            if not r.busy and r.replica_id not in unhealthy:
                undrainable.append(r)
            if r.inflight == 0 and r.running == 0:
                finished.append(r)
            else:
                draining_busy += 1
                retiring += r.outdated

    deficit = desired_active - serving
    # A replica being drained is the cheapest capacity there is (loaded, awake, serving within a
    # tick): a scale-up takes those back first, the busiest first (their streams never stopped),
    # before it wakes a pool replica or cold-starts one (a review: a burst during a drain
    # cold-started a replica while the loaded one sat draining for 26 s more).
    undrained = sorted(undrainable, key=lambda r: (-(r.inflight + r.running), r.replica_id))[: max(0, deficit)]
    for r in undrained:
        acts.append(Action(ActionKind.UNDRAIN, r.replica_id, "scale_up"))
        if r.inflight == 0 and r.running == 0:
            finished.remove(r)
        else:
            draining_busy -= 1
            retiring -= r.outdated
    deficit -= len(undrained)
    # Awake replicas promote fastest; ids break ties so plans are deterministic. A replica with
    # an operation in flight (going to sleep) comes last: its promotion would wait for that
    # operation, while an idle sleeping one wakes at once.
    # An outdated replica (another command than the configured one) is promoted last.
    warm.sort(key=lambda r: (r.outdated, r.busy, r.asleep, r.replica_id))
    promoted = warm[: max(0, deficit)]
    for r in promoted:
        acts.append(Action(ActionKind.PROMOTE, r.replica_id, "scale_up"))
    need = max(0, deficit) - len(promoted)  # still uncovered after promotion
    from_pipeline = min(need, pipeline)  # loading replicas will be promoted when warm
    need -= from_pipeline
    # The pool counts only replicas of the configured command: outdated pool replicas are
    # refilled (and retired below once their replacements are warm).
    pool = sum(1 for r in warm[len(promoted):] if not r.outdated) + pipeline - from_pipeline
    room = cfg.max_total - live

    # Finished drains: cover the remaining need first, then the pool, else terminate. An
    # outdated one is never recycled into the pool (it would keep the old command).
    for r in sorted(finished, key=lambda r: r.replica_id):
        if r.outdated and need <= 0:
            acts.append(Action(ActionKind.TERMINATE, r.replica_id, "outdated"))
            room += 1
            continue
        if cfg.enabled and (need > 0 or pool < warm_target):
            acts.append(Action(ActionKind.RECYCLE, r.replica_id, "scale_up" if need > 0 else "pool_refill"))
            if need > 0:
                need -= 1
            else:
                pool += 1
        else:
            acts.append(Action(ActionKind.TERMINATE, r.replica_id, "pool_full"))
            room += 1

    seq = next_seq
    for _ in range(min(need, max(0, room))):
        acts.append(Action(ActionKind.START, f"{id_prefix}{seq}", "scale_up"))
        seq += 1
        room -= 1

    new_drains = 0
    if deficit < 0:
        n = min(-deficit, cfg.max_concurrent_drains - draining_busy)
        # Outdated replicas first (a scale-down replaces them), then the idlest.
        idle_first = sorted(active, key=lambda r: (not r.outdated, r.inflight + r.running, r.last_busy_at, r.replica_id))
        for r in idle_first[: max(0, n)]:
            acts.append(Action(ActionKind.DRAIN, r.replica_id, "scale_down"))
            new_drains += 1
            retiring += r.outdated

    # Replicas being drained are loaded: they refill the pool when they finish (recycle), so
    # they count toward it here; no cold start while loaded replicas are on their way. The same
    # for the active replicas a burst will hand back (`returning`): they drain into the pool
    # when it passes.
    pending = (draining_busy - retiring + new_drains + max(0, returning)) if cfg.enabled else 0
    refill = max(0, warm_target - pool - pending)
    for _ in range(min(refill, max(0, room))):
        acts.append(Action(ActionKind.START, f"{id_prefix}{seq}", "pool_refill"))
        seq += 1
        room -= 1

    spare = warm[len(promoted) :]
    # Outdated pool replicas retire once the pool holds its target of warm replicas of the
    # configured command (not before: the pool keeps its burst capacity meanwhile).
    if sum(1 for r in spare if not r.outdated) >= warm_target:
        for r in [r for r in spare if r.outdated and not r.busy]:
            acts.append(Action(ActionKind.TERMINATE, r.replica_id, "outdated"))
            spare = [s for s in spare if s is not r]
    spare_current = [r for r in spare if not r.outdated]
    excess = pool - warm_target
    if excess > 0:
        # Shrink the pool from the longest-idle end, but never churn a fresh one.
        for r in sorted(spare_current, key=lambda r: (r.state_since, r.replica_id)):
            if excess <= 0:
                break
            if now - r.state_since >= cfg.warm_min_age_s:
                acts.append(Action(ActionKind.TERMINATE, r.replica_id, "pool_excess"))
                excess -= 1
                spare = [s for s in spare if s is not r]
    if cfg.sleep_enabled:
        for r in spare:
            if not r.asleep:
                acts.append(Action(ActionKind.SLEEP, r.replica_id, "pool"))
    return PoolPlan(tuple(acts), seq, warm_target)
