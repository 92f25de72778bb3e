"""A fake-clock replay of the grant loop with the admission policy in front of it (pure).

`replay(history)` runs a history of arrivals (time, class, tenant, service time) through the
policy (`queue_decision`) and the grant loop of the reference permit table (`PermitTable`,
the model the Lua script is checked against), with releases when each granted request's
service ends and the pool-wide release rate kept as leases.lua keeps it. `force_enqueue`
replays the same history with some requests enqueued instead of dropped: the oracle for
"did this early drop cost its class a request served in time?" (`wrongly_dropped`).
"""

from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from floodgate.extproc.config import AdmissionConfig, ClassConfig
from floodgate.extproc.permits import Lease, PermitTable, Waiter
from floodgate.extproc.policy import (
    ARRIVAL_FAST_TAU_S,
    ARRIVAL_TAU_S,
    CLASSES,
    SLOW_TAU_S,
    DecayingMean,
    DecayingRate,
    Enqueue,
    Reject,
    Snapshot,
    min_chance,
    queue_decision,
    wait_estimate,
    waits_on_budget,
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
    # every request let into the queue: (index, the snapshot the policy saw, the chance it needed)
    wait_states: list[tuple[int, Snapshot, float | None]] = field(default_factory=list)

    def early_drops(self) -> list[int]:
        return [i for i, d in self.decisions.items() if d == "early_drop"]


def replay(limit: int, classes: Mapping[int, ClassConfig], history: list[Arrival], *,
           force_enqueue: frozenset[int] = frozenset(), adm: AdmissionConfig | None = None,
           warm_rate: tuple[float, float] | None = None, ramp: tuple[float, float] | None = None,
           budget: bool = True, budget_in_air: bool = True) -> Outcome:
    """`warm_rate` = (rate, since): the release-rate estimator starts as if `rate` permits per
    second had been freed for `since` seconds (a pool that has been busy before the history).
    `ramp` = (burst, rate): the onset ramp on (shares of the limit; rate per second).
    `budget`: early drop spends the slow-rejection budget as the processor does
    (`policy.min_chance` over each class's rejections and queue timeouts); False: the class's
    `early_drop_min_chance` always. `budget_in_air`: the waits the budget let in count against
    it while they wait (`min_chance`'s `waiting`), as the processor counts them; False: only
    the timeouts seen (the rule before)."""
    adm = adm or AdmissionConfig()
    shares = (classes[0].share, classes[1].share, classes[2].share)
    table = PermitTable(limit=limit, shares=shares,
                        headroom=(classes[0].headroom, classes[1].headroom, classes[2].headroom),
                        ramp_burst=ramp[0] if ramp else 0.0, ramp_rate=ramp[1] if ramp else 0.0)
    released = DecayingRate()
    level = DecayingMean()
    grants = [DecayingRate(), DecayingRate(), DecayingRate()]
    # requests arriving per class, as the processor counts them
    arrivals = [DecayingRate(tau=ARRIVAL_TAU_S) for _ in CLASSES]
    arrivals_fast = [DecayingRate(tau=ARRIVAL_FAST_TAU_S) for _ in CLASSES]
    rejections = [DecayingRate(tau=SLOW_TAU_S) for _ in CLASSES]
    slow = [DecayingRate(tau=SLOW_TAU_S) for _ in CLASSES]
    on_budget: list[set[int]] = [set() for _ in CLASSES]  # waits on the budget (`waits_on_budget`), still waiting
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
            on_budget[history[i].cls].discard(i)
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
            on_budget[a.cls].discard(i)
            if i not in out.granted_at:  # a queue timeout: a slow rejection
                rejections[a.cls].bump(now)
                slow[a.cls].bump(now)
        else:
            arrivals[a.cls].bump(now)
            arrivals_fast[a.cls].bump(now)
            if table.try_acquire(str(i), a.cls, now):
                out.decisions[i] = "immediate"
                granted([str(i)], now)
                continue
            snap = table.snapshot(
                a.cls, a.tenant, released.read(now), now=now, release_n=released.n, inflight_avg=level.value,
                arrival_rates=(arrivals[0].read(now), arrivals[1].read(now), arrivals[2].read(now)),
                arrival_rates_fast=(arrivals_fast[0].read(now), arrivals_fast[1].read(now), arrivals_fast[2].read(now)),
                class_rates=(grants[0].read(now), grants[1].read(now), grants[2].read(now)))
            waiting = len(on_budget[a.cls]) if budget_in_air else 0
            chance = min_chance(classes[a.cls], rejections[a.cls].count(now), slow[a.cls].count(now), waiting) \
                if budget else None
            decision = queue_decision(a.cls, snap, classes, adm, rand=0.5, chance=chance)
            if isinstance(decision, Reject) and decision.reason == "early_drop" and i in force_enqueue:
                decision = Enqueue(None)
            if isinstance(decision, Reject) and decision.reason == "early_drop":
                out.drop_states.append((i, clone(table), snap, now))
            if isinstance(decision, Reject):
                rejections[a.cls].bump(now)
                out.decisions[i] = decision.reason
                out.retry_after[i] = decision.retry_after_s
                continue
            out.decisions[i] = "queued"
            out.wait_states.append((i, snap, chance))
            if chance is not None and waits_on_budget(a.cls, snap, classes, adm, chance):
                on_budget[a.cls].add(i)
            deadline = now + classes[a.cls].queue_timeout_s
            out.deadline[i] = deadline
            seq += 1
            heapq.heappush(events, (deadline, 1, seq, i))
            granted(table.enqueue(str(i), a.cls, a.tenant, deadline, now)[1], now)
    return out


def served_in_time(out: Outcome, history: list[Arrival], cls: int, until: float) -> int:
    """Requests of class `cls` arriving by `until` that were granted before their deadline
    (immediate grants included)."""
    n = 0
    for i, a in enumerate(history):
        if a.t > until:
            break
        if a.cls == cls and i in out.granted_at and (
                out.decisions.get(i) == "immediate" or out.granted_at[i] <= out.deadline[i]):
            n += 1
    return n


def wrongly_dropped(limit: int, classes: Mapping[int, ClassConfig], history: list[Arrival],
                    base: Outcome, sample: int | None = None, judged: tuple[int, ...] = CLASSES,
                    **kw: object) -> list[int]:
    """Early drops that cost their class a request served in time.

    The counterfactual: the same history with this one request enqueued instead and the rule
    applied to every other request as before. The drop was wrong if, there, the request is
    granted before its deadline AND its class serves more requests in time (of those arriving
    up to that deadline) than with the drop. If it is served only in place of a request of its
    class that the bounded queue then turns away or that then times out, the drop cost nothing:
    the grant loop serves a class no faster for a longer queue (that is why the queue is
    bounded), it only changes which of its requests it serves."""
    wrong = []
    drops = [i for i in base.early_drops() if history[i].cls in judged]
    if sample is not None and len(drops) > sample:
        step = len(drops) / sample
        drops = [drops[int(k * step)] for k in range(sample)]
    for i in drops:
        alt = replay(limit, classes, history, force_enqueue=frozenset({i}), **kw)  # type: ignore[arg-type]
        if i in alt.granted_at and alt.granted_at[i] <= alt.deadline[i]:
            cls, until = history[i].cls, alt.deadline[i]
            if served_in_time(alt, history, cls, until) > served_in_time(base, history, cls, until):
                wrong.append(i)
    return wrong


def clone(table: PermitTable) -> PermitTable:
    """A copy of `table` that shares nothing mutable with it (`copy.deepcopy`, but ~20x faster:
    the replays copy a table at every early drop)."""
    t = copy.copy(table)
    t.leases = {k: Lease(**v.__dict__) for k, v in table.leases.items()}
    t.queues = tuple([Waiter(**w.__dict__) for w in q]  # type: ignore[assignment]
                     for q in table.queues)
    t.gateways = dict(table.gateways)
    t.creditors = set(table.creditors)
    t.vtime, t.anon_next, t.flow_next = list(table.vtime), list(table.anon_next), dict(table.flow_next)
    return t


def granted_in_time_at_current_rate(table: PermitTable, snap: Snapshot, cls: int, timeout_s: float,
                                    now: float, future: list[tuple[float, int, str]] | None = None,
                                    tenant: str = "oracle") -> bool:
    """The rule's promise, checked on the real grant loop: enqueue the request into the grant
    loop's exact state and free permits at the current pool-wide release rate, each class
    freeing in proportion to what it holds. The requests that really arrive during its wait
    and would go before it (`future`: (time, class, tenant) of the history's arrivals that the
    run admitted or queued) join the grant loop when they arrive, as they do in the real one:
    every higher-class one, and, where the class is ordered fairly over tenants, those of its
    own class at their tenants' tags (a tenant with fewer waiters passes it: the grant loop's
    order, which early drop's place in the queue counts, `PermitTable.ahead`; left out, the
    judge called drops wrong that the grant loop would not have served in time, 7.75 % of P1's
    on the 40-tenant shape of `tests/policy_variety.py` where the counterfactual replay found
    none). The waiters already queued are served, not skipped: in the world where the rule is
    applied consistently each was let in because it would be served in time (a queue that
    only gets through because its waiters expire is the overlong queue the rule prevents). Is
    the request granted before its deadline?"""
    t = clone(table)
    for q in t.queues:
        for w in q:
            w.deadline = math.inf
    rate = snap.release_rate()
    deadline = now + timeout_s
    # (its own tenant: the grant loop orders a class fairly over tenants, PermitTable._put)
    if t.enqueue("me", cls, tenant, deadline, now)[0] == "granted":
        return True
    if rate <= 0:
        return False
    held = t.inflight()
    total = sum(held)
    if total == 0:
        return False
    # Each class frees its permits at its share of the rate (what it holds now), evenly.
    events = [(now + j * total / (rate * held[k]), 0, k, "") for k in CLASSES if held[k] > 0
              for j in range(1, math.floor(timeout_s * rate * held[k] / total + 1e-9) + 1)]
    events += [(at, 1, k, who if k == cls else "oracle") for at, k, who in (future or [])
               if now < at <= deadline and (k < cls or (k == cls and t.fair))]
    n = 0
    for at, kind, k, who in sorted(events):
        if kind == 1:
            n += 1
            if "me" in t.enqueue(f"f{n}", k, who, math.inf, at)[1]:
                return True
            continue
        ticket = next((tk for tk, lease in t.leases.items() if lease.cls == k), None)
        if ticket is None:
            continue
        _, got = t.release(ticket, at)
        if "me" in got:
            return True
    return False


def served_by_promise(out: Outcome, classes: Mapping[int, ClassConfig], history: list[Arrival],
                      counts: dict[tuple[int, str], tuple[int, int]] | None = None) -> dict[tuple[int, str], tuple[int, int]]:
    """How often the requests early drop let wait were served in time, by the chance the rule
    read for them (rates at their bound, as `WaitEstimate.certainly_over` reads them): 0.5-0.99
    (`mid`), >= 0.99 (`sure`), too few releases to read (`unsure`: it waits regardless), below
    the class's minimum (`budget`: let in by a slow-rejection budget). Classes told at once are
    left out (their promise is the other one). (class, bucket) -> (served in time, let wait),
    added to `counts` when given."""
    counts = {} if counts is None else counts
    shares = [classes[k].share for k in CLASSES]
    headroom = [classes[k].headroom for k in CLASSES]
    for i, snap, _ in out.wait_states:
        cls = history[i].cls
        c = classes[cls]
        if c.rejects_fast:
            continue
        est = wait_estimate(cls, snap, shares, headroom, arrivals=c.early_drop_counts_arrivals)
        scale = est._bound_scale(True)
        if scale is None:
            key = (cls, "unsure")
        else:
            chance = est.chance(c.queue_timeout_s, scale)
            key = (cls, "budget" if chance < c.early_drop_min_chance else "sure" if chance >= 0.99 else "mid")
        ok, n = counts.get(key, (0, 0))
        counts[key] = (ok + (i in out.granted_at and out.granted_at[i] <= out.deadline[i]), n + 1)
    return counts


def wrong_drops_at_current_rate(out: Outcome, classes: Mapping[int, ClassConfig],
                                history: list[Arrival], only: Container[int] = CLASSES) -> list[int]:
    """Early drops the grant loop would have granted before their deadline at the current
    release rate, with the higher-class requests that really arrived meanwhile (the rule's
    promise; target: none). Drops whose deadline lies past the history's last arrival are not
    judged: there the history stops arriving, which no rate could have foreseen. `only`: the
    classes to judge (each judgement replays the grant loop, so skip the ones not asked for)."""
    joined = [(a.t, a.cls, a.tenant) for j, a in enumerate(history) if out.decisions.get(j) in ("immediate", "queued")]
    end = history[-1].t if history else 0.0
    return [i for i, table, snap, now in out.drop_states
            if history[i].cls in only and now + classes[history[i].cls].queue_timeout_s <= end
            and granted_in_time_at_current_rate(table, snap, history[i].cls, classes[history[i].cls].queue_timeout_s,
                                                now, joined, history[i].tenant)]


__all__ = ["CLASSES", "Arrival", "Outcome", "granted_in_time_at_current_rate", "replay", "served_by_promise",
           "served_in_time", "wrong_drops_at_current_rate", "wrongly_dropped"]
