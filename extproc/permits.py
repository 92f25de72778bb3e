"""An in-memory permit table with the same semantics as `leases.lua` (pure, `now` passed in).

Used as the local limiter while Redis is unreachable, and as the reference model the Lua
script is checked against in tests. One gateway, so no leases to expire and no pub/sub:
`grant()` returns the tickets that just received a permit and the caller wakes them.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from floodgate.extproc.policy import CLASSES, Snapshot, eligible


@dataclass
class _Waiter:
    ticket: str
    cls: int
    tenant: str
    deadline: float


@dataclass
class PermitTable:
    limit: int
    shares: tuple[float, float, float]
    always: tuple[bool, bool, bool] = (False, False, False)  # reservations kept without waiters
    held: dict[str, int] = field(default_factory=dict)  # ticket -> class
    queues: tuple[deque[_Waiter], deque[_Waiter], deque[_Waiter]] = field(
        default_factory=lambda: (deque(), deque(), deque()))
    _seq: itertools.count = field(default_factory=itertools.count)

    def inflight(self) -> tuple[int, int, int]:
        counts = [0, 0, 0]
        for c in self.held.values():
            counts[c] += 1
        return counts[0], counts[1], counts[2]

    def queued(self) -> list[int]:
        return [len(q) for q in self.queues]

    def snapshot(self, cls: int, tenant: str, grant_rate: float) -> Snapshot:
        return Snapshot(
            limit=self.limit, inflight=self.inflight(),
            queued=(len(self.queues[0]), len(self.queues[1]), len(self.queues[2])),
            tenant_queued=sum(1 for w in self.queues[cls] if w.tenant == tenant),
            grant_rate=grant_rate)

    def try_acquire(self, ticket: str, cls: int, now: float) -> bool:
        """Lease at once if the grant loop would give this class the next permit."""
        self.grant(now)
        inflight, queued = list(self.inflight()), self.queued()
        if not eligible(cls, self.limit, inflight, queued, self.shares, self.always):
            return False
        if any(queued[k] and eligible(k, self.limit, inflight, queued, self.shares, self.always)
               for k in CLASSES if k <= cls):
            return False
        self.held[ticket] = cls
        return True

    def enqueue(self, ticket: str, cls: int, tenant: str, deadline: float, now: float) -> list[str]:
        self.queues[cls].append(_Waiter(ticket, cls, tenant, deadline))
        return self.grant(now)

    def cancel(self, ticket: str) -> int:
        """0: removed from the queue; 1: already granted; 2: unknown."""
        for q in self.queues:
            for w in q:
                if w.ticket == ticket:
                    q.remove(w)
                    return 0
        return 1 if ticket in self.held else 2

    def release(self, ticket: str, now: float) -> tuple[bool, list[str]]:
        held = self.held.pop(ticket, None) is not None
        return held, self.grant(now)

    def set_limit(self, limit: int, now: float) -> list[str]:
        self.limit = max(1, limit)
        return self.grant(now)

    def grant(self, now: float) -> list[str]:
        granted: list[str] = []
        while sum(self.inflight()) < self.limit:
            inflight, queued = list(self.inflight()), self.queued()
            for k in CLASSES:
                if queued[k] and eligible(k, self.limit, inflight, queued, self.shares, self.always):
                    w = self.queues[k].popleft()
                    if w.deadline >= now:
                        self.held[w.ticket] = k
                        granted.append(w.ticket)
                    break
            else:
                break
        return granted
