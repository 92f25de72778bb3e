"""Baselines: Kubernetes HPA- and Knative KPA-style autoscalers over a plain ReplicaSet.

They get none of Floodgate's warm-pool behaviour: a pod that finishes loading becomes Ready
and serves (no sleeping pool, no wake in seconds), a scale-down deletes surplus pods at once
(not-ready pods first, as the ReplicaSet controller does) and every new pod is a cold start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from floodgate.controller.backtest.engine import demand_of
from floodgate.controller.decider import Signals
from floodgate.controller.lifecycle import Action, ActionKind
from floodgate.controller.signals import ReplicaState, ReplicaView

S = ReplicaState


@dataclass(frozen=True, slots=True)
class ReplicaSetPlan:
    actions: tuple[Action, ...]
    next_seq: int


def plan_replicaset(
    desired: int,
    replicas: Sequence[ReplicaView],
    now: float,
    max_drain_s: float,
    next_seq: int,
    prefix: str = "r",
) -> ReplicaSetPlan:
    """Actions that make a ReplicaSet of `desired` pods: loaded pods serve at once; surplus pods
    are removed at once, not-ready ones first, then the least busy serving ones (drained for
    their in-flight requests, force-stopped after `max_drain_s`, never kept)."""
    acts: list[Action] = []
    pipeline: list[ReplicaView] = []
    serving: list[ReplicaView] = []
    for r in replicas:
        st = r.state
        if st is S.FAILED:
            acts.append(Action(ActionKind.TERMINATE, r.replica_id, "failed"))
        elif st is S.WARM:
            # Loaded and warmed up = Ready: the Service routes to it now.
            acts.append(Action(ActionKind.PROMOTE, r.replica_id, "ready"))
            serving.append(r)
        elif st in (S.ACTIVE, S.WAKING):
            serving.append(r)
        elif st in (S.COLD, S.LOADING, S.WARMING):
            pipeline.append(r)
        elif st is S.DRAINING:
            if now - r.state_since >= max_drain_s:
                acts.append(Action(ActionKind.FORCE_STOP, r.replica_id, "grace_period"))
            elif r.inflight == 0 and r.running == 0:
                acts.append(Action(ActionKind.TERMINATE, r.replica_id, "scaled_down"))
    have = len(pipeline) + len(serving)
    seq = next_seq
    if desired > have:
        for _ in range(desired - have):
            acts.append(Action(ActionKind.START, f"{prefix}{seq}", "scale_up"))
            seq += 1
    elif desired < have:
        surplus = have - desired
        for r in sorted(pipeline, key=lambda r: (-r.state_since, r.replica_id))[:surplus]:
            acts.append(Action(ActionKind.TERMINATE, r.replica_id, "scale_down"))
            surplus -= 1
        promoted = {a.replica_id for a in acts if a.kind is ActionKind.PROMOTE}
        order = sorted(serving, key=lambda r: (r.replica_id not in promoted, r.inflight + r.running,
                                               r.last_busy_at, r.replica_id))
        for r in order[: max(0, surplus)]:
            if r.replica_id in promoted:
                # Not routed to yet: delete it (the PROMOTE above is withdrawn).
                acts = [a for a in acts if a.replica_id != r.replica_id]
                acts.append(Action(ActionKind.TERMINATE, r.replica_id, "scale_down"))
            elif r.state is S.WAKING:
                continue  # becomes active within a second; removed next tick if still surplus
            else:
                acts.append(Action(ActionKind.DRAIN, r.replica_id, "scale_down"))
    return ReplicaSetPlan(tuple(acts), seq)


@dataclass
class HPAController:
    """Kubernetes HPA semantics on a concurrency metric: every `sync_s`,
    desired = ceil(current × metric/target) outside a ±tolerance band, scale-up limited to
    max(4 pods, 100 %) per sync, scale-down to the max recommendation of the last
    `down_stabilization_s`."""

    name: str
    target: float
    min_replicas: int
    max_replicas: int
    max_drain_s: float
    sync_s: float = 15.0
    tolerance: float = 0.1
    down_stabilization_s: float = 300.0
    instant_start: bool = False
    admission: bool = False  # no Floodgate admission in front
    desired: int | None = None
    last_sync: float = -math.inf
    recs: list[tuple[float, int]] = field(default_factory=list)
    seq: int = 0

    def _desired(self, signals: Signals, now: float) -> int:
        active, incoming, demand = demand_of(signals)
        current = active + incoming
        if self.desired is None:
            self.desired = max(current, self.min_replicas)
        if now - self.last_sync < self.sync_s - 1e-9:
            return self.desired
        self.last_sync = now
        base = max(current, 1)
        ratio = demand / (base * self.target)
        rec = current if abs(ratio - 1) <= self.tolerance else math.ceil(base * ratio - 1e-9)
        rec = min(rec, max(2 * current, current + 4))
        self.recs = [(t, r) for t, r in self.recs if now - t < self.down_stabilization_s]
        self.recs.append((now, rec))
        stab = max(r for _, r in self.recs)
        desired = rec if rec > self.desired else min(self.desired, stab)
        self.desired = min(max(desired, self.min_replicas), self.max_replicas)
        return self.desired

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        p = plan_replicaset(self._desired(signals, now), signals.replicas, now, self.max_drain_s, self.seq)
        self.seq = p.next_seq
        return p.actions


@dataclass
class KPAController:
    """Knative KPA semantics: concurrency averaged over a 60 s stable and a 6 s panic window;
    panic when the panic-window recommendation is ≥ 2× the ready pods; in panic never scale
    down; leave panic after a stable window without the condition; scale down at most to half
    per tick; no scale-down delay (Knative's default)."""

    name: str
    target: float
    min_replicas: int
    max_replicas: int
    max_drain_s: float
    stable_s: float = 60.0
    panic_s: float = 6.0
    panic_threshold: float = 2.0
    max_scale_down_rate: float = 2.0
    instant_start: bool = False
    admission: bool = False  # no Floodgate admission in front
    samples: list[tuple[float, float]] = field(default_factory=list)
    desired: int | None = None
    panic_since: float | None = None
    seq: int = 0

    def _desired(self, signals: Signals, now: float) -> int:
        active, incoming, demand = demand_of(signals)
        self.samples = [(t, v) for t, v in self.samples if now - t < self.stable_s]
        self.samples.append((now, demand))
        stable = sum(v for _, v in self.samples) / len(self.samples)
        recent = [v for t, v in self.samples if now - t < self.panic_s]
        panic_avg = sum(recent) / len(recent)
        want_stable = math.ceil(stable / self.target - 1e-9)
        want_panic = math.ceil(panic_avg / self.target - 1e-9)
        ready = max(active, 1)
        if self.desired is None:
            self.desired = max(active + incoming, self.min_replicas)
        if want_panic / ready >= self.panic_threshold:
            self.panic_since = now
        elif self.panic_since is not None and now - self.panic_since >= self.stable_s:
            self.panic_since = None
        if self.panic_since is not None:
            desired = max(want_panic, self.desired)
        else:
            desired = max(want_stable, math.floor(ready / self.max_scale_down_rate))
        self.desired = min(max(desired, self.min_replicas), self.max_replicas)
        return self.desired

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        p = plan_replicaset(self._desired(signals, now), signals.replicas, now, self.max_drain_s, self.seq)
        self.seq = p.next_seq
        return p.actions
