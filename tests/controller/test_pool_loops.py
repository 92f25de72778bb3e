"""Each pool ticks in its own loop: a pool whose replicas answer a scrape late (up to the scrape
timeout) must not hold back another pool's decisions. Before, the pools ticked one after the
other in one loop, so one slow pool stretched every pool's tick to its scrape timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from floodgate.controller.app import Controller, PoolController
from floodgate.controller.config import parse_config
from floodgate.extproc.registry import Registry
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.live import wait_for


def _pool(name: str, endpoint: str, scrape_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "policy": {"min_replicas": 1, "max_replicas": 1},
        "forecast": {"enabled": False},
        "warm_pool": {"enabled": False},
        "timeouts": {"scrape_s": scrape_s},
        "actuator": {"kind": "static", "endpoints": {f"{name}-r0": endpoint}},
    }


async def test_a_pool_whose_scrape_hangs_does_not_hold_back_another_pool(
        stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    done: dict[str, int] = {"slow": 0, "fast": 0}  # ticks finished, per pool
    real_tick = PoolController.tick

    async def counted_tick(self: PoolController, envoy: Any = None) -> Any:
        plan = await real_tick(self, envoy)
        done[self.pool] += 1
        return plan

    monkeypatch.setattr(PoolController, "tick", counted_tick)
    url = stack.start_redis()
    accepted = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # reads the request, never answers: the scrape waits its timeout
        accepted.set()
        await reader.read(65536)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    slow_ep = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    fast_ep = f"127.0.0.1:{free_port()}"  # nothing listens: its scrape fails at once (marked, never 0)
    c = redis_client(url, op_timeout_s=5)
    await Registry(c, "slow").set(slow_ep, "active", "slow-r0")
    await Registry(c, "fast").set(fast_ep, "active", "fast-r0")
    cfg = parse_config({"redis": {"url": url}, "tick_interval_s": 0.05, "metrics_listen": None,
                        "leader": {"enabled": False},
                        "pools": [_pool("slow", slow_ep, scrape_s=60.0), _pool("fast", fast_ep, scrape_s=1.0)]},
                       env={})
    ctl = Controller(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))

    def ticks(pool: str) -> float:
        return ctl.metrics.registry.get_sample_value("floodgate_controller_tick_seconds_count", {"pool": pool}) or 0.0

    async def fast_ticked() -> bool:
        return done["fast"] >= 5

    try:
        await asyncio.wait_for(accepted.wait(), 20)  # the slow pool's first scrape is in the air
        await wait_for(fast_ticked, 20)
        # Five decisions of the fast pool while the slow pool's first tick still waits on its
        # replica: the fast pool was not held back by it.
        assert done["slow"] == 0
        assert ticks("fast") >= 5 and ticks("slow") == 0  # floodgate_controller_tick_seconds{pool}
        assert ctl.pools["fast"].last_plan is not None and ctl.pools["slow"].last_plan is None
        assert not ctl.ready.is_set()  # ready means every pool has ticked
    finally:
        stop.set()
        # Stopping cancels the slow pool's tick in the air: no wait for its 60 s scrape timeout.
        await asyncio.wait_for(task, 15)
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()
        await c.aclose()
