"""A static actuator's endpoints are all the replicas there can be. With more wanted (a
waiting queue on its one endpoint, `max_replicas` 4), every planned start failed with
NoFreeEndpoint, and the failure's kick ran the next tick at once: 333 failed starts in 3 s,
each an `action_failed` event, a `failed` replica, a new replica id and an error count. Now
the controller plans no start beyond the actuator's capacity, says so once, and any start
that finds no room holds the next for `timeouts.start_backoff_s`."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
from floodgate.controller.actuators.base import NoCapacity, ReplicaHandle
from floodgate.controller.actuators.static import StaticActuator

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.live import SIM_ARGS, controller_config, registry_states, running
from tests.helpers import wait_until


async def _stream(s: aiohttp.ClientSession, port: int) -> None:
    body = {"model": "floodgate-sim-8b", "prompt": "x", "max_tokens": 20000, "stream": True}
    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        async for _ in r.content:
            pass


async def _active(url: str) -> bool:
    return (await registry_states(url)).get("r1") == "active"


def _failed(events: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "action_failed"]


def _redis_and_sim(stack: LocalStack) -> tuple[str, int, str]:
    """Redis and one emulated replica (2 slots): its URL, its port and endpoint."""
    url = stack.start_redis()
    port = free_port()
    stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), *SIM_ARGS],
                         name="sim", port=port)
    return url, port, f"127.0.0.1:{port}"


async def test_no_start_is_planned_beyond_the_static_endpoints(stack: LocalStack) -> None:
    url, port, ep = _redis_and_sim(stack)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 4},
                            actuator={"kind": "static", "endpoints": {"r1": ep}})
    async with running(cfg, StaticActuator({"r1": ep})) as ctl:  # type: ignore[arg-type]
        pc = ctl.pools["default"]
        assert await wait_until(lambda: _active(url), 20)
        async with aiohttp.ClientSession() as s:
            streams = [asyncio.create_task(_stream(s, port)) for _ in range(8)]  # 2 slots: 6 waiting
            try:
                assert await wait_until(lambda: pc.last_plan is not None and pc.last_plan.desired > 1, 20)
                await asyncio.sleep(3)  # a dozen ticks wanting more than there is
                assert not _failed(pc.events), _failed(pc.events)[:3]
                over = [e for e in pc.events if e["event"] == "over_capacity"]
                assert len(over) == 1 and over[0]["capacity"] == 1, over
                assert list(pc.replicas) == ["r1"], list(pc.replicas)  # no placeholder started and failed
                assert (await registry_states(url)) == {"r1": "active"}
            finally:
                for t in streams:
                    t.cancel()


class _Full:
    """A platform with no room (NoCapacity on every start) and no known size."""

    name = "full"
    capacity = None

    def __init__(self, ep: str) -> None:
        self.ep = ep
        self.starts = 0

    async def list(self) -> list[ReplicaHandle]:
        return [ReplicaHandle("r1", self.ep, True)]

    async def start(self, replica_id: str) -> None:
        self.starts += 1
        raise NoCapacity("no node has room")

    async def stop(self, replica_id: str) -> None:
        pass

    async def set_role(self, replica_id: str, role: str) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_a_start_without_room_holds_the_next(stack: LocalStack) -> None:
    url, port, ep = _redis_and_sim(stack)
    full = _Full(ep)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 4}, timeouts={"start_backoff_s": 1.0})
    async with running(cfg, full) as ctl:  # type: ignore[arg-type]
        pc = ctl.pools["default"]
        assert await wait_until(lambda: _active(url), 20)
        async with aiohttp.ClientSession() as s:
            streams = [asyncio.create_task(_stream(s, port)) for _ in range(8)]
            try:
                assert await wait_until(lambda: full.starts > 0, 20)
                before = full.starts
                await asyncio.sleep(3)
                # One start a second at most (it was one a tick, and the failure kicked the next).
                assert full.starts - before <= 4, full.starts - before
                assert not pc.start_backoff.failures  # no room is not a failing start
            finally:
                for t in streams:
                    t.cancel()
