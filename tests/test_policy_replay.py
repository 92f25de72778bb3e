"""Early drop never turns away what the grant loop would serve in time (fake-clock replays).

Each history runs through the policy and the reference grant loop (tests/policy_replay.py).
Every early drop is checked against the rule's promise on the real grant loop: the grant
loop's exact state at that moment, the request enqueued, permits freed at the current release
rate, higher classes that are backlogged kept backlogged, and the waiters already queued
served (in the world where the rule is applied consistently each of them was let in because
it would be; counting on them to expire is how queues grew until every waiter waited its whole
timeout). Target: no such drop, over histories that drop thousands. Separately, a sample of
drops is replayed with the request enqueued and the real (random) service times: a few are
served in time by luck — releases came faster than the current rate — and their share is
bounded.
"""

from __future__ import annotations

import functools
import math
import random
import statistics

import pytest
from floodgate.extproc.config import AdmissionConfig, ClassConfig, PoolConfig
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import (
    SLOW_REJECT_SHARE,
    Enqueue,
    Snapshot,
    queue_decision,
    wait_estimate,
)

from tests.policy_replay import (
    Arrival,
    Outcome,
    granted_in_time_at_current_rate,
    replay,
    served_by_promise,
    wrong_drops_at_current_rate,
    wrongly_dropped,
)

SHIPPED = PoolConfig().classes
# The partitions shipped before the headroom (floors 50/30/10 %, none kept free for P0).
OLD_PARTITIONS = {0: SHIPPED[0].model_copy(update={"headroom": 0.0}), 1: SHIPPED[1].model_copy(update={"share": 0.3}),
                  2: SHIPPED[2].model_copy(update={"share": 0.1})}


def poisson(rng: random.Random, rate: float, start: float, end: float, cls: int,
            service: float, tenant: str = "t") -> list[Arrival]:
    out, t = [], start
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= end:
            break
        out.append(Arrival(t, cls, rng.expovariate(1 / service), tenant))
    return out


@functools.cache
def shipped_replay(seed: int) -> tuple[int, list[Arrival], Outcome]:
    """`random_history(seed)` replayed with the shipped classes, once per test session: several
    tests judge the same 40 replays (none changes an outcome)."""
    limit, history = random_history(seed)
    return limit, history, replay(limit, SHIPPED, history)


def random_history(seed: int) -> tuple[int, list[Arrival]]:
    rng = random.Random(seed)
    limit = rng.randint(2, 24)
    service = rng.uniform(0.3, 3.0)
    capacity = limit / service
    load = rng.uniform(0.6, 3.0)
    mix = [rng.random() for _ in range(3)]
    if rng.random() < 0.5:
        mix[rng.randrange(3)] *= 0.05  # one sparse class
    total = sum(mix)
    arrivals: list[Arrival] = []
    duration = 90.0
    # Phases: the load changes midway, so rates are sometimes stale.
    cut = rng.uniform(20, 70)
    factor = rng.choice([0.3, 1.0, 2.0])
    for cls in range(3):
        rate = capacity * load * mix[cls] / total
        arrivals += poisson(rng, rate, 0, cut, cls, service, tenant=rng.choice("ab"))
        arrivals += poisson(rng, rate * factor, cut, duration, cls, service, tenant=rng.choice("ab"))
    arrivals.sort(key=lambda a: a.t)
    return limit, arrivals


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk", range(4))
def test_no_early_drop_of_a_request_the_grant_loop_serves_in_time(chunk: int) -> None:
    """The rule's promise on the real grant loop at the current release rate, with the
    higher-class requests that really arrived during the wait jumping ahead (the oracle sees
    the future that the estimate can only take from rates). When first measured over the 40
    histories (`python -m tests.policy_tradeoff`; the figures of each change follow): 0.12 % of
    early drops with the shipped classes (48 of 40,089), against 1.9 % for the estimate before it counted higher-class arrivals, a class's
    permits above its reservation and the spread of few releases. The rest sit at abrupt load
    changes (a rate lags them). Seeds 30-39 had 57 of 4,084 (1.4 %) with the shipped classes
    until the higher classes' arrival rate was read at its lower confidence bound (16 of 3,946):
    a P1 above its small floor is reached only by the open path, whose drift that rate sets.

    The promise is P0's and P1's (0 and 14 of 15,135 drops over the 40 histories; 0 and 18
    before P2 had a reject target). The shipped P2 would rather be told at once
    (`slo_reject_s`): it waits only when 99 % sure at the pessimistic rates, so its promise is
    the other one — its rejections are at once: 7 queue timeouts of 29,385 P2 rejections (3,753
    of 28,696, 13 %, when it waited at 0.5), at the cost of 6,924 of its drops that the grant
    loop would have served in time at the current rate (30 before) and 6,978 P2s served in
    time instead of 7,667 (`python -m tests.policy_tradeoff --reject-target`).

    Since the grant loop orders each class fairly over tenants (leases.lua `fair`): 21 of
    14,998 P0/P1 drops over the 40 histories (0.14 %; 14 of 15,137 in arrival order). These
    histories switch each class's tenant at the load change, where the new tenant's first
    waiters now go ahead of the old one's: from there on a run takes another path. Seeds 30-39
    went from 12 of 1,583 to 16 of 1,593 (seed 38's drops at 61-62 s, in a queue of one tenant),
    so the bound per ten histories is 1.25 % (it was 1 %). A rule passes this by dropping less:
    `test_requests_let_wait_are_served_as_often_as_early_drop_promised` checks the other side."""
    wrong = drops = p2_timeouts = p2_drops = 0
    for seed in range(10 * chunk, 10 * chunk + 10):
        _, history, base = shipped_replay(seed)
        drops += sum(1 for i in base.early_drops() if history[i].cls < 2)
        wrong += len(wrong_drops_at_current_rate(base, SHIPPED, history, only=(0, 1)))
        p2_drops += sum(1 for i in base.early_drops() if history[i].cls == 2)
        p2_timeouts += sum(1 for i, d in base.decisions.items() if history[i].cls == 2 and d == "queued"
                           and not (i in base.granted_at and base.granted_at[i] <= base.deadline[i]))
    assert drops > 500 and p2_drops > 500
    assert wrong * 80 <= drops, f"{wrong} of {drops} P0/P1 early drops: granted in time at the current rate"
    assert p2_timeouts * 100 <= p2_drops + p2_timeouts, f"P2: {p2_timeouts} queue timeouts of {p2_drops + p2_timeouts}"


def bench_burst(seed: int, limit: int = 107, hold: float = 5.6,
                mix: tuple[float, float, float] = (0.2, 0.5, 0.3), sparse: bool = False) -> list[Arrival]:
    """The overload bench's plan on a pool like its Vegas limit: 14 s at 0.7x capacity, 20 s at
    3x, 10 s at 0.7x, mix 20/50/30 % P0/P1/P2 (or `mix`), hold times lognormal (sigma 0.5).
    With `sparse`, the bench's last phase too: 30 s at 1.5x where P0's share goes to P1 (P1
    alone ~1.05x capacity) and P0 arrives 0.3/s."""
    rng = random.Random(seed)
    cap = limit / hold
    out: list[Arrival] = []
    phases = [(0, 14, 0.7, mix), (14, 34, 3.0, mix), (34, 44, 0.7, mix)]
    if sparse:
        phases.append((44, 74, 1.5, (0.0, mix[0] + mix[1], mix[2])))
    for t0, t1, f, m in phases:
        for cls, share in enumerate(m):
            t = float(t0)
            while share > 0:
                t += rng.expovariate(cap * f * share)
                if t >= t1:
                    break
                out.append(Arrival(t, cls, rng.lognormvariate(math.log(hold) - 0.125, 0.5), rng.choice("ab")))
    if sparse:
        t = 44.0
        while (t := t + rng.expovariate(0.3)) < 74:
            out.append(Arrival(t, 0, rng.lognormvariate(math.log(hold) - 0.125, 0.5), rng.choice("ab")))
    return sorted(out, key=lambda a: a.t)


def p2_outcomes(classes: dict[int, ClassConfig], seeds: range = range(4),
                limits: tuple[int, ...] = (96, 107), ramp: tuple[float, float] | None = None,
                mix: tuple[float, float, float] = (0.2, 0.5, 0.3)) -> tuple[int, int, int]:
    """(queue timeouts, early drops, served in time) of P2 over the bench's whole plan (with the
    sparse phase) on pools of these limits (static-96, and about Vegas's burst limit)."""
    timeouts = drops = served = 0
    for limit in limits:
        for seed in seeds:
            history = bench_burst(seed, limit=limit, sparse=True, mix=mix)
            out = replay(limit, classes, history, ramp=ramp)
            for i, a in enumerate(history):
                if a.cls != 2:
                    continue
                d = out.decisions[i]
                in_time = i in out.granted_at and (d == "immediate" or out.granted_at[i] <= out.deadline[i])
                served += in_time
                timeouts += d == "queued" and not in_time
                drops += d == "early_drop"
    return timeouts, drops, served


@pytest.mark.timeout(400)
def test_p2_waiters_in_the_bench_rarely_time_out() -> None:
    """In the bench's burst P0/P1 arrive faster than the pool frees permits; in its sparse phase
    P1 alone offers ~1.05x capacity, so a P2 is reached only when P1's queue runs dry (a walk
    without drift: a coin toss for a class that waits at a chance of 0.5). With P2 waiting at
    0.5 like the other classes, 88 of 4,519 P2 rejections (1.9 %) over these 8 replays were
    queue timeouts (26 in the burst, 61 in the sparse phase), each a 429 a whole second late.
    The shipped P2 has a 10 ms reject target (`slo_reject_s`): it waits only when 99 % sure at
    the rates' pessimistic bounds — 0 timeouts of 4,538, for 832 P2s served in time instead of
    851 (-2.2 %); spending half of the p99's slow-rejection budget (`policy.min_chance`, the
    processor's rule, which `replay` follows), 0 of 4,537 and 833."""
    timeouts, drops, served = p2_outcomes(SHIPPED)
    assert drops > 4000 and served > 780
    assert timeouts * 100 <= timeouts + drops, f"{timeouts} timeouts of {timeouts + drops} P2 rejections"
    lenient = {**SHIPPED, 2: SHIPPED[2].model_copy(update={"slo_reject_s": 0.0, "early_drop_min_chance": 0.5})}
    lt, ld, ls = p2_outcomes(lenient)
    assert lt * 100 > lt + ld  # the rule it replaces: over 1 %
    assert served >= 0.95 * ls, f"P2 served in time {served} vs {ls} waiting at a chance of 0.5"


@pytest.mark.timeout(400)
def test_p2_waiters_rarely_time_out_under_the_onset_ramp() -> None:
    """With the shipped onset ramp a free permit reaches P2 only with a token of the ramp (while
    P0 is in flight), so P2 waited at 0.5 for permits that the ramp then handed to P1 first:
    182 queue timeouts of 4,752 P2 rejections (3.8 %) over the same 8 replays, 618 served in
    time. Counting only releases when the ramp paces it: 0 of 4,669, and 701 served in time
    (when this test was written; 1 of 4,676 and 694 now); with the slow-rejection budget, 7 of
    4,673 (0.15 %) and 697."""
    ramp = (PoolConfig().onset_ramp_burst, PoolConfig().onset_ramp_rate)
    timeouts, drops, served = p2_outcomes(SHIPPED, ramp=ramp)
    assert drops > 4000 and served > 600
    assert timeouts * 100 <= timeouts + drops, f"{timeouts} timeouts of {timeouts + drops} P2 rejections"


def p0_burst_waits(classes: dict[int, ClassConfig], p0: float, seeds: int = 3) -> list[float]:
    """Queue waits of the P0s that arrive in the bench burst with this share of P0 (P1/P2 split
    5:3 as in the bench), sorted; a P0 never granted counts as 99 s."""
    waits = []
    for seed in range(seeds):
        history = bench_burst(seed, mix=(p0, (1 - p0) * 5 / 8, (1 - p0) * 3 / 8))
        out = replay(107, classes, history)
        waits += [out.granted_at.get(i, 99.0) - a.t for i, a in enumerate(history) if a.cls == 0 and 14 <= a.t < 34]
    return sorted(waits)


@pytest.mark.parametrize("p0", [0.1, 0.2])
def test_p0_in_the_bench_burst_finds_a_permit_at_once(p0: float) -> None:
    """Shipped: P0 keeps 10 % of the limit as headroom and the floors below it are small (P1
    10 %, P2 none), so in the 3x burst with P0 at 10 % or 20 % of the arrivals (30 % / 60 % of
    what the pool frees) a P0 finds a permit on arrival (measured 100 % / 98.2 % over 4 seeds;
    with the fair order over the bench's two tenants, 98.5 % / wait p99 0.05 s over these 12
    seeds, 98.9 % / 0.02 s in arrival order; over 3 seeds one unlucky seed took it to 96.4 %).
    With the old partitions (P1 30 %, P2 10 %, no headroom) P0 at 20 % queued: it waited for a
    release whenever P1/P2 kept the pool full, and was capped at the 60 % their floors left
    it — its wait p99 was 2.7 s in this replay."""
    waits = p0_burst_waits(SHIPPED, p0, seeds=12)
    n = len(waits)
    assert n > 100
    assert sum(1 for w in waits if w == 0) >= 0.97 * n
    assert waits[int(0.99 * n)] < 0.1
    if p0 == 0.2:
        old = p0_burst_waits(OLD_PARTITIONS, p0)
        assert old[int(0.99 * len(old))] > 1.0


def test_p0_near_the_pools_capacity_queues_but_is_served() -> None:
    """Where no headroom helps: P0 at 30 % of the 3x burst is 90 % of what the pool frees, at
    the 90 % that P1's floor leaves it, so it queues (measured: 57 % found a permit at once,
    wait p99 2.5 s) — but every one is granted within its 20 s."""
    waits = p0_burst_waits(SHIPPED, 0.3)
    n = len(waits)
    assert sum(1 for w in waits if w == 0) < 0.8 * n
    assert waits[-1] < SHIPPED[0].queue_timeout_s


def test_drops_served_by_luck_are_few() -> None:
    """Replayed with the dropped request enqueued (real service times, every other decision by
    the rule), a dropped request is sometimes granted in time AND its class serves one more
    request in time by then: the drop was wrong as a user counts it. Most such drops sat behind
    waiters that then timed out (the rule counts every waiter ahead as served: an independent
    review), a few saw releases come faster than the rate said. Judged on P0's and P1's drops
    (the shipped P2 would rather be told at once, so it is dropped on a pessimistic estimate by
    design). Measured: 9 of 49 sampled drops here; `python -m tests.policy_counterfactual` (more
    drops) reads 23 % of P0's and 19 % of P1's (docs/admission.md, "How often a drop is wrong").
    Bounded here at 1 in 4: a regression guard, not issue 9's goal (none)."""
    lucky = checked = 0
    for seed in range(0, 40, 2):
        limit, history, base = shipped_replay(seed)
        checked += min(4, sum(1 for i in base.early_drops() if history[i].cls < 2))
        lucky += len(wrongly_dropped(limit, SHIPPED, history, base, sample=4, judged=(0, 1)))
    assert checked > 40
    assert lucky * 4 <= checked, f"{lucky} of {checked} drops were served in time in the replay"


def test_the_replays_do_drop_early_and_the_queue_serves_its_waiters() -> None:
    """Guard against a vacuous property: overloaded histories must produce early drops; and the
    bounded queue does its job: most requests that are turned away are turned away at once."""
    drops = timeouts = 0
    for seed in range(40):
        *_, out = shipped_replay(seed)
        drops += len(out.early_drops())
        timeouts += sum(1 for i, d in out.decisions.items()
                        if d == "queued" and not (i in out.granted_at and out.granted_at[i] <= out.deadline[i]))
    assert drops > 2000
    assert timeouts < drops


def test_requests_let_wait_are_served_as_often_as_early_drop_promised() -> None:
    """The other side of the wrong-drop check, which a rule passes by dropping less: a P0/P1
    request early drop let wait because the grant loop reaches it before its deadline with
    chance >= `early_drop_min_chance` (0.5; rates at their bound, as the rule reads them) is
    served in time at least that often, and one let in at 0.99 or more nearly always.

    Measured over the 40 histories with the shipped classes: waits let in at 0.5-0.99 served
    63.6 % (P0, 910) and 63.0 % (P1, 9,070); at >= 0.99, 98.1 % and 97.1 %. A variant tried on
    2026-12-06 that counted only the higher arrivals sure to come (0 wrong drops; reverted)
    served its P1 waits 52 % and 91.7 %: it let in P1s the P0s then kept from a permit, and
    fails the second bound here. (By bucket the chance is not calibrated: P0s let in at 0.95-0.99 just
    before a tenant switch, where the other tenant's later arrivals pass them in the fair order,
    were served 43 %; so the promise is checked over the range, not per bucket.)"""
    counts: dict[tuple[int, str], tuple[int, int]] = {}
    for seed in range(40):
        _, history, out = shipped_replay(seed)
        served_by_promise(out, SHIPPED, history, counts)
    for cls in (0, 1):
        (ok_mid, n_mid), (ok_sure, n_sure) = counts[(cls, "mid")], counts[(cls, "sure")]
        assert n_mid > 500 and n_sure > 3000, counts
        assert ok_mid >= SHIPPED[cls].early_drop_min_chance * n_mid, (cls, ok_mid, n_mid)
        assert ok_sure >= 0.95 * n_sure, (cls, ok_sure, n_sure)


def saturated_background(rng: random.Random, limit: int, service: float, end: float) -> list[Arrival]:
    """P1 and P2 at 2x capacity: the pool stays full with a standing queue."""
    cap = limit / service
    return (poisson(rng, 1.2 * cap, 0, end, 1, service) + poisson(rng, 0.8 * cap, 0, end, 2, service))


def test_sparse_p0_into_a_saturated_pool_is_never_dropped_early() -> None:
    rng = random.Random(5)
    limit, service, end = 10, 1.0, 600.0
    history = saturated_background(rng, limit, service, end) + poisson(rng, 0.2, 10, end, 0, service)
    history.sort(key=lambda a: a.t)
    out = replay(limit, SHIPPED, history)
    p0 = [i for i, a in enumerate(history) if a.cls == 0]
    assert len(p0) > 80
    assert [i for i in p0 if out.decisions[i] not in ("immediate", "queued")] == []
    assert all(i in out.granted_at for i in p0)
    # ... and P0 waits about one release: its reservation holds the others back.
    waits = sorted(out.granted_at[i] - history[i].t for i in p0)
    assert waits[len(waits) // 2] < 2 * service / limit * 3
    # the background is shed (most of it is never granted), so this is not an idle pool
    assert sum(1 for i, a in enumerate(history) if a.cls > 0 and i not in out.granted_at) > 1000


def test_twenty_p0_after_forty_seconds_of_silence_are_all_admitted() -> None:
    rng = random.Random(6)
    limit, service = 10, 1.0
    background = saturated_background(rng, limit, service, 120.0)
    burst = [Arrival(60.0 + k * 0.01, 0, rng.expovariate(1 / service)) for k in range(20)]
    early_p0 = [Arrival(15.0, 0, 0.5)]  # P0 seen once, 45 s before the burst
    history = sorted(background + burst + early_p0, key=lambda a: a.t)
    out = replay(limit, SHIPPED, history)
    idx = [i for i, a in enumerate(history) if a.cls == 0 and a.t >= 60.0]
    assert len(idx) == 20
    assert all(out.decisions[i] in ("immediate", "queued") for i in idx)
    # capacity frees at ~10 permits/s: all twenty are granted within their 20 s timeout
    assert all(i in out.granted_at and out.granted_at[i] <= out.deadline.get(i, history[i].t) for i in idx)


def test_p2_inside_its_reservation_gets_the_next_release() -> None:
    """Limit 10, in flight (6, 4, 0), queued (3, 3, 0): the grant loop gives a new P2 the next
    freed permit (its reservation of 1 holds P0 and P1 back), so it must not be dropped. (With
    P2's floor of 10 %, as shipped before, and no reject target; the shipped P2 has neither: a
    P2 that would rather be told at once is turned away here, as one release of a turnover of
    2/s misses its 1 s one time in five, far above the 1 % its 10 ms reject target allows.)"""
    shares = [OLD_PARTITIONS[k].share for k in range(3)]
    snap = Snapshot(10, (6, 4, 0), (3, 3, 0), 0, grant_rate=2.0, release_n=200,
                    class_rates=(1.2, 0.8, 0.0))
    est = wait_estimate(2, snap, shares)
    assert est.releases == 1 and est.seconds == pytest.approx(0.5)
    waits = {**OLD_PARTITIONS, 2: OLD_PARTITIONS[2].model_copy(update={"slo_reject_s": 0.0, "early_drop_min_chance": 0.5})}
    assert isinstance(queue_decision(2, snap, waits, AdmissionConfig(), rand=0.3), Enqueue)
    assert not isinstance(queue_decision(2, snap, OLD_PARTITIONS, AdmissionConfig(), rand=0.3), Enqueue)
    # and the grant loop agrees: one release later the P2 holds the permit
    t = PermitTable(limit=10, shares=(0.5, 0.3, 0.1))
    for k, n in enumerate((6, 4, 0)):
        for j in range(n):
            t.adopt(f"h{k}{j}", k)
    for k, n in enumerate((3, 3, 0)):
        for j in range(n):
            t.enqueue(f"w{k}{j}", k, "t", 100.0, 0.0)
    assert t.enqueue("p2", 2, "t", 100.0, 0.0)[0] == "queued"
    assert t.release("h00", 0.1)[1] == ["p2"]


def test_degraded_local_table_same_rule() -> None:
    """Degraded mode runs the same policy on the local permit table with this process's share
    of the last seen rate: the replay with a small local limit keeps the property (P0/P1: no
    drop of a request served in time; P2, which would rather be told at once: queue timeouts
    within the half of its p99 budget early drop spends, `policy.SLOW_REJECT_SHARE` of its
    rejections: 2 of 2,476 here, none when it always waits at 99 %)."""
    wrong_total = drops = p2_timeouts = p2_rejected = 0
    for seed in range(6):
        limit, history = random_history(100 + seed)
        local = max(1, limit // 3)  # one of three gateways' share
        base = replay(local, SHIPPED, history, warm_rate=(local / 1.5, 30.0))
        drops += len(base.early_drops())
        wrong_total += len(wrong_drops_at_current_rate(base, SHIPPED, history, only=(0, 1)))
        p2_timeouts += sum(1 for i, d in base.decisions.items() if history[i].cls == 2 and d == "queued"
                           and not (i in base.granted_at and base.granted_at[i] <= base.deadline[i]))
        p2_rejected += sum(1 for i, d in base.decisions.items() if history[i].cls == 2
                           and d not in ("queued", "immediate"))
    assert drops > 0
    assert wrong_total == 0
    assert p2_rejected > 1000 and p2_timeouts <= SLOW_REJECT_SHARE * (p2_rejected + p2_timeouts)


def test_few_releases_never_drop() -> None:
    shares = [SHIPPED[k].share for k in range(3)]
    snap = Snapshot(10, (5, 3, 2), (0, 500, 0), 0, grant_rate=0.5, release_n=4)
    assert not wait_estimate(1, snap, shares).certainly_over(1.5)
    d = queue_decision(1, Snapshot(10, (5, 3, 2), (0, 999, 0), 0, grant_rate=0.5, release_n=4),
                       {k: ClassConfig(**{**SHIPPED[k].model_dump(), "max_queue": 5000}) for k in range(3)},
                       AdmissionConfig(), 0.1)
    assert isinstance(d, Enqueue)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["onoff", "tenants", "heavytail", "slowpool"])
def test_on_shapes_the_random_histories_lack_p0_is_never_wrongly_dropped(name: str) -> None:
    """An independent review's shapes (tests/policy_variety.py; docs/admission.md states its
    figures): P0 was never dropped where the grant loop would have served it in time, while P1's
    wrong drops rose to 2-9 % of its early drops (on/off bursts 8.6 %). Pinned here: P0 at 0, P1
    at most the review's level plus a margin (a worse estimate fails this)."""
    from tests.policy_variety import run

    res = run(name, range(1), sample_cf=0)
    p0, p1 = res["per_class"][0], res["per_class"][1]
    assert p0["wrong"] == 0, res["examples"]
    assert p1["wrong"] <= max(3, 0.12 * p1["drops"]), (p1, res["examples"])


@pytest.mark.parametrize("name", ["flash", "onoff", "p0ramp"])
def test_on_shapes_the_random_histories_lack_p0_waits_are_served_as_promised(name: str) -> None:
    """The other side for P0 on the review's shapes (seed 0; `python -m tests.policy_variety
    --served`): P0 waits let in at a chance of 0.5-0.99 are served in time at least half the
    time, at 0.99 or more 95 % of it (flash 258 of 258, on/off 309 of 309, the P0 ramp 640 of
    765 and 835 of 867). P1 does not keep it on burst onsets and with many tenants, nor P0 at
    85 % P0 (docs/admission.md, "The other side"): not pinned here."""
    from tests.policy_variety import served_counts

    counts = served_counts(name, range(1))
    ok, n = counts.get((0, "sure"), (0, 0))
    assert n > 200 and ok >= 0.95 * n, counts
    ok, n = counts.get((0, "mid"), (0, 0))
    assert ok >= SHIPPED[0].early_drop_min_chance * n, counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["mostlyp0", "p0ramp"])
def test_retry_after_of_an_early_dropped_p0_says_when_the_next_one_gets_in(name: str) -> None:
    """An independent review (tests/policy_variety.py, 'RA' lines): under P0 overload an
    early-dropped P0 was told its own predicted wait, past its 20 s timeout by construction
    (a median 26 s), while the next P0 the replay admitted and served came a median 0.16 s
    later: a client that obeys idled the whole time. Told when the drop test would let a
    newcomer in, it says the smallest Retry-After (1-2 s) nearly always."""
    from tests.policy_variety import run

    res = run(name, range(1), sample_cf=0)
    told = [(ra, actual) for ra, actual in res["retry"][0] if math.isfinite(actual)]
    assert len(told) > 100, len(told)  # P0 is early-dropped here
    too_long = sum(1 for ra, actual in told if ra > max(3 * actual, 2))
    assert too_long <= 0.05 * len(told), (too_long, len(told))  # before: all of them
    assert statistics.median(ra for ra, _ in told) <= 2


def _idle_then_flash(seed: int) -> list[Arrival]:
    """Limit 8, 1 s mean generations: busy 60 s, idle 90 s, then 60 P0 within 0.3 s from one
    client and P0 at 4/s (half the pool's capacity) for 30 s (a review's history)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while t < 60:
        t += rng.expovariate(6.0)
        out.append(Arrival(t, 0, rng.expovariate(1.0), "t"))
    out += [Arrival(150.0 + 0.3 * k / 60, 0, rng.expovariate(1.0), "t") for k in range(60)]
    t = 150.3
    while t < 180:
        t += rng.expovariate(4.0)
        out.append(Arrival(t, 0, rng.expovariate(1.0), "t"))
    return sorted(out, key=lambda a: a.t)


@pytest.mark.parametrize("seed", range(3))
def test_a_p0_burst_after_an_idle_spell_is_not_dropped_on_the_rates_warm_up(seed: int) -> None:
    """After an idle spell the decayed release rate reads ~n / 10 s for the first n releases of
    a burst. Trusting 8 releases, P0s the grant loop serves in time were dropped from the 9th
    release on (a review: 18 drops in six seeds, 14 wrong by the counterfactual judge); the
    shipped MIN_RELEASES waits past that warm-up."""
    h = _idle_then_flash(seed)
    out = replay(8, PoolConfig().classes, h)
    dropped = [i for i, d in out.decisions.items() if d == "early_drop" and h[i].t >= 150]
    assert dropped == [] or not wrongly_dropped(8, PoolConfig().classes, h, out, judged=(0,)), dropped


def test_the_judge_lets_a_lighter_tenant_pass_in_the_fair_order() -> None:
    """`granted_in_time_at_current_rate` replays the grant loop's order: a later P1 of a tenant
    with no waiter goes ahead of a tenant with two (leases.lua `fair`), so "me", the heavy
    tenant's third, needs one release more. With releases for exactly three before its deadline
    it is served in time without that arrival, and not with it; an arrival of the same tenant
    (behind it) or in arrival order (`fair` off) changes nothing."""
    def judge(future: list[tuple[float, int, str]], fair: bool = True) -> bool:
        t = PermitTable(limit=2, shares=(0.0, 0.0, 0.0), headroom=(0.0, 0.0, 0.0), fair=fair)
        assert t.try_acquire("a", 1, 0.0) and t.try_acquire("b", 1, 0.0)
        for k in range(2):
            t.enqueue(f"h{k}", 1, "heavy", math.inf, 0.0)
        snap = Snapshot(limit=2, inflight=(0, 2, 0), queued=(0, 2, 0), tenant_queued=2, grant_rate=2.0)
        return granted_in_time_at_current_rate(t, snap, 1, 1.6, 0.0, future, tenant="heavy")

    assert judge([])  # releases at 0.5, 1.0, 1.5 s: h0, h1, me
    assert not judge([(0.2, 1, "light")])  # "light" goes before "me": 4 releases needed
    assert judge([(0.2, 1, "heavy")])  # behind it
    assert judge([(0.2, 1, "light")], fair=False)  # arrival order: behind it
    assert not judge([(0.2, 0, "anyone")])  # a higher class goes first in any order


@pytest.mark.timeout(300)
def test_no_wrong_early_drop_when_p0_and_p1_do_not_count_arrivals_still_to_come() -> None:
    """With `early_drop_counts_arrivals: false` on P0 and P1, none of their early drops is of a
    request the grant loop serves in time (the shipped classes: 21 of 14,998 over the 40
    histories, all P1s turned away on P0 arrivals a rate predicted where fewer came). Over the 40:
    0 of 11,897, with 120 more P1s served in time and 6,683 P1 queue timeouts instead of 3,698;
    here seeds 30-39, where the shipped classes have 16 of 1,593 (0 of 992 with the setting)."""
    waits = {k: c.model_copy(update={"early_drop_counts_arrivals": k == 2}) for k, c in SHIPPED.items()}
    wrong = drops = 0
    for seed in range(30, 40):
        limit, history = random_history(seed)
        out = replay(limit, waits, history)
        drops += sum(1 for i in out.early_drops() if history[i].cls < 2)
        wrong += len(wrong_drops_at_current_rate(out, waits, history, only=(0, 1)))
    assert drops > 500
    assert wrong == 0, f"{wrong} of {drops} P0/P1 early drops: granted in time at the current rate"
