"""The actuator interface: the only thing that differs between local processes, a static list
of endpoints and Kubernetes.

Actuators own *where replicas run*; they do not talk to vLLM. Sleep, wake, warm-up requests
and metrics go through the replica's HTTP API (`controller/vllm.py`) the same way for every
actuator, so the lifecycle logic is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

Role = Literal["active", "warm-pool"]


class NoCapacity(RuntimeError):
    """`start` has nothing to start a replica on (every static endpoint is in use): the pool is
    at the platform's size, which is not a failing start (no start backoff)."""


class ActuatorUnavailable(RuntimeError):
    """The platform cannot be asked now (its API down, restarting, overloaded or unreachable):
    the controller skips the tick that needed it, as on a Redis outage, and asks again next
    tick. Anything else an actuator raises from `list` stops the controller (a bug, or a
    setting that no retry fixes)."""


@dataclass(frozen=True)
class ReplicaHandle:
    """A replica as the actuator sees it."""

    replica_id: str
    endpoint: str | None  # "host:port" of its OpenAI/vLLM API, once known
    running: bool  # exists and is not terminating (process alive, pod not deleted)
    role: Role | None = None  # last role set (Kubernetes: pod label app-state)
    labels: Mapping[str, str] = field(default_factory=dict)


class Actuator(Protocol):
    """Start/stop/label replicas. Every call is idempotent: a restarted controller may repeat one."""

    name: str
    @property
    def capacity(self) -> int | None:
        """The most replicas that can exist at once (a static list's length); None: as many as
        the platform gives (or a scaler adds: EndpointSlices). The controller plans no start
        beyond it (`PoolController`)."""
        ...

    async def list(self) -> list[ReplicaHandle]:
        """Every replica that exists now: what a restarted controller rebuilds its view from."""
        ...

    async def start(self, replica_id: str) -> ReplicaHandle | None:
        """Cold-start a replica (weights start loading). Returns its handle, or None when the
        platform names replicas itself (Kubernetes): it then appears in `list()` later."""
        ...

    async def stop(self, replica_id: str) -> None:
        """Terminate a replica (after it drained, or a force-stop). Unknown ids are ignored."""
        ...

    async def set_role(self, replica_id: str, role: Role) -> None:
        """Record the replica's role where the platform shows it (pod label); may be a no-op."""
        ...

    async def close(self) -> None:
        """Release client resources (not the replicas)."""
        ...
