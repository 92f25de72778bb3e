"""The admitter: one per processor process. It owns the permits and the mode switch.

`admit()` returns a `Permit` (now or after queueing) or a `Reject`; `release()` returns the
permit exactly once. Permits come from one of two backends (`backends.py`): the shared state
in Redis, or — while Redis is unreachable — a local table sized to this process's share of
the limit that also counts the shared permits still held (so the pool stays within its
limit). Every `lease_ttl_s/3` the admitter `sync`s each pool: it re-asserts every permit and
waiter it has, which renews its leases, proves it alive, and makes Redis drop whatever this
process no longer holds. Returning from degraded mode is such a sync (reconcile) first.

The mode is per pool. A failed call degrades the pools that share the failed server: on one
server or a Sentinel primary that is every pool; on a Cluster, the pools whose slots the same
node serves (the others stay on shared state, within their limit). Each pool's background work
(sync, status, polling, pub/sub) runs in its own task, on a Cluster with its own clients, so a
dead or frozen shard cannot delay another pool's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import secrets
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from floodgate.extproc import gateway_claim, schema
from floodgate.extproc.backends import (
    Backend,
    LocalBackend,
    Permit,
    RedisDown,
    Request,
    SharedBackend,
    Switched,
    Waiter,
)
from floodgate.extproc.cancel import cancel_and_wait
from floodgate.extproc.config import MESSAGE_TIMEOUT_MARGIN_S, ClassConfig, Config, PoolConfig
from floodgate.extproc.ejection import EjectionSettings, Ejector, EndpointOutcome, ejectable
from floodgate.extproc.endpoint_guard import make_guard
from floodgate.extproc.limit import (
    Latency,
    LimitState,
    Outcome,
    Sample,
    WindowedLimit,
    cap_to_ceiling,
    follow_endpoints,
    lift_ceiling,
    limit_for,
    sample_request,
    writes_shared_limit,
)
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.picking import Picker
from floodgate.extproc.policy import (
    ARRIVAL_FAST_TAU_S,
    ARRIVAL_TAU_S,
    CLASSES,
    PEER_ARRIVALS_FRESH_S,
    RAMP_CREDIT_S,
    RAMP_MIN_BURST,
    RAMP_MIN_BURST_PER_ENDPOINT,
    RAMP_MIN_RATE_PER_ENDPOINT_S,
    RAMP_MIN_RATE_S,
    SLOW_TAU_S,
    DecayingMean,
    DecayingRate,
    Reject,
    credits_usable,
    level_growth,
    min_chance,
    pool_arrivals,
    ramp_credit,
    retry_after,
)
from floodgate.extproc.redis_client import (
    OUTAGE_ERRORS,
    AnyRedis,
    Subscription,
    answered_with_error,
    follow_sentinel_primary,
    is_cluster,
    outage_hint,
    refused_settings_error,
    subscribe,
)
from floodgate.extproc.registry import parse_ceiling, read_arriving
from floodgate.extproc.retry_match import RetryMatch, window_for
from floodgate.extproc.schema import (
    ACTIVE,
    CTL_ARRIVING,
    CTL_CEILING,
    ENDPOINTS,
    NOT_DEMAND,
    REGISTRY_CHANGED,
    REGISTRY_SEEN,
    RESYNC,
    RETRIED_ADMITTED,
    TURNED_AWAY,
    UNREADABLE_REPLY,
    PoolSettings,
    PoolStatus,
    format_arrivals,
    format_idle_credits,
    fresh_idle_credits,
    gateway_channel,
    gateway_claim_key,
    key,
    peer_arrivals,
)
from floodgate.extproc.state import FUNCTION, DemandBatch, PoolState
from redis.exceptions import ResponseError

__all__ = ["PRIORITY_LABELS", "Admitter", "Permit", "RedisDown", "default_gateway_id", "pool_settings"]

log = logging.getLogger("floodgate.admission")

T = TypeVar("T")

PRIORITY_LABELS = ("0", "1", "2")
# While a processor turns requests away, its demand counters reach Redis within this (the
# controller's scale-up reads them; controller/demand.py), instead of with the once-a-second
# status tick: at most four extra pipelined HINCRBY writes per second per pool and process.
DEMAND_FLUSH_S = 0.25
MAX_REFUSED_LOGGED = 1000  # unregistered endpoints named by grants that are logged (once each)
# A grant is acted on at once only while this process's liveness in Redis has more than this
# share of the lease TTL left (`_granted`). Renewals come every third of it, so in normal
# running at least two thirds are left; less means the process stalled.
GRANT_MARGIN_SHARE = 1 / 3
# After a renewal sent once this process had lapsed, grants are confirmed for this long too
# (`PoolRuntime.suspect_until`): the pub/sub messages buffered during the stall are read within it.
SUSPECT_AFTER_LAPSE_S = 2.0


def tenant_cap(c: ClassConfig) -> int:
    """Most waiters one tenant may have in a class (policy.queue_decision applies the same)."""
    return max(1, int(c.tenant_queue_share * c.max_queue))


def pool_settings(p: PoolConfig) -> PoolSettings:
    """The settings of a pool that every grant must use, as stored in Redis."""
    cls = [p.classes[c] for c in (0, 1, 2)]
    return PoolSettings(
        initial_limit=p.limit.initial,
        shares=(cls[0].share, cls[1].share, cls[2].share),
        always=(cls[0].reserve == "always", cls[1].reserve == "always", cls[2].reserve == "always"),
        picking=p.endpoint_picking,
        headroom=(cls[0].headroom, cls[1].headroom, cls[2].headroom),
        max_queue=(cls[0].max_queue, cls[1].max_queue, cls[2].max_queue),
        tenant_cap=(tenant_cap(cls[0]), tenant_cap(cls[1]), tenant_cap(cls[2])),
        epoch=p.settings_epoch,
        ramp_burst=p.onset_ramp_burst, ramp_rate=p.onset_ramp_rate,
        ramp_min_burst=RAMP_MIN_BURST, ramp_min_rate=RAMP_MIN_RATE_S,
        ramp_ep_burst=RAMP_MIN_BURST_PER_ENDPOINT, ramp_ep_rate=RAMP_MIN_RATE_PER_ENDPOINT_S,
        pf_rate=p.prefill_tokens_per_s, pf_size=p.prefill_request_tokens, pf_k=p.prefill_pace_tokens,
        fair=p.fair_order)


ClassRates = tuple[DecayingRate, DecayingRate, DecayingRate]


def per_class_rates(tau: float) -> ClassRates:
    """One decayed event rate per priority class."""
    return DecayingRate(tau=tau), DecayingRate(tau=tau), DecayingRate(tau=tau)


def _note_failure(task: asyncio.Task[object]) -> None:
    """A background task's error, read (asyncio would log "Task exception was never retrieved"
    for one a cancelled caller stopped awaiting: `release`) and logged at debug: the call that
    failed was already counted and logged where it was made (`Admitter.call`)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("background task %s failed: %r", task.get_name(), task.exception())


@dataclass
class PoolRuntime:
    cfg: PoolConfig
    settings: PoolSettings
    state: PoolState
    local: PermitTable
    limit: WindowedLimit  # FixedLimit or VegasLimit behind the sample window (limit.limit_for)
    picker: Picker
    client: aioredis.Redis  # this pool's Redis client (on a Cluster, one per pool)
    pubsub_client: AnyRedis
    ejector: Ejector  # endpoints whose connections failed (endpoint picking): extproc/ejection.py
    registry_seen: bool = False  # the active endpoints were read at least once
    registry_marked: bool = False  # this process wrote REGISTRY_SEEN since it last (re)connected
    registry_lost: bool = False  # degraded because Redis lost the registry (REGISTRY_SEEN)
    degraded: bool = False  # admitting from `local`: this pool's Redis (or shard) is unreachable
    back_since: float | None = None  # degraded: when the first clean reconcile ran (Redis reachable again)
    asserted: int = 0  # leases (permits and reserve) this process asserted in Redis at its last reconcile
    # degraded: a switch's call failed, and may still have landed (a reply lost or late, Redis
    # fine): Redis may count only the permits it asserted, its reserve handed back to peers on
    # shared state. Admit no more than that until a reconcile with the reserve is answered, or
    # one lease TTL has passed (`unsure_until`; then the partition bound holds anyway).
    unsure_cap: int | None = None
    unsure_until: float = 0.0
    reserve_seq: int = 0  # degraded: the ticket number of this outage's reserve leases (`_sync`)
    budget: int = 0  # degraded: this process's local budget (its share of L, `_local_limit`)
    budget_open: bool = False  # degraded: the local table may use the whole budget (`_open_budget`)
    degraded_at: float = 0.0  # clock() when the pool last switched to local limits
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # cuts the sync loop's sleep short
    sync_due: bool = False  # the sync loop renews at once (the Redis primary moved)
    reserved: set[str] = field(default_factory=set)  # reserve leases the last successful reconcile asserted
    back_ms: float = 0.0  # degraded, back_since set: Redis's time of that first clean reconcile
    live_before: int = 0  # degraded: live gateways in the last sync before the outage
    held: dict[str, Permit] = field(default_factory=dict)  # every live permit of this process
    credits: list[str] = field(default_factory=list)  # idle credit leases (Redis)
    waiting: dict[str, Waiter] = field(default_factory=dict)  # waiters on the shared queue
    local_waiting: dict[str, Waiter] = field(default_factory=dict)  # waiters on the local table
    pending: dict[str, int] = field(default_factory=dict)  # ticket -> seq of acquire/enqueue in flight
    last_status: PoolStatus | None = None
    last_status_at: float = -1e9  # clock() when last_status was seen
    last_sync: PoolStatus | None = None  # has the rank among live gateways
    queue_clear: bool = False  # last seen: nothing waits, in-flight within L: credits may be used (credits_usable)
    credit_uses: int = 0  # since the last status tick; idle credits go back after an unused tick
    credit_done: int = 0  # credit-admitted requests completed since the last report (`credit_done`)
    pending_release: list[str] = field(default_factory=list)  # batched into one script call
    pending_refund: list[tuple[str, float]] = field(default_factory=list)  # (endpoint, tokens), sent with them
    wrong_type: bool = False  # a call failed with WRONGTYPE: the next reconcile repairs the keys (`_repair`)
    demand: Counter[tuple[int, str]] = field(default_factory=Counter)  # not yet added in Redis
    # A batch of `demand` written without a reply (Redis down, or a lost reply): sent again as it
    # is, under its seq, so Redis adds it once (`PoolState.add_demand`)
    demand_unsent: tuple[int, dict[tuple[int, str], int]] | None = None
    demand_seq: int = 0
    retries: RetryMatch = field(default_factory=RetryMatch)  # first attempts turned away, for their retries
    demand_flushed_at: float = -1e9  # clock() of the last write of `demand` to Redis
    demand_flush_due: bool = False  # a write soon (`DEMAND_FLUSH_S`) is scheduled: a request was turned away
    held_seen: int = 0  # permits + credits this process held when last_status was read, and still holds
    resyncing: bool = False  # a sync after Redis lost acknowledged writes is under way (`_lost_writes`)
    # the pub/sub loop's last attempt to subscribe to this pool's grant channel failed (it is not
    # subscribed, and not merely starting): grants reach this process by its polls
    unsubscribed: bool = False
    # Until when (clock()) Redis surely counts this process alive, so the leases of its waiters'
    # grants run: the send time of its last answered sync + the lease TTL (`_granted`).
    alive_until: float = 0.0
    # Until when (clock()) grants are confirmed with Redis even though a renewal has landed: one
    # sent after this process had lapsed may land before the grants published while it was
    # stalled are read from the pub/sub connection, and those may have been taken back.
    suspect_until: float = 0.0
    unconfirmed: set[str] = field(default_factory=set)  # tickets whose grants wait for a sync to confirm them
    confirming: bool = False  # `_confirm` is running
    # Requests arriving per class at this process (early drop: higher classes' arrivals jump
    # ahead of a waiter); the pool-wide rate adds the other processors' (`peer_arrivals`).
    arrivals: ClassRates = field(default_factory=lambda: per_class_rates(ARRIVAL_TAU_S))
    # The same with a short decay: a class that would rather be told at once reads the faster of
    # the two, which follows a burst's onset (policy.wait_estimate, reject_fast).
    arrivals_fast: ClassRates = field(default_factory=lambda: per_class_rates(ARRIVAL_FAST_TAU_S))
    # Rejections per class and the slow ones among them (queue timeouts), decayed: the budget
    # early drop spends for a class that would rather be told at once (policy.min_chance).
    rejections: ClassRates = field(default_factory=lambda: per_class_rates(SLOW_TAU_S))
    slow_rejections: ClassRates = field(default_factory=lambda: per_class_rates(SLOW_TAU_S))
    # The other processors' own arrival rates (slow, fast) as they last shared them (schema.ARRIVALS,
    # read at the status tick), and when (clock()); None: not read yet.
    peer_arrivals: tuple[list[tuple[float, float, float]], list[tuple[float, float, float]]] | None = None
    peer_arrivals_at: float = -1e9
    peer_idle_credits: int = 0  # the other processors' idle local credits, as they last shared them
    # Requests per class waiting now on that budget (let in where the strict reading would have
    # turned them away, and short of the class's own chance at the point estimates,
    # policy.budget_risk): they hold it until they end (policy.min_chance's `waiting`).
    budget_waiting: list[int] = field(default_factory=lambda: [0 for _ in CLASSES])
    endpoints_applied: int = 0  # active endpoint count this process last matched the limit to
    limit_seen: int | None = None  # the shared limit as this process last saw it (changes end a round trip)
    # The shared limiter state as this process last read or wrote it (the limit kept current by
    # every status read): written back if Redis comes back without one (`_restore_limit`).
    last_limit: LimitState | None = None
    sampled: int = 0  # admitted requests of this process streaming their body to measure latency now
    ceiling: float | None = None  # the controller's cap on the shared limit (limit.cap_to_ceiling); None: none
    uncapped: float | None = None  # the limit per endpoint before this process's first cap (limit.lift_ceiling)
    registry_due: bool = False  # the controller said the registry changed (schema.REGISTRY_CHANGED): read it now
    refused_endpoints: set[str] = field(default_factory=set)  # unregistered endpoints grants named (logged once; at most MAX_REFUSED_LOGGED)
    # Replicas the controller announced on their way (schema.CTL_ARRIVING): (clock() when each
    # serves, replicas, clock() until which it may still come: its time plus the controller's
    # grace); early drop counts the permits they bring (policy.Snapshot.arriving).
    arriving: tuple[tuple[float, int, float], ...] = ()
    # The active endpoint count (registry refreshes) and its time-weighted mean over the
    # release rate's window: how much the capacity behind the measured rate grew
    # (policy.Snapshot.capacity_growth).
    endpoints_seen: int = 0
    endpoints_mean: DecayingMean = field(default_factory=DecayingMean)

    def see_endpoints(self, now: float, n: int) -> None:
        """A registry refresh read `n` active endpoints; the count seen before held until now."""
        if self.endpoints_mean.ts is not None or self.endpoints_seen > 0:
            self.endpoints_mean.add(now, self.endpoints_seen)
        self.endpoints_seen = n

    def serving_endpoints(self, now: float) -> int:
        """Active endpoints not ejected (every active one when all are: picks then go on among
        them all). What the limit, the ceiling and the capacity growth are sized on: a dead
        replica's share of the limit would overload the live ones until the controller removes
        it, or for good while no controller runs."""
        active = set(self.picker.active)
        out = len(active & self.ejector.avoid(now))
        return len(active) - out if out < len(active) else len(active)

    def capacity_growth(self, now: float) -> float:
        """policy.level_growth of the active endpoints (1 without endpoint picking)."""
        return level_growth(self.endpoints_mean, self.endpoints_seen, now)

    def own_arrival_rates(self, now: float, *, fast: bool = False) -> tuple[float, float, float]:
        a = self.arrivals_fast if fast else self.arrivals
        return a[0].read(now), a[1].read(now), a[2].read(now)

    def arrival_rates(self, now: float, processors: int = 1, *, fast: bool = False) -> tuple[float, float, float]:
        """The pool-wide arrival rates (policy.pool_arrivals): the peers' shared rates while
        fresh and from as many peers as the other live processors, else own x `processors`."""
        peers = None
        shared = self.peer_arrivals
        if shared is not None and now - self.peer_arrivals_at <= PEER_ARRIVALS_FRESH_S \
                and len(shared[0]) + 1 >= processors:
            peers = shared[1] if fast else shared[0]
        return pool_arrivals(self.own_arrival_rates(now, fast=fast), peers, processors)

    def min_chance(self, cls: int, now: float) -> float:
        """The chance a request of class `cls` needs to wait now (policy.min_chance)."""
        return min_chance(self.cfg.classes[cls], self.rejections[cls].count(now), self.slow_rejections[cls].count(now),
                          self.budget_waiting[cls])

    def follows_endpoints(self) -> bool:
        return self.cfg.endpoint_picking and self.cfg.limit.follow_endpoints and self.limit.adaptive

    def follows_ceiling(self) -> bool:
        return self.cfg.endpoint_picking and self.cfg.limit.controller_ceiling and self.limit.adaptive

    def counts_arrivals(self) -> bool:
        """Does early drop count the controller's announced capacity? Only where a new active
        endpoint raises the limit (`follows_endpoints`): elsewhere it brings no permit."""
        return self.follows_endpoints() and self.cfg.limit.controller_arrivals

    def arriving_permits(self, now: float, limit: int, endpoints: int) -> tuple[tuple[float, int], ...]:
        """The announced replicas still ahead as (seconds until each serves, permits it adds):
        the limit follows the endpoint count, so each brings the limit's share per endpoint. A
        replica past its time but within the controller's grace (it promotes on its next look)
        is due at the grace's end: the processor holds what it read for up to a second, and
        counting nothing once the time passed turned P2s away in the moment before the replica
        served (elastic bench, seed 1: one at 78.38 s, the replicas due at 78.3 active at 78.46)."""
        if not self.arriving or endpoints <= 0 or not self.counts_arrivals():
            return ()
        per = limit // endpoints
        if per <= 0:
            return ()
        return tuple(((t if t > now else u) - now, k * per) for t, k, u in self.arriving if u > now)

    def capacity_view(self) -> tuple[int, float | None, int]:
        """What early drop reads of the pool's capacity besides the status snapshot: serving
        endpoints, the controller's ceiling, the permits announced on their way."""
        return self.endpoints_seen, self.ceiling, sum(k for _, k, _ in self.arriving)

    def inflight_seen(self) -> int:
        return self.last_status.inflight_total if self.last_status else 0


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Admitter:
    def __init__(self, cfg: Config, client: aioredis.Redis, *, metrics: Metrics | None = None,
                 pubsub_client: AnyRedis | None = None, gateway_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random,
                 accept_endpoint: Callable[[str], bool] | None = None,
                 pool_clients: Mapping[str, tuple[aioredis.Redis, AnyRedis]] | None = None) -> None:
        """`pool_clients`: pool -> (client, pub/sub client) for pools that get their own (on a
        Cluster: a failing node makes a cluster client refresh its slot map before its next
        call, which would delay every pool sharing it); the others use `client`."""
        self.cfg = cfg
        self.client = client
        self.pubsub_client = pubsub_client or client
        self.gateway_id = gateway_id or cfg.server.gateway_id or default_gateway_id()
        self._demand_nonce = secrets.token_hex(6)  # this process's run of demand batches (DemandBatch)
        # This process among any others started under the same gateway id (gateway_claim.py).
        self.instance = secrets.token_hex(8)
        self._claimed: set[str] = set()  # pools whose claim this process has renewed
        self._conflict_logged: dict[str, float] = {}
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.rng = rng
        self.shared = SharedBackend(self)
        self.local = LocalBackend(self)
        # Tickets are numbered from the start time in ms: a process restarted under the same
        # gateway id (a container restarted in its pod, a compose service with a fixed id)
        # numbers above every ticket its predecessor issued (unless that one averaged over one
        # ticket per ms), so its first renewal drops what the predecessor left in Redis (`sync`
        # drops this gateway's entries below the watermark) and no ticket is ever reused.
        # 13 digits: exact as a Lua number and in its `%.14g` formatting.
        self._next_seq = int(time.time() * 1000)
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[object]] = set()
        self._closing = False
        self._checked = False  # `check` ran (start need not repeat its wait)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.pools: dict[str, PoolRuntime] = {}
        for p in cfg.pools:
            settings = pool_settings(p)
            pc, ps = (pool_clients or {}).get(p.name, (client, self.pubsub_client))
            rt = PoolRuntime(
                cfg=p, settings=settings,
                state=PoolState(pc, p.name, lease_ttl_s=cfg.redis.lease_ttl_s, settings=settings,
                                gateway=self.gateway_id, batch_timeout_s=cfg.redis.op_timeout_s * 2),
                local=PermitTable(limit=p.limit.initial, shares=settings.shares, fair=settings.fair),
                retries=RetryMatch(window_for(cfg.admission.retry_after_max_s)),
                limit=limit_for(p),
                picker=Picker(p.endpoint_picking, accept_endpoint or make_guard(p.name, p.allowed_endpoints)),
                client=pc, pubsub_client=ps,
                ejector=Ejector(EjectionSettings(p.eject_after_failures if p.endpoint_picking else 0,
                                                 p.eject_base_s, p.eject_max_s,
                                                 p.eject_after_5xx if p.endpoint_picking else 0)))
            rt.state.on_grant = partial(self._granted, rt)
            rt.state.on_lost = partial(self._lost_writes, rt)
            self.pools[p.name] = rt
            self.metrics.limit.labels(p.name).set(p.limit.initial)
            self.metrics.pool_degraded.labels(p.name).set(0)
            self.metrics.prepare(p.name)

    @property
    def degraded(self) -> bool:
        """Some pool admits on its local share (its Redis or shard is unreachable)."""
        return any(rt.degraded for rt in self.pools.values())

    def backend(self, rt: PoolRuntime) -> Backend:
        return self.local if rt.degraded else self.shared

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Store or check each pool's settings, assert this gateway, then serve. A pool whose
        Redis cannot be reached starts degraded (see `_local_limit`)."""
        await asyncio.gather(*(self._start_pool(rt) for rt in self.pools.values()))
        # One subscription per pub/sub client: per pool on a Cluster, one for all otherwise.
        by_client: dict[int, list[PoolRuntime]] = {}
        for rt in self.pools.values():
            by_client.setdefault(id(rt.pubsub_client), []).append(rt)
        self._tasks = [self._keep_running(f"fg-pubsub-{rts[0].cfg.name}", partial(self._pubsub_loop, rts))
                       for rts in by_client.values()]
        for rt in self.pools.values():
            self._tasks += [self._keep_running(f"fg-sync-{rt.cfg.name}", partial(self._sync_loop, rt)),
                            self._keep_running(f"fg-poll-{rt.cfg.name}", partial(self._poll_loop, rt))]
        clients = {id(c): c for c in (self.client, self.pubsub_client,
                                      *(x for rt in self.pools.values() for x in (rt.client, rt.pubsub_client)))}
        self._tasks.append(self._keep_running("fg-sentinel", partial(follow_sentinel_primary, list(clients.values()),
                                                                     on_moved=self._primary_moved)))

    async def check(self) -> None:
        """What refuses a start and writes nothing: another live processor under this gateway id
        (`_check_gateway_id`). Run before the ports are bound, as `start` is run after."""
        await asyncio.gather(*(self._check_gateway_id(rt) for rt in self.pools.values()))
        self._checked = True

    def _primary_moved(self) -> None:
        """Sentinel named a new primary: every pool re-asserts its permits, waiters and
        liveness there now, not at its next renewal."""
        self._sync_soon(*self.pools.values())

    @staticmethod
    def _sync_soon(*rts: PoolRuntime) -> None:
        """Each pool's sync loop re-asserts its permits, waiters and liveness now."""
        for rt in rts:
            rt.sync_due = True
            rt.wake.set()

    def _keep_running(self, name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """A background loop that an unexpected error must not end silently: a dead sync loop
        stops renewing this process's liveness, and Redis then takes back its waiters' grants.
        The error is logged and counted; the loop starts again after `reconnect_interval_s`."""
        self.metrics.loop_restarts.labels(name)  # at 0 (Metrics.prepare)
        async def run() -> None:
            while not self._closing:
                try:
                    await loop()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    self.metrics.loop_restarts.labels(name).inc()
                    log.exception("%s failed; restarting it", name)
                    await asyncio.sleep(self.cfg.redis.reconnect_interval_s)
        return asyncio.create_task(run(), name=name)

    async def _start_pool(self, rt: PoolRuntime) -> None:
        if not self._checked:
            await self._check_gateway_id(rt)
        try:
            await self._store_settings(rt)
            await self._sync(rt)
            await self._claim_gateway_id(rt)
        except RedisDown:
            pass  # call() switched the pool to the local backend

    def _claim_key(self, rt: PoolRuntime) -> str:
        return gateway_claim_key(rt.cfg.name, self.gateway_id)

    async def _check_gateway_id(self, rt: PoolRuntime) -> None:
        """Refuse to start under a gateway id another live process renews (gateway_claim.py).
        Unreachable Redis skips the check; the renewals still catch a duplicate later."""
        ttl_s = self.cfg.redis.lease_ttl_s
        try:
            async with asyncio.timeout(ttl_s / 3 + 1 + self.cfg.redis.op_timeout_s * 4):
                started = time.monotonic()
                other, live = await gateway_claim.watch(rt.client, self._claim_key(rt), self.instance,
                                                        ttl_ms=int(ttl_s * 1000), period_s=ttl_s / 3,
                                                        clock=time.monotonic)
        except OUTAGE_ERRORS as exc:
            if (refused := refused_settings_error(exc, self.cfg.redis.url)) is not None:
                raise refused from exc
            return
        if other is not None and not live:
            log.info("pool %s: gateway id %s was last renewed by instance %s, which stopped renewing it "
                     "(waited %.1f s): taking it over (a restarted processor)", rt.cfg.name, self.gateway_id,
                     other, time.monotonic() - started)
        if other is not None and live:
            raise gateway_claim.GatewayIdInUse(
                f"server.gateway_id {self.gateway_id!r} is in use by another live processor (pool {rt.cfg.name}, "
                f"its instance {other}): two processes under one id drop each other's permits. Give each its "
                "own id (or leave server.gateway_id / FLOODGATE_GATEWAY_ID unset for a unique one)")

    async def _claim_gateway_id(self, rt: PoolRuntime) -> None:
        """Renew this process's claim on its gateway id (with every sync); a claim found held by
        another instance after the first renewal is a duplicate process: counted and logged."""
        try:
            async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                previous = await gateway_claim.renew(rt.client, self._claim_key(rt), self.instance,
                                                     int(self.cfg.redis.lease_ttl_s * 1000))
        except OUTAGE_ERRORS:
            return  # the sync's own calls decide about outages
        first = rt.cfg.name not in self._claimed
        self._claimed.add(rt.cfg.name)
        if gateway_claim.conflict(previous, self.instance, first):
            self.metrics.gateway_id_conflicts.labels(rt.cfg.name).inc()
            now = self.clock()
            if now - self._conflict_logged.get(rt.cfg.name, -1e9) >= 60:
                self._conflict_logged[rt.cfg.name] = now
                log.error("pool %s: gateway id %s is in use by another live processor too (instance %s; this one "
                          "%s): each renewal drops the other's permits, so the pool can run over its limit. Give "
                          "each processor its own server.gateway_id (or leave it unset)",
                          rt.cfg.name, self.gateway_id, previous, self.instance)

    async def stop(self) -> None:
        """Processor shutdown: wake every waiter (they reject), return every held permit."""
        self._closing = True
        for rt in self.pools.values():
            for w in [*rt.waiting.values(), *rt.local_waiting.values()]:
                w.future.cancel()
        await cancel_and_wait(self._tasks)  # (a lost cancellation would hang the stop; cancel.py)
        for rt in self.pools.values():
            # Degraded pools too: Redis may be back (a reconcile asserted this process's permits
            # and the reserve of its local budget, and it had not switched back yet); skipped,
            # those stayed counted for a lease TTL and it never left the pool (a fault review).
            # With Redis still down, the first call fails within its timeout and nothing follows.
            # Degraded, this process no longer knows every lease Redis holds of it (a permit
            # released locally after the last reconcile keeps the lease that reconcile asserted:
            # a review of the first fix), so it asserts that it holds nothing at all: Redis drops
            # every entry of this gateway.
            tickets = [*rt.held, *rt.credits]
            released = True
            if rt.degraded or tickets:
                try:
                    if rt.degraded:
                        await self.call(rt, "sync", partial(rt.state.sync, self.gateway_id, self._next_seq, {}, {}))
                    else:
                        await self.call(rt, "release", partial(rt.state.release, *tickets))
                except RedisDown:
                    released = False
            if released:  # else its leases must expire with its liveness, as after a crash
                with contextlib.suppress(RedisDown):
                    await self.call(rt, "leave", partial(rt.state.leave, self.gateway_id))
                with contextlib.suppress(*OUTAGE_ERRORS):  # a restart under this id need not wait
                    async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                        await gateway_claim.release(rt.client, self._claim_key(rt), self.instance)
            rt.held.clear()
            rt.credits.clear()
            rt.reserved.clear()
        if self._background:
            await asyncio.wait(self._background, timeout=2)

    def spawn(self, coro: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        """Run a coroutine that must finish even if the request that started it is cancelled."""
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_note_failure)
        return task

    def new_ticket(self) -> tuple[int, str]:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq, f"{self.gateway_id}/{seq}"

    # ---------------------------------------------------------------- redis plumbing

    async def call(self, rt: PoolRuntime, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One Redis call for pool `rt` with a deadline. The client retries a broken connection
        once on a fresh one (state.redis_client); a failure after that is an outage: degrade
        the pools on that server."""
        try:
            async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                return await fn()
        except OUTAGE_ERRORS as exc:
            self.metrics.redis_errors.labels(op).inc()
            answered = answered_with_error(exc)
            if answered:
                self.metrics.redis_error_replies.labels(op).inc()
                if "WRONGTYPE" in str(exc):
                    rt.wrong_type = True  # the next reconcile repairs the pool's keys first
            self._enter_degraded(rt, f"{op}: {type(exc).__name__}: {exc}{outage_hint(exc)}", answered=answered)
            raise RedisDown(op) from exc
        except UNREADABLE_REPLY as exc:
            # Redis answered something this version cannot read: the library under our name is
            # not ours (a holder of the processors' credentials replaced it) or a key holds what
            # no Floodgate wrote. The request is not at fault: local limits, and before the next
            # call the library is checked and ours loaded again if it is not (an attacker review:
            # every request a 503, for good).
            self.metrics.redis_errors.labels(op).inc()
            self.metrics.redis_error_replies.labels(op).inc()
            rt.state.reload_library()
            self._enter_degraded(rt, f"{op}: unreadable reply ({type(exc).__name__}: {exc}); the function "
                                 f"library {FUNCTION} is checked and loaded again if it is not this version's",
                                 answered=True)
            raise RedisDown(op) from exc

    async def _store_settings(self, rt: PoolRuntime) -> None:
        """`_configure`, and a static limit set when this processor's settings are the stored
        ones. A static limit is a setting like the others: set by the processors whose
        settings are stored (the same, or a newer settings_epoch). Forced by every processor at
        its start, the first one restarted with another limit changed the pool's while the
        error said the stored one applied, and one restarted on the old config would have
        changed it back; and after a Redis flush mid-rollout the old processor's first call
        wrote its limit, which the newer epoch's settings then kept (reviews)."""
        if await self._configure(rt) and not rt.limit.adaptive:
            await self._force_static_limit(rt)

    async def _configure(self, rt: PoolRuntime) -> bool:
        """Store this processor's pool settings, or read the ones stored (a newer epoch, or the
        same epoch stored first); True when they are this processor's."""
        stored = await self.call(rt, "configure", rt.state.configure)
        diff = rt.settings.differences(stored)
        if stored.epoch > rt.settings.epoch:
            diff = diff or [f"settings_epoch: {rt.settings.epoch} here, {stored.epoch} stored"]
        self.metrics.settings_mismatch.labels(rt.cfg.name).set(1 if diff else 0)
        if diff:
            log.error("pool %s: this processor's settings differ from the ones stored in Redis "
                      "(epoch %d), which every grant uses: %s. Make the configs agree, or raise "
                      "pools[].settings_epoch to replace the stored settings.%s",
                      rt.cfg.name, stored.epoch, "; ".join(diff),
                      "" if writes_shared_limit(rt.settings.epoch, stored.epoch) else
                      " A newer epoch is stored: this processor no longer changes the shared limit "
                      "(to roll back, raise the epoch again with the old settings).")
        return not diff

    def _local_limit(self, rt: PoolRuntime) -> int:
        """This process's budget while Redis is unreachable (the permits it still holds count
        against it). A process that never reached Redis: `limit.initial / expected_gateways`.
        Otherwise its share of the last seen limit, split over the live gateways by rank (the
        shares add up to L), but no more than what it held at the last status read and still
        holds (`_held_fell`) plus its share of what was free: processors hold unequal numbers of
        permits when Redis goes, and one holding fewer than its share cannot know another holds
        more. Summed over processors this stays <= L when nothing was free (under load); free
        permits another took since the read can be counted twice (docs/admission.md)."""
        st, share = rt.last_status, self._rank_share(rt)
        if st is None or share is None:
            return rt.cfg.limit.initial // self.cfg.redis.expected_gateways
        limit = st.limit
        # From one consistent read: what this process held then, and what was free then (the
        # permits held now were granted within that picture, and count against the budget).
        free = max(0, limit - st.inflight_total)
        return min(share, rt.held_seen + free * share // max(1, limit))

    def _rank_share(self, rt: PoolRuntime) -> int | None:
        """This process's share of the last seen limit, split over the live gateways by rank
        (the shares add up to L); None before it has read both."""
        st, sync = rt.last_status, rt.last_sync
        if st is None or sync is None:
            return None
        n, limit = max(1, sync.live_gateways), int(st.limit)
        return limit // n + (1 if 0 <= sync.gateway_rank < limit % n else 0)

    def _grow_to_share(self, rt: PoolRuntime) -> None:
        """Degraded for `redis.degraded_full_share_after_s`: every request admitted anywhere
        before the outage has ended (no request outlives that, by the operator's word: the route
        timeout), so the permits other processors held when Redis went are gone and this one
        may use its whole rank share (the shares add up to L). Before, a processor that held
        few permits when Redis went stayed below its share for the whole outage: with requests
        shorter than the status read interval, each held ~0 at the switch and the pool admitted
        nothing until Redis came back (a review: 82 of 90 requests 429 over a 15 s outage)."""
        share = self._rank_share(rt)
        if share is None or share <= rt.budget or \
                self.clock() - rt.degraded_at < self.cfg.redis.degraded_full_share_after_s:
            return
        log.warning("pool %s: degraded for %.0f s (redis.degraded_full_share_after_s): local budget %d -> "
                    "its full share %d", rt.cfg.name, self.clock() - rt.degraded_at, rt.budget, share)
        rt.budget = share
        if rt.budget_open:
            rt.local.limit = share
            self.local.wake(rt, rt.local.grant(self.clock()))
            self.metrics.limit.labels(rt.cfg.name).set(rt.local.limit)

    def local_rate(self, rt: PoolRuntime) -> float:
        st = rt.last_status
        return st.grant_rate / max(1, st.live_gateways) if st else 0.0

    def _server_of(self, rt: PoolRuntime) -> str:
        """Which server holds the pool's keys, as far as this process can tell: on a Cluster,
        the node its client's slot map names for the pool's slot; otherwise the one server
        (every pool shares it, so they fail together)."""
        if not is_cluster(rt.client):
            return ""
        try:
            node = rt.client.get_node_from_key(key(rt.cfg.name, ACTIVE))  # type: ignore[attr-defined]
        except Exception:  # no slot map yet (never reached the cluster)
            node = None
        return str(node.name) if node is not None else f"pool:{rt.cfg.name}"

    def _enter_degraded(self, failed: PoolRuntime, why: str, *, alone: bool = False, answered: bool = False) -> None:
        """A call for `failed` failed: it and the pools on the same server switch to local
        limits (the others' next call would fail too); pools on other shards stay shared.
        `alone`: only `failed` (its Redis answers, but without its registry). `answered`: Redis
        answered the call with an error (bad data in a pool key, an ACL refusal), not an outage."""
        if failed.degraded or self._closing:
            return
        server = self._server_of(failed)
        pools = [failed] + [rt for rt in self.pools.values()
                            if rt is not failed and not rt.degraded and self._server_of(rt) == server and not alone]
        for rt in pools:
            rt.degraded = True
            rt.registry_marked = False  # written again once the registry is read back
            rt.back_since = None
            rt.unsure_cap = None
            rt.reserve_seq = self.new_ticket()[0]
            rt.reserved = set()
            rt.budget, rt.budget_open = self._local_limit(rt), False
            rt.degraded_at = self.clock()
            rt.wake.set()  # the sync loop reconciles at once
            # The freshest count of live gateways: a sync runs every TTL/3, a status every second
            # (a processor that started since the last sync is in the status, not the sync).
            rt.live_before = max((s.live_gateways for s in (rt.last_sync, rt.last_status) if s is not None), default=0)
            self.metrics.pool_degraded.labels(rt.cfg.name).set(1)
            self.metrics.grants_held.labels(rt.cfg.name).set(0)  # (not read while degraded)
            self.metrics.degraded_transitions.labels(rt.cfg.name).inc()
            # Idle credits are leases nobody uses: forget them, they expire in Redis. The
            # permits live requests still hold count against the local share.
            rt.credits.clear()
            rt.queue_clear = False
            # Until the first reconcile is over, no more than Redis counts of this process: a
            # call can time out with Redis well (a stalled process), and a peer then admits
            # from it meanwhile (`_open_budget`).
            rt.local = self.local.table(rt, min(rt.budget, len(rt.held)))
            for p in rt.held.values():
                rt.local.adopt(p.ticket, p.priority, p.endpoint)
            self.metrics.limit.labels(rt.cfg.name).set(rt.local.limit)
            # Waiters on the shared queue cannot be granted any more: they queue locally.
            for w in rt.waiting.values():
                if not w.future.done():
                    w.future.set_exception(Switched())
                    w.future.exception()  # retrieved: the waiter may have gone already
        self.metrics.degraded.set(1)
        budgets = {rt.cfg.name: (rt.budget, len(rt.held)) for rt in pools}
        if answered:
            # Each renewal while degraded drops and recounts counts that are not numbers; a key
            # of the wrong type is deleted by the next reconcile (`_repair`).
            log.error("Redis answered with an error (%s): not an outage, Redis is up and refused the call "
                      "(the error says why: data in a pool key this version cannot read, docs/operations.md "
                      "\"A pool key deleted, evicted or overwritten\"; credentials or an ACL rule; maxmemory): "
                      "degraded to local limits %s", why, budgets)
        else:
            log.warning("redis unreachable (%s): degraded to local limits %s", why, budgets)

    def _open_budget(self, rt: PoolRuntime) -> None:
        """The first reconcile since the pool degraded is over. It failed: Redis is unreachable
        from here, and peers cannot admit from it either (unless this process alone is cut off:
        the partition bound). Or it succeeded: Redis now counts this process at its whole
        budget (the reserve, `_sync`). Either way the local table may use the budget now."""
        if rt.budget_open or not rt.degraded:
            return
        rt.budget_open = True
        rt.local.limit = rt.budget  # (set_limit would make a budget of 0 one)
        self.local.wake(rt, rt.local.grant(self.clock()))
        self.metrics.limit.labels(rt.cfg.name).set(rt.local.limit)

    async def _reconcile(self, rt: PoolRuntime, switch: bool) -> bool:
        """Re-assert every permit this process holds for the pool (shared and local) in Redis
        and drop the rest there; with `switch`, leave degraded mode and queue the local waiters
        in Redis. False if the pool's Redis is still unreachable."""
        try:
            if rt.wrong_type:
                await self._repair(rt)
            if rt.state.stored is None:
                await self._store_settings(rt)
            await self._sync(rt, reconcile=True, reserve=not switch)
        except RedisDown:
            self._open_budget(rt)
            self._grow_to_share(rt)
            return False
        self._open_budget(rt)
        if not switch:
            return True
        rt.degraded = False
        rt.back_since = None
        self.metrics.pool_degraded.labels(rt.cfg.name).set(0)
        self.metrics.degraded.set(1 if self.degraded else 0)
        for w in rt.local_waiting.values():
            if not w.future.done():
                w.future.set_exception(Switched())
                w.future.exception()
        log.warning("redis reachable again: pool %s resumed shared admission state (reconciled %d permits)",
                    rt.cfg.name, len(rt.held))
        self.spawn(self._quietly_restore_limit(rt))
        # Permits admitted locally while the reconcile call was in flight: assert them now.
        self.spawn(self._quietly_sync(rt))
        return True

    async def _repair(self, rt: PoolRuntime) -> None:
        """A call failed with WRONGTYPE: a pool key holds another type than the script writes
        (a hand, another tool). Every call of the pool failed until someone removed it; now the
        key goes, and this reconcile asserts this process's permits and waiters into fresh keys
        (each other processor's renewal does the same with its own)."""
        gone = await self.call(rt, "repair", rt.state.repair)
        rt.wrong_type = False
        if gone:
            rt.state.stored = None  # the settings may have gone with them: store them again
            self.metrics.reconciled.labels(rt.cfg.name, "repaired_keys").inc(len(gone))
            log.error("pool %s: Redis keys of the wrong type deleted: %s (written by something else: each "
                      "processor asserts its permits and waiters into fresh ones)", rt.cfg.name,
                      ", ".join(schema.key(rt.cfg.name, g) for g in gone))

    async def _quietly_restore_limit(self, rt: PoolRuntime) -> None:
        with contextlib.suppress(RedisDown):
            await self._restore_limit(rt)

    async def _quietly_sync(self, rt: PoolRuntime) -> None:
        with contextlib.suppress(RedisDown):
            await self._sync(rt)

    async def _sync(self, rt: PoolRuntime, reconcile: bool = False, reserve: bool = False) -> None:
        """Re-assert this process's permits, credits and waiters (a `reconcile` also sets
        `asserted`, before the call). With `reserve` (a reconcile while degraded), the local
        budget this process has not used yet is asserted too, as reserve leases: until its reply
        arrives, and until it switches back, it admits locally up to that budget, and a peer
        that is back on shared state must not hand out those permits meanwhile."""
        now = self.clock()
        held = {t: (p.priority, p.seq, p.endpoint) for t, p in rt.held.items()}
        for t in rt.credits:
            held[t] = (1, _seq_of(t), "")
        spare = max(0, rt.budget - len(held)) if reserve else 0
        reserves = {f"{self.gateway_id}/{rt.reserve_seq}:r{i}": (1, rt.reserve_seq, "") for i in range(spare)}
        # A waiter whose grant arrived but whose request has not taken the permit yet still
        # asserts its ticket (Redis keeps the lease); one switched to the local queue does not.
        waiting = {t: (w.cls, w.seq, max(0.001, w.deadline - now), w.tenant)
                   for t, w in rt.waiting.items() if w.enqueued and not _failed(w.future)}
        watermark = min(rt.pending.values(), default=self._next_seq)
        if reconcile:
            # Set before the call: on the way back (`LocalBackend`) nothing is admitted beyond
            # what this call asserts while it is in the air (the switch's call included).
            rt.asserted = len(held) + len(reserves)
        sent = self.clock()
        lapsed = 0 < rt.alive_until and sent >= rt.alive_until - self._grant_margin()
        try:
            res = await self.call(rt, "sync", lambda: rt.state.sync(self.gateway_id, watermark, held | reserves, waiting))
        except RedisDown:
            if reconcile and not reserve:
                # A failed switch may have landed: Redis then counts of this process only what
                # it asserted, and a peer on shared state may take the reserve it handed back.
                cap = len(held) if rt.unsure_cap is None else min(rt.unsure_cap, len(held))
                rt.unsure_cap, rt.unsure_until = cap, self.clock() + self.cfg.redis.lease_ttl_s
            raise
        if reconcile and reserve:
            rt.unsure_cap = None  # answered: Redis counts this process's whole budget again
        rt.alive_until = max(rt.alive_until, sent + self.cfg.redis.lease_ttl_s)
        if lapsed:
            rt.suspect_until = self.clock() + max(SUSPECT_AFTER_LAPSE_S, 4 * self.cfg.redis.op_timeout_s)
        rt.last_sync = res.status
        self.observe(rt, res.status)
        # Reserve leases come and go as the local permits do: not corrections of lost state.
        reasserted = max(0, res.reasserted - len(reserves.keys() - rt.reserved))
        dropped = max(0, res.dropped - len(rt.reserved - reserves.keys()))
        rt.reserved = set(reserves)
        if reserve and not res.status.partial:
            # The budget counts only permits Redis had room for: a peer still on shared state
            # (this process stalled; Redis was fine) may have taken some since it was set.
            others = res.status.inflight_total - len(held) - len(reserves)
            rt.budget = min(rt.budget, max(0, int(res.status.limit) - others))
            if rt.budget_open:
                rt.local.limit = rt.budget
        m = self.metrics.reconciled
        for kind, n in (("reasserted", reasserted), ("requeued", res.requeued), ("dropped", dropped),
                        ("recounted", res.recounted)):
            if n:
                m.labels(rt.cfg.name, kind).inc(n)
        if res.recounted:
            log.warning("pool %s: %d shared counts disagreed with the permits and waiters they count (a "
                        "key deleted, evicted or written by something else): recounted", rt.cfg.name, res.recounted)
        if reasserted:
            self.metrics.lost_leases.labels(rt.cfg.name).inc(reasserted)
        if reasserted and not reconcile:
            log.warning("pool %s: Redis had lost %d permits live requests hold (restart, or this "
                        "process stalled past the lease TTL): leased again", rt.cfg.name, reasserted)
        # Released or cancelled while the sync was in flight: the sync may have put them back.
        # Not after a reconcile: a degraded process releases locally, and the permit it freed
        # may already be held again by a request Redis does not count yet; the next sync
        # (right after a switch, `_reconcile`) drops the old ticket and asserts the new one
        # in one call. Releasing it here let a peer take it meanwhile (9 of L 8).
        gone = [t for t in held if t not in rt.held and t not in rt.credits]
        if gone and not reconcile:
            await self.call(rt, "release", lambda: rt.state.release(*gone))
        for t in waiting:
            if t not in rt.waiting and t not in rt.held and \
                    await self.call(rt, "cancel", partial(rt.state.cancel, t)) == 1:
                await self.call(rt, "release", partial(rt.state.release, t))

    def observe(self, rt: PoolRuntime, st: PoolStatus) -> None:
        if st.partial:
            return
        rt.queue_clear = credits_usable(st.queued_total, st.inflight, st.limit)
        if not rt.queue_clear:
            self._return_credits(rt)
        rt.last_status = st
        rt.last_status_at = self.clock()
        self._limit_seen(rt, st.limit)
        # (The initial limit is what a pool whose state Redis lost reads too: not a limit to
        # restore, and a status read between the loss and the restore must not forget the last.)
        if st.limit != rt.cfg.limit.initial and (rt.last_limit is None or rt.last_limit.limit != st.limit):
            rt.last_limit = replace(rt.last_limit, limit=st.limit) if rt.last_limit else LimitState(st.limit)
        rt.held_seen = len(rt.held) + len(rt.credits)
        # The gauges move together with what was enforced, from one consistent read.
        name = rt.cfg.name
        self.child(self.metrics.limit, (name,)).set(st.limit)
        for c in range(3):
            self.child(self.metrics.queue_depth, (name, PRIORITY_LABELS[c])).set(st.queued[c])
            if c != 1:  # (P1 less the idle credits: `_set_inflight_p1`)
                self.child(self.metrics.inflight, (name, PRIORITY_LABELS[c])).set(st.inflight[c])
        self._set_inflight_p1(rt)

    def _limit_seen(self, rt: PoolRuntime, limit: float) -> None:
        """The shared limit is `limit`: if it moved, samples of requests admitted before now
        no longer describe it (WindowedLimit.limit_changed)."""
        seen = max(1, int(limit))
        if rt.limit_seen is not None and seen != rt.limit_seen:
            rt.limit.limit_changed(self.clock())
        rt.limit_seen = seen

    def _return_credits(self, rt: PoolRuntime) -> None:
        """Something waits: idle credits go back so the grant loop can hand them out."""
        if not rt.credits or rt.degraded:
            return
        tickets, rt.credits = rt.credits, []
        self._held_fell(rt)
        idle = format_idle_credits(time.time() * 1000, 0)
        self.spawn(self._quietly(rt, "return_credits", lambda: rt.state.return_credits(*tickets, idle=idle)))

    async def _quietly(self, rt: PoolRuntime, op: str, fn: Callable[[], Awaitable[object]]) -> None:
        with contextlib.suppress(RedisDown):
            await self.call(rt, op, fn)

    # ---------------------------------------------------------------- admission

    async def admit(self, pool: str, priority: int, tenant: str, tokens: float | None = None, *,
                    retry: bool = False, caller: str = "", age_s: float = 0.0) -> Permit | Reject:
        """`tokens`: the request's prompt tokens for the prefill estimate (`prompt_tokens`;
        None: the pool's `prefill_request_tokens`). `retry`: the client says it sent this
        request before (`admission.retry_count_header`); if turned away it is counted as
        `retried`, no demand (schema.NOT_DEMAND); if admitted and its first attempt was turned
        away here, also as `retried_admitted` (schema.RETRIED_ADMITTED, extproc/retry_match.py).
        `caller`: who sent it (mTLS peer or source address), part of that match. `age_s`: how
        long ago Envoy took the request in (server.request_age), see `queue_timeout`."""
        rt = self.pools[pool]
        started = self.clock()
        if not tenant and self.cfg.admission.anonymous_tenant_cap:
            tenant = "(anonymous)"  # tenant-less requests share one tenant cap only when configured
        req = Request(pool, priority, tenant, started, started + self.queue_timeout(rt.cfg.classes[priority], age_s),
                      tokens)
        rt.arrivals[priority].bump(started)
        rt.arrivals_fast[priority].bump(started)
        result: Permit | Reject | None = None
        try:
            for _ in range(8):  # a request follows the mode switches while it waits
                result = await self.backend(rt).admit(rt, req)
                if (isinstance(result, Permit) and not result.endpoint and rt.picker.enabled and rt.picker.active
                        and await self.registry_gone(rt)):
                    # Granted with no endpoint to pick: the registry is gone from Redis (see
                    # `registry_gone`); again, on local picks.
                    await self.release(result, "no_endpoints")
                    continue
                if result is not None:
                    break
            if result is None:
                result = Reject("queue_timeout", retry_after(None, rt.cfg.classes[priority], self.cfg.admission,
                                                             self.rng()))
            if isinstance(result, Permit) and not (rt.picker.accept(result.endpoint)
                                                   and await self._registered(rt, result.endpoint)):
                await self.release(result, "no_endpoints")
                result = self.no_endpoints(rt, priority)
        except asyncio.CancelledError:
            # The client went away (Envoy cancelled the stream) between the grant and the reply:
            # the permit is in `held`, which the sync renews for good, and the caller, which
            # releases what it got, never got it (a review read this leak in the registry look-up).
            if isinstance(result, Permit):
                self.release_soon(result, "cancelled")  # (a no-op for one already given back)
            raise
        self._count_result(rt, priority, result, retry, tenant, caller)
        return result

    def queue_timeout(self, c: ClassConfig, age_s: float) -> float:
        """How long a request `age_s` old may wait here: its class's `queue_timeout_s`, but never
        past Envoy's ext_proc `message_timeout` (`server.envoy_message_timeout_s`, less the margin
        the config check keeps) counted from when Envoy took it in. Envoy retries the stream of a
        request queued at a processor that died (the filter's `retry_policy`) on another one, and
        its message timer keeps running from the first send: given a fresh queue timeout there, a
        request that had already waited got Envoy's 504 ("admission unavailable, retry after
        1 s") instead of a 429 with its Retry-After (a review: P0s queued 18 s at a killed
        processor, 504 at 35 s). A fresh request is ~0 s old: no change."""
        if age_s <= 0:
            return c.queue_timeout_s
        room = self.cfg.server.envoy_message_timeout_s - MESSAGE_TIMEOUT_MARGIN_S - age_s
        return max(0.0, min(c.queue_timeout_s, room))

    async def _registered(self, rt: PoolRuntime, endpoint: str) -> bool:
        """Is a granted endpoint one the controller registered? A grant names its endpoint (the
        message `pool|ticket|endpoint`, or the lease the poll reads), and anyone with the
        processors' Redis credentials can publish or write one: a review sent 19 of 20 prompts
        to its own listener that way while the registry, which that user cannot write, never
        changed. The active endpoints this process last read are the answer; one it has not seen
        yet (a replica promoted since its last read) is looked up in the registry's hash,
        which holds draining replicas too (a grant made just before a drain began is good)."""
        if not endpoint or not rt.picker.enabled or endpoint in rt.picker.active:
            return True
        try:
            async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                known = bool(await rt.client.hexists(key(rt.cfg.name, ENDPOINTS), endpoint))
        except OUTAGE_ERRORS as exc:
            # Unverifiable: not sent (a 503 now beats a prompt sent who knows where), but no
            # sign of forgery either: not counted as an unregistered grant.
            log.debug("pool %s: could not look up granted endpoint %s in the registry: %s", rt.cfg.name, endpoint, exc)
            return False
        if known:
            rt.registry_due = True  # this process's view is behind: read it now
            rt.wake.set()
            return True
        self.child(self.metrics.unregistered_grants, (rt.cfg.name,)).inc()
        # Logged once per endpoint, for the first MAX_REFUSED_LOGGED names: each forged grant
        # may name another, and the set was kept for good (an unbounded-growth review: 2,000
        # names, 2,000 entries); the counter counts them all.
        if endpoint not in rt.refused_endpoints and len(rt.refused_endpoints) < MAX_REFUSED_LOGGED:
            rt.refused_endpoints.add(endpoint)
            log.warning("pool %s: a grant named endpoint %s, which the controller has not registered: refused "
                        "(503 no_endpoints). Someone with the processors' Redis credentials may be forging grants",
                        rt.cfg.name, endpoint)
        return False

    def permit(self, rt: PoolRuntime, ticket: str, req: Request, endpoint: str, *,
               queued: bool = False, credit: bool = False) -> Permit:
        now = self.clock()
        p = Permit(rt.cfg.name, ticket, req.priority, now - req.started, now, endpoint, queued, credit,
                   _seq_of(ticket), req.tokens, on_finish=self.finish)
        rt.held[ticket] = p
        return p

    def no_endpoints(self, rt: PoolRuntime, priority: int) -> Reject:
        # No queue is involved: the pool has no endpoint to send to (a cold start, a registry
        # being rewritten). Retry soon, whatever the class: the class's queue timeout (what an
        # unknown wait falls back to) told P0 to come back after 20-24 s and P2 after 1-2 s.
        c = rt.cfg.classes[priority]
        return Reject("no_endpoints", retry_after(self.cfg.admission.retry_after_min_s, c, self.cfg.admission,
                                                  self.rng()), status=503)

    def count(self, rt: PoolRuntime, cls: int, outcome: str) -> None:
        if outcome == "abandoned":  # the one decision that ends with no reply: counted here
            self.child(self.metrics.decisions, (rt.cfg.name, PRIORITY_LABELS[cls], "abandoned", "client_gone")).inc()
        if rt.degraded and outcome in TURNED_AWAY:
            outcome = "degraded"  # for want of shared state, not of capacity: no demand (schema.NOT_DEMAND)
        rt.demand[(cls, outcome)] += 1
        if outcome in TURNED_AWAY or outcome in NOT_DEMAND:
            self._demand_soon(rt)

    def count_not_demand(self, pool: str, cls: int, outcome: str) -> None:
        """A request the server answered or passed without admission (schema.NOT_DEMAND)."""
        rt = self.pools.get(pool)
        if rt is not None:
            self.count(rt, cls, outcome)

    def _demand_soon(self, rt: PoolRuntime) -> None:
        """A request was turned away: the controller sizes scale-up from these counters
        (controller/demand.py), so they go to Redis within `DEMAND_FLUSH_S`, not with the next
        status tick (up to a second later). At most one write per `DEMAND_FLUSH_S` per pool and
        process, and none while nothing is turned away (the tick writes the rest)."""
        if rt.demand_flush_due or rt.degraded or self._closing:
            return
        rt.demand_flush_due = True
        self.spawn(self._flush_demand_soon(rt))

    async def _flush_demand_soon(self, rt: PoolRuntime) -> None:
        try:
            await asyncio.sleep(max(0.0, min(DEMAND_FLUSH_S, rt.demand_flushed_at + DEMAND_FLUSH_S - self.clock())))
            if not rt.degraded and not self._closing:
                await self._flush_demand(rt)
        finally:
            rt.demand_flush_due = False
        # Turned away while the write was in the air (the flush was already due, so no new one
        # was scheduled): those go with the next write, not with the next status tick.
        if any(n and outcome in TURNED_AWAY for (_, outcome), n in rt.demand.items()):
            self._demand_soon(rt)

    async def _flush_demand(self, rt: PoolRuntime) -> None:
        """Add the counts since the last write to the pool's demand counters in Redis. A batch
        whose write failed is sent again as it is (its seq with it), before anything newer: a
        write that timed out may still have run (a frozen server), and Redis adds a batch once
        (before, those counts were added again with the next write: counted twice)."""
        rt.demand_flushed_at = self.clock()
        for _ in range(2):  # the batch left over, then what came since
            if rt.demand_unsent is None:
                if not rt.demand:
                    return
                rt.demand_seq += 1
                rt.demand_unsent = (rt.demand_seq, dict(rt.demand))
                rt.demand = Counter()
            seq, counts = rt.demand_unsent
            batch = DemandBatch(self.gateway_id, self._demand_nonce, seq)
            try:
                await self.call(rt, "demand", functools.partial(rt.state.add_demand, counts, batch))
            except RedisDown:
                return  # kept, sent again by the next write
            if rt.demand_unsent is not None and rt.demand_unsent[0] == seq:
                rt.demand_unsent = None  # (a write beside this one may have ended it already)

    def _count_result(self, rt: PoolRuntime, priority: int, result: Permit | Reject, retry: bool = False,
                      tenant: str = "", caller: str = "") -> None:
        # Label lookups cost more than the increments: keep the children.
        label = PRIORITY_LABELS[priority]
        if isinstance(result, Permit):
            reason = "queued" if result.queued else "immediate"
            self.child(self.metrics.decisions, (rt.cfg.name, label, "admitted", reason)).inc()
            self.child(self.metrics.queue_wait, (rt.cfg.name, label)).observe(result.queue_s)
            rt.demand[(priority, "admitted")] += 1
            if retry and rt.retries.admitted_retry(priority, tenant, self.clock(), caller):
                rt.demand[(priority, RETRIED_ADMITTED)] += 1
        else:
            self.child(self.metrics.decisions, (rt.cfg.name, label, "rejected", result.reason)).inc()
            now = self.clock()
            rt.rejections[priority].bump(now)
            if result.reason == "queue_timeout":
                rt.slow_rejections[priority].bump(now)
            # (every reason here is a TURNED_AWAY one; a retry's first attempt was counted already)
            self.count(rt, priority, "retried" if retry else result.reason)
            if not retry and not rt.degraded:  # counted as demand: its retry, if admitted, takes it back
                rt.retries.turned_away(priority, tenant, now, caller)

    def child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key_ = (id(metric), labels)
        child = self._children.get(key_)
        if child is None:
            child = self._children[key_] = metric.labels(*labels)
        return child

    def any_active_endpoint(self, pool: str) -> str | None:
        """An active endpoint for a request that is routed without admission (e.g. /v1/models)."""
        rt = self.pools[pool]
        return rt.picker.any_active(self.rng(), rt.ejector.avoid(self.clock()))

    def endpoint_outcome(self, pool: str, endpoint: str, outcome: EndpointOutcome) -> None:
        """A request routed to `endpoint` got its response headers: from the endpoint
        (`answered`), from Envoy because the endpoint refused, timed out or dropped the
        connection (`failed`), or something that says nothing of the endpoint (`other`). Enough
        failures in a row eject it from every processor's picks (extproc/ejection.py)."""
        rt = self.pools.get(pool)
        if rt is None or not ejectable(endpoint) or not rt.ejector.settings.on or outcome == "other":
            return
        if outcome == "answered":
            rt.ejector.answered(endpoint)
            return
        errors = outcome == "error"
        length = (rt.ejector.errored if errors else rt.ejector.failed)(endpoint, self.clock())
        if length is None:
            return
        self.child(self.metrics.ejections, (pool,)).inc()
        what = "answered 5xx" if errors else "failed connections"
        log.warning("pool %s: endpoint %s %s %s: every processor's picks avoid it for %.0f s",
                    pool, endpoint, what, "again" if length > rt.ejector.settings.base_s else "in a row", length)
        if not rt.degraded:  # degraded: written when Redis answers again (`_refresh_registry`)
            self.spawn(self._eject(rt, endpoint, length))

    async def _eject(self, rt: PoolRuntime, endpoint: str, length: float) -> None:
        with contextlib.suppress(RedisDown):  # not written: sent again at the next registry read
            await self.call(rt, "eject", lambda: rt.state.eject(endpoint, length))
            rt.ejector.shared(endpoint)
        rt.registry_due = True  # the limit follows the endpoints left serving (serving_endpoints)
        rt.wake.set()

    async def _read_ejections(self, rt: PoolRuntime) -> None:
        """The ejections stored in Redis, for this process's own picks (cheap reads, and while
        Redis is unreachable), and this process's ejections that a failed call did not store."""
        left = await self.call(rt, "ejections", rt.state.ejections)
        now = self.clock()
        rt.ejector.see({ep: now + s for ep, s in left.items()})
        for ep, s in rt.ejector.unshared(now):
            self.spawn(self._eject(rt, ep, s))

    async def _uneject(self, rt: PoolRuntime, endpoints: list[str]) -> None:
        with contextlib.suppress(RedisDown):
            await self.call(rt, "uneject", lambda: rt.state.uneject(*endpoints))

    # ---------------------------------------------------------------- release

    async def release(self, permit: Permit, reason: str = "completed") -> None:
        """Return the permit. Safe to call more than once; only the first call counts. A caller
        cancelled meanwhile does not cancel the Redis call: the permit has left `held` (no
        renewal), so Redis would keep it until its lease expired."""
        pending = self._release(permit, reason)
        if pending is not None:
            await asyncio.shield(self.spawn(pending))

    def release_soon(self, permit: Permit, reason: str) -> None:
        """`release` for code that cannot await (a stream's `finally`): the Redis part, if
        any, runs as a task that the stream's cancellation cannot interrupt."""
        pending = self._release(permit, reason)
        if pending is not None:
            self.spawn(pending)

    def _release(self, permit: Permit, reason: str) -> Coroutine[Any, Any, None] | None:
        """The bookkeeping of a release, done at once; returns the Redis call still to make."""
        if permit.released:
            return None
        permit.released = True
        rt = self.pools[permit.pool]
        self.child(self.metrics.releases, (permit.pool, reason)).inc()
        rt.held.pop(permit.ticket, None)  # stop asserting it first: if Redis is down now, it expires
        pending = self.backend(rt).release(rt, permit)
        self._held_fell(rt)
        return pending

    @staticmethod
    def _held_fell(rt: PoolRuntime) -> None:
        """A permit or credit went back to Redis, which may grant it to another processor at
        once: the local budget (`_local_limit`) must not count it as this process's any more."""
        rt.held_seen = min(rt.held_seen, len(rt.held) + len(rt.credits))

    # ---------------------------------------------------------------- latency feedback

    def finish(self, permit: Permit, outcome: str, latency: Latency | None = None) -> None:
        """The request behind `permit` is over: feed its outcome (and, if it was measured, its
        latency) to the pool's limit, once. The limit's configuration picks the signal."""
        if permit.finished:
            return
        permit.finished = True
        rt = self.pools[permit.pool]
        rtt = latency.signal(rt.cfg.limit.signal) if latency is not None else None
        kind: Outcome = "success" if outcome == "success" else "dropped" if outcome == "dropped" else "ignored"
        sample = rt.limit.record(self.clock(), kind, rtt, rt.inflight_seen(), permit.admitted_at)
        if sample is not None and not rt.degraded and self._writes_limit(rt):
            self.spawn(self._apply_sample(rt, sample))

    def measures(self, pool: str) -> bool:
        """Does the pool's limit use latency at all (a fixed one does not)?"""
        return self.pools[pool].limit.adaptive

    def sample(self, pool: str) -> bool:
        """Should the request just admitted stream its body to measure its latency
        (limit.sample_request)? True takes one of the pool's sampling slots: the caller gives it
        back with `sampled_done` when the request ends."""
        rt = self.pools[pool]
        if not rt.limit.adaptive:
            return False
        c = rt.cfg.limit
        if not sample_request(self.rng(), c.sample_rate, rt.sampled, c.max_sampled):
            return False
        rt.sampled += 1
        return True

    def sampled_done(self, pool: str) -> None:
        rt = self.pools[pool]
        rt.sampled = max(0, rt.sampled - 1)

    async def _apply_sample(self, rt: PoolRuntime, sample: Sample) -> None:
        with contextlib.suppress(RedisDown):
            for _ in range(5):  # compare-and-set; another gateway may win the race
                rec = await self.call(rt, "get_limit", rt.state.get_limit)
                if rec.version > 0:  # (version 0: nothing stored, or Redis lost it)
                    rt.last_limit = rec.state
                new = self._capped(rt, rt.limit.update(rec.state, sample, self.rng()), rt.endpoints_seen)
                if new == rec.state:
                    return
                if await self.call(rt, "set_limit", partial(rt.state.set_limit, rec.version, new)):
                    rt.last_limit = new
                    self.metrics.limit_updates.labels(rt.cfg.name).inc()
                    self.metrics.limit.labels(rt.cfg.name).set(max(1, int(new.limit)))
                    self._limit_seen(rt, new.limit)
                    return

    @staticmethod
    def _writes_limit(rt: PoolRuntime) -> bool:
        """Not once a newer settings_epoch replaced this processor's (limit.writes_shared_limit)."""
        return writes_shared_limit(rt.settings.epoch, rt.state.stored.epoch if rt.state.stored else None)

    async def _follow_endpoints(self, rt: PoolRuntime, endpoints: int) -> None:
        """Scale the shared limit to the active endpoint count (limit.follow_endpoints) and hold
        it under the controller's ceiling (limit.cap_to_ceiling); every processor sees the same
        count, the first compare-and-set wins, the rest find it done."""
        if not self._writes_limit(rt):
            rt.endpoints_applied = endpoints  # (the newer epoch's processors apply it)
            return
        c = rt.cfg.limit
        for _ in range(5):
            rec = await self.call(rt, "get_limit", rt.state.get_limit)
            new = follow_endpoints(rec.state, endpoints, c.min, c.max) if rt.follows_endpoints() else rec.state
            lift = rt.ceiling is None and rt.uncapped is not None
            new = lift_ceiling(new, rt.uncapped, endpoints, c.min, c.max) if lift else self._capped(rt, new, endpoints)
            # The growth new endpoints bring may be taken at once (policy.ramp_credit).
            credit = ramp_credit(rec.state.limit, new.limit, rec.state.endpoints, endpoints) \
                if rt.settings.ramp_rate > 0 else 0
            if new == rec.state or await self.call(rt, "set_limit", partial(rt.state.set_limit, rec.version, new,
                                                                            credit, RAMP_CREDIT_S)):
                rt.endpoints_applied = endpoints
                if lift:
                    rt.uncapped = None
                self._limit_seen(rt, new.limit)
                if new.limit != rec.state.limit:
                    self.metrics.limit_updates.labels(rt.cfg.name).inc()
                    self.metrics.limit.labels(rt.cfg.name).set(max(1, int(new.limit)))
                    log.info("pool %s: %d active endpoints (was %d), ceiling %s: limit %.1f -> %.1f", rt.cfg.name,
                             endpoints, rec.state.endpoints, rt.ceiling, rec.state.limit, new.limit)
                return

    @staticmethod
    def _capped(rt: PoolRuntime, st: LimitState, endpoints: int) -> LimitState:
        """`st` under the controller's ceiling; the first cap of an episode remembers the level
        per endpoint it lowered (given back by limit.lift_ceiling when the ceiling goes)."""
        new = cap_to_ceiling(st, rt.ceiling, rt.cfg.limit.min)
        if new.limit < st.limit and rt.uncapped is None and endpoints > 0:
            rt.uncapped = st.limit / endpoints
        return new

    async def _force_static_limit(self, rt: PoolRuntime) -> None:
        for _ in range(5):
            rec = await self.call(rt, "get_limit", rt.state.get_limit)
            st = rt.limit.initial(rt.cfg.limit.initial)
            if await self.call(rt, "set_limit", partial(rt.state.set_limit, rec.version, st)):
                return

    # ---------------------------------------------------------------- background loops

    async def _pubsub_loop(self, rts: list[PoolRuntime]) -> None:
        """Grants and credit recalls for `rts` (pools sharing a pub/sub client). One channel per
        pool, in the pool's slot: sharded pub/sub on a Cluster (redis_client)."""
        channels = [gateway_channel(self.gateway_id, rt.cfg.name) for rt in rts]
        client = rts[0].pubsub_client
        failures = 0
        while not self._closing:
            pubsub: Subscription | None = None
            try:
                pubsub = await subscribe(client, channels, connect_timeout_s=self.cfg.redis.op_timeout_s)
                if failures:
                    # Subscribed again after a loss (a failover moved the primary or the slot's
                    # owner): a `!resync` published meanwhile was missed, so re-assert now
                    # (Redis may hold its grants until this process has).
                    self._sync_soon(*rts)
                for pool_rt in rts:
                    pool_rt.unsubscribed = False
                failures = 0
                while not self._closing:
                    msg = await pubsub.get_message(1.0)
                    if pubsub.reconnected():  # as after a loss (above): a `!resync` may have been missed
                        self._sync_soon(*rts)
                    if msg is not None:
                        data = msg[1].decode()
                        pool, ticket, endpoint = [*data.split("|", 2), "", ""][:3]
                        rt = self.pools.get(pool)
                        if rt is None:
                            continue
                        if ticket == "!return":  # a queue formed somewhere: stop using credits
                            rt.queue_clear = False
                            self._return_credits(rt)
                            continue
                        if ticket == RESYNC:  # Redis lost writes and holds its grants until we sync
                            self.metrics.resync_requests.labels(rt.cfg.name).inc()
                            log.warning("pool %s: Redis holds the pool's grants until every processor has "
                                        "re-asserted its permits (it lost acknowledged writes, a failover, or "
                                        "its clock stepped past the lease TTL): re-asserting now", rt.cfg.name)
                            self._sync_soon(rt)
                            continue
                        if ticket == REGISTRY_CHANGED:  # the sync loop reads the registry at once
                            rt.registry_due = True
                            rt.wake.set()
                            continue
                        self._granted(rt, ticket, endpoint)
            except asyncio.CancelledError:
                raise
            except OUTAGE_ERRORS as exc:
                failures += 1
                # Said once per loss that lasts (at once when the server refuses: an ACL without
                # the channel, a proxy without pub/sub); meanwhile this process says at each
                # poll that it is not subscribed, and its grants come by its polls.
                refused = isinstance(exc, ResponseError)
                (log.warning if failures == 3 or (refused and failures == 1) else log.debug)(
                    "pub/sub connection to Redis lost (pools %s): %s; until it is back, grants reach this "
                    "processor's waiters by its polls (every redis.poll_interval_s); retrying",
                    [rt.cfg.name for rt in rts], exc)
            finally:
                for pool_rt in rts:
                    pool_rt.unsubscribed = True
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
            if failures and not self._closing:  # after a failure, not after a clean close
                await asyncio.sleep(self.cfg.redis.reconnect_interval_s)

    def _lost_writes(self, rt: PoolRuntime) -> None:
        """A batch's reply shows that Redis lost writes of this processor it had acknowledged (a
        failover to a replica that had not received them, a restart without persistence): it
        may hold leases released since (phantoms: fewer admitted than L) and miss permits live
        requests hold (more than L elsewhere). Re-assert everything now rather than at the next
        renewal (up to `lease_ttl_s / 3` away). While degraded every reconcile does that anyway."""
        self.metrics.state_rollbacks.labels(rt.cfg.name).inc()
        if rt.resyncing and not rt.degraded and not self._closing:
            # Found again while a resync runs: its sync may have gone before this loss, and
            # Redis may hold the pool's grants until this process has re-asserted: once more.
            self._sync_soon(rt)
        if rt.degraded or rt.resyncing or self._closing:
            return
        # Eviction named too: under `maxmemory` with an allkeys-* policy, the pool's state hash
        # (which holds the fences) evicted reads exactly so, and a review's operator, the
        # servers up and unmoved, was sent after failovers (docs/operations.md).
        log.warning("pool %s: Redis lacks writes of this processor it had acknowledged (a failover to a "
                    "replica that missed them, a restart, a pool key evicted under maxmemory or deleted, "
                    "or this process stalled past the lease TTL): "
                    "re-asserting its permits and waiters now (after a failover Redis grants no permit "
                    "until every processor has re-asserted, at most %.1f s)", rt.cfg.name,
                    self.cfg.redis.lease_ttl_s / 3 + 1)
        rt.resyncing = True
        self.spawn(self._resync(rt))

    async def _resync(self, rt: PoolRuntime) -> None:
        try:
            await self._quietly_sync(rt)
            with contextlib.suppress(RedisDown):
                await self._restore_limit(rt)
        finally:
            rt.resyncing = False

    async def _restore_limit(self, rt: PoolRuntime) -> None:
        """Redis lost the shared limiter state (restarted empty, flushed, failed over to a
        replica without it): write back the one this process last saw, rather than let the pool
        start again from `limit.initial`. An operator's review: a pool at limit 322 with 110 in
        flight fell to 38 after a FLUSHALL and turned away 230 of 1,165 requests over the ~20 s
        Vegas took to climb back. Adaptive limits only (a fixed one is its config); the first
        processor to write it wins (compare-and-set on version 0), the others find it there."""
        if not rt.limit.adaptive or rt.last_limit is None or not self._writes_limit(rt):
            return
        rec = await self.call(rt, "get_limit", rt.state.get_limit)
        if rec.version != 0 or rec.state.limit == rt.last_limit.limit:
            return  # stored (by a peer, or never lost), or nothing to restore
        # Within this process's limit settings (they may have changed since) and the ceiling.
        c = rt.cfg.limit
        back = self._capped(rt, replace(rt.last_limit, limit=min(c.max, max(c.min, rt.last_limit.limit))),
                            rt.endpoints_seen)
        if await self.call(rt, "set_limit", partial(rt.state.set_limit, 0, back)):
            self.metrics.limit_updates.labels(rt.cfg.name).inc()
            self.metrics.limit.labels(rt.cfg.name).set(max(1, int(back.limit)))
            self._limit_seen(rt, back.limit)
            log.warning("pool %s: Redis had lost the shared limit (it read %.1f, the initial): restored the "
                        "%.1f this process last saw", rt.cfg.name, rec.state.limit, back.limit)

    def _granted(self, rt: PoolRuntime, ticket: str, endpoint: str) -> None:
        """A grant to one of this processor's waiters (by pub/sub, in a batch's reply, or found
        by the poll). A waiter's lease runs until this process's liveness in Redis ends (its
        last sync + the TTL). After a stall (a GC pause, a blocked loop, SIGSTOP) a grant read
        now may be one Redis took back meanwhile and gave to another gateway's waiter: started
        as it was, it ran above the limit (7 of L 4 after a 13.5 s stall at the shipped TTL of
        15 s). So a grant is acted on only while this process is surely alive in Redis, by its
        own clock with a margin (`GRANT_MARGIN_SHARE` of the TTL, at least two Redis
        timeouts), and not just after a renewal sent once it had lapsed (`suspect_until`: that
        renewal may land before the stale grants are read off the pub/sub connection);
        otherwise `_confirm` first renews (a sync) and asks Redis which of these waiters still
        hold their permits."""
        w = rt.waiting.get(ticket)
        if w is None or w.future.done():
            return
        now = self.clock()
        if rt.suspect_until <= now < rt.alive_until - self._grant_margin():
            w.future.set_result(endpoint)
            return
        rt.unconfirmed.add(ticket)
        if not rt.confirming:
            rt.confirming = True
            self.spawn(self._confirm(rt))

    def _grant_margin(self) -> float:
        return max(self.cfg.redis.lease_ttl_s * GRANT_MARGIN_SHARE, 2 * self.cfg.redis.op_timeout_s)

    async def _confirm(self, rt: PoolRuntime) -> None:
        """Grants held back by `_granted`: renew this process's liveness and leases (a sync: a
        waiter's lease Redis still has is extended, a waiter Redis lost is queued again at its
        place), then start only the waiters whose permits Redis confirms; the others wait on."""
        try:
            while rt.unconfirmed and not self._closing and not rt.degraded:
                try:
                    await self._sync(rt)
                    tickets = list(rt.unconfirmed)
                    got = await self.call(rt, "mine", partial(rt.state.granted_among, tickets))
                except RedisDown:
                    return  # degraded: the switch hands every waiter to the local queue
                self.metrics.grants_confirmed.labels(rt.cfg.name, "held").inc(len(got))
                self.metrics.grants_confirmed.labels(rt.cfg.name, "taken_back").inc(len(tickets) - len(got))
                for t in tickets:
                    rt.unconfirmed.discard(t)
                    w = rt.waiting.get(t)
                    if t in got and w is not None and not w.future.done():
                        w.future.set_result(got[t])
        finally:
            rt.confirming = False
            rt.unconfirmed.clear()

    async def _poll_loop(self, rt: PoolRuntime) -> None:
        """Fallback for lost grant messages; also drives reclaim when traffic is idle. A waiter
        Redis no longer has (dropped while this process's pub/sub connection was down, or lost
        in a failover) is re-queued at once by a sync rather than at the next renewal: looked for
        once a second (a lookup per waiter in Redis), not at every poll. While this process holds
        no subscription, every poll says so, and Redis grants to it anyway for a few polls: the
        polls are then how its grants arrive (leases.lua `hears`)."""
        last_gone_check = 0.0
        interval = self.cfg.redis.poll_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            if rt.degraded:
                continue
            tickets = [t for t, w in rt.waiting.items() if w.enqueued and not w.future.done()]
            if not tickets:
                continue
            now = self.clock()
            deaf = rt.unsubscribed
            check_gone = deaf or now - last_gone_check >= 1.0
            with contextlib.suppress(RedisDown):
                if check_gone:
                    last_gone_check = now
                    granted, gone = await self.call(rt, "mine", partial(
                        rt.state.waiting_among, tickets, deaf=self.gateway_id if deaf else None,
                        deaf_ms=self._deaf_ms()))
                else:
                    granted, gone = await self.call(rt, "mine", partial(rt.state.granted_among, tickets)), set()
                for t, endpoint in granted.items():
                    self._granted(rt, t, endpoint)
                gone = {t for t in gone if (w := rt.waiting.get(t)) is not None and not w.future.done()}
                if gone and not rt.resyncing and not self._closing:
                    self.metrics.waiters_dropped.labels(rt.cfg.name).inc(len(gone))
                    rt.resyncing = True
                    self.spawn(self._resync(rt))

    async def _sync_loop(self, rt: PoolRuntime) -> None:
        """Every lease_ttl/3: sync the pool (renew, prove alive, reconcile). Every second: a
        status read for the gauges, the registry's active endpoints, demand counters.

        While degraded: every `reconnect_interval_s`, re-assert everything in Redis; shared
        admission resumes once every other processor has re-asserted its permits too
        (`_await_peers`; otherwise this one would grant permits another still holds locally)."""
        interval = self.cfg.redis.lease_ttl_s / 3
        last_sync = self.clock()
        last_tick = 0.0
        while not self._closing:
            # Local knowledge: kept current while Redis is down too (the tick's status read fails then).
            self.metrics.local_inflight.labels(rt.cfg.name).set(len(rt.held))
            if rt.degraded:
                if rt.budget_open:  # the first reconcile runs at once
                    await asyncio.sleep(self.cfg.redis.reconnect_interval_s)
                rt.wake.clear()
                now = self.clock()
                if not await self._reconcile(rt, switch=False):
                    rt.back_since = None
                elif rt.registry_lost and not await self._registry_back(rt):
                    rt.back_since = None  # Redis answers, but without the registry: stay on local picks
                else:
                    await self._await_peers(rt, now)  # switches back once the peers are
                    last_sync = self.clock()
                continue
            now = self.clock()
            if now - last_sync >= interval or rt.sync_due:
                last_sync, rt.sync_due = now, False
                with contextlib.suppress(RedisDown):
                    await self._sync(rt)
                    await self._claim_gateway_id(rt)
            if now - last_tick >= 1.0:
                last_tick = now
                with contextlib.suppress(RedisDown):
                    await self._tick(rt)
            elif rt.registry_due:
                with contextlib.suppress(RedisDown):
                    await self._refresh_registry(rt)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rt.wake.wait(), min(1.0, interval))
            rt.wake.clear()

    async def _await_peers(self, rt: PoolRuntime, now: float) -> None:
        """A clean reconcile while degraded (Redis is reachable). Every reconcile while degraded
        asserts this process's whole local budget (its permits, and reserve leases for the rest:
        `_sync`), so from the moment one lands Redis counts at least what this process may admit
        locally, whether or not its reply has arrived yet. The first clean one starts the way back.
        It switches back only once every other gateway of the pool has synced since then (plus
        half a reconnect interval, past the calls that were sent during an outage and ran when it
        ended), and as many gateways as were live before the outage are known again: each has then
        asserted its budget, so the shared state counts everything that can be held. The switch
        asserts only the permits held (the reserve goes back); while that call is in the air
        nothing more is admitted (`LocalBackend`). A gateway that does not sync within one lease
        TTL is dead or cut off (its leases expire; the partition bound applies) and is not waited
        for."""
        try:
            times = await self.call(rt, "gateways", rt.state.sync_times)
        except RedisDown:
            rt.back_since = None
            return
        mine = times.pop(self.gateway_id, None)
        if rt.back_since is None:
            if mine is None:
                return
            rt.back_since, rt.back_ms = now, mine
        margin_ms = self.cfg.redis.reconnect_interval_s * 500
        # A gateway Redis forgot (its liveness expired during the outage) counts as not back.
        peers_back = (len(times) + 1 >= rt.live_before and all(t >= rt.back_ms + margin_ms for t in times.values())) \
            or now - rt.back_since >= self.cfg.redis.lease_ttl_s
        if peers_back and not await self._reconcile(rt, switch=True):  # at once: every round trip is a dip
            rt.back_since = None

    def _deaf_ms(self) -> int:
        """How long one "not subscribed" notice lets Redis grant to this process's waiters:
        past the next status tick (1 s) and several polls."""
        return max(3000, round(4000 * self.cfg.redis.poll_interval_s))

    async def _tick(self, rt: PoolRuntime) -> None:
        if rt.unsubscribed:
            # Heard by its polls even before a waiter of its own is queued: one whose turn came
            # before the first poll was dropped (leases.lua `hears`).
            await self.call(rt, "mine", partial(rt.state.waiting_among, [], deaf=self.gateway_id,
                                                deaf_ms=self._deaf_ms()))
        if rt.credit_done:
            # Completions whose credits came back here, not to Redis: the release rate counts them.
            n, rt.credit_done = rt.credit_done, 0
            with contextlib.suppress(RedisDown):
                await self.call(rt, "credit_done", lambda: rt.state.credit_done(n))
        status = await self.call(rt, "status", lambda: rt.state.status(self.gateway_id))
        self.observe(rt, status)
        self.metrics.grants_held.labels(rt.cfg.name).set(1 if status.hold_s > 0 else 0)
        if 0 <= status.settings_epoch < rt.settings.epoch:
            # Redis holds settings older than this process's: a restart emptied it during a
            # rollout and an older processor stored its own first (a review: the pool then ran
            # on the old epoch for good). The newer epoch replaces them, as at start.
            log.warning("pool %s: Redis holds settings of epoch %d, older than this processor's %d: "
                        "storing these", rt.cfg.name, status.settings_epoch, rt.settings.epoch)
            await self._store_settings(rt)
        elif status.settings_epoch > max(rt.settings.epoch, rt.state.stored.epoch if rt.state.stored else -1):
            # A newer epoch was stored since (a rollout under way): this processor's settings are
            # no longer the pool's. Said once per epoch (the gauge, an error); its static limit
            # is left to the processors of that epoch.
            await self._configure(rt)
        if rt.credit_uses == 0:  # quiet for a tick: idle credits should not look busy
            self._return_credits(rt)
        rt.credit_uses = 0
        await self._refresh_registry(rt)
        await self._flush_demand(rt)
        await self._share_arrivals(rt)

    async def _share_arrivals(self, rt: PoolRuntime) -> None:
        """Write this process's own arrival rates to the pool's shared hash and read the other
        processors' (policy.pool_arrivals). Ages are judged by the writers' wall clocks."""
        now, wall_ms = self.clock(), time.time() * 1000
        mine = format_arrivals(wall_ms, rt.own_arrival_rates(now), rt.own_arrival_rates(now, fast=True))
        idle = format_idle_credits(wall_ms, len(rt.credits))
        try:
            shared, credits = await self.call(rt, "arrivals", lambda: rt.state.share_arrivals(
                self.gateway_id, mine, forget_before_ms=wall_ms - 60_000, forget_after_ms=wall_ms + 60_000,
                idle=idle))
        except ResponseError as exc:  # e.g. a Redis user not allowed the key: own x processors, as before
            if rt.peer_arrivals is not None or rt.peer_arrivals_at == -1e9:
                log.warning("pool %s: cannot share arrival rates in Redis (%s): early drop reads this "
                            "processor's own rates times the live processors", rt.cfg.name, exc)
            rt.peer_arrivals, rt.peer_arrivals_at = None, 0.0
            return
        slow, fast = peer_arrivals(shared, self.gateway_id, wall_ms, PEER_ARRIVALS_FRESH_S)
        rt.peer_arrivals, rt.peer_arrivals_at = (slow, fast), now
        peers = fresh_idle_credits(credits, wall_ms, PEER_ARRIVALS_FRESH_S)
        rt.peer_idle_credits = sum(n for gw, n in peers.items() if gw != self.gateway_id)
        self._set_inflight_p1(rt)

    def _set_inflight_p1(self, rt: PoolRuntime) -> None:
        """`floodgate_inflight` for P1 from the last snapshot, less the local credits the
        processors hold idle (this one's now, the others' as they last shared them): Redis
        counts a credit as a P1 lease, and a pool at 0.5 requests in flight read 31 (a review)."""
        if rt.last_status is not None:
            busy = max(0, rt.last_status.inflight[1] - len(rt.credits) - rt.peer_idle_credits)
            self.child(self.metrics.inflight, (rt.cfg.name, PRIORITY_LABELS[1])).set(busy)

    def _lose_registry(self, rt: PoolRuntime) -> None:
        rt.registry_lost = True
        log.warning("pool %s: Redis lost the replica registry (its active set and mark are gone: restarted "
                    "empty?): routing to the %d endpoints last seen, on local limits, until the controller "
                    "writes it again", rt.cfg.name, len(rt.picker.active))
        self._enter_degraded(rt, "the replica registry is gone", alone=True)

    async def registry_gone(self, rt: PoolRuntime) -> bool:
        """The script found no active endpoint while this process knows some: if the mark the
        processors leave on a registry they read is gone too, Redis lost it; switch to local
        picks (True). False: emptied on purpose, or not known (Redis did not answer)."""
        if rt.registry_lost or rt.degraded:
            return False
        try:
            async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                marked = await rt.client.exists(key(rt.cfg.name, REGISTRY_SEEN))
        except OUTAGE_ERRORS:
            return False
        if marked:
            return False
        self._lose_registry(rt)
        return True

    async def _registry_back(self, rt: PoolRuntime) -> bool:
        """While the registry is lost: is an active endpoint registered again?"""
        try:
            async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                back = await rt.client.scard(key(rt.cfg.name, ACTIVE)) > 0
        except OUTAGE_ERRORS:
            return False
        if back:
            rt.registry_lost = False
            log.info("pool %s: the replica registry is back: resuming shared admission", rt.cfg.name)
        return back

    async def _refresh_registry(self, rt: PoolRuntime) -> None:
        """The active endpoints and the controller's ceiling; the limit follows them. Every
        status tick, and at once when the controller says they changed (`registry_due`)."""
        rt.registry_due = False
        if rt.picker.enabled:
            seen = rt.capacity_view()
            members = await self.call(rt, "registry", lambda: rt.client.smembers(key(rt.cfg.name, ACTIVE)))
            before = set(rt.picker.active)
            names = {m.decode() if isinstance(m, bytes) else str(m) for m in members}
            if not names and before and not await self.call(
                    rt, "registry", lambda: rt.client.exists(key(rt.cfg.name, REGISTRY_SEEN))):
                # Emptied, and the mark the processors leave once they saw it non-empty is gone
                # too: Redis lost the registry (restarted empty). Before, every picked request
                # (P0 too) was 503 no_endpoints until the controller wrote it again — for good
                # while no controller ran (a review: 47 of 47 P0). Route to the endpoints last
                # seen, on local limits, until it is back (`_registry_back`).
                self._lose_registry(rt)
                return
            if names and not rt.registry_marked:
                await self.call(rt, "registry", lambda: rt.client.set(key(rt.cfg.name, REGISTRY_SEEN), "1"))
                rt.registry_marked = True
            if before and not names:
                log.warning("pool %s: the registry has no active endpoint any more: requests are answered "
                            "503 no_endpoints until the controller makes one active", rt.cfg.name)
            rt.picker.update(names)
            rt.ejector.forget(set(rt.picker.active))
            back = set(rt.picker.active) - before
            if back and rt.registry_seen and rt.ejector.settings.on:
                # A replica brought up at the address of an ejected one (the controller removed
                # the dead one, then registered the new one active) is not dead: end the
                # ejection. Not at this process's first read, which would end every ejection.
                self.spawn(self._uneject(rt, sorted(back)))
            rt.registry_seen = True
            if rt.ejector.settings.on:
                await self._read_ejections(rt)
            now = self.clock()
            n = rt.serving_endpoints(now)
            rt.see_endpoints(now, n)
            if rt.follows_ceiling():
                per = parse_ceiling(await self.call(rt, "ceiling", lambda: rt.client.get(key(rt.cfg.name, CTL_CEILING))))
                rt.ceiling = per * n if per is not None and n else None
            if rt.counts_arrivals():
                at = await self.call(rt, "arriving",
                                     lambda: read_arriving(rt.client, key(rt.cfg.name, CTL_ARRIVING), late=True))
                now = self.clock()
                rt.arriving = tuple((now + s, k, now + s + g) for s, k, g in at)
            over = rt.ceiling is not None and rt.limit_seen is not None and rt.limit_seen > rt.ceiling
            lifted = rt.ceiling is None and rt.uncapped is not None and n > 0
            if (rt.follows_endpoints() and n and n != rt.endpoints_applied) or over or lifted:
                await self._follow_endpoints(rt, n)
            if rt.capacity_view() != seen:
                # The last status read, which early drop may decide on without a round trip
                # (`certain_reject`), described the pool before this change (the limit new
                # endpoints raise, the capacity announced for them and now taken back): the
                # next request decides on a fresh reply. Elastic bench, seed 2: P2 turned away
                # for 0.7 s after four replicas turned active, from the last second's full pool.
                rt.last_status_at = -1e9


def _failed(fut: asyncio.Future[str]) -> bool:
    return fut.done() and (fut.cancelled() or fut.exception() is not None)


def _seq_of(ticket: str) -> int:
    """The number in a ticket `<gateway>/<seq>` or a credit `<gateway>/<seq>:c<i>`."""
    tail = ticket.rsplit("/", 1)[-1].split(":", 1)[0]
    return int(tail) if tail.isdigit() else 0
