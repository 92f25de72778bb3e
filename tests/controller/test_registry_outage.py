"""A registry write that Redis does not take (a stall, an error) fails no replica operation (a
controller review): a 4 s write stall during a cold start failed the loading replica (stopped,
start backoff, another cold start), and an error on a promotion's write left the replica waking
with no operation for good. The entry is rewritten by the tick's registry sync instead."""
from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from floodgate.controller.actuators.process import ProcessActuator, sim_command
from floodgate.controller.app import PoolController
from floodgate.controller.signals import ReplicaState as S
from floodgate.extproc.registry import Registry
from floodgate.extproc.state import redis_client

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


async def test_a_redis_write_stall_during_a_cold_start_fails_no_replica(stack: LocalStack, tmp_path: Path) -> None:
    url = stack.start_redis()
    a = ProcessActuator(sim_command(*SIM_ARGS, "--cold-start", "3"), tmp_path / "r", supervisor=stack.sup)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 2}, warm_pool={"enabled": False},
                            leader={"ttl_s": 10})
    admin = redis_client(url, op_timeout_s=5)
    async with running(cfg, a, wait_ready=True) as ctl:
        pc = ctl.pools["default"]
        await asyncio.sleep(1.5)  # r0 is loading (3 s cold start)
        await admin.execute_command("CLIENT", "PAUSE", "4000", "WRITE")
        await asyncio.sleep(4.5)
        async def one_active() -> bool:
            return count(await registry_states(url), "active") == 1
        await wait_for(one_active, 40)
        ev = [(e["event"], e.get("replica"), e.get("why") or e.get("error") or e.get("seconds"))
              for e in pc.events if e["event"] in ("failed", "action_failed", "start_backoff", "stopped")]
        assert not [e for e in ev if e[0] in ("failed", "start_backoff")], ev
        assert sorted(pc.replicas) == ["default-r0"], "no second cold start"
    await admin.aclose()
    await a.stop_all()


async def test_a_redis_error_on_a_promotions_registry_write_does_not_strand_the_replica(
        stack: LocalStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = stack.start_redis()
    a = ProcessActuator(sim_command(*SIM_ARGS), tmp_path / "replicas", supervisor=stack.sup)
    real = Registry.set
    blips = {"n": 0}

    pcs: list[PoolController] = []

    async def flaky(self: Registry, endpoint: str, state: str, replica_id: str,
                    meta: dict[str, Any] | None = None) -> None:
        rep = pcs[0].replicas.get(replica_id) if pcs else None
        if rep is not None and rep.view.state is S.WAKING and blips["n"] == 0:  # one Redis timeout, on a promotion's write
            blips["n"] += 1
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        return await real(self, endpoint, state, replica_id, meta)

    monkeypatch.setattr(Registry, "set", flaky)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 3},
                            warm_pool={"min_size": 1, "sleep_enabled": True, "warm_min_age_s": 0})
    async with running(cfg, a) as ctl:
        pc = ctl.pools["default"]
        async def ready() -> bool:
            st = await registry_states(url)
            return count(st, "active") == 1 and count(st, "sleeping") == 1
        await wait_for(ready, 40)
        st = await registry_states(url)
        act = next(h for h in await a.list() if st.get(h.replica_id) == "active")
        pcs.append(pc)
        os.killpg(int(act.labels["pid"]), signal.SIGKILL)  # the serving replica dies: promote the pool one
        await asyncio.sleep(20)
        view = {rid: (r.view.state.value, r.busy) for rid, r in pc.replicas.items()}
        stuck = [rid for rid, (st, busy) in view.items() if st == "waking" and not busy]
        assert blips["n"] == 1 and not stuck, f"replicas stuck in waking with no operation: {stuck}"
        st = await registry_states(url)
        assert count(st, "active") == 1, st


async def test_a_replica_whose_registry_entry_is_stale_is_not_stopped_or_put_to_sleep(
        stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the write that took a replica out of `active` has not reached Redis, processors may
    still route to it: it is not terminated, force-stopped or put to sleep until the sync has
    written its entry (a dead one, FAILED, is stopped whatever its entry says)."""
    import aiohttp
    from floodgate.controller.actuators.static import StaticActuator
    from floodgate.controller.app import Replica
    from floodgate.controller.config import PoolConfig
    from floodgate.controller.lifecycle import ActionKind
    from floodgate.controller.metrics import ControllerMetrics
    from floodgate.controller.signals import ReplicaView

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    session = aiohttp.ClientSession()
    try:
        pc = PoolController(PoolConfig(name="default", actuator={"kind": "static", "endpoints": ["127.0.0.1:1"]}),
                            StaticActuator(["127.0.0.1:1"]), c, session, ControllerMetrics())
        rep = Replica(ReplicaView("r0", S.DRAINING, pc.clock()), "127.0.0.1:1")
        dead = Replica(ReplicaView("r1", S.FAILED, pc.clock()), "127.0.0.1:2", registry_stale=True)
        pc.replicas = {"r0": rep, "r1": dead}
        real = Registry.set

        async def down(self: Registry, *args: Any, **kw: Any) -> None:
            raise redis.exceptions.TimeoutError("Timeout writing to socket")

        monkeypatch.setattr(Registry, "set", down)
        await pc._set_registry(rep)  # the drain's write: not taken
        assert rep.registry_stale
        assert all(pc._skip("r0", k) for k in (ActionKind.TERMINATE, ActionKind.FORCE_STOP, ActionKind.SLEEP))
        assert not pc._skip("r1", ActionKind.TERMINATE)
        monkeypatch.setattr(Registry, "set", real)
        await pc._sync_registry(await pc.registry.endpoints(), set())  # Redis answers again
        assert not rep.registry_stale and not pc._skip("r0", ActionKind.TERMINATE)
        assert (await pc.registry.endpoints())["127.0.0.1:1"].state == "draining"
    finally:
        await session.close()
        await c.aclose()


async def test_a_takeover_that_redis_cuts_short_leaves_no_replica_operation_running(
        stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis error halfway through a pool's rebuild (after it adopted a replica and started its
    bring-up, before it read the stored sequence) abandoned that pool's view but not its
    operations: the bring-up ran on outside any controller's view (its /health polls, then its
    registry writes, role and, at `health_s`, a failure that takes the entry out of routing),
    beside the one the next takeover started, and on after this controller stopped leading."""
    from aiohttp import web
    from floodgate.controller.actuators.static import StaticActuator
    from floodgate.extproc import schema

    from tests.helpers import serving

    async def loading(_: web.Request) -> web.Response:  # a replica still loading its model
        return web.Response(status=503)

    app = web.Application()
    app.router.add_get("/health", loading)
    real_get = redis.asyncio.Redis.get
    cut = {"n": 0}

    async def flaky_get(self: Any, name: Any, *a: Any, **kw: Any) -> Any:
        if name == schema.key("default", schema.CTL_SEQ) and cut["n"] == 0:
            cut["n"] += 1
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return await real_get(self, name, *a, **kw)

    monkeypatch.setattr(redis.asyncio.Redis, "get", flaky_get)
    url = stack.start_redis()
    async with serving(app) as port:
        ep = f"127.0.0.1:{port}"
        cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 1}, warm_pool={"enabled": False},
                                actuator={"kind": "static", "endpoints": [ep]})
        async with running(cfg, StaticActuator([ep]), wait_ready=True) as ctl:  # type: ignore[arg-type]
            assert cut["n"] == 1  # the first takeover was cut short, the second one took the pool
            assert ctl.pools["default"].replicas[ep].view.state is S.LOADING
            await asyncio.sleep(0.5)
            bring_ups = [t for t in asyncio.all_tasks() if t.get_name() == f"default:{ep}" and not t.done()]
            assert len(bring_ups) == 1, bring_ups
