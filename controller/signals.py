"""Plain data the pure controller core reads: per-pool signals and replica views.

The scrapers (live) or the simulator fill these; the policy, forecaster and warm-pool planner
only read them. Every measured value carries the time it was taken and whether the scrape
succeeded, because a failed or stale scrape must never be read as zero (docs/controller.md): a scrape
outage would otherwise look like an idle pool and trigger a scale-down.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # runtime imports would be circular (capacity -> vllm -> signals)
    from floodgate.controller.capacity import TickLatency
    from floodgate.controller.demand import FloodgateCounters, GatewayCounters


class ReplicaState(StrEnum):
    """Lifecycle states of one model replica (see `controller.lifecycle`)."""

    COLD = "cold"  # known slot, no process yet
    LOADING = "loading"  # process starting, model loading
    WARMING = "warming"  # server up, warm-up request in flight (not ready)
    WARM = "warm"  # loaded and warmed up, serving nothing (asleep when sleep mode is on)
    WAKING = "waking"  # being promoted: wake + one-token warm-up, then active
    ACTIVE = "active"  # in the registry as a target for new requests
    DRAINING = "draining"  # gets no new requests, finishing in-flight ones
    FAILED = "failed"  # crashed or failed its warm-up; must be terminated
    TERMINATED = "terminated"  # gone


# States whose capacity will become servable without a new cold start decision: counted as
# "incoming" so the policy does not order a second wave while the first is loading.
INCOMING_STATES: frozenset[ReplicaState] = frozenset(
    {ReplicaState.COLD, ReplicaState.LOADING, ReplicaState.WARMING, ReplicaState.WAKING}
)


@dataclass(frozen=True, slots=True)
class ReplicaMetrics:
    """One vLLM `/metrics` scrape of one replica.

    `ok` is False when the scrape failed (timeout, refused, parse error); values are then
    meaningless. `scraped_at` is the controller's clock at scrape time; the policy treats a
    sample older than `PolicyConfig.stale_after_s` as stale.
    """

    replica_id: str
    scraped_at: float
    ok: bool = True
    waiting: float = 0.0  # vllm:num_requests_waiting
    running: float = 0.0  # vllm:num_requests_running
    kv_cache_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1


@dataclass(frozen=True, slots=True)
class QueueSignal:
    """Floodgate's own queue for the pool (all priority classes), read from Redis.

    Requests held here never reach vLLM's waiting queue, so the policy adds both.
    """

    depth: float
    scraped_at: float
    ok: bool = True


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """Everything measured about one pool at one tick."""

    pool: str
    replicas: tuple[ReplicaMetrics, ...]
    queue: QueueSignal | None  # None: Floodgate queue not wired (e.g. admission disabled)
    # Raw inputs of offered demand and learned capacity (None: not measured / not wired); the
    # decider turns them into `lacking` and `capacity` below before the policy reads them.
    counters: FloodgateCounters | None = None  # Floodgate's per-class demand counters
    gateway: GatewayCounters | None = None  # Envoy's gateway listener counters
    latency: TickLatency | None = None  # TTFT/ITL deltas of the fresh active replicas
    # Demand admission turned away, as concurrency the pool lacks (`controller.demand`:
    # turned-away rate x measured service time, excluded classes left out). 0 when unknown:
    # a stale offered-demand read adds nothing, so only served demand is counted.
    lacking: float = 0.0
    lacking_stale: bool = False  # offered demand was wired but its counters are stale
    # Offered concurrency since a step (`demand.burst_concurrency`), 0 when unknown or when the
    # pool kept up: sizes scale-up only, never scale-down. `burst` sizes; the policy acts on
    # it only when `burst_low` (the confident lower bound) is beyond the current size.
    burst: float = 0.0
    burst_low: float = 0.0
    # The same step at its rate's point estimate and upper bound, and whether requests were
    # turned away since it: the policy's first reaction to a confirmed step (`policy.burst_reaction`).
    burst_mid: float = 0.0
    burst_high: float = 0.0
    burst_shed: bool = False
    # Learned per-replica capacity (`controller.capacity`); None: the configured
    # `target_concurrency` sizes the pool.
    capacity: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What the controller knows about one replica: lifecycle state plus load.

    `inflight` is Floodgate's in-flight count for the endpoint (from the lease table);
    `running` is what the engine holds: vLLM's `num_requests_running` plus
    `num_requests_waiting` (`engine_held`). Both must reach 0 before a drain completes.
    `last_busy_at` orders replicas by idleness when choosing one to drain. `busy`: an operation
    on it is in flight (a sleep, a wake); the controller starts no other one until it ends.
    `outdated`: it runs another command than the one configured now (the process actuator
    records each replica's; a controller restarted with a new model or flags adopts the old
    ones): replaced as the pool allows (`lifecycle.plan_pool`).
    """

    replica_id: str
    state: ReplicaState
    state_since: float
    inflight: int = 0
    running: int = 0
    asleep: bool = False
    last_busy_at: float = 0.0
    busy: bool = False
    outdated: bool = False


def engine_held(ok: bool, running: float, waiting: float, previous: int) -> int:
    """Requests a replica's engine holds, from one scrape: running plus waiting. A request still in
    vLLM's waiting queue (not yet scheduled, or waiting for a LoRA adapter or remote KV blocks)
    is lost if the replica stops, so a drain must not end on `running` 0 alone. A failed scrape
    (`ok` false) is at least 1: unknown is not idle, and a drain does not end on it."""
    if not ok:
        return max(1, previous)
    return int(running + waiting)


def count_states(replicas: tuple[ReplicaView, ...]) -> dict[ReplicaState, int]:
    """Number of replicas per state (every state present, zeros included)."""
    counts = dict.fromkeys(ReplicaState, 0)
    for r in replicas:
        counts[r.state] += 1
    return counts
