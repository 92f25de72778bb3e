"""One gateway id, one live process.

Redis keys a processor's permits and waiters by its gateway id, and every renewal (`sync` in
leases.lua) makes Redis hold exactly what the caller asserts for that id. Two live processes
under one id (a copied config with `server.gateway_id`, a compose service with a fixed
`FLOODGATE_GATEWAY_ID` scaled to 2) therefore drop each other's permits every few seconds, and
the pool runs over its limit. Each process claims its id per pool with a random instance id
(`schema.gateway_claim_key`, renewed with every sync, TTL one lease TTL):

* at start-up, an id claimed by another instance is watched until one renewal period after that
  claim was made: if that instance renews it, it is alive and this process refuses to start
  (`GatewayIdInUse`); if not, it was this id's crashed predecessor and this process takes over
  its id (a restart right after a crash waits at most `lease_ttl_s / 3` + 1 s for that);
* while running, a renewal that finds another instance's claim (both started at once, or the
  check was skipped because Redis was down) is counted and logged by both processes.

The decisions are pure functions of what Redis returned; the two calls are thin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from floodgate.runtime import StartupError


class GatewayIdInUse(StartupError):
    """Another live process renews this gateway id."""


@dataclass(frozen=True)
class Observation:
    """The claim as read at one moment: its instance (None: no claim) and remaining ms."""

    instance: str | None
    pttl_ms: int


def renewed_by_other(first: Observation, later: Observation, mine: str) -> bool:
    """Did another instance renew the claim between two reads? A renewal resets the TTL, so the
    remaining time grows (reads are ms apart, far less than a renewal period); a different
    instance's value is a renewal too (a third process, or the id handed over and back)."""
    if later.instance is None or later.instance == mine:
        return False
    return later.instance != first.instance or later.pttl_ms > first.pttl_ms + 50


def conflict(previous: str | None, mine: str, first: bool) -> bool:
    """A renewal replaced another instance's claim. On the first renewal that is expected once
    (a crashed predecessor's claim, still within its TTL, after the start-up watch); after it,
    only another live process writes there."""
    return previous is not None and previous != mine and not first


async def read(client: aioredis.Redis, key: str) -> Observation:
    async with client.pipeline(transaction=False) as pipe:
        pipe.get(key)
        pipe.pttl(key)
        value, pttl = await pipe.execute()
    instance = value.decode() if isinstance(value, bytes) else value
    return Observation(instance, int(pttl))


async def renew(client: aioredis.Redis, key: str, mine: str, ttl_ms: int) -> str | None:
    """Claim the id for one TTL; returns the instance that held it before (None: nobody)."""
    previous = await client.set(key, mine, px=ttl_ms, get=True)
    return previous.decode() if isinstance(previous, bytes) else None if previous is None else str(previous)


async def release(client: aioredis.Redis, key: str, mine: str) -> None:
    """On a clean stop: drop the claim if it is still ours, so a restart need not watch it."""
    if await read_instance(client, key) == mine:
        await client.delete(key)


async def read_instance(client: aioredis.Redis, key: str) -> str | None:
    value = await client.get(key)
    return value.decode() if isinstance(value, bytes) else value


async def watch(client: aioredis.Redis, key: str, mine: str, *, ttl_ms: int, period_s: float,
                poll_s: float = 0.25, clock: Callable[[], float],
                sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> tuple[str | None, bool]:
    """Before the first renewal: (the other instance holding this id or None, whether it is
    live). A live holder
    renews its claim every `period_s` (with its sync), so a claim by another instance is
    followed until it is `period_s` old: live if renewed by then, gone if it expires or is not
    renewed (a crashed or frozen predecessor, whose leases run out with its liveness). A claim
    already older than that needs no wait."""
    first = await read(client, key)
    if first.instance is None or first.instance == mine:
        return None, False
    holder = first.instance
    end = clock() + watch_for(ttl_ms, first.pttl_ms, period_s)
    while clock() < end:
        await sleep(poll_s)
        later = await read(client, key)
        if later.instance is None:
            break
        if renewed_by_other(first, later, mine):
            return later.instance, True
        first = later
    return holder, False


def watch_for(ttl_ms: int, pttl_ms: int, period_s: float) -> float:
    """Seconds to watch a claim with `pttl_ms` left of `ttl_ms` before taking it as abandoned:
    until one renewal period (plus a second of slack for a busy event loop) after it was made."""
    age_s = max(0, ttl_ms - pttl_ms) / 1000
    return max(0.0, period_s + 1.0 - age_s)
