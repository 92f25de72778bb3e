"""The onset ramp on the reference permit table, with a fake clock (leases.lua is checked against
the same table in tests/test_state.py)."""

from __future__ import annotations

import math

from floodgate.extproc.config import PoolConfig
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import (
    RAMP_MIN_BURST,
    RAMP_MIN_BURST_PER_ENDPOINT,
    RAMP_MIN_RATE_PER_ENDPOINT_S,
    RAMP_MIN_RATE_S,
    ramp_burst,
    ramp_floors,
    ramp_paces,
    ramp_refill,
)


def table(limit: int = 100, burst: float = 0.08, rate: float = 0.1) -> PermitTable:
    return PermitTable(limit=limit, shares=(0.5, 0.1, 0.0), ramp_burst=burst, ramp_rate=rate,
                       ramp_min_rate=RAMP_MIN_RATE_S)


def arrive(t: PermitTable, n: int, cls: int, now: float, tag: str) -> list[str]:
    """n requests of class `cls` at `now`: those admitted at once; the rest wait (deadline far)."""
    got = []
    for i in range(n):
        ticket = f"{tag}{i}"
        if t.try_acquire(ticket, cls, now):
            got.append(ticket)
        else:
            t.enqueue(ticket, cls, "", math.inf, now)
    return got


def test_bucket_arithmetic() -> None:
    assert ramp_burst(100, 0.08) == 8.0
    assert ramp_burst(10, 0.08) == RAMP_MIN_BURST  # a small limit still admits a few at once
    assert ramp_refill(None, 0.0, 5.0, 100, 0.08, 0.1) == 8.0  # never used: full
    assert math.isclose(ramp_refill(0.0, 1.0, 1.5, 100, 0.08, 0.1), 5.0)  # 0.1 x 100 per s for 0.5 s
    assert ramp_refill(2.0, 1.0, 100.0, 100, 0.08, 0.1) == 8.0  # never above the burst
    assert ramp_refill(-3.0, 1.0, 1.0, 100, 0.08, 0.1) == -3.0  # no time, no tokens
    assert ramp_paces(1, (1, 0, 0)) and ramp_paces(2, (3, 5, 0))
    assert not ramp_paces(0, (1, 0, 0))  # P0 is never paced
    assert not ramp_paces(1, (0, 40, 0))  # no P0 in flight: nothing to protect
    # a small limit still grows at the floor rate, not at 0.1 x L (2 per second here)
    assert math.isclose(ramp_refill(0.0, 0.0, 0.5, 20, 0.08, 0.1, RAMP_MIN_RATE_S), 0.5 * RAMP_MIN_RATE_S)
    assert ramp_refill(0.0, 0.0, 0.5, 20, 0.08, 0.1, RAMP_MIN_RATE_S, min_burst=2.0) == 2.0


def test_the_floors_grow_with_the_active_endpoints() -> None:
    # The pool-wide floors were chosen on 2 replicas: 4 each at once and per second.
    assert RAMP_MIN_BURST_PER_ENDPOINT * 2 == RAMP_MIN_BURST and RAMP_MIN_RATE_PER_ENDPOINT_S * 2 == RAMP_MIN_RATE_S
    assert ramp_floors(0) == (RAMP_MIN_BURST, RAMP_MIN_RATE_S)  # unknown (nothing registered)
    assert ramp_floors(2) == (RAMP_MIN_BURST, RAMP_MIN_RATE_S)  # the overload bench's pool: as before
    assert ramp_floors(6) == (24.0, 24.0)
    assert ramp_floors(-1) == (RAMP_MIN_BURST, RAMP_MIN_RATE_S)
    assert ramp_floors(6, per_endpoint_burst=0.0, per_endpoint_rate=0.0) == (RAMP_MIN_BURST, RAMP_MIN_RATE_S)


def test_a_pool_of_many_endpoints_paces_at_its_endpoints_floor() -> None:
    # The elastic bench's burst 2 (limit 80, six replicas): 0.08 x L at once (6.4) and 0.1 x L per
    # second (8) gave a clump of P2 8 at once and 8 per second with 40 permits free.
    t = PermitTable(limit=80, shares=(0.5, 0.1, 0.0), ramp_burst=0.08, ramp_rate=0.1, ramp_min_rate=RAMP_MIN_RATE_S,
                    ramp_ep_burst=RAMP_MIN_BURST_PER_ENDPOINT, ramp_ep_rate=RAMP_MIN_RATE_PER_ENDPOINT_S, endpoints=6)
    assert arrive(t, 1, 0, 0.0, "p0-") == ["p0-0"]
    assert len(arrive(t, 40, 2, 0.0, "a")) == 23  # 24 at once, the P0 took one
    assert len(t.mine([], 0.5)[1]) == 12  # 24 per second
    assert t.snapshot(2, "", 10.0).ramp_refill == 24.0  # what early drop reads the pacing at
    t.endpoints = 0  # none registered: the pool-wide floors
    assert t.snapshot(2, "", 10.0).ramp_refill == RAMP_MIN_RATE_S


def test_lower_classes_grow_by_the_burst_then_at_the_rate_while_p0_runs() -> None:
    t = table()
    assert arrive(t, 1, 0, 0.0, "p0-") == ["p0-0"]  # P0 in flight (took a token: 7 left)
    got = arrive(t, 40, 1, 0.0, "a")
    assert len(got) == 7  # the rest of the burst at once, although 92 permits are free
    assert t.queued() == [0, 33, 0]
    # 10 tokens per second accrue (0.1 x L): half a second later 5 more waiters are granted
    assert len(t.mine([], 0.5)[1]) == 5
    assert len(t.mine([], 1.0)[1]) == 5
    # P0 is never paced: it takes a free permit at once with the bucket empty
    assert arrive(t, 3, 0, 1.0, "p0b-") == ["p0b-0", "p0b-1", "p0b-2"]
    assert t.tokens is not None and t.tokens < 0
    # a completion gives its token back: what completes is replaced, but the P0s' growth counts:
    # of 5 completions, 3 tokens pay for the 3 P0s, 2 waiters take the other 2
    _, granted = t.release_many(["a0", "a1", "a2", "a3", "a4"], 1.0)
    assert len(granted) == 2
    _, granted = t.release_many(["a5"], 1.0)
    assert len(granted) == 1


def test_without_p0_in_flight_nothing_is_paced() -> None:
    t = table()
    assert len(arrive(t, 40, 1, 0.0, "a")) == 40  # an idle pool's spike goes in at once
    assert t.tokens is not None and t.tokens < 0  # ... but counts as growth
    # P0 arrives: lower classes wait until the growth is paid back (completions, time)
    assert arrive(t, 1, 0, 0.0, "p0-") == ["p0-0"]
    assert arrive(t, 1, 1, 0.0, "b") == []
    assert t.mine([], 3.0)[1] == []  # 30 tokens accrued: still below 1 (-33 + 30)
    assert t.mine([], 3.5)[1] == ["b0"]


def test_off_by_rate_zero_and_shipped_on() -> None:
    t = table(rate=0.0)
    assert arrive(t, 1, 0, 0.0, "p0-") == ["p0-0"]
    assert len(arrive(t, 40, 1, 0.0, "a")) == 40
    assert t.tokens is None
    pool = PoolConfig()
    assert pool.onset_ramp_rate > 0 and pool.onset_ramp_burst > 0


def test_a_small_limit_is_not_paced_below_the_floors() -> None:
    # 20 lower-class requests at once into a pool of limit 20 with a P0 running: the burst floor
    # (8) goes at once and the rest follow at the floor rate, not at 0.1 x 20 = 2 per second
    t = table(limit=20)
    assert arrive(t, 1, 0, 0.0, "p0-") == ["p0-0"]
    assert len(arrive(t, 19, 1, 0.0, "a")) == RAMP_MIN_BURST - 1
    granted = [g for k in range(1, 5) for g in t.mine([], 0.25 * k)[1]]  # the grant loop runs often
    assert len(granted) == RAMP_MIN_RATE_S  # in one second


class _HoldClass:
    """A pacer (models only, extproc.permits.Pacer) that holds one class and records grants."""

    def __init__(self, held: int) -> None:
        self.held = held
        self.grants: list[tuple[int, int]] = []  # (class, in-flight before the grant)

    def open(self, cls: int, now: float, inflight: object, limit: int, head_deadline: float | None) -> bool:
        return cls != self.held

    def granted(self, cls: int, now: float, inflight: object, limit: int) -> None:
        self.grants.append((cls, sum(inflight)))  # type: ignore[call-overload]


def test_a_pacer_holds_its_class_and_lets_the_others_past() -> None:
    pacer = _HoldClass(1)
    t = PermitTable(limit=2, shares=(0.0, 0.0, 0.0), pacer=pacer)
    assert t.try_acquire("a", 2, 0.0) and t.try_acquire("b", 2, 0.0)  # the pool is full
    assert t.enqueue("p1", 1, "", 10.0, 0.0) == ("queued", [])
    assert t.enqueue("p2", 2, "", 10.0, 0.0) == ("queued", [])
    # a release: the held P1 at the head stays queued; the P2 behind it goes
    assert t.release("a", 1.0) == (True, ["p2"])
    assert t.queued() == [0, 1, 0]
    # an arriving P1 is not admitted at once either, a P0 is
    assert t.release("b", 1.0) == (True, [])
    assert not t.try_acquire("p1b", 1, 1.0)
    assert t.try_acquire("p0", 0, 1.0)
    assert pacer.grants == [(2, 0), (2, 1), (2, 1), (0, 1)]
    # without a pacer the same history grants the P1 first
    u = PermitTable(limit=2, shares=(0.0, 0.0, 0.0))
    assert u.try_acquire("a", 2, 0.0) and u.try_acquire("b", 2, 0.0)
    u.enqueue("p1", 1, "", 10.0, 0.0)
    u.enqueue("p2", 2, "", 10.0, 0.0)
    assert u.release("a", 1.0) == (True, ["p1"])
