"""A fake-clock replay of the grant loop with the admission policy in front of it (pure).

`replay(history)` runs a history of arrivals (time, class, tenant, service time) through the
policy (`queue_decision`) and the grant loop of the reference permit table (`PermitTable`,
the model the Lua script is checked against), with releases when each granted request's
service ends and the pool-wide release rate kept as leases.lua keeps it. `force_enqueue`
replays the same history with some requests enqueued instead of dropped: the oracle for
"would this early-dropped request have been granted before its deadline?".
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from floodgate.extproc.config import AdmissionConfig, ClassConfig
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import (
    CLASSES,
    DecayingMean,
    DecayingRate,
    Enqueue,
    Reject,
    Snapshot,
    queue_decision,
)


@dataclass(frozen=True)
class Arrival:
    t: float
    cls: int
    service_s: float
    tenant: str = "t"


@dataclass
class Outcome:
    decisions: dict[int, str] = field(default_factory=dict)  # index -> immediate|queued|<reject reason>
    granted_at: dict[int, float] = field(default_factory=dict)
    deadline: dict[int, float] = field(default_factory=dict)
    retry_after: dict[int, int] = field(default_factory=dict)
    # every early drop: (index, the grant loop's state then, the snapshot the policy saw, now)
    drop_states: list[tuple[int, PermitTable, Snapshot, float]] = field(default_factory=list)

    def early_drops(self) -> list[int]:
        return [i for i, d in self.decisions.items() if d == "early_drop"]


def replay(limit: int, classes: Mapping[int, ClassConfig], history: list[Arrival], *,
           force_enqueue: frozenset[int] = frozenset(), adm: AdmissionConfig | None = None,
           warm_rate: tuple[float, float] | None = None) -> Outcome:
    """`warm_rate` = (rate, since): the release-rate estimator starts as if `rate` permits per
    second had been freed for `since` seconds (a pool that has been busy before the history)."""
    adm = adm or AdmissionConfig()
    shares = (classes[0].share, classes[1].share, classes[2].share)
    table = PermitTable(limit=limit, shares=shares)
    released = DecayingRate()
    level = DecayingMean()
    grants = [DecayingRate(), DecayingRate(), DecayingRate()]
    if warm_rate is not None:
        rate, since = warm_rate
        n = int(rate * since)
        for k in range(n):
            released.bump(-since + k / rate)
            level.add(-since + k / rate, limit)
    out = Outcome()
    events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, index); kind 0 release, 1 deadline, 2 arrival
    for i, a in enumerate(history):
        heapq.heappush(events, (a.t, 2, i, i))
    seq = len(history)

    def granted(tickets: list[str], now: float) -> None:
        nonlocal seq
        for t in tickets:
            i = int(t)
            out.granted_at[i] = now
            grants[history[i].cls].bump(now)
            seq += 1
            heapq.heappush(events, (now + history[i].service_s, 0, seq, i))

    while events:
        now, kind, _, i = heapq.heappop(events)
        a = history[i]
        if kind == 0:
            level.add(now, sum(table.inflight()))
            _, got = table.release(str(i), now)
            released.bump(now)
            granted(got, now)
        elif kind == 1:
            table.cancel(str(i))  # gone from the queue, or granted already (then nothing)
        else:
            if table.try_acquire(str(i), a.cls, now):
                out.decisions[i] = "immediate"
                granted([str(i)], now)
                continue
            q = table.queued()
            snap = Snapshot(
                limit=table.limit, inflight=table.inflight(), queued=(q[0], q[1], q[2]),
                tenant_queued=sum(1 for w in table.queues[a.cls] if w.tenant == a.tenant),
                grant_rate=released.read(now), release_n=released.n,
                class_rates=(grants[0].read(now), grants[1].read(now), grants[2].read(now)),
                inflight_avg=level.value,
                head_left=tuple(max(0.0, table.queues[k][0].deadline - now) if table.queues[k] else 0.0
                                for k in CLASSES),  # type: ignore[arg-type]
                tail_left=tuple(max(0.0, table.queues[k][-1].deadline - now) if table.queues[k] else 0.0
                                for k in CLASSES))  # type: ignore[arg-type]
            decision = queue_decision(a.cls, snap, classes, adm, rand=0.5)
            if isinstance(decision, Reject) and decision.reason == "early_drop" and i in force_enqueue:
                decision = Enqueue(None)
            if isinstance(decision, Reject) and decision.reason == "early_drop":
                out.drop_states.append((i, copy.deepcopy(table), snap, now))
            if isinstance(decision, Reject):
                out.decisions[i] = decision.reason
                out.retry_after[i] = decision.retry_after_s
                continue
            out.decisions[i] = "queued"
            deadline = now + classes[a.cls].queue_timeout_s
            out.deadline[i] = deadline
            seq += 1
            heapq.heappush(events, (deadline, 1, seq, i))
            granted(table.enqueue(str(i), a.cls, a.tenant, deadline, now)[1], now)
    return out


def wrongly_dropped(limit: int, classes: Mapping[int, ClassConfig], history: list[Arrival],
                    base: Outcome, sample: int | None = None, **kw: object) -> list[int]:
    """Early drops that, enqueued instead (all else the same), are granted before their deadline."""
    wrong = []
    drops = base.early_drops()
    if sample is not None and len(drops) > sample:
        step = len(drops) / sample
        drops = [drops[int(k * step)] for k in range(sample)]
    for i in drops:
        alt = replay(limit, classes, history, force_enqueue=frozenset({i}), **kw)  # type: ignore[arg-type]
        if i in alt.granted_at and alt.granted_at[i] <= alt.deadline[i]:
            wrong.append(i)
    return wrong


def granted_in_time_at_current_rate(table: PermitTable, snap: Snapshot, cls: int, timeout_s: float,
                                    now: float) -> bool:
    """The deterministic oracle: enqueue the request into the grant loop's exact state (every
    waiter with its own deadline) and free permits at the current release rate, oldest grant
    first; classes that are backlogged now keep receiving waiters at their current grant rate.
    Is it granted before its deadline?"""
    t = copy.deepcopy(table)
    rate = snap.release_rate()
    deadline = now + timeout_s
    if t.enqueue("me", cls, "oracle", deadline, now)[0] == "granted":
        return True
    if rate <= 0:
        return False
    arrivals: dict[int, float] = {}
    events: list[tuple[float, int, int]] = [(now + k / rate, 0, 0) for k in range(1, int(timeout_s * rate) + 2)]
    for k, r in arrivals.items():
        if r > 0:
            events += [(now + j / r, 1, k) for j in range(1, int(timeout_s * r) + 2)]
    events.sort()
    seq = 0
    for at, kind, k in events:
        if at > deadline + 1e-9:
            break
        if kind == 1:
            seq += 1
            got = t.enqueue(f"o{seq}", k, "oracle", math.inf, at)[1]
        else:
            if not t.held:
                continue
            oldest = next(iter(t.held))
            _, got = t.release(oldest, at)
        if "me" in got:
            return True
    return False


def wrong_drops_at_current_rate(out: Outcome, classes: Mapping[int, ClassConfig],
                                history: list[Arrival]) -> list[int]:
    """Early drops that the grant loop would have granted before their deadline at the
    current release rate (the rule's promise; target: none)."""
    return [i for i, table, snap, now in out.drop_states
            if granted_in_time_at_current_rate(table, snap, history[i].cls, classes[history[i].cls].queue_timeout_s, now)]


__all__ = ["CLASSES", "Arrival", "Outcome", "granted_in_time_at_current_rate", "replay", "wrong_drops_at_current_rate",
           "wrongly_dropped"]
