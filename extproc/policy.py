"""The admission policy (pure): partitions, early drop, tenant caps, Retry-After.

Mechanism (leases, queues, grants) lives in Redis Lua (`leases.lua`) and in the local
fallback (`permits.py`); both call the same rules, written once here and mirrored in Lua:
`eligible` decides whether a class may take a free permit; `queue_decision` decides whether a
request that could not be admitted at once may wait or is turned away now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from floodgate.extproc.config import AdmissionConfig, ClassConfig

CLASSES = (0, 1, 2)


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


@dataclass(frozen=True)
class Snapshot:
    """What the shared state looked like when a request could not be admitted at once."""

    limit: int
    inflight: tuple[int, int, int]
    queued: tuple[int, int, int]
    tenant_queued: int  # this tenant's waiters in this request's class
    grant_rate: float  # permits freed per second, recent (0 = unknown)
    class_rate: float = 0.0  # grants per second to this request's class, recent (0 = none/unknown)


@dataclass(frozen=True)
class Reject:
    reason: str  # early_drop | queue_full | tenant_cap | queue_timeout | no_endpoints
    retry_after_s: int
    status: int = 429


@dataclass(frozen=True)
class Enqueue:
    predicted_wait_s: float | None


def predicted_wait(cls: int, snap: Snapshot) -> float | None:
    """Seconds until a permit frees for this request, or None when nothing is known yet.

    From the class's own recent grant rate when it has one: (waiters of the class + 1) /
    grants per second to the class, which already reflects higher classes taking their
    turn first. A class that got no grants while permits were freed and higher classes wait is
    starved (infinite wait). Otherwise all waiters ahead / the rate of freed permits.
    """
    if snap.class_rate > 0:
        return (snap.queued[cls] + 1) / snap.class_rate
    if snap.grant_rate <= 0:
        return None
    if any(snap.queued[k] for k in CLASSES if k < cls):
        return math.inf
    ahead = sum(snap.queued[k] for k in CLASSES if k <= cls)
    return (ahead + 1) / snap.grant_rate


def retry_after(wait_s: float | None, cls_cfg: ClassConfig, cfg: AdmissionConfig, rand: float) -> int:
    """Whole seconds for `retry-after`: predicted wait (or the class timeout when unknown),
    jittered by up to `retry_after_jitter` so rejected clients do not return in lockstep."""
    if wait_s is None:
        base = cls_cfg.queue_timeout_s
    elif math.isinf(wait_s):  # starved behind higher classes: come back late
        base = cfg.retry_after_max_s
    else:
        base = wait_s
    jittered = base * (1 + cfg.retry_after_jitter * rand)
    return math.ceil(max(cfg.retry_after_min_s, min(cfg.retry_after_max_s, jittered)))


def queue_decision(cls: int, snap: Snapshot, classes: Mapping[int, ClassConfig],
                   cfg: AdmissionConfig, rand: float) -> Enqueue | Reject:
    """A request that could not be admitted at once: may it wait, or is it rejected now?"""
    c = classes[cls]
    wait = predicted_wait(cls, snap)
    if snap.queued[cls] >= c.max_queue:
        return Reject("queue_full", retry_after(wait, c, cfg, rand))
    tenant_cap = max(1, int(c.tenant_queue_share * c.max_queue))
    if snap.tenant_queued >= tenant_cap:
        return Reject("tenant_cap", retry_after(wait, c, cfg, rand))
    if wait is not None and wait > c.queue_timeout_s:
        return Reject("early_drop", retry_after(wait, c, cfg, rand))
    return Enqueue(wait)


def timeout_reject(cls: int, snap: Snapshot | None, classes: Mapping[int, ClassConfig],
                   cfg: AdmissionConfig, rand: float) -> Reject:
    wait = predicted_wait(cls, snap) if snap else None
    return Reject("queue_timeout", retry_after(wait, classes[cls], cfg, rand))
