"""The slow-rejection budget in the processor (policy.min_chance, PoolRuntime.min_chance): each
rejection the processor answers is counted per class, a queue timeout also as slow, and the
chance early drop asks of a reject-fast class follows them. Real Redis, a real Admitter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.policy import SPEND_CHANCE, Reject
from floodgate.extproc.schema import SCRIPT_KEYS
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


async def test_a_wait_on_the_budget_counts_against_it_until_it_ends(admitter: Admitter) -> None:
    """A P2 let in at the budget's 90 % where the strict 99 % would have turned it away counts
    against the budget while it waits (policy.min_chance's `waiting`; short of 99 % at the
    point estimates too, policy.budget_risk): a second P2 arriving
    meanwhile is asked the strict 99 % and told at once, as it would be had the first already
    timed out. The wait's end is counted by outcome (`floodgate_budget_waits_total`)."""
    a, rt = admitter, admitter.pools["p"]
    # The pool's clock (leases.lua's admin_testclock, ms): 36 releases over 12 s, ~3 per second, a
    # rate measured on enough releases. One permit in flight then frees within the P2's 1 s
    # with ~95 % chance at that rate, under 99 % at its lower bound: a budget wait.
    clock, now = rt.state.keys[SCRIPT_KEYS.index("admin_testclock")], 1_000_000
    for _ in range(36):
        await a.client.set(clock, now)
        p = await a.admit("p", 1, "t")
        assert isinstance(p, Permit)
        now += 333
        await a.client.set(clock, now)
        await a.release(p)
    await asyncio.sleep(0.05)  # the release's call
    held = await a.admit("p", 0, "t")
    assert isinstance(held, Permit)
    first = asyncio.ensure_future(a.admit("p", 2, "t"))
    for _ in range(200):  # until it waits (a Redis round trip)
        await asyncio.sleep(0.005)
        if rt.budget_waiting[2] > 0 or first.done():
            break
    assert not first.done() and rt.budget_waiting[2] == 1, "the first P2 waits on the budget"
    assert rt.min_chance(2, a.clock()) == 0.99  # its wait is in the air: the budget holds no more
    second = await a.admit("p", 2, "t")
    assert isinstance(second, Reject) and second.reason == "early_drop"
    result = await first  # the permit is held: it times out
    assert isinstance(result, Reject) and result.reason == "queue_timeout"
    assert rt.budget_waiting[2] == 0
    assert a.metrics.budget_waits.labels("p", "2", "timed_out")._value.get() == 1
    assert rt.min_chance(2, a.clock()) == 0.99  # a slow rejection now: spent
    await a.release(held)


async def test_the_counted_rejections_reach_the_rule_as_requests(admitter: Admitter) -> None:
    """PoolRuntime.min_chance hands policy.min_chance the rejections and timeouts as counts of
    requests (its decayed levels times their tau), the unit the budget's share is stated in and
    the one of the waits in the air: 3 timeouts of 600 rejections are within it, 4 are not."""
    a, rt = admitter, admitter.pools["p"]
    now = a.clock()
    for _ in range(600):
        rt.rejections[2].bump(now)
    for _ in range(3):
        rt.slow_rejections[2].bump(now)
    assert rt.min_chance(2, now) == SPEND_CHANCE
    rt.budget_waiting[2] = 1
    assert rt.min_chance(2, now) == 0.99  # a wait on the budget in the air: one at a time
    rt.budget_waiting[2] = 0
    rt.slow_rejections[2].bump(now)
    assert rt.min_chance(2, now) == 0.99
