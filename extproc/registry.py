"""The replica registry in Redis: which endpoints serve a pool, and in which state.

The controller writes it (it owns replica lifecycles); the processor's Lua script reads the
`active` set to route each admitted request to the least-loaded active endpoint, and keeps a
per-endpoint count of permits held (`epinf`), which the controller reads to know when a
draining endpoint is idle. Part of extproc's public state API; key names in `schema.py`,
the processor-side picking in `picking.py`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from floodgate.extproc.redis_client import OUTAGE_ERRORS
from floodgate.extproc.schema import (
    ACTIVE,
    CTL_ARRIVING,
    CTL_CEILING,
    ENDPOINTS,
    EPINF,
    REGISTRY_CHANGED,
    gateway_channel,
    key,
)
from redis.exceptions import ResponseError

log = logging.getLogger("floodgate.registry")

STATES = ("loading", "warm", "active", "draining", "sleeping")


@dataclass(frozen=True)
class Endpoint:
    endpoint: str  # "host:port"
    state: str
    replica_id: str
    since_ms: int
    inflight: int = 0  # permits held by requests Floodgate routed here
    meta: dict[str, Any] = field(default_factory=dict)


class Registry:
    def __init__(self, client: aioredis.Redis, pool: str) -> None:
        self.client = client
        self.pool = pool
        self.k_endpoints = key(pool, ENDPOINTS)
        self.k_active = key(pool, ACTIVE)
        self.k_epinf = key(pool, EPINF)
        self.k_ceiling = key(pool, CTL_CEILING)
        self.k_arriving = key(pool, CTL_ARRIVING)
        self.k_gws = key(pool, "gws")

    async def set(self, endpoint: str, state: str, replica_id: str, meta: dict[str, Any] | None = None) -> None:
        """Record an endpoint's state; only `active` endpoints receive new requests."""
        if state not in STATES:
            raise ValueError(f"unknown endpoint state {state!r} (one of {', '.join(STATES)})")
        # Stamped with Redis's clock, not the writer's: the next controller (another host, or
        # this one after a clock step) compares it with Redis's TIME (controller.app.adopted_view).
        doc = json.dumps({"state": state, "replica": replica_id, "since_ms": await self.server_ms(),
                          "meta": meta or {}})
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.k_endpoints, endpoint, doc)
            if state == "active":
                pipe.sadd(self.k_active, endpoint)
            else:
                pipe.srem(self.k_active, endpoint)
            _, changed = await pipe.execute()
        if changed:
            await self.notify()

    async def server_ms(self) -> int:
        """Redis's clock (TIME), in ms: what `since_ms` is stamped with and read against."""
        sec, usec = await self.client.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def remove(self, endpoint: str) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(self.k_endpoints, endpoint)
            pipe.srem(self.k_active, endpoint)
            _, changed = await pipe.execute()
        if changed:
            await self.notify()

    async def notify(self) -> int:
        """Tell the pool's processors that the active set or the ceiling changed: `pool|!registry`
        on each live gateway's channel (schema.gateway_channel, the channel its grants come on),
        so they read the registry now instead of at their next once-a-second refresh. A new
        active replica serves only once the processors route to it (and count it under the
        ceiling): up to a second of its capacity was lost at every promotion. Best effort:
        a message that does not arrive leaves the refresh. Returns the processors reached."""
        msg = f"{self.pool}|{REGISTRY_CHANGED}"
        reached = 0
        try:
            for gw in await self.client.zrange(self.k_gws, 0, -1):
                ch = gateway_channel(gw.decode() if isinstance(gw, bytes) else str(gw), self.pool)
                try:
                    reached += int(await self.client.spublish(ch, msg))
                except ResponseError:  # Redis 6: no sharded pub/sub (the processors SUBSCRIBE)
                    reached += int(await self.client.publish(ch, msg))
        except OUTAGE_ERRORS as exc:
            log.debug("registry notify of pool %s failed: %s", self.pool, exc)
        return reached

    async def inflight(self, endpoint: str) -> int:
        return _count(await self.client.hget(self.k_epinf, endpoint))

    async def endpoints(self) -> dict[str, Endpoint]:
        """Every endpoint of the registry by its document; an endpoint in the `active` set without
        a readable document (another writer, or a document malformed since) is listed `active`
        with no replica id: processors route to what the set holds, so the controller must see it
        to take it out (`PoolController._drop_orphans`; a review: such an entry was routed to and
        never removed)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.k_endpoints)
            pipe.hgetall(self.k_epinf)
            pipe.smembers(self.k_active)
            docs, inflight, active = await pipe.execute()
        out: dict[str, Endpoint] = {}
        counts = {k.decode("utf-8", "replace"): _count(v) for k, v in inflight.items()}
        for raw_ep, raw_doc in docs.items():
            ep = raw_ep.decode("utf-8", "replace")
            try:
                d = json.loads(raw_doc)
                e = Endpoint(ep, str(d["state"]), str(d["replica"]), int(d["since_ms"]), counts.get(ep, 0),
                             d.get("meta") if isinstance(d.get("meta"), dict) else {})
            except (ValueError, TypeError, KeyError) as exc:
                # A malformed entry (a writer other than the controller) is skipped, not fatal:
                # it stopped the controller for good (and again at each restart).
                log.warning("pool %s: registry entry %r is malformed (%s): ignored", self.pool, ep, exc)
                continue
            out[ep] = e
        for raw_ep in active:
            ep = raw_ep.decode("utf-8", "replace")
            if ep not in out:
                out[ep] = Endpoint(ep, "active", "", 0, counts.get(ep, 0))
        return out

    async def set_ceiling(self, per_endpoint: float, ttl_s: float) -> None:
        """Publish the admission ceiling (concurrent requests per active endpoint) for `ttl_s`."""
        old = await self.client.set(self.k_ceiling, repr(float(per_endpoint)), px=max(1, round(ttl_s * 1000)), get=True)
        if parse_ceiling(old) != parse_ceiling(repr(float(per_endpoint))):
            await self.notify()

    async def clear_ceiling(self) -> None:
        if await self.client.delete(self.k_ceiling):
            await self.notify()

    async def ceiling(self) -> float | None:
        """The published per-endpoint ceiling; None when no controller publishes one."""
        return parse_ceiling(await self.client.get(self.k_ceiling))

    async def set_arriving(self, at: list[tuple[float, int]], ttl_s: float, grace_s: float = 0.0) -> None:
        """Announce capacity on its way: (seconds from now until it serves, replicas) for
        `ttl_s` (schema.CTL_ARRIVING); an empty list takes the announcement back. `grace_s`:
        how late past its time a replica may still come (the controller's tick: it promotes
        on its next look); the processors count it until then (`parse_arriving_entries`). The
        processors are told at once when the announcement grows (a promotion serves within a
        wake: their next refresh may come too late for it)."""
        if not at:
            await self.client.delete(self.k_arriving)
            return
        ttl_ms = max(1, round(ttl_s * 1000))
        body: dict[str, Any] = {"ttl_ms": ttl_ms, "at": [[max(0, round(s * 1000)), int(n)] for s, n in at]}
        if grace_s > 0:
            body["grace_ms"] = round(min(grace_s, ARRIVING_MAX_GRACE_S) * 1000)  # older processors ignore it
        doc = json.dumps(body)
        old = await self.client.set(self.k_arriving, doc, px=ttl_ms, get=True)
        before = parse_arriving(old, ttl_ms)
        if sum(n for _, n in before) < sum(n for _, n in at):
            await self.notify()

    async def arriving(self) -> list[tuple[float, int]]:
        """The announced capacity on its way: (seconds from now, replicas), earliest first."""
        return [(s, n) for s, n, _ in await read_arriving(self.client, self.k_arriving)]


ARRIVING_MAX_S = 3600.0  # an announcement further out than this is not believed
ARRIVING_MAX_REPLICAS = 10_000
ARRIVING_MAX_GRACE_S = 10.0  # a longer grace is read as this


async def read_arriving(client: Any, k: str, *, late: bool = False) -> list[tuple[float, int, float]]:
    """GET and PTTL of the announcement in one pipeline: the time since it was written is its
    TTL minus what is left of it, on Redis's clock (no gateway clock is compared with the
    controller's). `parse_arriving_entries`: (seconds from now, replicas, grace); with `late`
    also the entries whose time passed within their grace (negative seconds)."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(k)
        pipe.pttl(k)
        raw, pttl = await pipe.execute()
    return [e for e in parse_arriving_entries(raw, pttl) if late or e[0] > 0]


def parse_arriving_entries(raw: Any, pttl_ms: Any) -> list[tuple[float, int, float]]:
    """A stored announcement (schema.CTL_ARRIVING) as (seconds from now, replicas, grace
    seconds) entries not yet past their time plus the grace (`grace_ms`, 0 when absent: an older
    controller's), earliest first; [] when missing, unreadable, without a TTL, or out of bounds
    (a missed or absurd ETA counts nothing: the early-drop reading of before)."""
    if raw is None:
        return []
    try:
        doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        ttl_ms, left = float(doc["ttl_ms"]), float(pttl_ms)
        if left < 0 or left > ttl_ms:  # no TTL (-1), gone (-2): not an announcement
            return []
        grace = min(ARRIVING_MAX_GRACE_S, max(0.0, float(doc.get("grace_ms", 0)) / 1000))
        elapsed = ttl_ms - left
        out = []
        for ms, n in doc["at"]:
            s = (float(ms) - elapsed) / 1000
            if -grace < s <= ARRIVING_MAX_S and s + grace > 0 and 0 < int(n) <= ARRIVING_MAX_REPLICAS:
                out.append((s, int(n), grace))
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    return sorted(out)


def parse_arriving(raw: Any, pttl_ms: Any) -> list[tuple[float, int]]:
    """The entries of `parse_arriving_entries` still ahead: (seconds from now, replicas)."""
    return [(s, n) for s, n, _ in parse_arriving_entries(raw, pttl_ms) if s > 0]


def parse_ceiling(raw: Any) -> float | None:
    """A stored ceiling (bytes, str or None) as a positive number, else None (unreadable or
    non-positive values cap nothing)."""
    if raw is None:
        return None
    try:
        v = float(raw.decode() if isinstance(raw, bytes) else raw)
    except ValueError:
        return None
    return v if v > 0 and math.isfinite(v) else None


def _count(v: bytes | str | None) -> int:
    """An in-flight count as stored (`epinf`); anything but a non-negative integer reads 0."""
    try:
        n = int(v) if v else 0
    except (ValueError, TypeError):
        return 0
    return max(0, n)
