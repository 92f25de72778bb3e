"""The live controller: the imperative shell around the pure policy and lifecycle.

Each tick, per pool (only while holding the leader lease; every pool ticks in its own loop, so
a pool with slow scrapes or actions never delays another's decisions):

    reconcile  actuator.list() + registry  -> adopt unknown replicas, mark vanished ones failed
    scrape     vLLM /metrics per serving replica, Floodgate queue (Redis), Envoy admin
    decide     decider.decide(...)          (pure)  -> desired active replicas + replica actions
               (the same step the backtest runs: policy, forecast, burst memory, warm pool, plan)
    execute    actions via the actuator, the vLLM client and the registry
    sync       the registry rewritten wherever it differs from the lifecycle view (level-
               triggered: a failed DRAIN write is retried next tick, not lost)

Slow operations (cold start: start, /health, warm-up; promotion: wake, warm-up; sleep; stop)
run as one background task per replica, so a tick never waits on a model load; a replica with
a task in flight is skipped by later plans until the task has moved its state on. Every
transition goes through `lifecycle.apply_event`, so an illegal one is a bug, not a state.

Restart safety: all state that matters is outside the process. Replicas come from the
actuator's list, their roles from the registry (active / draining / warm / sleeping / loading),
the last desired count and the forecast history from Redis. A restarted (or newly elected) controller rebuilds its view
from those and continues half-finished drains instead of starting or stopping anything twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from floodgate.controller import forecast as fc
from floodgate.controller.actuators.base import (
    Actuator,
    ActuatorUnavailable,
    NoCapacity,
    ReplicaHandle,
    Role,
)
from floodgate.controller.capacity import tick_latency
from floodgate.controller.config import ControllerConfig, PoolConfig, process_state_dir, table_owner
from floodgate.controller.decider import DeciderConfig, DeciderState, Decision, Signals, decide
from floodgate.controller.leader import LeaderLease
from floodgate.controller.lifecycle import (
    Action,
    ActionKind,
    Event,
    action_event,
    allows,
    apply_action,
    apply_event,
)
from floodgate.controller.liveness import StartBackoff, Unresponsive
from floodgate.controller.metrics import BackgroundOp, ControllerMetrics
from floodgate.controller.policy import (
    ScalePlan,
    StartTimes,
    admission_ceiling,
    arriving_capacity,
    health_poll_pause,
    later_than_announced,
    offered_to_active,
    replica_due,
    stalled_wakes,
)
from floodgate.controller.scrape import EnvoySample, ReplicaScraper, scrape_envoy, scrape_floodgate
from floodgate.controller.signals import (
    INCOMING_STATES,
    PoolSignals,
    ReplicaState,
    ReplicaView,
    count_states,
    engine_held,
)
from floodgate.controller.vllm import VllmClient, VllmError, VllmSample
from floodgate.extproc import schema
from floodgate.extproc.cancel import cancel_and_wait
from floodgate.extproc.redis_client import (
    OUTAGE_ERRORS,
    answered_with_error,
    follow_sentinel_primary,
    parse_redis_url,
    refused_settings_error,
)
from floodgate.extproc.registry import Endpoint, Registry
from floodgate.extproc.state import redis_client

S = ReplicaState
def steady_wall_clock() -> Callable[[], float]:
    """Epoch seconds that never step: the wall clock read once, then advanced by the monotonic
    one. Every duration the controller keeps (a drain's age against `max_drain_s`, the
    stabilization window, panic, the scale-down interval) is a difference of this clock's
    readings; on `time.time` an NTP step or a VM resume moved them (a review: +400 s cut a
    draining replica's stream after 3 s of real drain; -1 h held the first scale-down for
    3,900 s instead of 300). Epoch-based, so the forecast's minute of day and the registry's
    `since_ms` read as before."""
    base = time.time() - time.monotonic()
    return lambda: base + time.monotonic()


STEADY_CLOCK = steady_wall_clock()


log = logging.getLogger("floodgate.controller")
WARM_FRESH_S = 2.0  # a bring-up's warm-up this recent stands for the promotion's own
decision_log = logging.getLogger("floodgate.controller.decisions")

# Registry state written for each lifecycle state (the processor routes to `active` only).
_REGISTRY_STATE = {
    S.COLD: "loading", S.LOADING: "loading", S.WARMING: "loading", S.WAKING: "warm",
    S.ACTIVE: "active", S.DRAINING: "draining",
}


def registry_state(view: ReplicaView) -> str | None:
    if view.state is S.WARM:
        return "sleeping" if view.asleep else "warm"
    return _REGISTRY_STATE.get(view.state)


def adopted_view(rid: str, entry: Endpoint | None, now: float, role: Role | None = None,
                 probe: tuple[bool, bool | None] | None = None, redis_now_ms: int | None = None) -> ReplicaView:
    """The lifecycle state of a replica found running, from its registry entry (pure).

    Anything not known to have passed its warm-up (no entry, `loading`) restarts the
    bring-up; a `waking` promotion that was cut off shows as `warm` and is simply re-promoted.

    Without a registry entry (Redis came back empty, or lost the entry), the role the actuator
    last recorded (`ReplicaHandle.role`) and a look at the replica (`probe`: healthy, asleep)
    tell what it was: a healthy `active` one serves on, a healthy `warm-pool` one stays in the
    pool as it is (asleep or not), and a healthy one found asleep, whatever its role (none: a
    static endpoint the last controller freed, since that actuator keeps no roles across
    restarts), is a sleeping pool replica (the plan trims a pool above its size). Restarting
    the bring-up instead woke every sleeping replica, and the first plan then promoted them all
    (the current size counted them as arriving) and cold-started a new warm pool beside them.
    """
    if entry is None:
        if probe is not None and probe[0]:
            if probe[1]:
                return ReplicaView(rid, S.WARM, now, asleep=True)
            if role == "active":
                return ReplicaView(rid, S.ACTIVE, now)
            if role is not None:
                return ReplicaView(rid, S.WARM, now)
        return ReplicaView(rid, S.LOADING, now)
    # How long it has been in its state, on the clock that wrote it: Redis's (`redis_now_ms`, the
    # server's TIME when this controller read the registry; Registry.set stamps entries with it),
    # carried over to this controller's clock. Read against this host's clock, a clock step or a
    # skew between leader and standby aged a 3 s drain past `max_drain_s` and cut its streams
    # (a review). Not below 0: an entry stamped "later" (an older writer's clock) is new.
    since = entry.since_ms / 1000.0 if redis_now_ms is None else now - max(0, redis_now_ms - entry.since_ms) / 1000.0
    if entry.state == "active":
        return ReplicaView(rid, S.ACTIVE, since, inflight=entry.inflight)
    if entry.state == "draining":
        # Keep the original drain start: max_drain_s counts across restarts.
        return ReplicaView(rid, S.DRAINING, since, inflight=entry.inflight, running=1)
    if entry.state in ("warm", "sleeping"):
        return ReplicaView(rid, S.WARM, since, asleep=entry.state == "sleeping")
    return ReplicaView(rid, S.LOADING, now)


def parse_seq(raw: bytes | str | None) -> int | None:
    """The stored next replica sequence number (pure): 0 when absent, None when it is no
    non-negative integer (another writer's; a review: `int("1.0")` stopped every start)."""
    if not raw:
        return 0
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def next_seq_after(ids: list[str], prefix: str) -> int:
    """First sequence number not used by any id `prefix<N>` (no id is ever reused)."""
    pat = re.compile(re.escape(prefix) + r"(\d+)$")
    nums = [int(m.group(1)) for i in ids if (m := pat.match(i))]
    return max(nums, default=-1) + 1


@dataclass
class Replica:
    view: ReplicaView
    endpoint: str | None
    task: asyncio.Task[None] | None = None
    can_sleep: bool = True
    placeholder: bool = False  # started, but the platform names it: waiting for it in list()
    cold_for_demand: bool = False  # cold-started for a scale-up (a pool miss, not a later hit)
    started_at: float | None = None  # clock() when this controller started it (None: adopted)
    warmed_at: float | None = None  # clock() when its bring-up's warm-up request succeeded
    proven: bool = False  # up for timeouts.crash_loop_s since warmed_at: the start backoff was reset
    sample: VllmSample | None = None
    unresponsive: Unresponsive = field(default_factory=Unresponsive)  # its current run of failed scrapes while active
    probe: asyncio.Task[None] | None = None  # a liveness check of an unresponsive replica in flight
    pool_health: Unresponsive = field(default_factory=Unresponsive)  # its current run of failed /health checks while in the warm pool
    pool_probed_at: float | None = None  # clock() of its last warm-pool /health check
    registry_stale: bool = False  # its last registry write failed (Redis): `_sync_registry` rewrites it
    stop_failures: int = 0  # failed `actuator.stop` calls in a row (a TERMINATED replica still present)
    stop_retry_at: float = 0.0  # clock() from which the next stop is tried

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


class PoolController:
    """One pool's view and tick. Created fresh on every leadership gain (`rebuild`)."""

    def __init__(self, cfg: PoolConfig, actuator: Actuator, client: aioredis.Redis,
                 session: aiohttp.ClientSession, metrics: ControllerMetrics, *,
                 kick: Callable[[], None] = lambda: None, clock: Callable[[], float] = STEADY_CLOCK,
                 tick_interval_s: float = 1.0, confirm: Callable[[], Awaitable[bool]] | None = None,
                 leading: Callable[[], bool] = lambda: True) -> None:
        self.cfg = cfg
        self.pool = cfg.name
        self.tick_interval_s = tick_interval_s  # a replica warm mid-tick is promoted by the next
        self.actuator = actuator
        self.redis = client
        self.session = session
        self.metrics = metrics
        self.registry = Registry(client, cfg.name)
        self.kick = kick
        # Asked before a tick acts (starts, stops, drains, registry writes): does this controller
        # still hold the leader lease in Redis? (Controller.confirm_leader; None: no lease.)
        self.confirm = confirm
        # Does this controller still count itself leader (its lease, by its own clock)? Asked by
        # the replica operations that run beside the ticks before each registry write, role or
        # stop: a controller paused past its lease (SIGSTOP, a VM freeze, a long GC) resumed
        # those operations before it noticed the loss and stepped down, and acted beside the
        # new leader (a review: a promotion's role written after the new leader had recycled
        # the replica; a stop that resumed would kill a replica the new leader serves on).
        self.leading = leading
        self.clock = clock
        self.prefix = cfg.id_prefix or f"{cfg.name}-r"
        self.replicas: dict[str, Replica] = {}
        # Dead replicas already dropped from the actuator's books: clock() of the next repeat.
        self._forgotten: dict[str, float] = {}
        self._forget_retry: dict[str, tuple[int, float]] = {}  # failed drops: (failures, clock() of the next try)
        self.dcfg = DeciderConfig(cfg.policy, cfg.forecast, cfg.warm_pool, self.prefix, cfg.demand, cfg.capacity)
        self._over_capacity = False  # said once: more wanted than the actuator can run
        retention = cfg.forecast.retention_days * fc.MINUTES_PER_DAY
        # Policy window, burst memory, demand history, next replica id (controller.decider).
        self.state = DeciderState(history=fc.DemandHistory.empty(retention, fc.minute_of(clock())))
        self.scraper = ReplicaScraper(session, cfg.timeouts.scrape_s, cfg.model,
                                      on_failure=lambda src: metrics.scrape_failures.labels(source=src).inc())
        self.events: deque[dict[str, Any]] = deque(maxlen=2000)  # the decision log, for tests/status
        self.last_plan: ScalePlan | None = None
        self.last_reason = ""
        self.scale_up_since: float | None = None  # clock() of the decision that began the scale-up under way
        self.envoy: EnvoySample | None = None
        self._k_history = schema.key(cfg.name, schema.CTL_HISTORY)
        self._k_seq = schema.key(cfg.name, schema.CTL_SEQ)
        self._k_desired = schema.key(cfg.name, schema.CTL_DESIRED)
        self._desired_stored: int | None = None  # the value last written to _k_desired
        self._history_refused = False  # Redis refused the last demand-history write (said once)
        self._orphans: set[str] = set()  # registry endpoints of no known replica at the last tick
        self._stops_due: list[Replica] = []  # replicas whose failed stop is due again (reconcile; run after the leader check)
        self._ceiling_set: bool | None = None  # None: unknown (a previous leader's may be in Redis: cleared)
        self.start_times = StartTimes()  # measured cold starts and wakes (policy.replica_due)
        self._stalled_said: set[str] = set()  # stalled wakes already logged
        self._arriving_set: bool | None = None  # an announcement of capacity on its way is in Redis (None: unknown)
        self._arriving_due: list[float] = []  # the times announced last, one per replica (controller clock)
        self.start_backoff = StartBackoff()  # failed starts in a row (controller.liveness)
        self.logged_actions: list[Action] = []  # the last step's actions, as the decision log names them
        # A pool that had no replica at all when this controller took it over starts its first
        # ones for min_replicas: no warm-pool miss (there was never a pool to hit) until one is active.
        self._booting = False
        metrics.prepare(self.pool)

    # ---- logging -------------------------------------------------------------------------

    def emit(self, kind: str, **fields: Any) -> None:
        rec = {"ts": round(self.clock(), 3), "pool": self.pool, "event": kind, **fields}
        self.events.append(rec)
        decision_log.info(json.dumps(rec, default=str))

    # ---- start-up: rebuild from the outside world ----------------------------------------

    async def rebuild(self) -> None:
        now = self.clock()
        handles = await self.actuator.list()
        eps = await self.registry.endpoints()
        redis_now_ms = await self.registry.server_ms()
        by_rid = {e.replica_id: e for e in eps.values()}
        seen_eps: set[str] = set()
        entries = {h.replica_id: by_rid.get(h.replica_id) or (eps.get(h.endpoint) if h.endpoint else None)
                   for h in handles if h.running}
        # A replica without a registry entry: look before deciding (adopted_view).
        unknown = [h for h in handles if h.running and entries[h.replica_id] is None and h.endpoint]
        looks = await asyncio.gather(*(self._probe(h) for h in unknown))
        probes = {h.replica_id: look for h, look in zip(unknown, looks, strict=True)}
        for h in handles:
            if not h.running:
                await self._forget(h)
                continue
            self._adopt(h, entries[h.replica_id], now, probes.get(h.replica_id), redis_now_ms)
            if h.endpoint:
                seen_eps.add(h.endpoint)
        for ep, e in eps.items():
            if ep not in seen_eps and e.replica_id not in self.replicas:
                await self.registry.remove(ep)  # a replica that died while no controller ran
        stored_seq = parse_seq(await self.redis.get(self._k_seq))
        if stored_seq is None:
            log.warning("pool %s: %s holds no replica sequence number: ignored (ids go on after the "
                        "replicas found)", self.pool, self._k_seq)
        next_seq = max(next_seq_after([h.replica_id for h in handles], self.prefix), stored_seq or 0)
        self.state = replace(self.state, next_seq=next_seq)
        self._resume_desired(await self.redis.get(self._k_desired))
        raw = await self.redis.get(self._k_history)
        if raw:
            retention = self.cfg.forecast.retention_days * fc.MINUTES_PER_DAY
            try:
                stored = fc.DemandHistory.from_dict(json.loads(raw), retention)
            except (ValueError, KeyError, TypeError, OverflowError) as exc:  # (an infinite end: OverflowError)
                log.warning("pool %s: %s is unreadable (%s: %s): the history starts empty", self.pool,
                            self._k_history, type(exc).__name__, exc)
            else:
                # Another writer's end far ahead of the clock would leave every minute this
                # controller records behind it, unrecorded until that time.
                if stored.end_minute > fc.minute_of(self.clock()) + fc.MINUTES_PER_DAY:
                    log.warning("pool %s: %s ends at minute %d, more than a day ahead of the clock: the "
                                "history starts empty", self.pool, self._k_history, stored.end_minute)
                else:
                    self.state = replace(self.state, history=stored)
        assert self.state.history is not None
        self._booting = not self.replicas
        self.emit("rebuild", replicas={rid: r.view.state.value for rid, r in self.replicas.items()},
                  next_seq=self.state.next_seq, history_end=self.state.history.end_minute)

    def _resume_desired(self, raw: bytes | str | None) -> None:
        """Start the policy from the last leader's desired count, bounded by the serving and
        incoming replicas found (never more than exist: a count from a controller that stopped
        long ago must not start replicas by itself). Without it a new leader counted every
        replica in its cold start as wanted serving capacity, a warm-pool refill included, and
        cold-started another refill (a review: one needless cold start and ~120 replica-s per
        restart during a scale-up)."""
        try:
            stored = int(raw) if raw is not None else None
        except (TypeError, ValueError):
            stored = None
        if stored is None or stored < 0:
            return
        found = sum(1 for r in self.replicas.values() if r.view.state is S.ACTIVE or r.view.state in INCOMING_STATES)
        # ...and never below the replicas serving or being promoted: the count only tells which
        # replicas in their cold start were wanted to serve. A lower count (a controller that
        # stopped long ago, another config) would drain serving replicas on a stale first tick,
        # past the scale-down step and stabilization (a review's repro: 4 busy, stored 1).
        serving = sum(1 for r in self.replicas.values() if r.view.state in (S.ACTIVE, S.WAKING))
        desired = max(serving, min(stored, found))
        self.state = replace(self.state, policy=replace(self.state.policy, desired=desired))
        self._desired_stored = stored
        self.emit("resume", stored_desired=stored, found=found, desired=desired)

    async def _forget(self, h: ReplicaHandle) -> None:
        """A replica the actuator lists but that no longer runs, and that this controller never
        knew (it died while no controller ran): drop it from the actuator's books (for the
        process actuator its table entry, whose pid might otherwise be another process's one
        day) and say so. Repeated every `FORGET_AGAIN_S` while it is listed (an actuator may
        keep listing a stopped one, static: its repeat changes nothing), not once: a Kubernetes
        pod whose recorded scale-down the ReplicaSet spent on another pod is stopped only by a
        repeat made after the ReplicaSet acted (`KubernetesActuator._stop_again_if_spent`); once,
        that repeat came a tick after the stop, before it, and the pod ran on for good."""
        again_at = self._forgotten.get(h.replica_id)
        if again_at is not None and self.clock() < again_at:
            return
        failures, retry_at = self._forget_retry.get(h.replica_id, (0, 0.0))
        if self.clock() < retry_at:
            return
        self._forgotten[h.replica_id] = self.clock() + FORGET_AGAIN_S
        try:
            await self.actuator.stop(h.replica_id)
        except Exception as exc:  # the next rebuild or reconcile tries again, after a backoff
            # (not once per replica then: kept in _forgotten, it was never tried again by this
            # leader, and a replica being stopped, `stopping` in the process actuator's table,
            # ran on untracked; nor at every tick: a stop that keeps failing logged a warning a
            # second)
            self._forgotten.pop(h.replica_id, None)
            self._forget_retry[h.replica_id] = (failures + 1, self.clock() + min(STOP_RETRY_MAX_S, 2.0 ** failures))
            log.warning("%s: could not forget dead replica %s (attempt %d, next in %.0f s): %s", self.pool,
                        h.replica_id, failures + 1, min(STOP_RETRY_MAX_S, 2.0 ** failures), exc)
            return
        self._forget_retry.pop(h.replica_id, None)
        if again_at is None:
            self.emit("forgotten", replica=h.replica_id, endpoint=h.endpoint, role=h.role)

    async def _probe(self, h: ReplicaHandle) -> tuple[bool, bool | None]:
        """(healthy, asleep) of a running replica; (False, None) when it does not answer."""
        assert h.endpoint is not None
        client = self._client_at(h.endpoint)
        try:
            return await client.health(), await client.is_sleeping()
        except (VllmError, aiohttp.ClientError, TimeoutError, ValueError):
            return False, None

    def _adopt(self, h: ReplicaHandle, entry: Endpoint | None, now: float,
               probe: tuple[bool, bool | None] | None = None, redis_now_ms: int | None = None) -> Replica:
        view = adopted_view(h.replica_id, entry, now, h.role, probe, redis_now_ms)
        outdated = h.labels.get("outdated") == "1"
        if outdated:
            view = replace(view, outdated=True)
            log.warning("pool %s: replica %s runs the command it was started with, not the one configured now: "
                        "it serves on until replaced (drained first when the pool shrinks, retired from the "
                        "warm pool once a replacement is warm)", self.pool, h.replica_id)
        rep = Replica(view, h.endpoint)
        self.replicas[h.replica_id] = rep
        self.emit("adopt", replica=h.replica_id, endpoint=h.endpoint, state=view.state.value,
                  registry=entry.state if entry else None, role=h.role, outdated=outdated)
        if view.state is S.LOADING and h.endpoint:
            self._spawn(rep, self._bring_up(rep))
        return rep

    # ---- reconcile with the actuator -----------------------------------------------------

    async def reconcile(self, now: float) -> None:
        self._stops_due = []
        handles = {h.replica_id: h for h in await self.actuator.list()}
        for rid in [r for r in self._forgotten if r not in handles]:
            del self._forgotten[rid]  # no longer listed: gone for good
        for rid in [r for r in self._forget_retry if r not in handles]:
            del self._forget_retry[rid]  # (kept, one entry per such replica ever seen)
        for rid, h in handles.items():
            rep = self.replicas.get(rid)
            if rep is None:
                if not h.running:
                    await self._forget(h)
                    continue
                # A replica the platform named itself (start returned None): it replaces one
                # placeholder, so it is not counted twice.
                ph = next((r for r in self.replicas.values() if r.placeholder), None)
                if ph is not None:
                    del self.replicas[ph.view.replica_id]
                self._adopt(h, None, now)
            elif rep.endpoint is None and h.endpoint and rep.view.state is S.LOADING:
                rep.endpoint = h.endpoint
                rep.placeholder = False
                if not rep.busy:
                    self._spawn(rep, self._bring_up(rep))
        grace = self.cfg.timeouts.adopt_grace_s
        for rid, rep in list(self.replicas.items()):
            st = rep.view.state
            if st is S.TERMINATED and rep.stop_failures and not rep.busy:
                if rid not in handles:
                    self.replicas.pop(rid, None)  # gone after all: nothing left to stop
                elif now >= rep.stop_retry_at:
                    self._stops_due.append(rep)  # its last stop failed: again, once the tick may act
                continue
            if st in (S.TERMINATED, S.FAILED):
                continue
            if rep.placeholder:
                if now - rep.view.state_since > self.cfg.timeouts.health_s:
                    del self.replicas[rid]  # never appeared: forget it (the policy re-plans)
                    self.emit("placeholder_expired", replica=rid)
                continue
            cur = handles.get(rid)
            if cur is not None and cur.running:
                continue
            if cur is None and st is S.LOADING and now - rep.view.state_since < grace:
                continue  # list() may lag behind start()
            if rep.busy and rep.task is not None:
                rep.task.cancel()
            why = "vanished" if cur is None else "not_running"
            await self._fail(rep, why, kind=why)

    # ---- the tick ------------------------------------------------------------------------

    async def tick(self, envoy: EnvoySample | None = None) -> ScalePlan:
        now = self.clock()
        self.envoy = envoy
        await self.reconcile(now)

        scrape_eps = {rid: r.endpoint for rid, r in self.replicas.items()
                      if r.endpoint and r.view.state in (S.ACTIVE, S.DRAINING)}
        samples, fg, eps = await asyncio.gather(
            self.scraper.scrape(scrape_eps, now),
            scrape_floodgate(self.redis, self.pool, now, self.cfg.timeouts.scrape_s),
            self._registry_endpoints(),
        )
        if not fg.signal.ok:
            self.metrics.scrape_failures.labels(source="floodgate").inc()
        inflight = {e.replica_id: e.inflight for e in eps.values()} if eps is not None else {}
        for rid, rep in self.replicas.items():
            s = samples.get(rid)
            if s is not None:
                rep.sample = s
            running = rep.view.running
            if s is not None:
                running = engine_held(s.metrics.ok, s.metrics.running, s.metrics.waiting, rep.view.running)
            inf = inflight.get(rid, rep.view.inflight) if eps is not None else max(1, rep.view.inflight)
            busy_now = running + inf > 0
            rep.view = replace(rep.view, running=running, inflight=inf,
                               last_busy_at=now if busy_now else rep.view.last_busy_at)
            if rep.view.state in (S.ACTIVE, S.DRAINING):
                # Draining too: a hung draining replica reads as busy (its scrapes fail), so its
                # drain never ended before max_drain_s (300 s), holding the pool's one drain
                # and its refill all that time (a review).
                rep.unresponsive = rep.unresponsive.observe(now, None if s is None else s.metrics.ok)
            else:
                rep.unresponsive = Unresponsive()
        await self._fail_unresponsive(now)
        self._probe_pool(now)
        for rep in self.replicas.values():
            if rep.view.state not in (S.FAILED, S.TERMINATED):
                self._prove(rep, now)

        views = tuple(replace(r.view, busy=True) if r.busy else r.view for r in self.replicas.values())
        # Offered demand and learned capacity inputs: Floodgate's counters, Envoy's gateway
        # listener (when this controller's Envoy serves this pool), the replicas' latency deltas.
        gateway = envoy.gateway if envoy is not None and envoy.ok and self.cfg.demand.use_envoy else None
        active_ids = [rid for rid, r in self.replicas.items() if r.view.state is S.ACTIVE]
        fresh = [samples[rid] for rid in active_ids if rid in samples and samples[rid].metrics.ok]
        latency = tick_latency([(s.ttft_delta, s.itl_delta, s.metrics.running + s.metrics.waiting) for s in fresh],
                               len(active_ids), saturated=fg.signal.ok and fg.signal.depth > 0)
        pool_signals = PoolSignals(self.pool, tuple(s.metrics for s in samples.values()), fg.signal,
                                   counters=fg.counters, gateway=gateway, latency=latency if active_ids else None)
        stalled = stalled_wakes(views, self.start_times, now)
        for rid in stalled - self._stalled_said:
            log.warning("pool %s: %s has been waking for much longer than any wake measured: promoting "
                        "another warm replica meanwhile (it still has until timeouts.wake_s)", self.pool, rid)
        self._stalled_said = set(stalled)
        # A draining replica whose scrape failed reads as busy (unknown is not idle): taking it
        # back would put a hung replica first in line for the burst (a review).
        unhealthy = frozenset(rid for rid, r in self.replicas.items() if r.view.state is S.DRAINING
                              and (rid not in samples or not samples[rid].metrics.ok))
        signals = Signals(pool_signals, views, stalled, unhealthy)
        seq_before = self.state.next_seq
        d = self.step(signals, now, extra={"queue": fg.queued, "limit": fg.limit,
                                           "envoy_active": envoy.rq_active if envoy and envoy.ok else None},
                      count=False)
        if self.confirm is not None and not await self.confirm():
            # Another controller took the lease since this one last renewed it (Redis lost it,
            # a pause): whatever this tick writes — replicas started or stopped, the desired
            # count, the registry, the ceiling — would fight the new leader's. Nothing.
            if self.logged_actions:
                self.emit("not_leader", skipped=[f"{a.kind.value}:{a.replica_id}:{a.reason}" for a in self.logged_actions])
            return d.plan  # (and counts no change: a standby's decision changed nothing)
        self.count_change(d.plan, now)
        await self._persist(d, seq_before)
        # The actions the decision log named (`step`), less any that became skippable while the
        # plan was persisted: filtering d.actions afresh here started a replica the log did not
        # name when a start backoff ended in between (a flaky test, and a log that undercounts).
        # Checked as each is carried out, not once before: an action's registry write lets a
        # liveness check beside the tick fail the replica of an action after it (`_skip`).
        todo: list[Action] = []
        for a in self.logged_actions:
            if not self._skip(a.replica_id, a.kind):
                todo.append(a)
                await self._execute(a.kind, a.replica_id, a.reason, now)
        for rep in self._stops_due:  # (after the leader check: another leader may own it by now)
            if not rep.busy and self.replicas.get(rep.view.replica_id) is rep:
                self._spawn(rep, self._stop(rep))
        self._stops_due = []
        await self._publish_ceiling(d)  # after the promotions: they count as coming within a wake
        await self._publish_arriving(d, now)
        await self._sync_registry(eps, {a.replica_id for a in todo})
        self.metrics.set_states(self.pool, count_states(tuple(r.view for r in self.replicas.values())))
        self.metrics.start_backoff.labels(pool=self.pool).set(max(0.0, self.start_backoff.until - self.clock()))
        if self._booting and any(r.view.state is S.ACTIVE for r in self.replicas.values()):
            self._booting = False
        return d.plan

    def _decider_config(self, capacity: int | None) -> DeciderConfig:
        """The pool's decider settings with `warm_pool.max_total` held to the replicas the
        actuator can have (a static list's endpoints; read every tick). Beyond them every
        planned start failed with NoCapacity, and the failure's kick ran the next tick at once:
        a static pool of 1 endpoint wanting 2 replicas failed 333 starts in 3 s, each a
        `failed` replica and a new replica id."""
        wp = self.dcfg.warm_pool
        if capacity is None or capacity >= wp.max_total:
            return self.dcfg
        return replace(self.dcfg, warm_pool=wp.model_copy(update={"max_total": capacity}))

    def count_change(self, plan: ScalePlan, now: float) -> None:
        """Count a change of the desired count (`floodgate_scale_events_total`, the scale-up under
        way for warm-pool hits): only one this controller acts on."""
        if plan.direction != "none":
            self.metrics.scale_events.labels(pool=self.pool, direction=plan.direction, reason=plan.reason).inc()
        if plan.direction == "up" and self.scale_up_since is None:
            self.scale_up_since = now  # a scale-up runs until the next step down (warm-pool hits)
        elif plan.direction == "down":
            self.scale_up_since = None

    def step(self, signals: Signals, now: float, extra: dict[str, Any] | None = None, count: bool = True) -> Decision:
        """The decider's step for this pool (pure `decider.decide`) plus its metrics and decision
        log; no I/O. The backtest calls the same `decide` with the same `Signals`. `count`: count
        the change here (`tick` counts it after its leader check instead)."""
        seq_before = self.state.next_seq
        capacity = self.actuator.capacity
        self.state, d = decide(self._decider_config(capacity), self.state, signals, now)
        plan = d.plan
        over = capacity is not None and plan.desired > capacity
        if over and not self._over_capacity:
            log.warning("pool %s: %d replicas wanted, the %s actuator has %d endpoints: no start is planned "
                        "beyond them (add endpoints, or lower policy.max_replicas)", self.pool, plan.desired,
                        self.actuator.name, capacity)
            self.emit("over_capacity", desired=plan.desired, capacity=capacity)
        self._over_capacity = over
        self.last_plan = plan
        m = self.metrics
        m.desired.labels(pool=self.pool).set(plan.desired)
        m.actual.labels(pool=self.pool).set(plan.active)
        m.warm_target.labels(pool=self.pool).set(d.warm_target)
        m.warm_reserve.labels(pool=self.pool).set(d.reserve)
        m.demand.labels(pool=self.pool).set(plan.demand)
        m.lacking.labels(pool=self.pool).set(plan.lacking)
        m.per_replica.labels(pool=self.pool).set(d.per_replica)
        if d.offered is not None:
            for c in (0, 1, 2):
                off = d.offered.offered_rate.get(c, 0.0) if not d.offered.stale else float("nan")
                away = d.offered.turned_away_rate.get(c, 0.0) if not d.offered.stale else float("nan")
                m.offered_rate.labels(pool=self.pool, priority=str(c)).set(off)
                m.turned_away_rate.labels(pool=self.pool, priority=str(c)).set(away)
        m.forecast.labels(pool=self.pool).set(float("nan") if d.floor is None else d.floor)
        m.forecast_demand.labels(pool=self.pool).set(float("nan") if d.forecast.peak is None else d.forecast.peak)
        if count:
            self.count_change(plan, now)
        actions = self._cap_starts([a for a in d.actions if not self._skip(a.replica_id, a.kind)], now)
        if not any(a.kind is ActionKind.START for a in actions):
            # Starts held back (a start backoff) take no ids: the next planned start gets the
            # same one, so ids stay consecutive.
            self.state = replace(self.state, next_seq=seq_before)
        self.logged_actions = actions
        if plan.direction != "none" or plan.reason != self.last_reason or actions:
            self.emit("decision", direction=plan.direction, desired=plan.desired, previous=plan.previous,
                      reason=plan.reason, cause=plan.cause, active=plan.active, incoming=plan.incoming,
                      demand=round(plan.demand, 2), waiting=round(plan.waiting, 2),
                      running=round(plan.running, 2), kv_mean=plan.kv_mean, stale=plan.stale,
                      panic=plan.panic, recommendation=plan.recommendation, stabilized=plan.stabilized,
                      floor=d.floor, forecast=d.forecast.reason, warm_target=d.warm_target,
                      warm_reserve=round(d.reserve, 3),
                      lacking=round(plan.lacking, 2), burst=round(plan.burst, 2), burst_low=round(plan.burst_low, 2),
                      burst_mid=round(plan.burst_mid, 2), burst_high=round(plan.burst_high, 2), per_replica=round(d.per_replica, 2),
                      offered=None if d.offered is None else {
                          "source": d.offered.source, "stale": d.offered.stale,
                          "rate": round(d.offered.offered_total, 2),
                          "turned_away": round(d.offered.lacking_rate(), 2),
                          **({"unanswered": round(d.offered.unanswered_rate, 2)}
                             if d.offered.unanswered_rate > 0 else {})},
                      **(extra or {}),
                      actions=[f"{a.kind.value}:{a.replica_id}:{a.reason}" for a in actions])
        self.last_reason = plan.reason
        return d

    async def _publish_ceiling(self, d: Decision) -> None:
        """The admission ceiling per active endpoint (config.AdmissionCeilingConfig), published
        while the pool waits for cold starts and the active replicas are offered more than it
        lets them hold (`policy.admission_ceiling`). Taken back once that is over (the
        processors then give the limit back its level from before the cap and Vegas moves it
        alone again); it also expires with this controller. The processors read it with the
        registry."""
        c = self.cfg.admission_ceiling
        p = d.plan
        soon = sum(1 for r in self.replicas.values() if r.view.state in (S.ACTIVE, S.WAKING))
        offered = offered_to_active(p.running, p.waiting, p.lacking)
        value = admission_ceiling(bool(self._ceiling_set), p.desired, soon, p.active, offered, d.per_replica,
                                  c.headroom) if c.enabled else None
        short = value is not None
        if not short and self._ceiling_set is False:
            return
        try:
            if value is not None:
                await self.registry.set_ceiling(value, c.ttl_s)
            else:
                await self.registry.clear_ceiling()
        except OUTAGE_ERRORS:
            self.metrics.scrape_failures.labels(source="redis").inc()
            return
        if short != bool(self._ceiling_set):
            self.emit("ceiling", per_endpoint=value, active=p.active, desired=p.desired, demand=round(p.demand, 2),
                      offered=round(offered, 2))
        self._ceiling_set = short
        self.metrics.ceiling.labels(pool=self.pool).set(float("nan") if value is None else value)

    async def _publish_arriving(self, d: Decision, now: float) -> None:
        """Announce the capacity on its way (`policy.arriving_capacity`: the replicas the plan
        still needs that are cold-starting or waking, each due at the time this controller
        measured such a start to take) for the processors' early drop (schema.CTL_ARRIVING);
        taken back when there is none. It expires with this controller (`admission_ceiling.ttl_s`)."""
        c = self.cfg.admission_ceiling
        at: list[tuple[float, int]] = []
        if c.announce_arrivals:
            due = [replica_due(r.view, r.started_at, self.start_times) for r in self.replicas.values()
                   if r.view.state in (S.LOADING, S.WARMING, S.WAKING)]
            at = arriving_capacity(d.plan.desired, d.plan.active, due, now, grace_s=self.tick_interval_s)
        if not at and self._arriving_set is False:
            return
        announced = sorted(now + s for s, k in at for _ in range(k))
        try:
            await self.registry.set_arriving(at, c.ttl_s, grace_s=self.tick_interval_s)
            if later_than_announced(self._arriving_due, announced):
                # A late replica's time moved (`arriving_capacity`'s grace): the processors hold
                # the time they read, which is passing, until their next refresh (up to a second)
                # and count nothing for it meanwhile; tell them now. (A growing announcement
                # tells them itself.)
                await self.registry.notify()
        except OUTAGE_ERRORS:
            self.metrics.scrape_failures.labels(source="redis").inc()
            return
        self._arriving_due = announced
        if bool(at) != bool(self._arriving_set):
            self.emit("arriving", at=at, active=d.plan.active, desired=d.plan.desired)
        self._arriving_set = bool(at)

    async def _persist(self, d: Decision, seq_before: int) -> None:
        """Write what must survive a restart: the replica id counter, the desired count and the
        demand history."""
        if d.plan.desired != self._desired_stored:
            with contextlib.suppress(*OUTAGE_ERRORS):
                await self.redis.set(self._k_desired, d.plan.desired)
                self._desired_stored = d.plan.desired
        if self.state.next_seq != seq_before:
            with contextlib.suppress(*OUTAGE_ERRORS):
                await self.redis.set(self._k_seq, self.state.next_seq)
        if d.recorded is not None and self.state.history is not None:
            try:
                await self.redis.set(self._k_history, json.dumps(self.state.history.to_dict()))
                self._history_refused = False
            except OUTAGE_ERRORS as exc:
                # An outage is retried next minute; a refusal (a value past the server's
                # `proto-max-bulk-len`, `maxmemory` reached) would be refused every time, and a
                # restart or failover would start the forecast from nothing: say so, once.
                if answered_with_error(exc) and not self._history_refused:
                    log.warning("pool %s: Redis refused the demand history (%s): it is not kept across restarts "
                                "(lower forecast.retention_days, or raise the server's proto-max-bulk-len / "
                                "maxmemory)", self.pool, exc)
                self._history_refused = answered_with_error(exc)

    async def _sync_registry(self, eps: dict[str, Endpoint] | None, acted: set[str]) -> None:
        """Level-triggered registry: rewrite every entry that differs from the lifecycle view
        (a write lost to a Redis blip, e.g. DRAIN, is retried here every tick until it holds)."""
        if eps is None:
            return  # registry unreadable this tick: nothing to compare with
        for rep in list(self.replicas.values()):
            if rep.busy or rep.placeholder or not rep.endpoint or rep.view.replica_id in acted:
                continue  # an operation in flight (or just issued) writes its own outcome
            want = registry_state(rep.view)
            have = eps.get(rep.endpoint)
            try:
                if want is None:
                    if have is not None and rep.view.state in (S.FAILED, S.TERMINATED):
                        await self.registry.remove(rep.endpoint)
                        self.emit("registry_sync", replica=rep.view.replica_id, frm=have.state, to=None)
                elif have is None or have.state != want or have.replica_id != rep.view.replica_id:
                    await self.registry.set(rep.endpoint, want, rep.view.replica_id)
                    self.emit("registry_sync", replica=rep.view.replica_id,
                              frm=have.state if have else None, to=want)
                rep.registry_stale = False
            except OUTAGE_ERRORS:
                self.metrics.scrape_failures.labels(source="registry").inc()
                return
        await self._drop_orphans(eps)

    async def _drop_orphans(self, eps: dict[str, Endpoint]) -> None:
        """Remove registry entries of no replica this controller knows, once seen on two ticks
        in a row: a removal lost to a Redis blip (`_fail` and `_stop` forget the replica after
        trying) or an old leader's late write left a dead endpoint `active` for good, and
        processors kept routing to it; only `rebuild` removed such entries (a review: one
        survived 120 ticks)."""
        known_eps = {r.endpoint for r in self.replicas.values() if r.endpoint}
        known_ids = set(self.replicas)
        orphans = {ep for ep, e in eps.items() if ep not in known_eps and e.replica_id not in known_ids}
        for ep in orphans & self._orphans:
            try:
                await self.registry.remove(ep)
            except OUTAGE_ERRORS:
                self.metrics.scrape_failures.labels(source="registry").inc()
                return
            self.emit("registry_sync", replica=eps[ep].replica_id, endpoint=ep, frm=eps[ep].state, to=None,
                      why="no such replica")
        self._orphans = orphans - self._orphans

    async def _registry_endpoints(self) -> dict[str, Endpoint] | None:
        try:
            return await self.registry.endpoints()
        except OUTAGE_ERRORS:
            self.metrics.scrape_failures.labels(source="registry").inc()
            return None

    def _cap_starts(self, actions: list[Action], now: float) -> list[Action]:
        """Drop the starts beyond what the start backoff allows now (`StartBackoff.starts_allowed`)."""
        starting = sum(r.view.state in (S.COLD, S.LOADING, S.WARMING) for r in self.replicas.values())
        t = self.cfg.timeouts
        cap = self.start_backoff.starts_allowed(starting, now, max(t.start_backoff_max_s, t.crash_loop_s))
        if cap is None:
            return actions
        out: list[Action] = []
        for a in actions:
            if a.kind is ActionKind.START:
                if cap <= 0:
                    continue
                cap -= 1
            out.append(a)
        return out

    def _skip(self, rid: str, kind: ActionKind) -> bool:
        if kind is ActionKind.START:  # the plan asks again next tick
            return self.start_backoff.blocks(self.clock())
        rep = self.replicas.get(rid)
        if rep is None or rep.busy:
            return True  # an operation is in flight: the next tick sees its outcome
        ev = action_event(rep.view, kind)
        if not (rep.view.state is S.WARM if ev is None else allows(rep.view.state, ev)):
            # It moved on since the plan: a liveness check beside the tick failed it while the
            # tick checked its lease or persisted (a PROMOTE of a FAILED replica raised
            # InvalidTransition out of the tick and stopped the controller). The next tick re-plans.
            return True
        if kind in (ActionKind.TERMINATE, ActionKind.FORCE_STOP, ActionKind.SLEEP) and rep.registry_stale and \
                rep.view.state is not S.FAILED:
            return True  # its entry may still read active (processors route to it): first the write
        return kind is ActionKind.SLEEP and (not rep.can_sleep or not rep.endpoint)

    # ---- actions -------------------------------------------------------------------------

    def _spawn(self, rep: Replica, coro: Coroutine[Any, Any, None]) -> None:
        rep.task = asyncio.create_task(coro, name=f"{self.pool}:{rep.view.replica_id}")

    def _client(self, rep: Replica) -> VllmClient:
        assert rep.endpoint is not None
        return self._client_at(rep.endpoint)

    def _client_at(self, endpoint: str, timeout_s: float | None = None) -> VllmClient:
        t = self.cfg.timeouts.scrape_s if timeout_s is None else timeout_s
        return VllmClient(self.session, endpoint, timeout_s=t, model=self.cfg.model)

    async def _set_registry(self, rep: Replica) -> None:
        """Write `rep`'s registry entry. A Redis outage does not fail the operation that wrote
        it (a review: a 4 s write stall failed a replica mid cold start, and an error on a
        promotion's write left the replica waking with no operation, for good): the entry is
        marked stale and `_sync_registry` rewrites it on a later tick, and a draining replica
        whose entry may still read active is not stopped meanwhile (`_skip`)."""
        st = registry_state(rep.view)
        if not self.leading():
            # No longer leads: the registry is the new leader's (see `leading`). Should this
            # controller lead on after all (a renewal that came late), the sync writes it.
            rep.registry_stale = True
            return
        if rep.endpoint and st is not None:
            try:
                await self.registry.set(rep.endpoint, st, rep.view.replica_id)
            except OUTAGE_ERRORS as exc:
                rep.registry_stale = True
                self.metrics.scrape_failures.labels(source="registry").inc()
                self.emit("registry_write_failed", replica=rep.view.replica_id, to=st, error=f"{type(exc).__name__}: {exc}")
                return
            rep.registry_stale = False

    async def _set_role(self, rid: str, role: Role) -> None:
        """Record a replica's role with the actuator (best effort), while this controller leads."""
        if self.leading():
            with contextlib.suppress(Exception):
                await self.actuator.set_role(rid, role)

    def _event(self, rep: Replica, ev: Event, **kw: Any) -> None:
        before = rep.view.state
        rep.view = apply_event(rep.view, ev, self.clock(), **kw)
        self.emit("transition", replica=rep.view.replica_id, on=ev.value, frm=before.value,
                  to=rep.view.state.value, asleep=rep.view.asleep, inflight=rep.view.inflight,
                  running=rep.view.running)

    def _act(self, rep: Replica, kind: ActionKind) -> None:
        """Apply a planned action's lifecycle event (`lifecycle.apply_action`, shared with the
        backtest) and log the transition."""
        before = rep.view.state
        ev = action_event(rep.view, kind)
        rep.view = apply_action(rep.view, kind, self.clock())
        self.emit("transition", replica=rep.view.replica_id, on=ev.value if ev else kind.value, frm=before.value,
                  to=rep.view.state.value, asleep=rep.view.asleep, inflight=rep.view.inflight,
                  running=rep.view.running)

    async def _execute(self, kind: ActionKind, rid: str, reason: str, now: float) -> None:
        m = self.metrics
        m.actions.labels(pool=self.pool, action=kind.value, outcome="issued").inc()
        if kind is ActionKind.START:
            if reason == "scale_up" and not self._booting:
                m.warm_misses.labels(pool=self.pool).inc()
            rep = Replica(apply_action(ReplicaView(rid, S.COLD, now), kind, now), None, placeholder=True,
                          cold_for_demand=reason == "scale_up", started_at=now)
            self.replicas[rid] = rep
            self._spawn(rep, self._start(rep))
            return
        rep = self.replicas[rid]
        if kind is ActionKind.PROMOTE:
            if reason == "scale_up" and not rep.cold_for_demand:
                hit = pool_hit(rep.started_at, self.scale_up_since)
                (m.warm_hits if hit else m.warm_misses).labels(pool=self.pool).inc()
            rep.cold_for_demand = False
            self._act(rep, kind)
            await self._set_registry(rep)
            self._spawn(rep, self._promote(rep))
        elif kind is ActionKind.SLEEP:
            self._spawn(rep, self._sleep(rep))
        elif kind is ActionKind.DRAIN:
            self._act(rep, kind)
            await self._set_registry(rep)  # from now on the processor routes nothing new here
        elif kind is ActionKind.UNDRAIN:
            m.drain.labels(pool=self.pool, outcome="undrained").observe(now - rep.view.state_since)
            self._act(rep, kind)
            await self._set_registry(rep)  # routed to again at once
            await self._set_role(rid, "active")
        elif kind is ActionKind.RECYCLE:
            m.drain.labels(pool=self.pool, outcome="recycled").observe(now - rep.view.state_since)
            self._act(rep, kind)
            await self._set_registry(rep)
            await self._set_role(rid, "warm-pool")
        elif kind is ActionKind.TERMINATE:
            if rep.view.state is S.DRAINING:
                m.drain.labels(pool=self.pool, outcome="terminated").observe(now - rep.view.state_since)
            self._act(rep, kind)
            self._spawn(rep, self._stop(rep))
        elif kind is ActionKind.FORCE_STOP:
            m.drain.labels(pool=self.pool, outcome="forced").observe(now - rep.view.state_since)
            self._act(rep, kind)
            self._spawn(rep, self._stop(rep))

    async def _guard(self, rep: Replica, what: BackgroundOp, coro: Coroutine[Any, Any, None]) -> None:
        """Run one replica operation; any failure marks the replica failed (then terminated)."""
        try:
            await coro
            self.metrics.actions.labels(pool=self.pool, action=what, outcome="ok").inc()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.metrics.actions.labels(pool=self.pool, action=what, outcome="error").inc()
            self.emit("action_failed", replica=rep.view.replica_id, action=what, error=f"{type(exc).__name__}: {exc}")
            # Neither a platform at its size (NoCapacity) nor one whose API refused for now
            # (ActuatorUnavailable: the start never happened) is a failing start: counted as one,
            # a few seconds of an API server's 503s held the scale-up that followed to one start
            # at a time until a replica had come up (`StartBackoff.starts_allowed`). Both pause
            # starts for `start_backoff_s`: asked again at once (the kick below), they failed as
            # fast as ticks ran (a static pool: 246 starts in 3 s; an API outage: 219 in 4.2 s).
            if isinstance(exc, (NoCapacity, ActuatorUnavailable)):
                self.start_backoff = self.start_backoff.paused(self.clock(), self.cfg.timeouts.start_backoff_s)
            await self._fail(rep, f"{what}: {exc}", start_failed=not isinstance(exc, (NoCapacity, ActuatorUnavailable)),
                             kind="action_failed")
        finally:
            self.kick()  # the next tick should see the outcome at once

    async def _fail_unresponsive(self, now: float) -> None:
        """Check the active and draining replicas whose scrapes have failed for
        `timeouts.unresponsive_s` (controller.liveness): each gets one /health check of its own,
        beside the ticks."""
        t = self.cfg.timeouts
        for rep in list(self.replicas.values()):
            if rep.busy or not rep.endpoint or not rep.unresponsive.due(now, t.unresponsive_s):
                continue
            if rep.probe is None or rep.probe.done():
                rep.probe = asyncio.create_task(self._probe_liveness(rep), name=f"{self.pool}:{rep.view.replica_id}:live")

    async def _probe_liveness(self, rep: Replica) -> None:
        """Fail the replica if /health does not answer within `timeouts.liveness_probe_s` (its
        own timeout: an overloaded replica answers its scrapes late but still serves, and a
        review had one answering in 1.5 s failed on the 1 s scrape timeout). One that answers
        starts a new run: checked again after another `unresponsive_s` of failed scrapes."""
        t = self.cfg.timeouts
        assert rep.endpoint is not None
        since, state = rep.unresponsive.since, rep.view.state
        if await self._client_at(rep.endpoint, t.liveness_probe_s).health():
            rep.unresponsive = Unresponsive(self.clock())
            return
        if rep.view.state is not state or rep.busy or rep.unresponsive.since != since or since is None:
            return  # it moved on while the check ran (a scrape came back, a drain began or ended)
        self.metrics.unresponsive.labels(pool=self.pool).inc()
        await self._fail(rep, f"unresponsive: scrapes failing for {self.clock() - since:.0f} s, "
                              f"/health not answering within {t.liveness_probe_s:g} s", kind="unresponsive")
        self.kick()

    def _probe_pool(self, now: float) -> None:
        """Start a /health check of each warm-pool replica due one (`timeouts.pool_probe_s`).
        Pool replicas are not scraped: without this a hung one (a frozen process, a wedged
        server) was found only when a burst promoted it, and the burst waited for its wake to
        time out."""
        t = self.cfg.timeouts
        for rep in self.replicas.values():
            if rep.view.state is not S.WARM:
                rep.pool_health, rep.pool_probed_at = Unresponsive(), None
                continue
            if t.pool_probe_s <= 0 or rep.busy or not rep.endpoint or (rep.probe is not None and not rep.probe.done()):
                continue
            if rep.pool_probed_at is None:
                rep.pool_probed_at = now  # first seen in the pool: its bring-up or sleep just talked to it
                continue
            if now - rep.pool_probed_at >= t.pool_probe_s:
                rep.pool_probed_at = now
                rep.probe = asyncio.create_task(self._probe_pooled(rep), name=f"{self.pool}:{rep.view.replica_id}:pool")

    async def _probe_pooled(self, rep: Replica) -> None:
        """One /health check of a warm-pool replica; a run of failures lasting `unresponsive_s`
        fails it (the plan then refills the pool)."""
        t = self.cfg.timeouts
        assert rep.endpoint is not None
        ok = await self._client_at(rep.endpoint, t.liveness_probe_s).health()
        now = self.clock()
        if rep.view.state is not S.WARM or rep.busy:
            return  # promoted, put to sleep or stopped while the check ran
        rep.pool_health = rep.pool_health.observe(now, ok)
        if not ok:
            self.emit("pool_probe_failed", replica=rep.view.replica_id, since=rep.pool_health.since)
        if rep.pool_health.due(now, t.unresponsive_s):
            self.metrics.unresponsive.labels(pool=self.pool).inc()
            since = rep.pool_health.since or now
            await self._fail(rep, f"unresponsive in the warm pool: /health failing for {now - since:.0f} s", kind="pool_unresponsive")
            self.kick()

    def _prove(self, rep: Replica, now: float) -> None:
        """A replica up for `timeouts.crash_loop_s` resets the start backoff (once)."""
        if not rep.proven and rep.warmed_at is not None and now - rep.warmed_at >= self.cfg.timeouts.crash_loop_s:
            rep.proven = True
            self.start_backoff = self.start_backoff.succeeded()

    async def _fail(self, rep: Replica, why: str, start_failed: bool = True, *, kind: str) -> None:
        """Mark `rep` failed (`why` for the log; `kind`, one of metrics.FAILURE_REASONS, for the
        failures counter), hold the next start back if it never came up or died young, and take
        it out of the registry."""
        crashed_young = rep.warmed_at is not None and not rep.proven  # died within crash_loop_s of coming up
        live = rep.view.state not in (S.FAILED, S.TERMINATED)
        if start_failed and live and (rep.view.state in (S.COLD, S.LOADING, S.WARMING) or crashed_young):
            # it never came up, or died soon after: the next start waits (a missing binary, a
            # crashing command, an engine that dies on its first batches)
            self.start_backoff = self.start_backoff.failed(
                self.clock(), self.cfg.timeouts.start_backoff_s, self.cfg.timeouts.start_backoff_max_s)
            self.emit("start_backoff", failures=self.start_backoff.failures,
                      seconds=round(self.start_backoff.until - self.clock(), 3))
        if rep.view.state not in (S.FAILED, S.TERMINATED):
            self._event(rep, Event.FAIL)
            self.metrics.failures.labels(pool=self.pool, reason=kind).inc()
            self.emit("failed", replica=rep.view.replica_id, why=why)
        if rep.endpoint and self.leading():
            with contextlib.suppress(*OUTAGE_ERRORS):
                await self.registry.remove(rep.endpoint)

    async def _start(self, rep: Replica) -> None:
        async def run() -> None:
            rid = rep.view.replica_id
            h = await self.actuator.start(rid)
            if h is None:
                return  # the platform names it: adopted from list() later
            if h.replica_id != rid:
                # The actuator picked its own replica (static pool): carry on under its id.
                self.replicas.pop(rid, None)
                if h.replica_id in self.replicas:
                    return
                rep.view = replace(rep.view, replica_id=h.replica_id)
                self.replicas[h.replica_id] = rep
            rep.placeholder = False
            rep.endpoint = h.endpoint
            if rep.endpoint:
                await self._bring_up_steps(rep)

        await self._guard(rep, "start", run())

    async def _bring_up(self, rep: Replica) -> None:
        await self._guard(rep, "bring_up", self._bring_up_steps(rep))

    async def _bring_up_steps(self, rep: Replica) -> None:
        """loading -> (/health) -> warming -> (one-token warm-up) -> warm. Never active here:
        a cold replica is promoted by the plan like any warm one."""
        t = self.cfg.timeouts
        await self._set_registry(rep)
        client = self._client(rep)
        deadline = time.monotonic() + t.health_s
        delay = 0.1
        while not await client.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"/health not ready after {t.health_s:g} s")
            await asyncio.sleep(health_poll_pause(delay, self.clock(), rep.started_at, self.start_times))
            # Short cap: every pause is time a loaded replica sits unused during a burst
            # (a 2 s cap cost up to 2 s of each 15 s scaled cold start in the elastic bench).
            delay = min(delay * 1.5, t.health_poll_s)
        self._event(rep, Event.LOADED)
        if await client.is_sleeping():
            await client.wake(t.wake_s)  # adopted asleep (static endpoint, restart mid-recycle)
        await client.warmup(t.warmup_s)
        self._event(rep, Event.WARMUP_OK, asleep=False)
        rep.warmed_at = self.clock()
        self.start_backoff = self.start_backoff.up()
        self._prove(rep, rep.warmed_at)  # (crash_loop_s 0: up is proven)
        if rep.started_at is not None:
            self.start_times = self.start_times.observe("cold", self.clock() - rep.started_at)
        await self._set_registry(rep)
        await self._set_role(rep.view.replica_id, "warm-pool")

    async def _promote(self, rep: Replica) -> None:
        async def run() -> None:
            t = self.cfg.timeouts
            client = self._client(rep)
            t0, c0 = time.monotonic(), self.clock()
            # A replica whose bring-up warmed it up a moment ago (the plan promotes a needed
            # one on the tick its bring-up kicks) is awake and serving: asking again only
            # delays its capacity (0.14 s of every cold start's promotion in the elastic bench).
            fresh = not rep.view.asleep and rep.warmed_at is not None and c0 - rep.warmed_at < WARM_FRESH_S
            asleep = not fresh and (rep.view.asleep or await client.is_sleeping())
            if asleep:
                await client.wake(t.wake_s)
            if not fresh:
                await client.warmup(t.warmup_s)
            self._event(rep, Event.WAKE_OK, asleep=False)
            self.start_times = self.start_times.observe("wake_asleep" if asleep else "wake_awake", self.clock() - c0)
            await self._set_registry(rep)
            self.emit("promoted", replica=rep.view.replica_id, seconds=round(time.monotonic() - t0, 3), fresh=fresh)
            await self._set_role(rep.view.replica_id, "active")

        await self._guard(rep, "promote", run())

    async def _sleep(self, rep: Replica) -> None:
        async def run() -> None:
            if not self.leading():
                # Decided while leading, run after the lease lapsed (a pause): the new leader may
                # have promoted it and serve on it; put to sleep, every request sent there would
                # fail until someone woke it (a fault review). Left to the new leader.
                return
            ok = await self._client(rep).sleep(1, self.cfg.timeouts.sleep_s)
            if not ok:
                rep.can_sleep = False  # no sleep mode: keep it warm and awake
                return
            if rep.view.state is S.WARM:
                rep.view = apply_action(rep.view, ActionKind.SLEEP, self.clock())
                await self._set_registry(rep)
                self.emit("slept", replica=rep.view.replica_id)

        await self._guard(rep, "sleep", run())

    async def _stop(self, rep: Replica) -> None:
        rid = rep.view.replica_id
        try:
            # Decided while leading, resumed after the lease lapsed (a pause): the new leader may
            # have adopted it and serve on it (a drained replica out of the registry, found awake
            # with its role `active`), and stops what it wants stopped. Should this controller
            # lead on after all (a renewal that came late), the stop is tried again (below).
            if not self.leading():
                raise NotLeading("the leader lease lapsed: not stopped")
            if rep.endpoint:
                with contextlib.suppress(*OUTAGE_ERRORS):
                    await self.registry.remove(rep.endpoint)
            if not self.leading():
                raise NotLeading("the leader lease lapsed: not stopped")
            await self.actuator.stop(rid)
            self.emit("stopped", replica=rid)
            self.metrics.actions.labels(pool=self.pool, action="stop", outcome="ok").inc()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Kept as TERMINATED-but-present: `reconcile` tries again after a backoff (it was
            # never retried: a review's replica ran on, out of the registry and uncounted).
            rep.stop_failures += 1
            rep.stop_retry_at = self.clock() + min(STOP_RETRY_MAX_S, 2.0 ** (rep.stop_failures - 1))
            self.emit("action_failed", replica=rid, action="stop", error=f"{type(exc).__name__}: {exc}",
                      retry_in_s=round(rep.stop_retry_at - self.clock(), 3))
            self.metrics.actions.labels(pool=self.pool, action="stop", outcome="error").inc()
            return
        self.replicas.pop(rid, None)
        self.kick()

    async def shutdown(self) -> None:
        """Cancel operations in flight (leadership lost / exit). Replicas are left as they are:
        the next leader adopts them."""
        await cancel_and_wait([t for r in self.replicas.values() for t in (r.task, r.probe) if t is not None])


# What cuts a takeover short without being a bug: retried on the next round (`_tick_once`).
_TAKEOVER_OUTAGES: tuple[type[BaseException], ...] = (*OUTAGE_ERRORS, ActuatorUnavailable)


class NotLeading(RuntimeError):
    """A replica operation found its controller no longer leading (`PoolController.leading`)."""


STOP_RETRY_MAX_S = 30.0  # a stop that failed is tried again after 1, 2, 4, ... s, at most this
FORGET_AGAIN_S = 30.0  # a dead replica still listed is stopped again this often (`_forget`)


def pool_hit(started_at: float | None, scale_up_since: float | None) -> bool:
    """Was a promotion for a scale-up served by the warm pool (pure)? Only a replica that was
    in the pool before the scale-up began (`scale_up_since`; adopted ones, `started_at` None,
    were): one started during it (a pool refill the next step promotes once warm) served the
    scale-up after a cold start. `floodgate up`'s demo counted its burst's two refills as hits."""
    return started_at is None or scale_up_since is None or started_at < scale_up_since


def build_actuator(cfg: PoolConfig, *, supervisor: Any = None, controller: ControllerConfig | None = None) -> Actuator:
    """The pool's actuator. A process actuator needs `controller` (its table's owner and
    default directory: `config.table_owner`)."""
    a = cfg.actuator
    if a.kind == "process":
        from floodgate.controller.actuators.process import ProcessActuator, sim_command

        assert controller is not None, "a process actuator is built with its controller config"
        return ProcessActuator(a.command or sim_command(), process_state_dir(controller, cfg),
                               supervisor=supervisor, env=a.env, owner=table_owner(controller, cfg))
    if a.kind == "static":
        from floodgate.controller.actuators.static import StaticActuator

        assert a.endpoints is not None
        return StaticActuator(a.endpoints)
    if a.kind == "endpointslices":  # metrics-only (KEDA/HPA): controller/discovery.py
        from floodgate.controller.discovery import EndpointSliceActuator, EndpointSliceConfig

        return EndpointSliceActuator(EndpointSliceConfig(**a.options))
    from floodgate.controller.actuators.kubernetes import (
        KubernetesActuator,
        KubernetesActuatorConfig,
    )

    return KubernetesActuator(KubernetesActuatorConfig(**a.options))


class Controller:
    """All pools, the leader lease, the metrics endpoint and the tick loop."""

    def __init__(self, cfg: ControllerConfig, actuators: dict[str, Actuator] | None = None, *,
                 holder: str | None = None, clock: Callable[[], float] = STEADY_CLOCK,
                 stop_replicas_on_exit: bool = False) -> None:
        self.cfg = cfg
        # `--stop-replicas-on-exit`: stop the pools' replicas on the way out, only if this
        # controller leads then (a standby's replicas are the leader's), and before the lease
        # is released (a standby taking over would adopt replicas being stopped).
        self.stop_replicas_on_exit = stop_replicas_on_exit
        self.clock = clock
        self.actuators = actuators or {p.name: build_actuator(p, controller=cfg) for p in cfg.pools}
        self.metrics = ControllerMetrics()
        self.redis = redis_client(cfg.redis.url, password=cfg.redis.password, op_timeout_s=cfg.redis.op_timeout_s)
        self.lease: LeaderLease | None = (
            LeaderLease(self.redis, cfg.leader.key, holder=holder, ttl_s=cfg.leader.ttl_s)
            if cfg.leader.enabled else None)
        self.pools: dict[str, PoolController] = {}
        self._kick = asyncio.Event()  # the main loop: leadership, Envoy
        self._kicks: dict[str, asyncio.Event] = {p.name: asyncio.Event() for p in cfg.pools}
        self._loops: dict[str, asyncio.Task[None]] = {}  # one tick loop per pool while leader
        self._ticked: set[str] = set()  # pools that have ticked since this leadership began
        self.envoy: EnvoySample | None = None  # the last Envoy scrape, shared by the pools
        self.session: aiohttp.ClientSession | None = None
        self.ready = asyncio.Event()  # set once every pool has ticked as leader

    def kick(self, pool: str | None = None) -> None:
        """Tick `pool` (every pool and the main loop: None) now instead of at its interval."""
        if pool is None:
            self._kick.set()
        for name, ev in self._kicks.items():
            if pool is None or name == pool:
                ev.set()

    @property
    def is_leader(self) -> bool:
        return self.lease.is_leader if self.lease is not None else True

    async def confirm_leader(self) -> bool:
        """Does Redis still name this controller the lease holder? Asked before a tick acts: the
        local lease check trusts the last renewal for up to a renewal period, and a standby that
        took the lease meanwhile (Redis flushed or failed over, this process paused) acted beside
        it (a review: two leaders for 0.9 s, one extra cold start). No: step down now."""
        assert self.lease is not None
        try:
            held = await self.lease.holder_now() == self.lease.holder
        except OUTAGE_ERRORS:
            return False  # cannot tell: act on nothing this tick
        if not held and self.lease.is_leader:
            self.lease.lost()
            self.kick()
        return held

    async def _become_leader(self) -> None:
        assert self.session is not None
        self.pools = {}
        for p in self.cfg.pools:
            pc = PoolController(p, self.actuators[p.name], self.redis, self.session, self.metrics,
                                kick=functools.partial(self.kick, p.name), clock=self.clock,
                                tick_interval_s=self.cfg.tick_interval_s,
                                confirm=self.confirm_leader if self.lease is not None else None,
                                leading=lambda: self.is_leader)
            try:
                await pc.rebuild()
            except BaseException:
                # Cut short (Redis failed halfway): the pool is not taken over, and neither are
                # the operations its rebuild started (bring-ups of the replicas it adopted). Left
                # running, they acted outside any view, beside the next takeover's, and on after
                # this controller stopped leading (a review).
                await pc.shutdown()
                raise
            self.pools[p.name] = pc
        self._ticked = set()
        for name, pc in self.pools.items():
            self._loops[name] = asyncio.create_task(self._pool_loop(pc), name=f"floodgate-pool-{name}")

    async def _step_down(self) -> None:
        loops, self._loops = list(self._loops.values()), {}
        await cancel_and_wait(loops)
        for pc in self.pools.values():
            await pc.shutdown()
        self.pools = {}
        self.metrics.forget_pools()
        self.ready.clear()

    async def _pool_loop(self, pc: PoolController) -> None:
        """One pool's ticks, at the tick interval or at once when kicked. Each pool has its own
        loop, so a pool whose scrapes are slow (replicas that answer late, up to the scrape
        timeout) or whose actions take long never delays another pool's decisions."""
        kick = self._kicks[pc.pool]
        while True:
            t0 = time.monotonic()
            # Cleared before the tick, not after: a replica that turns warm (or any
            # operation that ends) during a tick kicks the next one at once; cleared after,
            # that kick was lost and the replica waited a whole interval to be promoted
            # (0.67 s in the elastic bench, while its announced time ran out).
            kick.clear()
            if self.is_leader:  # lost between two rounds of the main loop: it steps down
                try:
                    await self.tick_pool(pc)
                except OUTAGE_ERRORS as exc:
                    # Redis down: act on nothing (the registry is the routing truth); retry.
                    self.metrics.scrape_failures.labels(source="redis").inc()
                    log.warning("pool %s: tick skipped: %s", pc.pool, exc)
                except ActuatorUnavailable as exc:
                    # The platform's API down (Kubernetes answering 503 through an upgrade):
                    # the same, a tick without the replica list acts on nothing. Drains and
                    # replica operations in flight go on; the next tick asks again.
                    self.metrics.scrape_failures.labels(source="actuator").inc()
                    log.warning("pool %s: tick skipped: %s", pc.pool, exc)
                finally:
                    self.metrics.tick_seconds.labels(pool=pc.pool).observe(time.monotonic() - t0)
            wait = max(0.0, self.cfg.tick_interval_s - (time.monotonic() - t0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kick.wait(), wait)

    async def tick_pool(self, pc: PoolController) -> None:
        """One tick of one pool, on the last Envoy sample."""
        await pc.tick(self.envoy)
        self.metrics.ticks.inc()
        self._ticked.add(pc.pool)
        if self._ticked >= self.pools.keys():
            self.ready.set()

    async def run(self, stop: asyncio.Event) -> None:
        runner = None
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        lease_task = None
        lease_stop = asyncio.Event()  # the lease is kept until the replicas are stopped
        follow_task: asyncio.Task[None] | None = None
        try:
            if self.cfg.metrics_listen:
                runner = await self.metrics.serve(self.cfg.metrics_listen)
            log.info("floodgate controller started (metrics %s, redis %s, pools %s, tick %.2g s, %s)",
                     self.cfg.metrics_listen or "off", parse_redis_url(self.cfg.redis.url).display,
                     [f"{p.name}: {p.actuator.kind}" for p in self.cfg.pools], self.cfg.tick_interval_s,
                     f"leader election as {self.lease.holder}" if self.lease is not None else "no leader election")
            # A Sentinel primary that moves takes every connection along (redis_client).
            follow_task = asyncio.create_task(follow_sentinel_primary([self.redis]), name="floodgate-sentinel")
            try:  # credentials or a database the server refuses: a config error, not an outage
                await asyncio.wait_for(self.redis.ping(), self.cfg.redis.op_timeout_s * 2)
            except OUTAGE_ERRORS as exc:
                if (refused := refused_settings_error(exc, self.cfg.redis.url)) is not None:
                    raise refused from exc
            if self.lease is not None:
                await self.lease.try_acquire_or_renew()  # know at once whether to act
                lease_task = asyncio.create_task(self.lease.run(lease_stop))
            while not stop.is_set():
                t0 = time.monotonic()
                self._kick.clear()
                await self._tick_once()
                wait = max(0.0, self.cfg.tick_interval_s - (time.monotonic() - t0))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wait_any(stop), wait)
        finally:
            await self._step_down()
            if self.stop_replicas_on_exit and self.is_leader:
                await self._stop_replicas()
            if lease_task is not None:
                lease_stop.set()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await lease_task
            if follow_task is not None:
                await cancel_and_wait([follow_task])
            for a in self.actuators.values():
                with contextlib.suppress(Exception):
                    await a.close()
            if runner is not None:
                await runner.cleanup()
            await self.session.close()
            await self.redis.aclose()

    async def _stop_replicas(self) -> None:
        """`--stop-replicas-on-exit`: each pool's replicas out of the registry (no processor
        routes to them any more), then stopped."""
        for name, a in self.actuators.items():
            stop_all = getattr(a, "stop_all", None)
            if stop_all is None:
                continue
            try:
                registry = Registry(self.redis, name)
                for h in await a.list():
                    if h.endpoint:
                        with contextlib.suppress(*OUTAGE_ERRORS):
                            await registry.remove(h.endpoint)
                await stop_all()
            except Exception as exc:  # the other pools' replicas are still stopped
                log.warning("pool %s: could not stop its replicas: %s", name, exc)

    async def _wait_any(self, stop: asyncio.Event) -> None:
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self._kick.wait())]
        if self.lease is not None:
            self.lease.changed.clear()
            waits.append(asyncio.create_task(self.lease.changed.wait()))  # leadership changed
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _tick_once(self) -> None:
        """The main loop's round: leadership (start or stop the pools' loops) and Envoy's stats
        (shared by the pools; each pool ticks in its own loop, `_pool_loop`)."""
        leader = self.is_leader
        self.metrics.leader.set(1 if leader else 0)
        if not leader:
            if self.pools:
                log.warning("lost the leader lease: standing by")
                await self._step_down()
            return
        for t in list(self._loops.values()):
            exc = t.exception() if t.done() and not t.cancelled() else None
            if exc is not None:
                raise exc  # a bug in a pool's tick: the controller stops, as it did before
        if self.cfg.envoy.admin_url and self.session is not None:
            clusters = frozenset(self.cfg.envoy.clusters) if self.cfg.envoy.clusters else None
            envoy = await scrape_envoy(self.session, self.cfg.envoy.admin_url, clusters, self.clock(),
                                       gateway_prefix=self.cfg.envoy.gateway_stat_prefix)
            if not envoy.ok:
                self.metrics.scrape_failures.labels(source="envoy").inc()
            self.envoy = envoy
        if not self.pools:
            try:
                await self._become_leader()
            except _TAKEOVER_OUTAGES as exc:
                # Redis (or the platform's API) down: act on nothing (the registry is the
                # routing truth); retry.
                source = "actuator" if isinstance(exc, ActuatorUnavailable) else "redis"
                self.metrics.scrape_failures.labels(source=source).inc()
                log.warning("could not take over the pools yet: %s", exc)
                await self._step_down()
