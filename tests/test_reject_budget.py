"""The slow-rejection budget in the processor (policy.min_chance, PoolRuntime.min_chance): each
rejection the processor answers is counted per class, a queue timeout also as slow, and the
chance early drop asks of a reject-fast class follows them. Real Redis, a real Admitter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.policy import SPEND_CHANCE, Reject
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack


@pytest.fixture
async def admitter(stack: LocalStack) -> AsyncIterator[Admitter]:
    url = stack.start_redis()
    client = redis_client(url)
    cfg = Config.model_validate({"redis": {"url": url},
                                 "pools": [{"name": "p", "local_credits": 0,
                                            "limit": {"mode": "static", "initial": 1}}]})
    a = Admitter(cfg, client, metrics=Metrics(), gateway_id="gw")
    await a._start_pool(a.pools["p"])  # configure + first sync, without the background loops
    try:
        yield a
    finally:
        await a.stop()
        await client.aclose()


async def test_rejections_and_timeouts_set_the_chance_a_p2_needs(admitter: Admitter) -> None:
    a, rt = admitter, admitter.pools["p"]
    assert rt.min_chance(2, a.clock()) == SPEND_CHANCE  # nothing rejected yet: the budget is unspent
    held = await a.admit("p", 0, "t")
    assert isinstance(held, Permit)
    # the pool is full and the rates rest on nothing: the shipped P2 is told at once (fast)
    for _ in range(3):
        r = await a.admit("p", 2, "t")
        assert isinstance(r, Reject) and r.reason == "early_drop"
    now = a.clock()
    assert rt.rejections[2].level(now) > 0 and rt.slow_rejections[2].level(now) == 0
    assert rt.min_chance(2, now) == SPEND_CHANCE
    # a queue timeout is a slow rejection: the budget is spent, P2 is back at 99 %
    a._count_result(rt, 2, Reject("queue_timeout", 1))
    assert rt.slow_rejections[2].level(a.clock()) > 0
    assert rt.min_chance(2, a.clock()) == 0.99
    # P0 and P1 do not spend a budget: their chance is their configured one
    assert rt.min_chance(0, a.clock()) == rt.min_chance(1, a.clock()) == 0.5
    await a.release(held)
