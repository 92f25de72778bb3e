"""A fixed list of endpoints (replicas someone else runs): sleep and wake only.

Nothing can be created or destroyed, so `start` claims a free endpoint and wakes it, and
`stop` puts it to sleep and frees it. Replica ids are the configured names (or the endpoints);
`start(id)` may therefore return a handle with a *different* id than asked for, which the
controller adopts. The free/claimed split lives in memory: after a restart every endpoint is
claimed again; the controller adopts the ones it finds asleep as sleeping pool replicas and
trims the pool back down as usual, without waking them.

A free endpoint that did not answer when it was last stopped (dead, or down for maintenance)
goes to the back of the line: `start` claims the endpoints that answered first, so one dead
endpoint cannot hold every scale-up to its health timeout while a healthy one is free.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import aiohttp
from floodgate.controller.actuators.base import NoCapacity, ReplicaHandle, Role
from floodgate.controller.vllm import VllmClient, VllmError


class NoFreeEndpoint(NoCapacity):
    pass


class StaticActuator:
    name = "static"

    def __init__(self, endpoints: Mapping[str, str] | list[str], *, timeout_s: float = 120.0) -> None:
        self.endpoints: dict[str, str] = (
            dict(endpoints) if isinstance(endpoints, Mapping) else {ep: ep for ep in endpoints})
        self.timeout_s = timeout_s
        self._stopped: set[str] = set()
        self._unreachable_at: dict[str, float] = {}  # free endpoints that did not answer, when
        self._roles: dict[str, Role] = {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def capacity(self) -> int:
        """Every endpoint is one replica, active or asleep: there are no more."""
        return len(self.endpoints)

    def _client(self, rid: str) -> VllmClient:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return VllmClient(self._session, self.endpoints[rid], timeout_s=self.timeout_s)

    def _handle(self, rid: str) -> ReplicaHandle:
        return ReplicaHandle(rid, self.endpoints[rid], rid not in self._stopped, self._roles.get(rid))

    async def list(self) -> list[ReplicaHandle]:
        return [self._handle(rid) for rid in self.endpoints]

    async def start(self, replica_id: str) -> ReplicaHandle | None:
        if replica_id in self.endpoints and replica_id not in self._stopped:
            return self._handle(replica_id)
        if replica_id in self._stopped:
            rid: str | None = replica_id
        else:  # the ones that answered last first, then the longest unreachable
            rid = min(self._stopped, key=lambda r: (self._unreachable_at.get(r, 0.0), r), default=None)
        if rid is None:
            raise NoFreeEndpoint(f"all {len(self.endpoints)} static endpoints are in use")
        try:
            await self._client(rid).wake(self.timeout_s)
        except VllmError:
            # Unreachable now: the controller's health wait decides; if it is freed again, it
            # is claimed last.
            self._unreachable_at[rid] = time.monotonic()
        self._stopped.discard(rid)
        return self._handle(rid)

    async def stop(self, replica_id: str) -> None:
        if replica_id not in self.endpoints or replica_id in self._stopped:
            return
        try:
            await self._client(replica_id).sleep(1, self.timeout_s)
        except VllmError:
            # A dead endpoint is as stopped as it gets; claimed last next time.
            self._unreachable_at[replica_id] = time.monotonic()
        else:
            self._unreachable_at.pop(replica_id, None)
        self._stopped.add(replica_id)

    async def set_role(self, replica_id: str, role: Role) -> None:
        self._roles[replica_id] = role

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
