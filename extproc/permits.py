"""An in-memory permit table with the semantics of `leases.lua` (pure, `now` passed in).

Two uses: the local limiter while Redis is unreachable (one gateway, leases that never
expire), and the reference model the Lua script is checked against on random histories
(tests/test_state.py): several gateways, lease expiry, waiter deadlines, dead gateways,
reclaim, tenant counts and caps, credits and `sync`. Time is in whatever unit the caller
uses (the differential test uses the script's milliseconds). Grant-rate bookkeeping and
endpoint picking are not modelled.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from floodgate.extproc.policy import (
    CLASSES,
    RAMP_MIN_BURST,
    Snapshot,
    eligible,
    ramp_burst,
    ramp_floors,
    ramp_paces,
    ramp_refill,
    ramp_refill_rate,
)


@dataclass
class Lease:
    cls: int
    gateway: str
    seq: int
    expiry: float
    endpoint: str = ""


@dataclass
class Waiter:
    ticket: str
    cls: int
    deadline: float
    gateway: str
    seq: int
    tenant: str
    tag: int = 0  # its place in the class's fair order (leases.lua `fair`): the flow's start tag
    arrival: int = 0  # ties of `tag` go by arrival


class Pacer(Protocol):
    """A pacing hook for models of other grant rules (bench/p0_onset.py); the shipped code sets
    none. `open` False: a waiter of class `cls` at the head of its queue is not granted now (it
    stays queued and the grant loop tries the next class), and an arrival of that class is not
    admitted at once; `head_deadline` is the head waiter's deadline (None for an arrival).
    `granted` is told of every permit the table hands out, with in-flight before it."""

    def open(self, cls: int, now: float, inflight: Sequence[int], limit: int,
             head_deadline: float | None) -> bool: ...

    def granted(self, cls: int, now: float, inflight: Sequence[int], limit: int) -> None: ...


@dataclass
class PermitTable:
    limit: int
    shares: tuple[float, float, float]
    always: tuple[bool, bool, bool] = (False, False, False)  # reservations kept without waiters
    headroom: tuple[float, float, float] = (0.0, 0.0, 0.0)  # kept free for the classes above
    max_queue: tuple[int, int, int] = (10**9, 10**9, 10**9)
    tenant_cap: tuple[int, int, int] = (10**9, 10**9, 10**9)
    # The onset ramp (policy.ramp_refill): shares of the limit, the rate per unit of the caller's
    # clock; ramp_rate 0 = off. `tokens` None = a full bucket (never used).
    ramp_burst: float = 0.0
    ramp_rate: float = 0.0
    ramp_min_rate: float = 0.0  # tokens per unit of the caller's clock at least (policy.RAMP_MIN_RATE_S)
    ramp_min_burst: float = RAMP_MIN_BURST
    # per active endpoint (policy.ramp_floors; the rate per unit of the caller's clock), and the
    # active endpoints (leases.lua counts the registry's active set; 0 here: the floors above)
    ramp_ep_burst: float = 0.0
    ramp_ep_rate: float = 0.0
    endpoints: int = 0
    tokens: float | None = None
    tokens_ts: float = 0.0
    # New endpoints' credit beside the bucket (set_limit's `credit`; leases.lua `ramp_extra`):
    # tokens taken first, never given back, gone at `extra_until` (the caller's clock).
    extra: float = 0.0
    extra_until: float = -math.inf
    ttl: float = math.inf  # lease and gateway-liveness lifetime
    waiter_grace: float = 0.0  # a waiter past its deadline is reaped this much later
    leases: dict[str, Lease] = field(default_factory=dict)
    queues: tuple[list[Waiter], list[Waiter], list[Waiter]] = field(default_factory=lambda: ([], [], []))
    gateways: dict[str, float] = field(default_factory=dict)  # gateway -> liveness expiry
    creditors: set[str] = field(default_factory=set)
    pacer: Pacer | None = None  # models only: see Pacer
    # The fair order within each class (leases.lua `fair`: start-time fair queueing over
    # tenants, the tenant-less requests one flow): per class the tag of the waiter granted
    # last, the tenant-less flow's next tag, and each named tenant's next tag while it waits.
    vtime: list[int] = field(default_factory=lambda: [0, 0, 0])
    anon_next: list[int] = field(default_factory=lambda: [0, 0, 0])
    flow_next: dict[tuple[int, str], int] = field(default_factory=dict)
    arrivals: int = 0
    fair: bool = True  # off: every waiter in the tenant-less flow (arrival order)

    # ------------------------------------------------------------------ reads

    @property
    def held(self) -> dict[str, int]:
        return {t: lease.cls for t, lease in self.leases.items()}

    def inflight(self) -> tuple[int, int, int]:
        counts = [0, 0, 0]
        for lease in self.leases.values():
            counts[lease.cls] += 1
        return counts[0], counts[1], counts[2]

    def queued(self) -> list[int]:
        return [len(q) for q in self.queues]

    def tenant_queued(self, cls: int, tenant: str) -> int:
        return sum(1 for w in self.queues[cls] if w.tenant == tenant)

    def waiting(self) -> set[str]:
        return {w.ticket for q in self.queues for w in q}

    def _flow(self, tenant: str) -> str:
        return tenant if self.fair else ""

    def _next_tag(self, cls: int, tenant: str) -> int:
        tenant = self._flow(tenant)
        nxt = self.flow_next.get((cls, tenant), 0) if tenant else self.anon_next[cls]
        return max(self.vtime[cls] + 1, nxt)  # (leases.lua `next_tag`: at the earliest, the next round)

    def ahead(self, cls: int, tenant: str) -> int:
        """Waiters of `cls` a new request of `tenant` counts ahead of it (leases.lua
        `snapshot`): the ones whose tag is at most its own, or, for a flow with waiters, its
        waiters times the flows waiting (later arrivals of flows with fewer pass it), at most
        the whole queue."""
        q = self.queues[cls]
        if not self.fair:
            return len(q)
        tag = self._next_tag(cls, tenant)
        place = sum(1 for w in q if w.tag <= tag)
        own = sum(1 for w in q if w.tenant == tenant)
        return max(place, min(len(q), own * len({w.tenant for w in q})))

    def _put(self, w: Waiter) -> None:
        """Queue `w` at its flow's tag (fair order; one flow alone: arrival order)."""
        tag = self._next_tag(w.cls, w.tenant)
        if self._flow(w.tenant):
            self.flow_next[(w.cls, w.tenant)] = tag + 1
        else:
            self.anon_next[w.cls] = tag + 1
        self.arrivals += 1
        w.tag, w.arrival = tag, self.arrivals
        bisect.insort(self.queues[w.cls], w, key=lambda x: (x.tag, x.arrival))

    def _left(self, w: Waiter) -> None:
        """`w` left its queue (granted, cancelled, reaped): a flow with no waiter left starts
        afresh (a named tenant's next tag goes; the tenant-less flow's comes back to now)."""
        q = self.queues[w.cls]
        if self._flow(w.tenant):
            if not any(x.tenant == w.tenant for x in q):
                self.flow_next.pop((w.cls, w.tenant), None)
        elif not any(not self._flow(x.tenant) for x in q):
            self.anon_next[w.cls] = min(self.anon_next[w.cls], self.vtime[w.cls])

    def forget_order(self) -> None:
        """The shared state was lost (Redis restarted empty): the fair order starts again."""
        self.vtime, self.anon_next, self.flow_next = [0, 0, 0], [0, 0, 0], {}

    def snapshot(self, cls: int, tenant: str, grant_rate: float, *, now: float | None = None,
                 release_n: int = 0, inflight_avg: float = 0.0,
                 arrival_rates: tuple[float, float, float] | None = None,
                 arrival_rates_fast: tuple[float, float, float] | None = None,
                 class_rates: tuple[float, float, float] | None = None) -> Snapshot:
        """The policy's view of this table; with `now`, the head/tail deadlines of each queue.
        The rates are the caller's (the processor's estimators, or a model's fake-clock ones)."""
        q = self.queued()
        head = tail = None
        if now is not None:
            head = tuple(max(0.0, w[0].deadline - now) if w else 0.0 for w in self.queues)
            tail = tuple(max(0.0, w[-1].deadline - now) if w else 0.0 for w in self.queues)
        return Snapshot(limit=self.limit, inflight=self.inflight(), queued=(q[0], q[1], q[2]),
                        tenant_queued=self.tenant_queued(cls, tenant), grant_rate=grant_rate,
                        release_n=release_n, inflight_avg=inflight_avg, arrival_rates=arrival_rates,
                        arrival_rates_fast=arrival_rates_fast, ramp=self.ramp_rate > 0,
                        ramp_refill=ramp_refill_rate(self.limit, self.ramp_rate, self._ramp_floors()[1]),
                        class_rate=class_rates[cls] if class_rates else 0.0,
                        class_rates=class_rates or (0.0, 0.0, 0.0),
                        head_left=head, tail_left=tail, ahead=self.ahead(cls, tenant))  # type: ignore[arg-type]

    def _alive(self, gateway: str, now: float) -> bool:
        exp = self.gateways.get(gateway)
        return exp is not None and exp > now

    def _find(self, ticket: str) -> Waiter | None:
        for q in self.queues:
            for w in q:
                if w.ticket == ticket:
                    return w
        return None

    # ------------------------------------------------------------------ the onset ramp

    def _ramp_floors(self) -> tuple[float, float]:
        return ramp_floors(self.endpoints, self.ramp_min_burst, self.ramp_min_rate, self.ramp_ep_burst,
                           self.ramp_ep_rate)

    def _ramp(self, now: float) -> None:
        """Bring the bucket to `now` (leases.lua does it once per mutating call, at its start)."""
        if self.ramp_rate > 0:
            min_burst, min_rate = self._ramp_floors()
            self.tokens = ramp_refill(self.tokens, self.tokens_ts, now, self.limit, self.ramp_burst, self.ramp_rate,
                                      min_rate, min_burst)
            self.tokens_ts = now

    def _extra(self, now: float) -> float:
        return self.extra if self.extra >= 1 and now < self.extra_until else 0.0

    def _ramp_open(self, cls: int, inflight: list[int] | tuple[int, int, int], now: float) -> bool:
        return self.ramp_rate <= 0 or not ramp_paces(cls, inflight) or (self.tokens or 0.0) >= 1 \
            or self._extra(now) >= 1

    def _ramp_take(self, now: float, n: int = 1) -> None:
        if self.ramp_rate > 0 and self.tokens is not None:
            x = self._extra(now)
            if x >= 1:
                k = min(n, math.floor(x))
                self.extra, n = x - k, n - k
            self.tokens -= n

    def _paced(self, cls: int, now: float, inflight: Sequence[int], head_deadline: float | None) -> bool:
        return self.pacer is not None and not self.pacer.open(cls, now, inflight, self.limit, head_deadline)

    def _pacer_granted(self, cls: int, now: float, inflight: Sequence[int]) -> None:
        if self.pacer is not None:
            self.pacer.granted(cls, now, inflight, self.limit)

    def _ramp_give(self) -> None:
        if self.ramp_rate > 0 and self.tokens is not None:
            self.tokens = min(ramp_burst(self.limit, self.ramp_burst, self._ramp_floors()[0]), self.tokens + 1)

    # ------------------------------------------------------------------ mechanism

    def _unqueue(self, w: Waiter) -> None:
        self.queues[w.cls].remove(w)
        self._left(w)

    def reclaim(self, now: float) -> None:
        for t in [t for t, lease in self.leases.items() if lease.expiry <= now]:
            del self.leases[t]
            self._ramp_give()
        cutoff = now - self.waiter_grace
        for q in self.queues:
            if any(w.deadline <= cutoff for w in q):  # rebuilt only when one is due (the common case: none)
                self._drop_where(q, lambda w: w.deadline <= cutoff)
        dead = {g for g, exp in self.gateways.items() if exp <= now}
        if dead:
            for q in self.queues:
                self._drop_where(q, lambda w: w.gateway in dead)
            for g in dead:
                del self.gateways[g]
            self.creditors -= dead

    def _drop_where(self, q: list[Waiter], gone: Callable[[Waiter], bool]) -> None:
        out = [w for w in q if gone(w)]
        if out:
            q[:] = [w for w in q if not gone(w)]
            for w in out:
                self._left(w)

    def grant(self, now: float) -> list[str]:
        """Hand free permits to waiters; returns the tickets that just received one."""
        granted: list[str] = []
        while True:
            inflight = list(self.inflight())
            if sum(inflight) >= self.limit:
                break
            queued = self.queued()
            for k in CLASSES:
                if queued[k] and eligible(k, self.limit, inflight, queued, self.shares, self.always, self.headroom):
                    if not self._ramp_open(k, inflight, now):
                        return granted  # paced: a lower class waits for a token (P0 went first)
                    if self._paced(k, now, inflight, self.queues[k][0].deadline):
                        continue  # a model's pacer holds this class: it stays queued
                    w = self.queues[k].pop(0)
                    self.vtime[k] = max(self.vtime[k], w.tag)
                    self._left(w)
                    if w.deadline >= now and self._alive(w.gateway, now):
                        # no longer than its gateway's liveness (leases.lua: a crashed gateway's
                        # grants must not outlive it by a TTL)
                        self.leases[w.ticket] = Lease(k, w.gateway, w.seq, min(now + self.ttl, self.gateways[w.gateway]))
                        self._ramp_take(now)
                        self._pacer_granted(k, now, inflight)
                        granted.append(w.ticket)
                    break
            else:
                break
        return granted

    # ------------------------------------------------------------------ operations (as leases.lua)

    def acquire(self, ticket: str, cls: int, now: float, *, gateway: str = "local", seq: int = 0,
                credits: int = 0) -> tuple[bool, list[str], list[str]]:
        """Lease at once if the grant loop would give this class the next permit.
        Returns (granted, credit tickets, tickets the grant loop granted to waiters first)."""
        if ticket in self.leases:
            return True, [], []
        self._ramp(now)
        self.reclaim(now)
        woken = self.grant(now)
        inflight, queued = list(self.inflight()), self.queued()
        ok = eligible(cls, self.limit, inflight, queued, self.shares, self.always, self.headroom) and not any(
            queued[k] and eligible(k, self.limit, inflight, queued, self.shares, self.always, self.headroom)
            and not self._paced(k, now, inflight, self.queues[k][0].deadline)
            for k in CLASSES if k <= cls) and self._ramp_open(cls, inflight, now) and not self._paced(cls, now, inflight, None)
        if not ok:
            self.creditors.clear()
            return False, [], woken
        self.leases[ticket] = Lease(cls, gateway, seq, now + self.ttl)
        self._ramp_take(now)
        self._pacer_granted(cls, now, inflight)
        extra: list[str] = []
        if credits > 0 and sum(queued) == 0:
            n = min(credits, self.limit // 2 - (sum(inflight) + 1))
            if self.ramp_rate > 0 and ramp_paces(1, self.inflight()):  # credits admit any class later
                n = min(n, math.floor(self.tokens or 0.0))
            self._ramp_take(now, max(0, n))
            for i in range(1, n + 1):
                extra.append(f"{ticket}:c{i}")
                self.leases[extra[-1]] = Lease(1, gateway, seq, now + self.ttl)
            if n > 0:
                self.creditors.add(gateway)
        return True, extra, woken

    def try_acquire(self, ticket: str, cls: int, now: float) -> bool:
        return self.acquire(ticket, cls, now)[0]

    def enqueue(self, ticket: str, cls: int, tenant: str, deadline: float, now: float, *,
                gateway: str = "local", seq: int = 0) -> tuple[str, list[str]]:
        """Wait for a permit. Returns (outcome, granted tickets): outcome is `granted` (this
        ticket holds a permit now), `queued`, or the cap that refused it (`queue_full`,
        `tenant_cap`)."""
        self._ramp(now)
        self.reclaim(now)
        if ticket in self.leases:
            return "granted", []
        if self._find(ticket) is None:
            if len(self.queues[cls]) >= self.max_queue[cls]:
                return "queue_full", []
            if tenant and self.tenant_queued(cls, tenant) >= self.tenant_cap[cls]:
                return "tenant_cap", []
            self.gateways.setdefault(gateway, now + self.ttl)
            self._put(Waiter(ticket, cls, deadline, gateway, seq, tenant))
        self.creditors.clear()
        granted = self.grant(now)
        return ("granted" if ticket in self.leases else "queued"), granted

    def cancel(self, ticket: str) -> int:
        """0: removed from the queue; 1: already granted; 2: unknown."""
        w = self._find(ticket)
        if w is not None:
            self._unqueue(w)
            return 0
        return 1 if ticket in self.leases else 2

    def release(self, ticket: str, now: float) -> tuple[bool, list[str]]:
        n, granted = self.release_many([ticket], now)
        return n == 1, granted

    def release_many(self, tickets: list[str], now: float) -> tuple[int, list[str]]:
        self._ramp(now)
        n = 0
        for t in tickets:
            if self.leases.pop(t, None) is not None:
                n += 1
                self._ramp_give()
        self.reclaim(now)
        return n, self.grant(now)

    def return_credits(self, tickets: list[str], now: float) -> list[str]:
        self._ramp(now)
        for t in tickets:
            if self.leases.pop(t, None) is not None:
                self._ramp_give()
        return self.grant(now)

    def mine(self, tickets: list[str], now: float) -> tuple[list[str], list[str]]:
        self._ramp(now)
        self.reclaim(now)
        granted = self.grant(now)
        return [t for t in tickets if t in self.leases], granted

    def sync(self, gateway: str, watermark: int, held: dict[str, tuple[int, int]],
             waiting: dict[str, tuple[int, int, float, str]], now: float) -> list[str]:
        """A gateway re-asserts what it has: held ticket -> (class, seq); waiting ticket ->
        (class, seq, remaining, tenant). Its other leases and waiters older than `watermark`
        are dropped. Returns the tickets the grant loop granted."""
        self._ramp(now)
        self.gateways[gateway] = now + self.ttl
        for t, (cls, seq) in held.items():
            if t in self.leases:
                self.leases[t].expiry = now + self.ttl
            else:
                w = self._find(t)
                if w is not None:
                    self._unqueue(w)
                self.leases[t] = Lease(cls, gateway, seq, now + self.ttl)
        for t, (cls, seq, remaining, tenant) in waiting.items():
            if t not in self.leases and self._find(t) is None:
                self._put(Waiter(t, cls, now + remaining, gateway, seq, tenant))
        for t, lease in list(self.leases.items()):
            if lease.gateway == gateway and lease.seq < watermark and t not in held and t not in waiting:
                del self.leases[t]
                self._ramp_give()
        for q in self.queues:
            self._drop_where(q, lambda w: w.gateway == gateway and w.seq < watermark and w.ticket not in waiting)
        self.reclaim(now)
        return self.grant(now)

    def set_limit(self, limit: int, now: float, credit: int = 0, credit_for: float = 0.0) -> list[str]:
        """`credit` (policy.ramp_credit): growth lower classes may take at once for `credit_for`."""
        self._ramp(now)
        if credit >= 1 and credit_for > 0 and self.ramp_rate > 0:
            self.extra, self.extra_until = self._extra(now) + credit, now + credit_for
        self.limit = max(1, limit)
        return self.grant(now)

    def adopt(self, ticket: str, cls: int, endpoint: str = "") -> None:
        """Count a permit granted elsewhere (degraded mode: the shared permits still held)."""
        self.leases[ticket] = Lease(cls, "local", 0, math.inf, endpoint)
