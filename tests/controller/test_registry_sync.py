"""Level-triggered registry: every tick rewrites what differs from the lifecycle view, so a
registry write lost to a Redis blip (a DRAIN that the processors never saw) is retried."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import aiohttp
from floodgate.controller.actuators.base import ReplicaHandle
from floodgate.controller.app import PoolController, Replica
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.policy import PolicyState
from floodgate.controller.signals import ReplicaState, ReplicaView
from floodgate.extproc.registry import Registry
from floodgate.extproc.state import redis_client
from redis.asyncio import Redis

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.live import controller_config


class Fixed:
    """Two running replicas; the test fails if the controller starts or stops anything."""

    name = "fixed"
    capacity = None

    def __init__(self, eps: dict[str, str]) -> None:
        self.eps = eps

    async def list(self) -> list[ReplicaHandle]:
        return [ReplicaHandle(rid, ep, True) for rid, ep in self.eps.items()]

    async def start(self, replica_id: str) -> None:
        raise AssertionError("no start expected")

    async def stop(self, replica_id: str) -> None:
        raise AssertionError("no stop expected")

    async def set_role(self, replica_id: str, role: str) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_lost_drain_write_is_rewritten_next_tick(stack: LocalStack) -> None:
    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 1}, warm_pool={"enabled": False})
    rc = redis_client(url)
    reg = Registry(rc, "default")
    # Nothing listens on these ports: scrapes fail, so the tick is stale and the drain cannot
    # finish (unknown is not idle) — the replicas stay as set up here.
    eps = {"r0": f"127.0.0.1:{free_port()}", "r1": f"127.0.0.1:{free_port()}"}
    await reg.set(eps["r0"], "active", "r0")
    await reg.set(eps["r1"], "active", "r1")  # the DRAIN write below never reached Redis
    async with aiohttp.ClientSession() as s:
        pc = PoolController(cfg.pools[0], Fixed(eps), rc, s, ControllerMetrics())  # type: ignore[arg-type]
        now = pc.clock()
        pc.replicas = {
            "r0": Replica(ReplicaView("r0", ReplicaState.ACTIVE, now - 600), eps["r0"]),
            "r1": Replica(ReplicaView("r1", ReplicaState.DRAINING, now - 1, inflight=1, running=1), eps["r1"]),
        }
        assert (await reg.endpoints())[eps["r1"]].state == "active"
        await pc.tick()
        after = await reg.endpoints()
        assert after[eps["r1"]].state == "draining" and after[eps["r0"]].state == "active"
        assert await rc.smembers(reg.k_active) == {eps["r0"].encode()}  # no new requests to r1
        synced = [e for e in pc.events if e["event"] == "registry_sync"]
        assert [(e["replica"], e["frm"], e["to"]) for e in synced] == [("r1", "active", "draining")]
        # Level, not edge: a second tick with everything in place writes nothing.
        await pc.tick()
        assert len([e for e in pc.events if e["event"] == "registry_sync"]) == 1
    await rc.aclose()


async def test_an_entry_of_no_known_replica_is_removed_on_the_second_tick(stack: LocalStack) -> None:
    # A removal lost to a Redis blip (or an old leader's late write) left a dead endpoint
    # `active` for good while the leader ran, and processors routed to it; only a restart's
    # rebuild removed it (a review: 120 ticks). Now the second tick that sees it removes it.
    dead = f"127.0.0.1:{free_port()}"
    async with _one_known_replica(stack) as (pc, rc, reg, ep0):
        await reg.set(dead, "active", "r99")  # appears while the leader runs
        await pc.tick()  # seen once: could be a write racing this tick
        assert dead in await reg.endpoints()
        await pc.tick()
        after = await reg.endpoints()
        assert dead not in after and ep0 in after
        assert await rc.smembers(reg.k_active) == {ep0.encode()}
        dropped = [e for e in pc.events if e["event"] == "registry_sync" and e.get("why") == "no such replica"]
        assert [(e["replica"], e["endpoint"]) for e in dropped] == [("r99", dead)]


@asynccontextmanager
async def _one_known_replica(stack: LocalStack) -> AsyncIterator[tuple[PoolController, Redis, Registry, str]]:
    """A leader's pool controller that knows one active replica, r0 (registered, one tick run)."""
    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 1}, warm_pool={"enabled": False})
    rc = redis_client(url)
    reg = Registry(rc, "default")
    eps = {"r0": f"127.0.0.1:{free_port()}"}
    await reg.set(eps["r0"], "active", "r0")
    try:
        async with aiohttp.ClientSession() as s:
            pc = PoolController(cfg.pools[0], Fixed(eps), rc, s, ControllerMetrics())  # type: ignore[arg-type]
            pc.replicas = {"r0": Replica(ReplicaView("r0", ReplicaState.ACTIVE, pc.clock() - 600), eps["r0"])}
            await pc.tick()
            yield pc, rc, reg, eps["r0"]
    finally:
        await rc.aclose()


async def test_an_active_endpoint_without_a_document_is_removed_too(stack: LocalStack) -> None:
    # Processors route to the `active` set; the controller read only the documents, so an
    # endpoint in the set with no document (another writer) or a malformed one was routed to
    # and never removed (a controller review).
    bare, garbled = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    async with _one_known_replica(stack) as (pc, rc, reg, ep0):
        await rc.sadd(reg.k_active, bare, garbled)
        await rc.hset(reg.k_endpoints, garbled, "{not json")
        listed = await reg.endpoints()
        assert listed[bare].state == "active" and listed[bare].replica_id == ""
        await pc.tick()
        await pc.tick()
        assert await rc.smembers(reg.k_active) == {ep0.encode()}
        assert not await rc.hexists(reg.k_endpoints, garbled)
        # The known replica's own entry, garbled, is written again rather than dropped.
        await rc.hset(reg.k_endpoints, ep0, "{not json")
        await pc.tick()
        await pc.tick()
        assert (await reg.endpoints())[ep0].replica_id == "r0"
        assert await rc.smembers(reg.k_active) == {ep0.encode()}


async def test_a_resumed_desired_count_never_drains_what_serves(stack: LocalStack) -> None:
    # The last leader's desired count (ctl:desired) tells a new leader which replicas in their
    # cold start were wanted to serve. Below what serves (a controller stopped long ago, another
    # config) it drained serving replicas on a stale first tick (a review's repro: 4 busy, 1).
    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 1}, warm_pool={"enabled": False})
    rc = redis_client(url)
    async with aiohttp.ClientSession() as s:
        pc = PoolController(cfg.pools[0], Fixed({}), rc, s, ControllerMetrics())  # type: ignore[arg-type]
        now = pc.clock()

        def resumed(states: list[ReplicaState], stored: bytes | None) -> int | None:
            pc.replicas = {f"r{i}": Replica(ReplicaView(f"r{i}", st, now), None) for i, st in enumerate(states)}
            pc.state = replace(pc.state, policy=PolicyState())
            pc._resume_desired(stored)
            return pc.state.policy.desired

        A, L, W = ReplicaState.ACTIVE, ReplicaState.LOADING, ReplicaState.WAKING
        assert resumed([A, A, A, A], b"1") == 4  # never below what serves
        assert resumed([L, L, L], b"2") == 2  # the third cold start is the pool's refill
        assert resumed([A, W, L], b"9") == 3  # never above what exists
        assert resumed([A, L], b"garbage") is None and resumed([A, L], None) is None  # found decides, as before
    await rc.aclose()
