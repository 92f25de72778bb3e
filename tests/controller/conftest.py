"""Fixtures for the pure controller core: a fake clock and signal builders."""

from __future__ import annotations

from pathlib import Path

import pytest
from floodgate.controller.signals import (
    PoolSignals,
    QueueSignal,
    ReplicaMetrics,
    ReplicaState,
    ReplicaView,
)
from floodgate.sim.arrivals import DEFAULT_TRACE

TRACE = DEFAULT_TRACE  # the Azure trace shipped with the package (floodgate/sim/data)


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def views(now: float, active: int = 0, loading: int = 0, warm: int = 0, draining: int = 0) -> tuple[ReplicaView, ...]:
    out: list[ReplicaView] = []
    for i in range(active):
        out.append(ReplicaView(f"a{i}", ReplicaState.ACTIVE, now - 1000))
    for i in range(loading):
        out.append(ReplicaView(f"l{i}", ReplicaState.LOADING, now - 10))
    for i in range(warm):
        out.append(ReplicaView(f"w{i}", ReplicaState.WARM, now - 1000, asleep=True))
    for i in range(draining):
        out.append(ReplicaView(f"d{i}", ReplicaState.DRAINING, now - 5, inflight=1, running=1))
    return tuple(out)


def signals(
    now: float,
    reps: tuple[ReplicaView, ...],
    running: float = 0.0,
    waiting: float = 0.0,
    queue: float = 0.0,
    kv: float = 0.0,
    stale_ids: frozenset[str] = frozenset(),
    failed_ids: frozenset[str] = frozenset(),
    queue_ok: bool = True,
    queue_age: float = 0.0,
) -> PoolSignals:
    """Spread running/waiting evenly over the active replicas; everything fresh unless told."""
    active = [r for r in reps if r.state is ReplicaState.ACTIVE]
    n = max(1, len(active))
    ms = tuple(
        ReplicaMetrics(
            r.replica_id,
            now - (60.0 if r.replica_id in stale_ids else 0.0),
            r.replica_id not in failed_ids,
            waiting / n,
            running / n,
            kv,
        )
        for r in active
    )
    return PoolSignals("p", ms, QueueSignal(queue, now - queue_age, queue_ok))


def trace_or_skip() -> Path:
    if not TRACE.is_file():
        pytest.skip(f"Azure trace not found at {TRACE} (floodgate/sim/data/README.md)")
    return TRACE
