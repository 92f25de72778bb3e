"""The two places a permit can come from, behind one interface.

`SharedBackend` admits through the pool's shared state in Redis (`state.py`, `leases.lua`);
`LocalBackend` admits from this process's own `PermitTable` while Redis is unreachable. Both
implement `admit(rt, req) -> Permit | Reject | None` (None: the admitter switched modes while
the request waited — continue on the other backend with the time left) and
`release(rt, permit)` (returns the Redis call still to make, if any). The admitter
(`admission.py`) owns the switch between them — per pool: a pool whose Redis (or Cluster
shard) fails runs locally while the other pools stay shared — and the permits they hand out;
a permit does not remember where it came from (on a switch, the new backend adopts every held
permit).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from floodgate.extproc.limit import Latency
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import (
    Enqueue,
    Reject,
    Snapshot,
    certain_reject,
    credit_admits,
    newcomer_wait,
    queue_decision,
    ramp_floors,
    ramp_refill_rate,
    retry_after,
    timeout_reject,
    waits_on_budget,
)
from floodgate.extproc.schema import PoolSettings, PoolStatus

if TYPE_CHECKING:
    from floodgate.extproc.admission import Admitter, PoolRuntime


class RedisDown(Exception):
    """A Redis call failed; never escapes the admitter."""


class Switched(Exception):
    """The admission mode changed while a request waited: it continues on the other backend."""


@dataclass
class Permit:
    pool: str
    ticket: str
    priority: int
    queue_s: float
    admitted_at: float
    endpoint: str = ""  # routed-to endpoint when the pool picks endpoints
    queued: bool = False  # waited in the queue (vs admitted by the first acquire)
    credit: bool = False  # admitted from a local credit (no Redis round trip)
    seq: int = 0  # the ticket's number (`sync` watermark)
    tokens: float | None = None  # prompt tokens its grant added to its endpoint's prefill estimate (None: pf_size)
    unprefilled: bool = False  # it ended unprefilled: prefill.unprefilled (set before its release)
    released: bool = False
    finished: bool = False  # its outcome went to the limit (finish)
    on_finish: Callable[[Permit, str, Latency | None], None] | None = field(default=None, repr=False, compare=False)

    def finish(self, outcome: str, latency: Latency | None = None) -> None:
        """The request is over: `success` (with its latency if measured), `dropped` (5xx) or
        `ignored`; feeds the pool's limit once (Netflix's limiter listener)."""
        if not self.finished and self.on_finish is not None:
            self.on_finish(self, outcome, latency)


@dataclass(frozen=True)
class Request:
    pool: str
    priority: int
    tenant: str
    started: float
    deadline: float
    tokens: float | None = None  # prompt tokens for the prefill estimate (None: the pool's pf_size)


@dataclass
class Waiter:
    """A request of this process waiting for a permit."""

    cls: int
    seq: int
    deadline: float
    tenant: str
    future: asyncio.Future[str]  # resolves to the routed endpoint
    enqueued: bool = False  # its enqueue ran: `sync` asserts it


class Backend(Protocol):
    async def admit(self, rt: PoolRuntime, req: Request) -> Permit | Reject | None: ...

    def release(self, rt: PoolRuntime, permit: Permit) -> Coroutine[Any, Any, None] | None: ...


Rates = tuple[float, float, float]


def _snapshot(st: PoolStatus, arrivals: tuple[Rates, Rates] | None = None,
              settings: PoolSettings | None = None, arriving: tuple[tuple[float, int], ...] = (),
              growth: float = 1.0, ahead: int | None = None) -> Snapshot:
    """`ahead`: the request's class's waiters ahead of it (None: the whole class queue);
    `arrivals`: (the arrival rates per class, the fast-reacting ones); `settings`: the
    pool's (the onset ramp's); `arriving`: the controller's capacity on its way (seconds,
    permits); `growth`: the active endpoints over their recent mean (`capacity_growth`)."""
    refill = 0.0
    if settings:
        _, floor = ramp_floors(st.active_endpoints, settings.ramp_min_burst, settings.ramp_min_rate,
                               settings.ramp_ep_burst, settings.ramp_ep_rate)
        refill = ramp_refill_rate(st.limit, settings.ramp_rate, floor)
    # Prefill-aware picking paces lower classes too while a P0 runs, until the endpoints'
    # prefill estimates drain: each active endpoint lets one paced request in per
    # `pf_size / pf_rate` seconds, from when its estimate is down to the pace level (the
    # script reports when the least one is, `pf_wait`, and the tokens above it, `pf_backlog`).
    prefill = settings is not None and settings.picking and settings.pf_rate > 0 and settings.pf_size > 0
    pf_rate = st.active_endpoints * settings.pf_rate / settings.pf_size if settings and prefill else 0.0
    paced = refill > 0 or prefill
    return Snapshot(st.limit, st.inflight, st.queued, st.tenant_queued, st.grant_rate, st.class_rate,
                    release_n=st.release_n, inflight_avg=st.inflight_avg, head_left=st.head_left,
                    tail_left=st.tail_left, arrival_rates=arrivals[0] if arrivals else None,
                    arrival_rates_fast=arrivals[1] if arrivals else None, ramp=paced, ramp_refill=refill,
                    arriving=arriving, pf_rate=pf_rate, pf_wait=st.pf_wait,
                    pf_backlog=st.pf_backlog / settings.pf_size if settings and prefill else 0.0,
                    capacity_growth=growth, ahead=ahead)


def local_ahead(st: PoolStatus, cls: int, tenant: str, fair: bool = True) -> int:
    """The fewest waiters of its class a new request can have ahead of it, by a snapshot of
    another request's call (a rejection without a round trip must hold wherever the fair order
    puts it, leases.lua `fair`): the tenant-less waiters go before a tenant-less request (one
    flow, in arrival order); a named tenant with no waiter goes right behind the head. With the
    fair order off (`fair`), every waiter is ahead of it."""
    if not fair:
        return st.queued[cls]
    if tenant:
        return 0
    named = st.named_queued[cls] if st.named_queued is not None else 0
    return max(0, st.queued[cls] - named)


SNAPSHOT_FRESH_S = 1.0  # a last seen snapshot this recent may decide a certain rejection


class SharedBackend:
    def __init__(self, admitter: Admitter) -> None:
        self.a = admitter

    def _arrivals(self, rt: PoolRuntime, st: PoolStatus) -> tuple[Rates, Rates]:
        """Pool-wide arrival rates per class (and the fast-reacting ones): this process's plus
        the other processors' as they shared them (PoolRuntime.arrival_rates)."""
        now = self.a.clock()
        return (rt.arrival_rates(now, st.live_gateways), rt.arrival_rates(now, st.live_gateways, fast=True))

    def _arriving(self, rt: PoolRuntime, st: PoolStatus) -> tuple[tuple[float, int], ...]:
        """The controller's capacity on its way, in permits at this snapshot's limit."""
        # The limit is sized on the endpoints serving (ejected ones left out), the snapshot
        # counts every active one.
        return rt.arriving_permits(self.a.clock(), st.limit, rt.endpoints_seen or st.active_endpoints)

    def _view(self, rt: PoolRuntime, st: PoolStatus, ahead: int | None = None) -> Snapshot:
        """The snapshot early drop decides on: `st` with this process's arrival rates, the
        controller's capacity on its way and the growth of the active endpoints; `ahead`: the
        request's class's waiters ahead of it (None: `st`'s own, from the call that asked)."""
        return _snapshot(st, self._arrivals(rt, st), rt.settings, self._arriving(rt, st),
                         rt.capacity_growth(self.a.clock()), st.ahead if ahead is None else ahead)

    async def admit(self, rt: PoolRuntime, req: Request) -> Permit | Reject | None:
        a, cls = self.a, req.priority
        last, age = rt.last_status, a.clock() - rt.last_status_at
        need = rt.min_chance(cls, a.clock())  # the chance early drop asks of it (its class's reject budget)
        # (No status seen yet: nothing known in flight, so only the class decides.)
        by_credit = credit_admits(cls, last.inflight if last is not None else (0, 0, 0), rt.settings.ramp_rate > 0)
        if rt.credits and rt.queue_clear and by_credit:
            # Fast path: a credit is a lease this process already holds; no round trip.
            ticket = rt.credits.pop()
            rt.credit_uses += 1
            return a.permit(rt, ticket, req, "", credit=True)
        # (the last snapshot answered another request: where this one would stand is bounded below)
        last_snap = self._view(rt, last, local_ahead(last, cls, req.tenant, rt.settings.fair)) if last is not None else None
        if last_snap is not None and age <= SNAPSHOT_FRESH_S:
            # The last snapshot may already prove this request cannot be granted in time
            # (even had the queues drained since): reject without a round trip.
            certain = certain_reject(cls, last_snap, rt.cfg.classes, a.cfg.admission, a.rng(), age_s=age,
                                     chance=need)
            if certain is not None:
                a.child(a.metrics.local_rejections, (rt.cfg.name, str(cls))).inc()
                return certain
        seq, ticket = a.new_ticket()
        # (no new credits for a request that could not use one: they would idle until recalled)
        wanted = 0 if rt.cfg.endpoint_picking or not by_credit else max(0, rt.cfg.local_credits - len(rt.credits))
        # One call per contended request: when the last snapshot showed a queue this request
        # would join, acquire and enqueue run as one script call (`admit`). The policy still
        # decides on the snapshot that call returns; a waiter it rejects is cancelled.
        one_call = last is not None and last_snap is not None and age <= SNAPSHOT_FRESH_S and \
            last.queued_total > 0 and isinstance(
                queue_decision(cls, last_snap, rt.cfg.classes, a.cfg.admission, 0.5,
                               named_tenant=bool(req.tenant), chance=need), Enqueue)
        w = Waiter(cls, seq, req.deadline, req.tenant, asyncio.get_running_loop().create_future())
        rt.pending[ticket] = seq
        try:
            if one_call:
                rt.waiting[ticket] = w  # from here a grant message may arrive
                remaining = max(0.001, req.deadline - a.clock())
                st = await a.call(rt, "admit", lambda: rt.state.admit(ticket, a.gateway_id, seq, cls, req.tenant,
                                                                  wanted, remaining, req.tokens))
            else:
                st = await a.call(rt, "acquire", lambda: rt.state.acquire(ticket, a.gateway_id, seq, cls, req.tenant,
                                                                      wanted, req.tokens))
        except RedisDown:
            rt.waiting.pop(ticket, None)  # a waiter queued by a call whose reply was lost: the next sync drops it
            return None
        except asyncio.CancelledError:
            # The client went away with the call in the air: leave the queue, or hand back a
            # permit the call granted (a plain acquire's too: left, it held a permit until its
            # lease expired, lease_ttl_s later; a review).
            rt.waiting.pop(ticket, None)
            a.spawn(self._abandon(rt, ticket, credits=wanted))
            raise
        finally:
            rt.pending.pop(ticket, None)
        # The state to remember is the one after the call: `admit` reports the queue before this
        # request joined it (what the policy decides on), so count the request in (as the
        # enqueue reply did), or a queue it formed would look clear and credits would be used.
        a.observe(rt, replace(st, queued=tuple(q + (k == cls) for k, q in enumerate(st.queued)))  # type: ignore[arg-type]
                  if st.enqueued else st)
        if st.granted:
            rt.waiting.pop(ticket, None)
            if st.credits:
                rt.credits.extend(st.credits)
                rt.queue_clear = True
            return a.permit(rt, ticket, req, st.endpoint)
        decision: Enqueue | Reject
        on_budget = False  # waits on its class's slow-rejection budget (policy.waits_on_budget)
        if rt.cfg.endpoint_picking and st.active_endpoints == 0:
            if rt.picker.active and await a.registry_gone(rt):
                # Redis lost the registry (restarted empty) since this process last read it: on
                # local limits with the endpoints last seen (admission._lose_registry), this
                # request too, instead of 503 until the next registry read notices.
                if st.enqueued:
                    rt.waiting.pop(ticket, None)
                    a.spawn(self._abandon(rt, ticket))
                return None
            decision = a.no_endpoints(rt, cls)
        else:
            view = self._view(rt, st)
            decision = queue_decision(cls, view, rt.cfg.classes, a.cfg.admission, a.rng(),
                                      named_tenant=bool(req.tenant), chance=need)
            on_budget = isinstance(decision, Enqueue) and waits_on_budget(
                cls, view, rt.cfg.classes, a.cfg.admission, need, named_tenant=bool(req.tenant))
        if isinstance(decision, Reject):
            if st.enqueued:
                rt.waiting.pop(ticket, None)
                a.spawn(self._abandon(rt, ticket))
            return decision
        rt.waiting[ticket] = w
        outcome = "gone"  # the budget wait's end, for its metric: served, timed out, or gone
        if on_budget:
            rt.budget_waiting[cls] += 1
        try:
            if not st.enqueued and not st.rejected:
                rt.pending[ticket] = seq
                try:
                    remaining = max(0.001, req.deadline - a.clock())
                    st = await a.call(rt, "enqueue", lambda: rt.state.enqueue(ticket, a.gateway_id, seq, cls, req.tenant,
                                                                          remaining, req.tokens))
                except RedisDown:
                    return None
                finally:
                    rt.pending.pop(ticket, None)
                a.observe(rt, st)
            if st.rejected:
                # The queue filled while the call was in the air: told from the state it found
                # (a full queue, or the tenant's cap: the wait itself, `policy.queue_decision`).
                c = rt.cfg.classes[cls]
                wait = newcomer_wait(cls, self._view(rt, st), rt.cfg.classes, need)
                return Reject(st.rejected, retry_after(wait, c, a.cfg.admission, a.rng()))
            a.count(rt, cls, "queued")
            if st.granted:
                outcome = "served"
                return a.permit(rt, ticket, req, st.endpoint, queued=True)
            w.enqueued = True
            try:
                endpoint = await asyncio.wait_for(asyncio.shield(w.future), max(0.0, req.deadline - a.clock()))
                outcome = "served"
                return a.permit(rt, ticket, req, endpoint, queued=True)
            except TimeoutError:
                pass
            except Switched:
                return None
            # Timed out: remove ourselves atomically; we may have been granted in the meantime.
            try:
                if await a.call(rt, "cancel", lambda: rt.state.cancel(ticket)) == 1:
                    # Granted in the race, if its lease still runs: `mine` reclaims expired
                    # leases first (a grant this process read too late, after a stall, is one
                    # Redis has taken back: started, it ran without a permit).
                    granted = await a.call(rt, "mine", lambda: rt.state.granted_among([ticket]))
                    if ticket in granted:
                        outcome = "served"
                        return a.permit(rt, ticket, req, granted[ticket], queued=True)
            except RedisDown:
                pass  # the queue entry goes with the next sync
            outcome = "timed_out"
            # Retry-After from the freshest state seen (the status loop's), not from enqueue time.
            fresh = rt.last_status or st
            return timeout_reject(cls, _snapshot(fresh, self._arrivals(rt, fresh), rt.settings), rt.cfg.classes,
                                  a.cfg.admission, a.rng())
        except asyncio.CancelledError:
            # Client went away while queued (or shutdown): leave the queue, or hand back a
            # permit granted in the race, in a task the cancellation cannot interrupt.
            a.count(rt, cls, "abandoned")
            a.spawn(self._abandon(rt, ticket))
            raise
        finally:
            rt.waiting.pop(ticket, None)
            if on_budget:
                rt.budget_waiting[cls] -= 1
                a.child(a.metrics.budget_waits, (rt.cfg.name, str(cls), outcome)).inc()

    async def _abandon(self, rt: PoolRuntime, ticket: str, credits: int = 0) -> None:
        """Leave the queue, or hand back the permit granted meanwhile. `credits`: the call in
        the air asked for that many local credits, which a grant leased as `<ticket>:c<i>`
        (leases.lua `try_lease`) and nobody will use: handed back too (not as completions), or
        they stayed leased until the next renewal dropped them."""
        a = self.a
        try:
            if await a.call(rt, "cancel", lambda: rt.state.cancel(ticket)) == 1:
                await a.call(rt, "release", lambda: rt.state.release(ticket))
                a.metrics.releases.labels(rt.cfg.name, "abandoned_grant").inc()
                if credits:
                    await a.call(rt, "return_credits", lambda: rt.state.return_credits(
                        *(f"{ticket}:c{i}" for i in range(1, credits + 1))))
        except RedisDown:
            pass  # the next sync drops what this gateway no longer asserts

    def release(self, rt: PoolRuntime, permit: Permit) -> Coroutine[Any, Any, None] | None:
        if permit.credit and rt.queue_clear and len(rt.credits) < rt.cfg.local_credits:
            rt.credits.append(permit.ticket)  # back to the local pool: the lease stays held
            # A completion Redis does not see: reported with the next status tick (`credit_done`)
            rt.credit_done += 1
            return None
        # Releases that arrive in the same event-loop turn share one script call.
        rt.pending_release.append(permit.ticket)
        refund = self._refund(rt, permit)
        if refund > 0:
            rt.pending_refund.append((permit.endpoint, refund))
        return self._flush(rt) if len(rt.pending_release) == 1 else None

    @staticmethod
    def _refund(rt: PoolRuntime, permit: Permit) -> float:
        """The prompt tokens a request that ended unprefilled takes out of its endpoint's
        estimate: the size its grant added (0 when the pool does not estimate prefill)."""
        cfg = rt.cfg
        if not (permit.unprefilled and permit.endpoint and cfg.endpoint_picking and cfg.prefill_tokens_per_s > 0):
            return 0.0
        return cfg.prefill_request_tokens if permit.tokens is None else permit.tokens

    async def _flush(self, rt: PoolRuntime) -> None:
        await asyncio.sleep(0)
        tickets, rt.pending_release = rt.pending_release, []
        refunds, rt.pending_refund = rt.pending_refund, []
        # The refunds go first, in the same batch (state.PoolState sends what one event-loop
        # turn queued as one call, in order): the release's grant loop sees the estimate they
        # lowered.
        calls = [self.a.call(rt, "refund", partial(rt.state.refund, ep, n)) for ep, n in refunds]
        calls.append(self.a.call(rt, "release", lambda: rt.state.release(*tickets)))
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, BaseException) and not isinstance(r, RedisDown):
                raise r
            # RedisDown: not renewed any more: the leases expire, or the next sync drops them


class LocalBackend:
    """Admission from this process's share of the limit while Redis is unreachable."""

    def __init__(self, admitter: Admitter) -> None:
        self.a = admitter

    @staticmethod
    def table(rt: PoolRuntime, limit: int) -> PermitTable:
        s = rt.settings
        return PermitTable(limit=limit, shares=s.shares, always=s.always, headroom=s.headroom, max_queue=s.max_queue,
                           tenant_cap=s.tenant_cap, ttl=math.inf, fair=s.fair)

    async def admit(self, rt: PoolRuntime, req: Request) -> Permit | Reject | None:
        a, cls = self.a, req.priority
        seq, ticket = a.new_ticket()
        now = a.clock()
        if self._held_back(rt):
            # Redis is back and a processor that switched already admits from it, counting of
            # this process only the leases its last reconcile asserted (its local budget while
            # degraded; the permits held once the switch's call is sent), or only the permits
            # a failed switch asserted if it landed after all: more would overshoot L. Wait
            # for the switch instead (or for Redis to fail again).
            return await self._await_switch(rt, req, seq, ticket)
        if rt.local.try_acquire(ticket, cls, now):
            return self._permit(rt, ticket, req)
        last = rt.last_status
        snap = rt.local.snapshot(cls, req.tenant, a.local_rate(rt), now=now,
                                 release_n=last.release_n if last else 0,
                                 inflight_avg=(last.inflight_avg * rt.local.limit / max(1, last.limit)) if last else 0.0,
                                 arrival_rates=rt.own_arrival_rates(now),  # its own queue: its own arrivals
                                 arrival_rates_fast=rt.own_arrival_rates(now, fast=True))
        decision = queue_decision(cls, snap, rt.cfg.classes, a.cfg.admission, a.rng(), named_tenant=bool(req.tenant),
                                  chance=rt.min_chance(cls, now))
        if isinstance(decision, Reject):
            return decision
        if req.deadline <= now:
            return timeout_reject(cls, snap, rt.cfg.classes, a.cfg.admission, a.rng())
        w = Waiter(cls, seq, req.deadline, req.tenant, asyncio.get_running_loop().create_future())
        rt.local_waiting[ticket] = w
        table = rt.local
        try:
            outcome, granted = table.enqueue(ticket, cls, req.tenant, req.deadline, now)
            self.wake(rt, granted)
            if outcome in ("queue_full", "tenant_cap"):
                # Told from the table as it is (the wait of a request arriving now), as the
                # shared path tells it, not the class timeout.
                wait = newcomer_wait(cls, snap, rt.cfg.classes, rt.min_chance(cls, now))
                return Reject(outcome, retry_after(wait, rt.cfg.classes[cls], a.cfg.admission, a.rng()))
            a.count(rt, cls, "queued")
            if outcome == "granted":
                return self._permit(rt, ticket, req, queued=True)
            try:
                await asyncio.wait_for(asyncio.shield(w.future), max(0.0, req.deadline - a.clock()))
                return self._permit(rt, ticket, req, queued=True)
            except TimeoutError:
                if table.cancel(ticket) == 1:
                    return self._permit(rt, ticket, req, queued=True)
                fresh = table.snapshot(cls, req.tenant, a.local_rate(rt), now=a.clock())
                return timeout_reject(cls, fresh, rt.cfg.classes, a.cfg.admission, a.rng())
            except Switched:
                return None  # shared state is back: this table is gone, queue there
        except asyncio.CancelledError:
            a.count(rt, cls, "abandoned")
            if table.cancel(ticket) == 1:
                self.wake(rt, table.release(ticket, a.clock())[1])
            raise
        finally:
            rt.local_waiting.pop(ticket, None)

    def _held_back(self, rt: PoolRuntime) -> bool:
        """May this process admit no more locally than Redis is sure to count of it?"""
        if rt.back_since is not None and len(rt.held) >= rt.asserted:
            return True
        return rt.unsure_cap is not None and self.a.clock() < rt.unsure_until and len(rt.held) >= rt.unsure_cap

    async def _await_switch(self, rt: PoolRuntime, req: Request, seq: int, ticket: str) -> Permit | Reject | None:
        """Wait, outside the local table, until the pool switches back to shared admission
        (None: continue there), the reconcile fails again (admit locally after all), or the
        deadline passes."""
        a, cls = self.a, req.priority
        w = Waiter(cls, seq, req.deadline, req.tenant, asyncio.get_running_loop().create_future())
        rt.local_waiting[ticket] = w
        try:
            while True:
                left = req.deadline - a.clock()
                if left <= 0:
                    snap = rt.local.snapshot(cls, req.tenant, a.local_rate(rt), now=a.clock())
                    return timeout_reject(cls, snap, rt.cfg.classes, a.cfg.admission, a.rng())
                try:
                    await asyncio.wait_for(asyncio.shield(w.future), min(left, a.cfg.redis.reconnect_interval_s))
                except TimeoutError:
                    pass
                except Switched:
                    return None
                if not rt.degraded:
                    return None
                if not self._held_back(rt):
                    break
        finally:
            rt.local_waiting.pop(ticket, None)
        return await self.admit(rt, req)

    def _permit(self, rt: PoolRuntime, ticket: str, req: Request, queued: bool = False) -> Permit:
        endpoint = rt.picker.pick_local((p.endpoint for p in rt.held.values()), rt.ejector.avoid(self.a.clock()))
        return self.a.permit(rt, ticket, req, endpoint, queued=queued)

    def wake(self, rt: PoolRuntime, granted: list[str]) -> None:
        for t in granted:
            w = rt.local_waiting.get(t)
            if w is not None and not w.future.done():
                w.future.set_result("")
            else:
                # Granted to a waiter that already left: give the permit straight back.
                self.wake(rt, rt.local.release(t, self.a.clock())[1])

    def release(self, rt: PoolRuntime, permit: Permit) -> Coroutine[Any, Any, None] | None:
        self.wake(rt, rt.local.release(permit.ticket, self.a.clock())[1])
        return None
