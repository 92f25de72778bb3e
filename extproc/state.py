"""Cluster-wide admission state in Redis: a thin async wrapper over `leases.lua`.

This is also Floodgate's public state API: the controller reads a pool's queue depth, in-flight
count and limit through `read_pool_status` (it may import this module; extproc never imports
the controller). Every pool's keys share one hash tag (`fg:{pool}:...`), so one Lua script sees
them all in one Redis Cluster slot. redis-py's `Script` reloads the script on NOSCRIPT.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from floodgate.extproc.vegas import VegasState

_LUA = resources.files("floodgate.extproc").joinpath("leases.lua").read_text()
_KEY_NAMES = ("leases", "lmeta", "queue", "qmeta", "qdl", "counts", "state", "gws", "active", "epinf", "lep",
              "creditors")


def pool_keys(pool: str) -> list[str]:
    return [f"fg:{{{pool}}}:{name}" for name in _KEY_NAMES]


def gateway_channel(gateway_id: str) -> str:
    return f"fg:gw:{gateway_id}"


@dataclass(frozen=True)
class PoolStatus:
    """One consistent read of a pool's shared state."""

    granted: bool
    limit: int
    inflight: tuple[int, int, int]
    queued: tuple[int, int, int]
    tenant_queued: int
    grant_rate: float
    live_gateways: int
    server_ms: int
    endpoint: str = ""  # where the granted request is routed (endpoint picking), else ""
    active_endpoints: int = 0
    partial: bool = False  # an immediate grant: only `granted` and `endpoint` are filled in
    class_rate: float = 0.0  # recent grants per second to the asking request's class
    credits: tuple[str, ...] = ()  # extra leases granted for local admission (see leases.lua)

    @property
    def inflight_total(self) -> int:
        return sum(self.inflight)

    @property
    def queued_total(self) -> int:
        return sum(self.queued)


def _status(raw: list[Any]) -> PoolStatus:
    v = [x.decode() if isinstance(x, bytes) else x for x in raw]
    if v[0] == "g":  # the short reply of an immediate grant (the hot path)
        return PoolStatus(True, 0, (0, 0, 0), (0, 0, 0), 0, 0.0, 0, 0, str(v[1]), 0, partial=True,
                          credits=tuple(str(c) for c in v[2:]))
    return PoolStatus(
        granted=int(v[0]) == 1,
        limit=int(v[1]),
        inflight=(int(v[2]), int(v[3]), int(v[4])),
        queued=(int(v[5]), int(v[6]), int(v[7])),
        tenant_queued=int(v[8]),
        grant_rate=float(v[9]),
        live_gateways=int(v[10]),
        server_ms=int(v[11]),
        endpoint=str(v[12]) if len(v) > 12 else "",
        active_endpoints=int(v[13]) if len(v) > 13 else 0,
        class_rate=float(v[14]) if len(v) > 14 else 0.0,
    )


@dataclass(frozen=True)
class LimitRecord:
    state: VegasState
    version: int


class PoolState:
    """The shared state of one pool. Every call is one atomic script run."""

    def __init__(self, client: aioredis.Redis, pool: str, *, lease_ttl_s: float,
                 initial_limit: int, shares: tuple[float, float, float], picking: bool = False,
                 always: tuple[bool, bool, bool] = (False, False, False)) -> None:
        self.client = client
        self.pool = pool
        self.keys = pool_keys(pool)
        self._script = client.register_script(_LUA)
        self._common = [str(int(lease_ttl_s * 1000)), str(initial_limit),
                        # a reservation kept `always` travels as a negative share (leases.lua)
                        *(repr(-s if a else s) for s, a in zip(shares, always, strict=True)),
                        pool, "1" if picking else "0"]

    async def _run(self, op: str, *args: Any) -> Any:
        return await self._script(keys=self.keys, args=[op, *self._common, *args])

    async def acquire(self, ticket: str, gateway: str, cls: int, tenant: str, credits: int = 0) -> PoolStatus:
        return _status(await self._run("acquire", ticket, gateway, cls, tenant, credits))

    async def return_credits(self, *tickets: str) -> None:
        if tickets:
            await self._run("return_credits", *tickets)

    async def enqueue(self, ticket: str, gateway: str, cls: int, tenant: str, timeout_s: float) -> PoolStatus:
        return _status(await self._run("enqueue", ticket, gateway, cls, tenant, int(timeout_s * 1000)))

    async def cancel(self, ticket: str) -> int:
        """0: removed from the queue; 1: it had been granted (the caller owns a permit); 2: gone."""
        return int(await self._run("cancel", ticket))

    async def release(self, *tickets: str) -> int:
        return int(await self._run("release", *tickets)) if tickets else 0

    async def renew(self, gateway: str, tickets: list[str]) -> list[str]:
        lost = await self._run("renew", gateway, *tickets)
        return [t.decode() if isinstance(t, bytes) else str(t) for t in lost]

    async def granted_among(self, tickets: list[str]) -> dict[str, str]:
        """Which of these waiting tickets hold a permit now, and the endpoint each was routed to."""
        if not tickets:
            return {}
        got = [t.decode() if isinstance(t, bytes) else str(t) for t in await self._run("mine", *tickets)]
        return dict(zip(got[::2], got[1::2], strict=True))

    async def status(self) -> PoolStatus:
        return _status(await self._run("status"))

    async def get_limit(self) -> LimitRecord:
        raw = [x.decode() if isinstance(x, bytes) else x for x in await self._run("get_limit")]
        st = VegasState(limit=float(raw[0]), rtt_noload=float(raw[1]), probe_count=int(raw[2]),
                        probe_jitter=float(raw[3]))
        return LimitRecord(st, int(raw[4]))

    async def set_limit(self, expected_version: int, st: VegasState) -> bool:
        raw = await self._run("set_limit", expected_version, repr(st.limit), repr(st.rtt_noload),
                              st.probe_count, repr(st.probe_jitter))
        return int(raw[0]) == 1


async def read_pool_status(client: aioredis.Redis, pool: str, *, lease_ttl_s: float = 15.0,
                           initial_limit: int = 16,
                           shares: tuple[float, float, float] = (0.5, 0.3, 0.1)) -> PoolStatus:
    """Queue depth per class, in-flight per class and the current limit of `pool` (for the controller)."""
    return await PoolState(client, pool, lease_ttl_s=lease_ttl_s, initial_limit=initial_limit,
                           shares=shares).status()


def redis_client(url: str, *, password: str | None = None, op_timeout_s: float = 0.25) -> aioredis.Redis:
    """A client whose calls fail fast: a dead Redis must degrade admission, not hang it."""
    return aioredis.Redis.from_url(
        url, password=password, socket_timeout=op_timeout_s, socket_connect_timeout=op_timeout_s,
        health_check_interval=0, retry_on_timeout=False, decode_responses=False)
