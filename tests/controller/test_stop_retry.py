"""A stop that fails (a Kubernetes API 500, a process stuck in D state past proc.wait(5)) is
tried again (a controller review: it never was, and the replica ran on, TERMINATED in the
controller's view, out of the registry and uncounted, for as long as the controller ran)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from floodgate.controller.actuators.process import ProcessActuator, pid_alive, sim_command

from floodgate.stack import LocalStack
from tests.controller.live import (
    SIM_ARGS,
    controller_config,
    count,
    registry_states,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration


class FlakyStop(ProcessActuator):
    fails = 1

    async def stop(self, replica_id: str) -> None:
        if self.fails > 0:
            self.fails -= 1
            raise RuntimeError("transient: platform API returned 500")
        await super().stop(replica_id)


async def test_a_failed_stop_is_tried_again(stack: LocalStack, tmp_path: Path) -> None:
    url = stack.start_redis()
    sd = tmp_path / "replicas"
    nopool = {"enabled": False, "min_size": 0, "max_size": 0}
    a = ProcessActuator(sim_command(*SIM_ARGS), sd, supervisor=stack.sup)
    async with running(controller_config(url, policy={"min_replicas": 2, "max_replicas": 3}, warm_pool=nopool), a):
        await wait_for(lambda: _n_active(url, 2), 30)
    flaky = FlakyStop(sim_command(*SIM_ARGS), sd, supervisor=stack.sup)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 3}, warm_pool=nopool)
    async with running(cfg, flaky) as ctl:
        await wait_for(lambda: _n_active(url, 1), 30)
        await asyncio.sleep(6)  # 24 ticks
        pc = ctl.pools["default"]
        view = {rid: r.view.state.value for rid, r in pc.replicas.items()}
        handles = await flaky.list()
        alive = {h.replica_id: (h.running, pid_alive(int(h.labels["pid"]))) for h in handles}
        leaked = [rid for rid, st in view.items() if st == "terminated" and alive.get(rid, (False,))[0]]
        assert not leaked, f"replicas stopped by no one, still running: {leaked}"
        assert flaky.fails == 0 and [e for e in pc.events if e["event"] == "action_failed"], "the stop did fail once"
        assert sorted(view.values()) == ["active"], view
    await flaky.stop_all()


async def _n_active(url: str, n: int) -> bool:
    return count(await registry_states(url), "active") == n


async def test_a_replica_found_not_running_whose_stop_fails_is_tried_again(stack: LocalStack) -> None:
    # A replica the actuator lists as not running (dead, or being stopped by a controller that
    # died) is stopped to drop it from the actuator's books (`_forget`). A stop that failed was
    # marked done anyway: "the next rebuild or reconcile tries again" said its comment, but
    # neither did while this controller led.
    from floodgate.controller.actuators.base import ReplicaHandle

    class Flaky:
        name = "flaky"
        capacity = None

        def __init__(self) -> None:
            self.stops = 0
            self.gone = False

        async def list(self) -> list[ReplicaHandle]:
            return [] if self.gone else [ReplicaHandle("r0", "127.0.0.1:1", False)]

        async def stop(self, replica_id: str) -> None:
            self.stops += 1
            if self.stops == 1:
                raise RuntimeError("the platform's API answered 500")
            self.gone = True

        async def start(self, replica_id: str) -> None:
            raise AssertionError("no start expected")

        async def set_role(self, replica_id: str, role: str) -> None:
            return None

        async def close(self) -> None:
            return None

    act = Flaky()
    async with _pool_controller(stack, act) as (pc, now):
        await pc.rebuild()  # the first stop fails
        assert act.stops == 1
        await pc.reconcile(pc.clock())  # not at once: after a backoff (1 s, doubling), not a try every tick
        assert act.stops == 1
        now[0] += 1.0
        await pc.reconcile(pc.clock())
        assert act.stops == 2 and act.gone
        assert [e for e in pc.events if e["event"] == "forgotten"]


async def test_failed_forgets_of_replicas_that_went_away_are_not_kept(stack: LocalStack) -> None:
    # An unbounded-growth review: a dead replica whose stop (`_forget`) failed kept its retry
    # entry after the actuator stopped listing it (gone some other way: a pod deleted by hand),
    # one entry per such replica for as long as the controller ran (40 here, 40 kept).
    from floodgate.controller.actuators.base import ReplicaHandle

    class Failing:
        name = "failing"
        capacity = None

        def __init__(self) -> None:
            self.listed: list[str] = []
            self.stops = 0

        async def list(self) -> list[ReplicaHandle]:
            return [ReplicaHandle(rid, "127.0.0.1:1", False) for rid in self.listed]

        async def stop(self, replica_id: str) -> None:
            self.stops += 1
            raise RuntimeError("the platform's API answered 500")

        async def start(self, replica_id: str) -> None:
            raise AssertionError("no start expected")

        async def set_role(self, replica_id: str, role: str) -> None:
            return None

        async def close(self) -> None:
            return None

    act = Failing()
    async with _pool_controller(stack, act) as (pc, now):
        await pc.rebuild()
        for i in range(40):
            act.listed = [f"dead-{i}"]  # listed dead; its stop fails; then it is gone
            now[0] += 1.0
            await pc.reconcile(pc.clock())
        assert act.stops == 40
        assert len(pc._forget_retry) <= 1, len(pc._forget_retry)  # (was 40)


@contextlib.asynccontextmanager
async def _pool_controller(stack: LocalStack, act: object) -> AsyncIterator[tuple[Any, list[float]]]:
    """A PoolController over a real Redis and a stand-in actuator `act`, on a clock the test
    moves (`now[0]`); the Redis client and HTTP session closed after."""
    from floodgate.controller.app import PoolController
    from floodgate.controller.metrics import ControllerMetrics
    from floodgate.extproc.state import redis_client

    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 0, "max_replicas": 1}, warm_pool={"enabled": False})
    rc = redis_client(url)
    try:
        async with aiohttp.ClientSession() as s:
            pc = PoolController(cfg.pools[0], act, rc, s, ControllerMetrics())  # type: ignore[arg-type]
            now = [1000.0]
            pc.clock = lambda: now[0]  # type: ignore[method-assign]
            yield pc, now
    finally:
        await rc.aclose()
