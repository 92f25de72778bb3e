"""The admission policy (pure): partitions, early drop, tenant caps, Retry-After.

Mechanism (leases, queues, grants) lives in Redis Lua (`leases.lua`) and in the local
fallback (`permits.py`); both call the same rules, written once here and mirrored in Lua:
`eligible` decides whether a class may take a free permit; `queue_decision` decides whether a
request that could not be admitted at once may wait or is turned away now.

Early drop bounds each class's queue by what the grant loop can grant in time. A new request
waits only if its place in the grant order (the waiters ahead of it in its class) can be
reached before its deadline at the rate the grant loop hands that class permits: the pool-wide
rate of freed permits when no higher class waits, else the turnover of what the class holds or
is reserved (higher classes take the rest) or its own recent grant rate, whichever is higher.
With FIFO and timeouts, a queue longer than that does not serve more requests: every waiter
beyond it waits about its whole timeout and then fails (or pushes out one that would have been
served). Bounded, the queue's waiters are served, and the rest are rejected at once — from the
last seen state without a Redis round trip when that already shows the queue at its bound
(`certain_reject`). The rate is read at its upper confidence bound and never trusted on few
releases: when unsure, the request waits (admitting late beats rejecting early).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from floodgate.extproc.config import AdmissionConfig, ClassConfig

CLASSES = (0, 1, 2)
RATE_TAU_S = 10.0  # decay time of the event rates (leases.lua RATE_TAU_MS)
MIN_RELEASES = 20  # below this many freed permits behind the rate, never drop early
CONFIDENCE_Z = 2.0  # standard errors of margin on the measured rate before a wait counts as too long


def reservations(limit: int, shares: Sequence[float]) -> list[int]:
    """Permits each class keeps under contention: floor(share * L), so they never exceed L."""
    return [math.floor(s * limit + 1e-9) for s in shares]


def eligible(cls: int, limit: int, inflight: Sequence[int], queued: Sequence[int],
             shares: Sequence[float], always: Sequence[bool] = (False, False, False)) -> bool:
    """May class `cls` take a free permit now? (Netflix partitions, never above the limit.)

    Below the limit any class may use spare capacity; under contention a class inside its own
    reservation always may, and any other class only if what stays free still covers the
    unused reservations of the other classes that have requests waiting — or, for a class
    whose reservation is kept `always`, whether or not it has waiters (headroom for P0).
    """
    free = limit - sum(inflight)
    if free < 1:
        return False
    res = reservations(limit, shares)
    if inflight[cls] < res[cls]:
        return True
    others_unused = sum(max(0, res[k] - inflight[k]) for k in CLASSES
                        if k != cls and (queued[k] > 0 or always[k]))
    return free - 1 >= others_unused


@dataclass
class DecayingRate:
    """Events per second, exponentially decayed (tau `RATE_TAU_S`), as leases.lua keeps them.

    Used by the local permit table (degraded mode) and by the tests' fake-clock replays.
    """

    rate: float = 0.0
    ts: float | None = None
    t0: float | None = None
    n: int = 0

    def bump(self, now: float) -> None:
        if self.ts is None or self.t0 is None:
            self.ts = self.t0 = now
        self.rate = self.rate * math.exp(-(now - self.ts) / RATE_TAU_S) + 1 / RATE_TAU_S
        self.ts = now
        self.n += 1

    def read(self, now: float) -> float:
        """0 (unknown) until 5 events over at least 1 s, like `read_rate` in leases.lua."""
        if self.ts is None or self.t0 is None or self.n < 5 or now - self.t0 < 1.0:
            return 0.0
        seen = 1 - math.exp(-(now - self.t0) / RATE_TAU_S)
        return self.rate * math.exp(-(now - self.ts) / RATE_TAU_S) / seen


@dataclass
class DecayingMean:
    """A time-weighted mean (decay `RATE_TAU_S`) of a level sampled at events: the in-flight
    count at each release, as leases.lua keeps it (`inflight_avg`)."""

    value: float = 0.0
    ts: float | None = None

    def add(self, now: float, level: float) -> None:
        if self.ts is None:
            self.value, self.ts = float(level), now
            return
        w = math.exp(-max(0.0, now - self.ts) / RATE_TAU_S)
        self.value = self.value * w + (1 - w) * level
        self.ts = now


@dataclass(frozen=True)
class Snapshot:
    """What the shared state looked like when a request could not be admitted at once."""

    limit: int
    inflight: tuple[int, int, int]
    queued: tuple[int, int, int]
    tenant_queued: int  # this tenant's waiters in this request's class
    grant_rate: float  # permits freed per second, pool-wide, recent (0 = unknown)
    class_rate: float = 0.0  # grants per second to this request's class (informational)
    release_n: int = 0  # freed permits counted so far (how much the rate rests on)
    class_rates: tuple[float, float, float] = (0.0, 0.0, 0.0)  # recent grants per second per class
    inflight_avg: float = 0.0  # mean in-flight over the rate's window (0 = unknown)
    # Seconds until the deadline of each class's oldest (head) and newest (tail) waiter; None =
    # unknown, which makes early drop assume no waiter ahead expires.
    head_left: tuple[float, float, float] | None = None
    tail_left: tuple[float, float, float] | None = None

    def release_rate(self) -> float:
        """Permits freed per second now. The decayed rate lags a pool that just filled up:
        it measured throughput at the old in-flight. Each permit is held about
        inflight_avg / rate seconds (Little's law), so with more in flight now, more free per
        second; scaled up only, never down (an optimistic rate never drops early)."""
        r = self.grant_rate
        if r > 0 and self.inflight_avg > 0:
            r *= max(1.0, sum(self.inflight) / self.inflight_avg)
        return r


@dataclass(frozen=True)
class Reject:
    reason: str  # early_drop | queue_full | tenant_cap | queue_timeout | no_endpoints
    retry_after_s: int
    status: int = 429


@dataclass(frozen=True)
class Enqueue:
    predicted_wait_s: float | None


@dataclass(frozen=True)
class WaitEstimate:
    """Where a new request of a class stands in the grant order and how fast it advances.

    Its class receives permits at `rate` (the pool-wide rate of freed permits) for the first
    `gap` of them (free permits and the unused part of its reservation go to it first), then at
    `class_rate`. The `ahead` waiters of its class go first, all of them: each was let in because
    the grant loop reaches it in time (this rule, applied to it), so none is counted on to
    expire. (Counting on waiters ahead to time out is what let queues grow until every waiter
    waited its whole timeout.)"""

    ahead: int  # waiters of its class ahead of it
    free: int  # permits free right now
    gap: int  # permits that reach the class at the pool rate (unused reservation)
    rate: float  # freed permits per second, pool-wide (0 = unknown)
    class_rate: float  # permits per second the grant loop hands this class while it waits
    samples: float  # events the rate rests on

    @property
    def releases(self) -> int:
        """Permits its class must receive until this request holds one (every waiter served)."""
        return max(0, self.ahead + 1 - self.free)

    def by(self, t: float, scale: float = 1.0) -> float:
        """Permits the class has received t seconds from now (rates times `scale`)."""
        fast, slow = self.rate * scale, self.class_rate * scale
        if fast <= 0:
            return float(self.free)
        if self.gap >= t * fast:
            return self.free + t * fast
        return self.free + self.gap + (t - self.gap / fast) * slow

    def _time_for(self, n: float, scale: float) -> float:
        fast, slow = self.rate * scale, self.class_rate * scale
        n -= self.free
        if n <= 0:
            return 0.0
        if n <= self.gap:
            return n / fast
        return self.gap / fast + (n - self.gap) / slow if slow > 0 else math.inf

    @property
    def seconds(self) -> float | None:
        """Point estimate: every waiter ahead served first (for Retry-After)."""
        if self.rate <= 0:
            return None
        return self._time_for(self.ahead + 1, 1.0)

    def certainly_over(self, deadline_s: float) -> bool:
        """True when the grant loop cannot reach this request before `deadline_s` even at the
        rates' upper confidence bounds; never on few releases: when unsure, the request waits
        (admitting late beats rejecting early)."""
        if self.rate <= 0 or self.samples < MIN_RELEASES:
            return False
        scale = 1 + CONFIDENCE_Z / math.sqrt(self.samples)
        return self.by(deadline_s, scale) + 1e-9 < self.ahead + 1


def class_release_rate(cls: int, snap: Snapshot, res: Sequence[int]) -> float:
    """Permits per second the grant loop hands class `cls` while it has waiters.

    No higher class waiting: every freed permit (until one arrives, which the next decision
    sees). Otherwise the higher classes take every permit but the ones this class holds or is
    reserved — those come back to it as they free (its reservation holds the others back) —
    or, if higher, what it was actually granted recently."""
    r = snap.release_rate()
    if r <= 0:
        return 0.0
    if not any(snap.queued[k] > 0 for k in CLASSES if k < cls):
        return r
    held = max(snap.inflight[cls], res[cls])
    turnover = r * min(1.0, held / max(1, sum(snap.inflight)))
    return max(turnover, min(r, snap.class_rate))


def wait_estimate(cls: int, snap: Snapshot, shares: Sequence[float]) -> WaitEstimate:
    """Where a new request of class `cls` stands in the grant order and how fast it advances.

    It needs its class's waiters ahead of it plus one permit. Free permits and the unused part
    of its reservation reach it at the pool rate (the grant loop gives them to this class
    first); the rest at `class_release_rate`."""
    limit = max(1, snap.limit)
    res = reservations(limit, shares)
    q, inflight = snap.queued, snap.inflight
    samples = min(float(snap.release_n), snap.grant_rate * RATE_TAU_S) if snap.grant_rate > 0 else 0.0
    free = max(0, limit - sum(inflight))
    gap = max(0, res[cls] - inflight[cls] - free)
    return WaitEstimate(q[cls], free, gap, snap.release_rate(), class_release_rate(cls, snap, res), samples)


def predicted_wait(cls: int, snap: Snapshot, shares: Sequence[float] = (0.5, 0.3, 0.1)) -> float | None:
    """Seconds until this request is granted (point estimate), None when nothing is known."""
    return wait_estimate(cls, snap, shares).seconds


def retry_after(wait_s: float | None, cls_cfg: ClassConfig, cfg: AdmissionConfig, rand: float) -> int:
    """Whole seconds for `retry-after`, always jittered so rejected clients do not return in
    lockstep — also at the clamps: the base (predicted wait, or the class timeout when
    unknown) is clamped to [min, max], then spread over a band `retry_after_jitter` wide that
    lies inside [min, max]; the fraction is rounded up or down at random, not always up."""
    lo_s, hi_s = cfg.retry_after_min_s, max(cfg.retry_after_min_s, cfg.retry_after_max_s)
    base = cls_cfg.queue_timeout_s if wait_s is None else wait_s
    base = min(hi_s, max(lo_s, base if math.isfinite(base) else hi_s))
    top = min(hi_s, base * (1 + cfg.retry_after_jitter))
    bottom = max(lo_s, top / (1 + cfg.retry_after_jitter))
    value = bottom + (top - bottom) * rand
    frac_rand = (rand * 1_000_003) % 1.0  # a second, independent-enough uniform from `rand`
    whole = math.floor(value) + (1 if value - math.floor(value) > frac_rand else 0)
    return int(min(math.ceil(hi_s), max(math.floor(lo_s), whole)))


def queue_decision(cls: int, snap: Snapshot, classes: Mapping[int, ClassConfig],
                   cfg: AdmissionConfig, rand: float, *, named_tenant: bool = True) -> Enqueue | Reject:
    """A request that could not be admitted at once: may it wait, or is it rejected now?

    `named_tenant` is False for a request without a tenant header: such requests are not one
    tenant (unless `admission.anonymous_tenant_cap` says so), so no tenant cap applies."""
    c = classes[cls]
    shares = [classes[k].share for k in CLASSES]
    est = wait_estimate(cls, snap, shares)
    wait = est.seconds
    if snap.queued[cls] >= c.max_queue:
        return Reject("queue_full", retry_after(wait, c, cfg, rand))
    if named_tenant or cfg.anonymous_tenant_cap:
        tenant_cap = max(1, int(c.tenant_queue_share * c.max_queue))
        if snap.tenant_queued >= tenant_cap:
            return Reject("tenant_cap", retry_after(wait, c, cfg, rand))
    if est.certainly_over(c.queue_timeout_s):
        return Reject("early_drop", retry_after(wait, c, cfg, rand))
    return Enqueue(wait)


def certain_reject(cls: int, snap: Snapshot, classes: Mapping[int, ClassConfig],
                   cfg: AdmissionConfig, rand: float, age_s: float = 0.0) -> Reject | None:
    """A rejection the last seen snapshot (`age_s` old) already proves, decided without a
    Redis round trip: the pool was full and the class's queue so far past its bound that even
    if its waiters had been granted at the pool's upper rate for `age_s` since, queue_decision
    would still drop the request."""
    c = classes[cls]
    if sum(snap.inflight) < snap.limit:
        return None
    shares = [classes[k].share for k in CLASSES]
    est = wait_estimate(cls, snap, shares)
    if est.samples < MIN_RELEASES:
        return None
    drained = math.ceil(est.rate * (1 + CONFIDENCE_Z / math.sqrt(est.samples)) * max(0.0, age_s))
    q = list(snap.queued)
    q[cls] = max(0, q[cls] - drained)
    aged = replace(snap, queued=(q[0], q[1], q[2]))
    est = wait_estimate(cls, aged, shares)
    if est.certainly_over(c.queue_timeout_s):
        return Reject("early_drop", retry_after(est.seconds, c, cfg, rand))
    return None


def timeout_reject(cls: int, snap: Snapshot | None, classes: Mapping[int, ClassConfig],
                   cfg: AdmissionConfig, rand: float) -> Reject:
    """A waiter whose deadline passed; `snap` should be the freshest state seen, not the one
    from when it was enqueued, so Retry-After reflects the queue as it is now."""
    shares = [classes[k].share for k in CLASSES]
    wait = predicted_wait(cls, snap, shares) if snap else None
    return Reject("queue_timeout", retry_after(wait, classes[cls], cfg, rand))
