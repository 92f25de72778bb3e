"""The admission policy (pure): partitions, early drop, tenant caps, Retry-After.

Mechanism (leases, queues, grants) lives in Redis Lua (`leases.lua`) and in the local
fallback (`permits.py`); both call the same rules, written once here and mirrored in Lua:
`eligible` decides whether a class may take a free permit; `queue_decision` decides whether a
request that could not be admitted at once may wait or is turned away now.

Early drop predicts a request's wait from what decides it: its place in the grant order
(waiters ahead of it in its own and higher classes, minus what its class's reservation lets
it bypass) and the POOL-WIDE rate of freed permits, not its class's own (possibly sparse)
grant history. It rejects only when even an optimistic reading of that estimate (the rate
at its upper confidence bound, a Poisson margin on the releases needed) says the request
cannot be granted before its deadline, and never while the rate rests on few releases:
admitting late is cheaper than rejecting a request the pool would have served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from floodgate.extproc.config import AdmissionConfig, ClassConfig

CLASSES = (0, 1, 2)
RATE_TAU_S = 10.0  # decay time of the event rates (leases.lua RATE_TAU_MS)
MIN_RELEASES = 20  # below this many freed permits behind the rate, never drop early
CONFIDENCE_Z = 3.0  # standard deviations of margin before a wait counts as certainly too long


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
    """How long a new request of a class would wait, as a point estimate (for Retry-After) and
    as a lower bound in the grant order most favourable to it (for early drop)."""

    releases: int  # freed permits until its grant, waiters ahead served in order (point estimate)
    rate: float  # freed permits per second, pool-wide (0 = unknown)
    samples: float  # events the rate rests on
    earliest: float  # seconds, lower bound at `rate` (inf: never at this rate)
    earliest_hi: float  # the same at the rate's upper confidence bound

    @property
    def seconds(self) -> float | None:
        if self.rate <= 0:
            return None
        return self.releases / self.rate

    def certainly_over(self, deadline_s: float) -> bool:
        """True only when even the most favourable grant order at the rate's upper confidence
        bound cannot grant the request before `deadline_s`, and the rate rests on enough
        releases; when unsure, the request waits (admitting late beats rejecting early)."""
        if self.rate <= 0 or self.samples < MIN_RELEASES:
            return False
        return self.earliest_hi > deadline_s


def _earliest(cls: int, snap: Snapshot, res: Sequence[int], rate: float, horizon: float) -> float:
    """Lower bound on the seconds until the grant loop grants a new request of class `cls`,
    with permits freed at `rate` from now on in whatever order suits it best.

    The request is granted at time t only if its class got more grants by t than the waiters
    ahead of it that are still alive at t (waiters that expire are skipped, and every waiter
    ahead lives at least until the class head's deadline and at most until the tail's).
    Before each of its class's grants, the higher waiters that are certain to go first take
    theirs: all higher waiters alive over the whole horizon, or, when the class can take
    permits through its own reservation (which higher classes over their shares may not
    touch), only the higher waiters still inside their reservations.
    """
    limit = max(1, snap.limit)
    q, inflight = snap.queued, snap.inflight
    free = max(0, limit - sum(inflight))
    head = snap.head_left or (math.inf, math.inf, math.inf)
    tail = snap.tail_left or (math.inf, math.inf, math.inf)

    def alive(k: int, n: int) -> int:
        return n if head[k] >= horizon else 0  # may all expire before the horizon otherwise

    bypass = res[cls] >= 1 and (inflight[cls] >= 1 or inflight[cls] < res[cls])
    if bypass:
        higher = sum(alive(k, min(q[k], max(0, res[k] - inflight[k]))) for k in CLASSES if k < cls)
    else:
        higher = sum(alive(k, q[k]) for k in CLASSES if k < cls)

    def when(grants: int) -> float:
        """Earliest time the class can have received `grants` grants."""
        return max(0.0, (grants + higher - free)) / rate

    own = q[cls]
    if own == 0:
        return when(1)
    options = []
    t_all = when(own + 1)  # everything ahead served, then this request
    if t_all <= head[cls]:
        options.append(t_all)
    t_one_left = max(head[cls], when(2))  # the head may have expired; the tail has not
    if t_one_left <= tail[cls]:
        options.append(t_one_left)
    options.append(max(tail[cls], when(1)))  # every waiter ahead is gone
    return min(options)


def wait_estimate(cls: int, snap: Snapshot, shares: Sequence[float], horizon: float = math.inf) -> WaitEstimate:
    """Where a new request of class `cls` stands in the grant order and when it may be granted.

    The point estimate counts its class's waiters and, unless it is inside its reservation,
    every higher waiter, at the pool-wide rate of freed permits. The lower bound (see
    `_earliest`) is what early drop uses; `horizon` is the request's queue timeout.
    """
    limit = max(1, snap.limit)
    res = reservations(limit, shares)
    q, inflight = snap.queued, snap.inflight
    samples = min(float(snap.release_n), snap.grant_rate * RATE_TAU_S) if snap.grant_rate > 0 else 0.0
    rate = snap.release_rate()
    releases = q[cls] + 1
    if q[cls] >= res[cls] - inflight[cls]:
        releases += sum(q[k] for k in CLASSES if k < cls)
    releases = max(0, releases - max(0, limit - sum(inflight)))
    if rate <= 0:
        return WaitEstimate(releases, 0.0, samples, 0.0, 0.0)
    rate_hi = rate * (1 + CONFIDENCE_Z / math.sqrt(samples)) if samples > 0 else rate
    return WaitEstimate(releases, rate, samples, _earliest(cls, snap, res, rate, horizon),
                        _earliest(cls, snap, res, rate_hi, horizon))


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
    est = wait_estimate(cls, snap, shares, c.queue_timeout_s)
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
                   cfg: AdmissionConfig, rand: float) -> Reject | None:
    """A rejection the last seen snapshot already proves, decided without a Redis round trip.

    Only early drops, with twice the deadline as margin: the snapshot may be up to a second
    old, and a backlog that long does not drain in that time."""
    c = classes[cls]
    shares = [classes[k].share for k in CLASSES]
    est = wait_estimate(cls, snap, shares, 2 * c.queue_timeout_s)
    if est.certainly_over(2 * c.queue_timeout_s):
        return Reject("early_drop", retry_after(est.seconds, c, cfg, rand))
    return None


def timeout_reject(cls: int, snap: Snapshot | None, classes: Mapping[int, ClassConfig],
                   cfg: AdmissionConfig, rand: float) -> Reject:
    """A waiter whose deadline passed; `snap` should be the freshest state seen, not the one
    from when it was enqueued, so Retry-After reflects the queue as it is now."""
    shares = [classes[k].share for k in CLASSES]
    wait = predicted_wait(cls, snap, shares) if snap else None
    return Reject("queue_timeout", retry_after(wait, classes[cls], cfg, rand))
