"""The admitter: one per processor process. It owns the bookkeeping around the pure policy.

`admit()` returns a `Permit` (now or after queueing) or a `Reject`; `release()` returns the
permit exactly once. Shared mode talks to Redis (`state.py`); when Redis fails, the process
switches within one call to a local `PermitTable` sized to its share of the last seen limit,
and a background probe switches back when Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio as aioredis
from floodgate.extproc.config import Config, PoolConfig
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import (
    Enqueue,
    Reject,
    Snapshot,
    queue_decision,
    retry_after,
    timeout_reject,
)
from floodgate.extproc.state import PoolState, PoolStatus, gateway_channel
from floodgate.extproc.vegas import Sample, SampleWindow, VegasLimit
from redis.exceptions import RedisError

log = logging.getLogger("floodgate.admission")

T = TypeVar("T")

PRIORITY_LABELS = ("0", "1", "2")


class RedisDown(Exception):
    """Raised inside the admitter when a Redis call fails; never escapes admit()/release()."""


@dataclass
class Permit:
    pool: str
    ticket: str
    priority: int
    backend: str  # "redis" | "local"
    queue_s: float
    admitted_at: float
    endpoint: str = ""  # routed-to endpoint when the pool picks endpoints
    queued: bool = False  # waited in the queue (vs admitted by the first acquire)
    credit: bool = False  # admitted from a local credit (no Redis round trip)
    released: bool = False


@dataclass
class _PoolRuntime:
    cfg: PoolConfig
    state: PoolState
    local: PermitTable
    vegas: VegasLimit
    window: SampleWindow
    shares: tuple[float, float, float]
    held: set[str] = field(default_factory=set)  # redis tickets this process holds
    local_held: set[str] = field(default_factory=set)
    local_endpoints: dict[str, str] = field(default_factory=dict)  # local ticket -> endpoint
    active_endpoints: list[str] = field(default_factory=list)  # last seen (1 s), for unadmitted paths and degraded picking
    last_status: PoolStatus | None = None
    credits: list[str] = field(default_factory=list)  # idle credit leases (also in `held`)
    queue_clear: bool = False  # last seen: nothing waits anywhere, so credits may be used
    credit_uses: int = 0  # since the last status tick; idle credits go back after an unused tick
    pending_release: list[str] = field(default_factory=list)  # batched into one script call

    def local_share(self) -> tuple[int, float]:
        """This process's share of the last seen shared limit and grant rate (degraded mode)."""
        st = self.last_status
        if st is None:
            return self.cfg.limit.initial, 0.0
        gateways = max(1, st.live_gateways)
        return max(1, st.limit // gateways), st.grant_rate / gateways

    def inflight_seen(self) -> int:
        return self.last_status.inflight_total if self.last_status else 0


def default_gateway_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Admitter:
    def __init__(self, cfg: Config, client: aioredis.Redis, *, metrics: Metrics | None = None,
                 pubsub_client: aioredis.Redis | None = None, gateway_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random) -> None:
        self.cfg = cfg
        self.client = client
        self.pubsub_client = pubsub_client or client
        self.gateway_id = gateway_id or cfg.server.gateway_id or default_gateway_id()
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.rng = rng
        self.degraded = False
        self._tickets = itertools.count(1)
        self._waiters: dict[str, asyncio.Future[str]] = {}  # resolves to the routed endpoint
        self._waiter_pool: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[object]] = set()
        self._closing = False
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.pools: dict[str, _PoolRuntime] = {}
        for p in cfg.pools:
            shares = (p.classes[0].share, p.classes[1].share, p.classes[2].share)
            always = (p.classes[0].reserve == "always", p.classes[1].reserve == "always",
                      p.classes[2].reserve == "always")
            self.pools[p.name] = _PoolRuntime(
                cfg=p,
                state=PoolState(client, p.name, lease_ttl_s=cfg.redis.lease_ttl_s,
                                initial_limit=p.limit.initial, shares=shares, picking=p.endpoint_picking,
                                always=always),
                local=PermitTable(limit=p.limit.initial, shares=shares, always=always),
                vegas=VegasLimit(p.limit.min, p.limit.max, p.limit.smoothing, p.limit.probe_multiplier,
                                 p.limit.rtt_tolerance),
                window=SampleWindow(p.limit.window_min_samples, p.limit.window_s, p.limit.window_max_s),
                shares=shares)
            self.metrics.limit.labels(p.name).set(p.limit.initial)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        for rt in self.pools.values():
            if rt.cfg.limit.mode == "static":
                await self._force_static_limit(rt)
            with contextlib.suppress(RedisDown):
                self._observe(rt, await self._call("status", rt.state.status()))
        self._tasks = [
            asyncio.create_task(self._pubsub_loop(), name="fg-pubsub"),
            asyncio.create_task(self._renew_loop(), name="fg-renew"),
            asyncio.create_task(self._poll_loop(), name="fg-poll"),
        ]

    async def stop(self) -> None:
        """Processor shutdown: wake every waiter (they reject), return every held permit."""
        self._closing = True
        for fut in list(self._waiters.values()):
            fut.cancel()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for rt in self.pools.values():
            if rt.held:
                with contextlib.suppress(RedisDown):
                    await self._call("release", rt.state.release(*rt.held))
                rt.held.clear()
        if self._background:
            await asyncio.wait(self._background, timeout=2)

    def spawn(self, coro: Coroutine[Any, Any, object]) -> None:
        """Run a coroutine that must finish even if the request that started it is cancelled."""
        task: asyncio.Task[object] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---------------------------------------------------------------- redis plumbing

    async def _call(self, op: str, coro: Awaitable[T]) -> T:
        timeout = self.cfg.redis.op_timeout_s * 2
        try:
            async with asyncio.timeout(timeout):  # no extra task per call, unlike wait_for
                return await coro
        except (RedisError, OSError, TimeoutError) as exc:
            self.metrics.redis_errors.labels(op).inc()
            self._enter_degraded(f"{op}: {type(exc).__name__}: {exc}")
            raise RedisDown(op) from exc

    def _enter_degraded(self, why: str) -> None:
        if self.degraded:
            return
        self.degraded = True
        self.metrics.degraded.set(1)
        self.metrics.degraded_transitions.inc()
        for rt in self.pools.values():
            # Idle credits are leases in an unreachable Redis: forget them, they expire there.
            rt.held.difference_update(rt.credits)
            rt.credits.clear()
            rt.queue_clear = False
            share = rt.local_share()[0]
            self._resolve_local(rt, rt.local.set_limit(share, self.clock()))
        log.warning("redis unreachable (%s): degraded to local limits %s", why,
                    {n: rt.local.limit for n, rt in self.pools.items()})
        # Waiters on the shared queue cannot be granted any more: move them to the local one.
        for ticket, fut in list(self._waiters.items()):
            if not fut.done() and not ticket.startswith("L"):
                fut.set_exception(RedisDown("degraded"))

    def _leave_degraded(self) -> None:
        if not self.degraded:
            return
        self.degraded = False
        self.metrics.degraded.set(0)
        log.warning("redis reachable again: shared admission state resumed")

    def _observe(self, rt: _PoolRuntime, st: PoolStatus) -> None:
        if st.partial:
            return
        rt.queue_clear = st.queued_total == 0
        if not rt.queue_clear:
            self._return_credits(rt)
        rt.last_status = st

    def _return_credits(self, rt: _PoolRuntime) -> None:
        """Something waits: idle credits go back so the grant loop can hand them out."""
        if not rt.credits:
            return
        tickets, rt.credits = rt.credits, []
        rt.held.difference_update(tickets)
        if not self.degraded:
            self.spawn(self._quietly(rt.state.return_credits(*tickets), "return_credits"))

    async def _quietly(self, coro: Awaitable[object], op: str) -> None:
        with contextlib.suppress(RedisDown):
            await self._call(op, coro)

    def _publish_gauges(self) -> None:
        """Gauges from the last seen status, once a second rather than on every request."""
        for rt in self.pools.values():
            st, name = rt.last_status, rt.cfg.name
            self.metrics.local_inflight.labels(name).set(len(rt.held) - len(rt.credits) + len(rt.local_held))
            if st is None:
                continue
            self.metrics.limit.labels(name).set(st.limit)
            for c in range(3):
                self.metrics.queue_depth.labels(name, PRIORITY_LABELS[c]).set(st.queued[c])
                self.metrics.inflight.labels(name, PRIORITY_LABELS[c]).set(st.inflight[c])

    @staticmethod
    def _snapshot(st: PoolStatus) -> Snapshot:
        return Snapshot(st.limit, st.inflight, st.queued, st.tenant_queued, st.grant_rate, st.class_rate)

    # ---------------------------------------------------------------- admission

    async def admit(self, pool: str, priority: int, tenant: str) -> Permit | Reject:
        rt = self.pools[pool]
        started = self.clock()
        deadline = started + rt.cfg.classes[priority].queue_timeout_s
        result: Permit | Reject | None = None
        if rt.credits and rt.queue_clear and not self.degraded:
            # Fast path: a credit is a lease this process already holds; no round trip.
            result = Permit(pool, rt.credits.pop(), priority, "redis", 0.0, started, credit=True)
            rt.credit_uses += 1
        elif not self.degraded:
            with contextlib.suppress(RedisDown):
                result = await self._admit_shared(rt, priority, tenant, started, deadline)
        if result is None:
            result = await self._admit_local(rt, priority, tenant, started, deadline)
        if isinstance(result, Permit):
            result = await self._routed(rt, result)
        self._count(rt, priority, result)
        return result

    def _count(self, rt: _PoolRuntime, priority: int, result: Permit | Reject) -> None:
        # Label lookups cost more than the increments: keep the children.
        label = PRIORITY_LABELS[priority]
        if isinstance(result, Permit):
            reason = "queued" if result.queued else "immediate"
            key = (rt.cfg.name, label, "admitted", reason)
            self.child(self.metrics.decisions, key).inc()
            self.child(self.metrics.queue_wait, (rt.cfg.name, label)).observe(result.queue_s)
        else:
            self.child(self.metrics.decisions, (rt.cfg.name, label, "rejected", result.reason)).inc()

    def child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _permit(self, rt: _PoolRuntime, ticket: str, priority: int, backend: str, started: float,
                endpoint: str = "", queued: bool = False) -> Permit:
        now = self.clock()
        (rt.held if backend == "redis" else rt.local_held).add(ticket)
        return Permit(rt.cfg.name, ticket, priority, backend, now - started, now, endpoint, queued)

    def _no_endpoints(self, rt: _PoolRuntime, priority: int) -> Reject:
        c = rt.cfg.classes[priority]
        return Reject("no_endpoints", retry_after(None, c, self.cfg.admission, self.rng()), status=503)

    async def _routed(self, rt: _PoolRuntime, permit: Permit) -> Permit | Reject:
        """With endpoint picking, a permit without an endpoint (none active) is given back."""
        if rt.cfg.endpoint_picking and not permit.endpoint:
            await self.release(permit, "no_endpoints")
            return self._no_endpoints(rt, permit.priority)
        return permit

    async def _admit_shared(self, rt: _PoolRuntime, priority: int, tenant: str,
                            started: float, deadline: float) -> Permit | Reject | None:
        """None means Redis failed part-way: the caller continues on the local limiter."""
        ticket = f"{self.gateway_id}:{next(self._tickets)}"
        wanted = 0 if rt.cfg.endpoint_picking else max(0, rt.cfg.local_credits - len(rt.credits))
        st = await self._call("acquire", rt.state.acquire(ticket, self.gateway_id, priority, tenant, wanted))
        self._observe(rt, st)
        if st.granted:
            if st.credits:
                rt.held.update(st.credits)
                rt.credits.extend(st.credits)
                rt.queue_clear = True
            return self._permit(rt, ticket, priority, "redis", started, st.endpoint)
        if rt.cfg.endpoint_picking and st.active_endpoints == 0:
            return self._no_endpoints(rt, priority)
        decision = queue_decision(priority, self._snapshot(st), rt.cfg.classes, self.cfg.admission, self.rng())
        if isinstance(decision, Reject):
            return decision
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        self._waiter_pool[ticket] = rt.cfg.name
        try:
            remaining = max(0.001, deadline - self.clock())
            st = await self._call("enqueue", rt.state.enqueue(ticket, self.gateway_id, priority, tenant, remaining))
            self._observe(rt, st)
            if st.granted:
                return self._permit(rt, ticket, priority, "redis", started, st.endpoint, queued=True)
            try:
                endpoint = await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - self.clock()))
                return self._permit(rt, ticket, priority, "redis", started, endpoint, queued=True)
            except TimeoutError:
                pass
            except RedisDown:
                return None
            # Timed out: remove ourselves atomically; we may have been granted in the meantime.
            outcome = await self._call("cancel", rt.state.cancel(ticket))
            if outcome == 1:
                granted = await self._call("mine", rt.state.granted_among([ticket]))
                return self._permit(rt, ticket, priority, "redis", started, granted.get(ticket, ""), queued=True)
            return timeout_reject(priority, self._snapshot(st), rt.cfg.classes, self.cfg.admission, self.rng())
        except asyncio.CancelledError:
            # Client went away while queued (or shutdown): leave the queue, or hand back a
            # permit granted in the race, in a task the cancellation cannot interrupt.
            self.spawn(self._abandon(rt, ticket))
            raise
        finally:
            self._waiters.pop(ticket, None)
            self._waiter_pool.pop(ticket, None)

    async def _abandon(self, rt: _PoolRuntime, ticket: str) -> None:
        with contextlib.suppress(RedisDown):
            outcome = await self._call("cancel", rt.state.cancel(ticket))
            if outcome == 1:
                await self._call("release", rt.state.release(ticket))
                self.metrics.releases.labels(rt.cfg.name, "abandoned_grant").inc()

    async def _admit_local(self, rt: _PoolRuntime, priority: int, tenant: str,
                           started: float, deadline: float) -> Permit | Reject:
        ticket = f"L{self.gateway_id}:{next(self._tickets)}"
        now = self.clock()
        if rt.local.try_acquire(ticket, priority, now):
            return self._local_permit(rt, ticket, priority, started)
        snap = rt.local.snapshot(priority, tenant, rt.local_share()[1])
        decision = queue_decision(priority, snap, rt.cfg.classes, self.cfg.admission, self.rng())
        if isinstance(decision, Reject):
            return decision
        assert isinstance(decision, Enqueue)
        if deadline <= now:
            return timeout_reject(priority, snap, rt.cfg.classes, self.cfg.admission, self.rng())
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = fut
        try:
            self._resolve_local(rt, rt.local.enqueue(ticket, priority, tenant, deadline, now))
            try:
                await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - self.clock()))
                return self._local_permit(rt, ticket, priority, started, queued=True)
            except TimeoutError:
                if rt.local.cancel(ticket) == 1:
                    return self._local_permit(rt, ticket, priority, started, queued=True)
                return timeout_reject(priority, snap, rt.cfg.classes, self.cfg.admission, self.rng())
        except asyncio.CancelledError:
            if rt.local.cancel(ticket) == 1:
                self._resolve_local(rt, rt.local.release(ticket, self.clock())[1])
            raise
        finally:
            self._waiters.pop(ticket, None)

    def _local_permit(self, rt: _PoolRuntime, ticket: str, priority: int, started: float,
                      queued: bool = False) -> Permit:
        endpoint = ""
        if rt.cfg.endpoint_picking and rt.active_endpoints:
            # Degraded picking: least of this process's own requests, from the last seen registry.
            load = {ep: 0 for ep in rt.active_endpoints}
            for ep in rt.local_endpoints.values():
                if ep in load:
                    load[ep] += 1
            endpoint = min(rt.active_endpoints, key=lambda ep: load[ep])
            rt.local_endpoints[ticket] = endpoint
        return self._permit(rt, ticket, priority, "local", started, endpoint, queued)

    def any_active_endpoint(self, pool: str) -> str | None:
        """An active endpoint for a request that is routed without admission (e.g. /v1/models)."""
        eps = self.pools[pool].active_endpoints
        return eps[int(self.rng() * len(eps)) % len(eps)] if eps else None

    def _resolve_local(self, rt: _PoolRuntime, granted: list[str]) -> None:
        for t in granted:
            fut = self._waiters.get(t)
            if fut is not None and not fut.done():
                fut.set_result("")
            elif fut is None:
                # Granted to a waiter that already left: give the permit straight back.
                self._resolve_local(rt, rt.local.release(t, self.clock())[1])

    # ---------------------------------------------------------------- release

    async def release(self, permit: Permit, reason: str = "completed") -> None:
        """Return the permit. Safe to call more than once; only the first call counts."""
        pending = self._release(permit, reason)
        if pending is not None:
            await pending

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
        if permit.backend == "local":
            rt.local_held.discard(permit.ticket)
            rt.local_endpoints.pop(permit.ticket, None)
            self._resolve_local(rt, rt.local.release(permit.ticket, self.clock())[1])
            return None
        if permit.credit and rt.queue_clear and not self.degraded and len(rt.credits) < rt.cfg.local_credits:
            rt.credits.append(permit.ticket)  # back to the local pool: the lease stays held
            return None
        # Stop renewing first: if Redis is down now, the lease simply expires. Releases that
        # arrive in the same event-loop turn share one script call.
        rt.held.discard(permit.ticket)
        rt.pending_release.append(permit.ticket)
        return self._flush_releases(rt) if len(rt.pending_release) == 1 else None

    async def _flush_releases(self, rt: _PoolRuntime) -> None:
        await asyncio.sleep(0)
        tickets, rt.pending_release = rt.pending_release, []
        with contextlib.suppress(RedisDown):
            await self._call("release", rt.state.release(*tickets))

    # ---------------------------------------------------------------- latency feedback

    def observe_latency(self, pool: str, rtt: float | None, dropped: bool = False) -> None:
        """Feed one request's measured latency (or a drop) to the pool's Vegas window."""
        rt = self.pools[pool]
        if rt.cfg.limit.mode != "vegas":
            return
        now = self.clock()
        rt.window.add(now, rtt, rt.inflight_seen(), dropped)
        if rt.window.ready(now):
            sample = rt.window.take()
            if sample is not None and not self.degraded:
                self.spawn(self._apply_sample(rt, sample))

    async def _apply_sample(self, rt: _PoolRuntime, sample: Sample) -> None:
        with contextlib.suppress(RedisDown):
            for _ in range(5):  # compare-and-set; another gateway may win the race
                rec = await self._call("get_limit", rt.state.get_limit())
                new = rt.vegas.update(rec.state, sample, self.rng())
                if new == rec.state:
                    return
                if await self._call("set_limit", rt.state.set_limit(rec.version, new)):
                    self.metrics.limit_updates.labels(rt.cfg.name).inc()
                    self.metrics.limit.labels(rt.cfg.name).set(max(1, int(new.limit)))
                    return

    async def _force_static_limit(self, rt: _PoolRuntime) -> None:
        with contextlib.suppress(RedisDown):
            for _ in range(5):
                rec = await self._call("get_limit", rt.state.get_limit())
                st = rt.vegas.initial(rt.cfg.limit.initial)
                if await self._call("set_limit", rt.state.set_limit(rec.version, st)):
                    return

    # ---------------------------------------------------------------- background loops

    async def _pubsub_loop(self) -> None:
        channel = gateway_channel(self.gateway_id)
        while not self._closing:
            pubsub = self.pubsub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                while not self._closing:
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        data = msg["data"].decode() if isinstance(msg["data"], bytes) else str(msg["data"])
                        pool, ticket, endpoint = [*data.split("|", 2), "", ""][:3]
                        if ticket == "!return":  # a queue formed somewhere: stop using credits
                            if pool in self.pools:
                                self.pools[pool].queue_clear = False
                                self._return_credits(self.pools[pool])
                            continue
                        fut = self._waiters.get(ticket)
                        if fut is not None and not fut.done():
                            fut.set_result(endpoint)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.debug("pubsub connection lost: %s", exc)
                await asyncio.sleep(self.cfg.redis.reconnect_interval_s)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _poll_loop(self) -> None:
        """Fallback for lost grant messages; also drives reclaim when traffic is idle."""
        while not self._closing:
            await asyncio.sleep(self.cfg.redis.poll_interval_s)
            if self.degraded:
                continue
            by_pool: dict[str, list[str]] = {}
            for ticket, pool in list(self._waiter_pool.items()):
                by_pool.setdefault(pool, []).append(ticket)
            for pool, tickets in by_pool.items():
                with contextlib.suppress(RedisDown):
                    granted = await self._call("mine", self.pools[pool].state.granted_among(tickets))
                    for t, endpoint in granted.items():
                        fut = self._waiters.get(t)
                        if fut is not None and not fut.done():
                            fut.set_result(endpoint)

    async def _renew_loop(self) -> None:
        interval = self.cfg.redis.lease_ttl_s / 3
        last_renew = 0.0
        while not self._closing:
            if self.degraded:
                await asyncio.sleep(self.cfg.redis.reconnect_interval_s)
                try:
                    async with asyncio.timeout(self.cfg.redis.op_timeout_s * 2):
                        await self.client.ping()
                except (RedisError, OSError, TimeoutError):
                    continue
                self._leave_degraded()
                last_renew = 0.0
                continue
            now = self.clock()
            renew = now - last_renew >= interval
            if renew:
                last_renew = now
            for rt in self.pools.values():
                with contextlib.suppress(RedisDown):
                    if renew:
                        lost = await self._call("renew", rt.state.renew(self.gateway_id, sorted(rt.held)))
                        for t in lost:
                            rt.held.discard(t)
                            if t in rt.credits:
                                rt.credits.remove(t)
                            self.metrics.lost_leases.labels(rt.cfg.name).inc()
                            log.warning("lease %s expired before renewal (process stalled?)", t)
                    # Once a second: fresh gauges, live gateway count, and reclaim when idle.
                    self._observe(rt, await self._call("status", rt.state.status()))
                    if rt.credit_uses == 0:  # quiet for a tick: idle credits should not look busy
                        self._return_credits(rt)
                    rt.credit_uses = 0
                    if rt.cfg.endpoint_picking:
                        members = await self._call("registry", self.client.smembers(rt.state.keys[8]))
                        rt.active_endpoints = sorted(
                            m.decode() if isinstance(m, bytes) else str(m) for m in members)
            self._publish_gauges()
            await asyncio.sleep(1.0)
