"""What a (re)started controller makes of a replica it finds running (`app.adopted_view`, pure),
and the look it takes at one found without a registry entry."""

from __future__ import annotations

import pytest
from floodgate.controller.app import adopted_view
from floodgate.controller.signals import ReplicaState as S
from floodgate.extproc.registry import Endpoint

from floodgate.stack import LocalStack


def _entry(state: str) -> Endpoint:
    return Endpoint(endpoint="h:1", state=state, replica_id="r1", since_ms=5000, inflight=2)


def test_the_registry_entry_decides_when_there_is_one() -> None:
    assert adopted_view("r1", _entry("active"), 9.0, "warm-pool", (True, True)).state is S.ACTIVE
    v = adopted_view("r1", _entry("sleeping"), 9.0)
    assert v.state is S.WARM and v.asleep and v.state_since == 5.0
    assert adopted_view("r1", _entry("draining"), 9.0).state is S.DRAINING
    assert adopted_view("r1", _entry("loading"), 9.0, "active", (True, False)).state is S.LOADING


def test_without_an_entry_the_recorded_role_and_a_look_decide() -> None:
    assert adopted_view("r1", None, 9.0, "active", (True, False)).state is S.ACTIVE
    v = adopted_view("r1", None, 9.0, "active", (True, True))  # asleep: it serves nothing
    assert v.state is S.WARM and v.asleep
    v = adopted_view("r1", None, 9.0, "warm-pool", (True, True))
    assert v.state is S.WARM and v.asleep
    v = adopted_view("r1", None, 9.0, "warm-pool", (True, None))  # no sleep mode
    assert v.state is S.WARM and not v.asleep


def test_unknown_role_or_an_unhealthy_replica_is_brought_up_again() -> None:
    assert adopted_view("r1", None, 9.0).state is S.LOADING
    assert adopted_view("r1", None, 9.0, None, (True, False)).state is S.LOADING
    assert adopted_view("r1", None, 9.0, "active", (False, None)).state is S.LOADING
    assert adopted_view("r1", None, 9.0, "warm-pool", None).state is S.LOADING


def test_a_replica_found_asleep_without_entry_or_role_is_a_sleeping_pool_replica() -> None:
    # A static endpoint the last controller freed (put to sleep, registry entry removed) has no
    # role after a restart: brought up again, it was woken and counted as arriving capacity.
    v = adopted_view("r1", None, 9.0, None, (True, True))
    assert v.state is S.WARM and v.asleep


def test_an_entrys_age_is_read_on_redis_clock_and_carried_to_this_controllers() -> None:
    # Stamped 3 s ago on Redis's clock (since_ms 5000, Redis now 8000): 3 s old on this
    # controller's clock, whatever it reads (here 409.0: 400 s ahead of the writer's).
    v = adopted_view("r1", _entry("draining"), 409.0, redis_now_ms=8000)
    assert v.state is S.DRAINING and v.state_since == 406.0
    # an entry stamped after Redis's now (an older writer's clock ahead): new, never in the future
    assert adopted_view("r1", _entry("sleeping"), 9.0, redis_now_ms=4000).state_since == 9.0


@pytest.mark.integration
@pytest.mark.parametrize("body", [b"[]", b"null", b"true", b"\"x\"", b"{\"is_sleeping\": \"no\"}", b"not json"])
async def test_an_unreadable_is_sleeping_answer_fails_the_look_not_the_takeover(stack: LocalStack, body: bytes) -> None:
    # A replica found without a registry entry is looked at (/health, /is_sleeping). An answer
    # that is JSON but no object (`[]`, `null`, a bare `true`: another server on a reused port,
    # an engine's own shape) raised AttributeError out of the rebuild: the controller stopped,
    # and again at every restart. Now it is an unreadable answer like any other (VllmError):
    # the replica is brought up again.
    import aiohttp
    from aiohttp import web
    from floodgate.controller.app import PoolController
    from floodgate.controller.metrics import ControllerMetrics
    from floodgate.controller.vllm import VllmClient, VllmError
    from floodgate.extproc.state import redis_client

    from tests.controller.live import controller_config
    from tests.controller.test_registry_sync import Fixed
    from tests.helpers import serving

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def is_sleeping(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/is_sleeping", is_sleeping)
    url = stack.start_redis()
    rc = redis_client(url)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 1}, warm_pool={"enabled": False})
    async with serving(app) as port, aiohttp.ClientSession() as s:
        ep = f"127.0.0.1:{port}"
        with pytest.raises(VllmError):
            await VllmClient(s, ep).is_sleeping()
        pc = PoolController(cfg.pools[0], Fixed({"r0": ep}), rc, s, ControllerMetrics())  # type: ignore[arg-type]
        await pc.rebuild()  # raised AttributeError / ValueError out of the takeover
        assert pc.replicas["r0"].view.state is S.LOADING
        await pc.shutdown()
    await rc.aclose()
