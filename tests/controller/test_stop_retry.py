"""A stop that fails (a Kubernetes API 500, a process stuck in D state past proc.wait(5)) is
tried again (a controller review: it never was, and the replica ran on, TERMINATED in the
controller's view, out of the registry and uncounted, for as long as the controller ran)."""
from __future__ import annotations

import asyncio
from pathlib import Path

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
