"""A replica operation decided while leading and run after the lease lapsed (the controller was
paused: SIGSTOP, a VM freeze, a long GC) must not act on a replica the new leader may serve on.
Stops and registry writes checked `leading()` already; a sleep did not, so an old leader could
put to sleep a replica the new one had promoted (a fault review). Real emulator, real Redis."""

from __future__ import annotations

import sys

import aiohttp
from floodgate.controller.actuators.static import StaticActuator
from floodgate.controller.app import PoolController, Replica
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.signals import ReplicaState, ReplicaView
from floodgate.controller.vllm import VllmClient
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.live import SIM_ARGS, controller_config


async def test_a_sleep_decided_while_leading_is_not_sent_once_the_lease_lapsed(stack: LocalStack) -> None:
    url = stack.start_redis()
    port = free_port()
    stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), "--enable-sleep-mode",
                          *SIM_ARGS], name="sim", port=port)
    ep = f"127.0.0.1:{port}"
    cfg = controller_config(url, actuator={"kind": "static", "endpoints": {"r1": ep}})
    rc = redis_client(url)
    leading = [False]
    try:
        async with aiohttp.ClientSession() as s:
            pc = PoolController(cfg.pools[0], StaticActuator({"r1": ep}), rc, s, ControllerMetrics(),
                                leading=lambda: leading[0])
            rep = Replica(ReplicaView("r1", ReplicaState.WARM, pc.clock()), ep)
            pc.replicas = {"r1": rep}
            replica = VllmClient(s, ep)
            await pc._sleep(rep)  # the lease lapsed between the plan and this
            assert await replica.is_sleeping() is False
            leading[0] = True
            await pc._sleep(rep)  # (the same call while leading does put it to sleep)
            assert await replica.is_sleeping() is True
    finally:
        await rc.aclose()
