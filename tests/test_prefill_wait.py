"""Early drop under prefill pacing (policy.WaitEstimate.prefill_chance, with a fake clock).

While a P0 is in flight, prefill-aware picking grants a lower class only while the least
endpoint estimate is at most the pace level (extproc/prefill.py). A lower-class request that
would rather be told at once (shipped P2) waits only when that pacing is sure to let it in
before its timeout; these tests check the chance early drop reads against a simulation of the
pacing itself (`PrefillEstimate`, the model the grant script is tested against)."""

from __future__ import annotations

import random

from floodgate.extproc.backends import _snapshot
from floodgate.extproc.config import AdmissionConfig, PoolConfig
from floodgate.extproc.policy import Enqueue, Reject, WaitEstimate, queue_decision
from floodgate.extproc.prefill import PrefillEstimate, PrefillSettings
from floodgate.extproc.schema import PoolSettings, PoolStatus

ON = PrefillSettings(rate=6000.0, request_tokens=512.0, pace_tokens=512.0)


def simulate(levels: list[float], ahead: int, lam0: float, lam1: float, t_end: float,
             rng: random.Random) -> bool:
    """One run of the pacing: endpoints at `levels` (tokens, now = 0), `ahead` paced waiters
    before the request; P0s arrive at lam0 (never paced, routed to the least estimate), P1s at
    lam1 (paced, ahead of the request). Is the request granted by `t_end` (seconds)?"""
    est = PrefillEstimate(ON)
    eps = [f"e{i}" for i in range(len(levels))]
    for ep, lv in zip(eps, levels, strict=True):
        est.levels[ep] = (lv, 0)
    lam = lam0 + lam1
    now = 0.0
    t_arr = rng.expovariate(lam) if lam > 0 else float("inf")
    while True:
        ms = int(now * 1000)
        least = est.least(eps, ms)
        t_open = now + max(0.0, least - ON.pace_tokens) / ON.rate
        # the script grants at whole ms: the first ms the least is at the pace level
        t_open = max(now, (int(t_open * 1000) + (0 if t_open * 1000 == int(t_open * 1000) else 1)) / 1000)
        if min(t_open, t_arr) > t_end:
            return False
        if t_arr < t_open:
            now = t_arr
            if rng.random() < lam0 / lam:
                est.routed(est.pick(eps, {}, 0, int(now * 1000)), int(now * 1000))
            else:
                ahead += 1
            t_arr = now + rng.expovariate(lam)
            continue
        now = t_open
        est.routed(est.pick(eps, {}, 0, int(now * 1000)), int(now * 1000))
        if ahead == 0:
            return True
        ahead -= 1


def estimate(levels: list[float], higher_queued: int, ahead: int, lam: float) -> WaitEstimate:
    """What wait_estimate gives prefill_chance, from what the script reports (pfw, pfb)."""
    least = min(levels)
    return WaitEstimate(ahead=ahead, free=100, gap=0, rate=50.0, class_rate=0.0, samples=500,
                        higher_queued=higher_queued, higher_arrivals=lam,
                        pf_rate=len(levels) * ON.rate / ON.request_tokens,
                        pf_wait=max(0.0, least - ON.pace_tokens) / ON.rate,
                        pf_backlog=sum(max(0.0, lv - ON.pace_tokens) for lv in levels) / ON.request_tokens)


def test_prefill_chance_is_a_lower_bound_of_the_pacing() -> None:
    """Random pools (1-8 endpoints, estimates up to 6,000 tokens, waiters ahead, P0/P1 arrivals):
    the chance early drop reads is never above the simulated share granted in time by more than
    the simulation's own noise (so a P2 let wait is let in), and where the pacing lets the
    request in nearly always, the reading says it is likely (so it is not turned away)."""
    rng = random.Random(11)
    runs = 400
    sure_but_low = checked = 0
    for _ in range(60):
        n = rng.randint(1, 8)
        levels = [rng.uniform(0, 6000) for _ in range(n)]
        hq, ahead = rng.randint(0, 6), rng.randint(0, 6)
        lam0, lam1 = rng.uniform(0, 30), rng.uniform(0, 30)
        t_end = rng.choice((0.5, 1.0, 2.0))
        p = estimate(levels, hq, ahead, lam0 + lam1).prefill_chance(t_end)
        f = sum(simulate(levels, hq + ahead, lam0, lam1, t_end, rng) for _ in range(runs)) / runs
        assert p <= f + 0.06, (levels, hq, ahead, lam0, lam1, t_end, p, f)
        if f >= 0.999:
            checked += 1
            sure_but_low += p < 0.5
    assert checked >= 10  # the sure cases were exercised
    assert sure_but_low <= checked // 5, (sure_but_low, checked)


def shipped_pool() -> tuple[PoolConfig, AdmissionConfig, PoolSettings]:
    pool = PoolConfig(name="p", endpoint_picking=True)
    settings = PoolSettings(140, (0.5, 0.1, 0.0), picking=True, ramp_burst=pool.onset_ramp_burst,
                            ramp_rate=pool.onset_ramp_rate, pf_rate=pool.prefill_tokens_per_s,
                            pf_size=pool.prefill_request_tokens, pf_k=pool.prefill_pace_tokens)
    return pool, AdmissionConfig(), settings


def test_a_p2_paced_only_by_prefill_waits_for_it() -> None:
    """The elastic bench's late P2 drops: a clump with a P0 in flight, permits free (50 of 140
    in flight on 8 endpoints), the prefill estimates 300 tokens above the pace level each. The
    pacing lets ~94 requests per second in from 50 ms on; the shipped P2 (1 s timeout, told at
    once when unsure) waits instead of being turned away. Before, the snapshot read prefill
    pacing as a gate with no way in but releases, and the same request was dropped."""
    pool, adm, settings = shipped_pool()
    assert pool.classes[2].rejects_fast
    st = PoolStatus(granted=False, limit=140, inflight=(14, 30, 6), queued=(0, 0, 0), grant_rate=30.0,
                    release_n=400, inflight_avg=48.0, active_endpoints=8, pf_wait=0.05, pf_backlog=8 * 300.0)
    arrivals = ((6.0, 18.0, 8.0), (9.0, 24.0, 10.0))  # P0/P1 arriving fast (a clump)
    decision = queue_decision(2, _snapshot(st, arrivals, settings), pool.classes, adm, 0.5)
    assert isinstance(decision, Enqueue), decision


def test_a_p2_the_prefill_cannot_reach_in_time_is_told_at_once() -> None:
    pool, adm, settings = shipped_pool()
    arrivals = ((6.0, 18.0, 8.0), (9.0, 24.0, 10.0))
    # one endpoint, 7,000 tokens above the pace level: the first paced grant is 1.17 s away
    st = PoolStatus(granted=False, limit=140, inflight=(14, 30, 6), queued=(0, 0, 0), grant_rate=30.0,
                    release_n=400, inflight_avg=48.0, active_endpoints=1, pf_wait=7000 / 6000, pf_backlog=7000.0)
    decision = queue_decision(2, _snapshot(st, arrivals, settings), pool.classes, adm, 0.5)
    assert isinstance(decision, Reject) and decision.reason == "early_drop"
    # 8 endpoints, but 60 P1 waiting ahead: more than a second of paced grants
    st = PoolStatus(granted=False, limit=140, inflight=(14, 30, 6), queued=(0, 60, 0), grant_rate=30.0,
                    release_n=400, inflight_avg=48.0, active_endpoints=8, pf_wait=0.05, pf_backlog=8 * 300.0)
    decision = queue_decision(2, _snapshot(st, arrivals, settings), pool.classes, adm, 0.5)
    assert isinstance(decision, Reject) and decision.reason == "early_drop"
