"""A fixed list of endpoints (replicas someone else runs): sleep and wake only.

Nothing can be created or destroyed, so `start` claims a free endpoint and wakes it, and
`stop` puts it to sleep and frees it. Replica ids are the configured names (or the endpoints);
`start(id)` may therefore return a handle with a *different* id than asked for, which the
controller adopts. The free/claimed split lives in memory: after a restart every endpoint is
claimed again, and the controller shrinks the warm pool back down as usual.
"""

from __future__ import annotations

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
        self._roles: dict[str, Role] = {}
        self._session: aiohttp.ClientSession | None = None

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
        rid = replica_id if replica_id in self._stopped else next(iter(sorted(self._stopped)), None)
        if rid is None:
            raise NoFreeEndpoint(f"all {len(self.endpoints)} static endpoints are in use")
        try:
            await self._client(rid).wake(self.timeout_s)
        except VllmError:
            pass  # unreachable now: the controller's health wait decides
        self._stopped.discard(rid)
        return self._handle(rid)

    async def stop(self, replica_id: str) -> None:
        if replica_id not in self.endpoints or replica_id in self._stopped:
            return
        try:
            await self._client(replica_id).sleep(1, self.timeout_s)
        except VllmError:
            pass  # a dead endpoint is as stopped as it gets
        self._stopped.add(replica_id)

    async def set_role(self, replica_id: str, role: Role) -> None:
        self._roles[replica_id] = role

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
