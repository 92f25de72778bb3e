"""Pool-wide arrival rates from what each processor shares, not this one's times the live ones.

Early drop lets a lower-class request wait only if the releases the higher classes' arrivals
leave reach it in time, so it needs the pool's arrival rate per class. Each processor used to
read it as its own rate times the live processors: an idle peer (a second gateway with little
traffic, one draining after SIGTERM, one not yet in Envoy's rotation) counted as much traffic
as this one (a review: 8 of 211 P1s early-dropped wrongly with one idle peer, 27 with three,
none alone). Each processor now writes its own rates at its status tick (schema.ARRIVALS) and
sums the others' (policy.pool_arrivals).
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
from floodgate.extproc.admission import pool_settings
from floodgate.extproc.config import Config
from floodgate.extproc.policy import pool_arrivals
from floodgate.extproc.schema import (
    ARRIVALS,
    IDLE_CREDITS,
    format_arrivals,
    format_idle_credits,
    fresh_idle_credits,
    key,
    parse_arrivals,
    peer_arrivals,
)
from floodgate.extproc.state import PoolState, redis_client

from floodgate.redis_topology import ClusterTopology
from floodgate.stack import LocalStack
from tests.helpers import drained, metrics, post
from tests.redis_topologies import cluster  # noqa: F401 - fixture
from tests.test_admission_e2e import TRUST_LOCAL, hdr


def test_pool_rates_sum_what_the_peers_shared() -> None:
    own = (1.0, 2.0, 3.0)
    assert pool_arrivals(own, [(0.0, 0.0, 0.0)] * 3, 4) == own  # idle peers add nothing
    assert pool_arrivals(own, [(5.0, 0.0, 1.0)], 2) == (6.0, 2.0, 4.0)  # a peer that alone takes P0
    assert pool_arrivals(own, None, 3) == (3.0, 6.0, 9.0)  # not known: as before, own x processors


def test_a_shared_value_that_is_not_one_is_ignored() -> None:
    assert parse_arrivals(format_arrivals(1_000.4, (1.5, 0, 2), (3, 4, 5))) == (1000.0, (1.5, 0.0, 2.0), (3.0, 4.0, 5.0))
    assert parse_arrivals("1 2 3 4 5 6 1e6") is not None
    # A review: one buggy peer sharing 1e300/s would make every other processor early-drop everything.
    for bad in ("", "1 2 3", "x 1 2 3 4 5 6", "1 2 3 4 5 6 -1", "1 2 3 4 5 6 inf", "1 2 3 4 5 6 nan",
                "1 2 3 4 5 6 1e300", "1 1e7 0 0 0 0 0", "-5 1 1 1 1 1 1"):
        assert parse_arrivals(bad) is None, bad


def test_only_fresh_peers_count_whichever_way_their_clock_is_off() -> None:
    # A review: a dead processor whose clock ran an hour ahead kept counting as a live peer for
    # the hour (P1s turned away 2 -> 18 of 100 behind a ghost claiming 40 P0/s).
    now = 1_000_000_000.0
    shared = {"me": format_arrivals(now, (9, 9, 9), (9, 9, 9)),
              "behind": format_arrivals(now - 2_000, (1, 0, 0), (2, 0, 0)),
              "ahead": format_arrivals(now + 2_500, (0, 1, 0), (0, 2, 0)),
              "ghost": format_arrivals(now + 3_600_000, (40, 0, 0), (40, 0, 0)),
              "stale": format_arrivals(now - 5_000, (7, 0, 0), (7, 0, 0)), "junk": "x"}
    slow, fast = peer_arrivals(shared, "me", now, 3.0)
    assert sorted(slow) == [(0.0, 1.0, 0.0), (1.0, 0.0, 0.0)] and sorted(fast) == [(0.0, 2.0, 0.0), (2.0, 0.0, 0.0)]


@pytest.mark.integration
async def test_share_arrivals_reads_all_and_forgets_the_long_gone(stack: LocalStack) -> None:
    url = stack.start_redis()
    cfg = Config.model_validate({"pools": [{"name": "p"}]})
    c = redis_client(url, op_timeout_s=5)
    try:
        st = PoolState(c, "p", lease_ttl_s=3, settings=pool_settings(cfg.pools[0]), gateway="a")
        now_ms = time.time() * 1000
        await c.hset(key("p", ARRIVALS), mapping={"gone": format_arrivals(now_ms - 120_000, (1, 1, 1), (1, 1, 1)),
                                                  "future": format_arrivals(now_ms + 3_600_000, (1, 1, 1), (1, 1, 1)),
                                                  "junk": "not rates", "b": format_arrivals(now_ms, (2, 0, 0), (3, 0, 0))})
        await c.hset(key("p", IDLE_CREDITS), mapping={"gone": format_idle_credits(now_ms - 120_000, 3),
                                                      "junk": "3", "b": format_idle_credits(now_ms, 7)})
        got, idle = await st.share_arrivals("a", format_arrivals(now_ms, (1, 0, 0), (1, 0, 0)), now_ms - 60_000,
                                            now_ms + 60_000, idle=format_idle_credits(now_ms, 2))
        assert set(got) == {"a", "b", "gone", "future", "junk"}  # read as they were
        # the long gone, the far future (a clock an hour ahead) and junk dropped
        assert {f.decode() for f in await c.hkeys(key("p", ARRIVALS))} == {"a", "b"}
        # the idle local credits the same way (schema.IDLE_CREDITS)
        assert fresh_idle_credits(idle, now_ms, 3) == {"a": 2, "b": 7}
        assert {f.decode() for f in await c.hkeys(key("p", IDLE_CREDITS))} == {"a", "b"}
    finally:
        await c.aclose()


@pytest.mark.integration
async def test_idle_peers_do_not_make_early_drop_see_more_higher_class_traffic(
        stack: LocalStack, upstream: int) -> None:
    # Static limit 16, 500 ms per request (~32/s), P0 15/s + P1 12/s (85 %), all through
    # processor A; three more processors share the pool and get nothing. Alone, A drops no P1.
    stack.start_redis()
    cfg = {"pools": [{"name": "default", "limit": {"mode": "static", "initial": 16}, "local_credits": 0}],
           **TRUST_LOCAL}
    a = stack.start_processor(cfg)
    for _ in range(3):
        stack.start_processor(cfg)
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processors=[a])
    rnd = random.Random(7)
    loop = asyncio.get_running_loop()
    dur, warm = 16.0, 4.0
    p1: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = loop.time()
        tasks: list[asyncio.Task[None]] = []

        async def one(prio: int, at: float) -> None:
            r = await post(s, envoy.url, headers=hdr(prio, chunks="1", delay_ms="500"), timeout=60)
            if prio == 1 and at >= warm:
                p1.append(r.status)

        async def gen(prio: int, rate: float) -> None:
            t = 0.0
            while True:
                t += rnd.expovariate(rate)
                if t >= dur:
                    return
                await asyncio.sleep(max(0.0, t0 + t - loop.time()))
                tasks.append(asyncio.create_task(one(prio, t)))

        await asyncio.gather(gen(0, 15), gen(1, 12))
        await asyncio.gather(*tasks)
        m = await metrics(s, a.metrics_url)
    drops = m.get('floodgate_decisions_total{outcome="rejected",pool="default",priority="1",reason="early_drop"}', 0)
    rejected = len(p1) - p1.count(200)
    print(f"P1 turned away {rejected} of {len(p1)} (early drops {drops:.0f})")
    assert rejected <= 0.03 * len(p1), (rejected, len(p1), drops)
    st = await drained(stack.redis_url)
    assert st.inflight_total == 0 and st.queued_total == 0


@pytest.mark.integration
async def test_share_arrivals_on_a_cluster(cluster: ClusterTopology) -> None:  # noqa: F811
    # The write and the read go as one pipeline; on a Cluster the key's hash tag keeps both on
    # the pool's shard (a cross-slot pipeline would fail every status tick).
    cfg = Config.model_validate({"pools": [{"name": "p"}]})
    c = redis_client(cluster.url, op_timeout_s=5)
    try:
        st = PoolState(c, "p", lease_ttl_s=3, settings=pool_settings(cfg.pools[0]), gateway="a")
        now_ms = time.time() * 1000
        await st.share_arrivals("b", format_arrivals(now_ms, (2, 0, 0), (3, 0, 0)), now_ms - 60_000)
        got, idle = await st.share_arrivals("a", format_arrivals(now_ms, (1, 0, 0), (1, 0, 0)), now_ms - 60_000,
                                            idle=format_idle_credits(now_ms, 1))
        assert fresh_idle_credits(idle, now_ms, 3) == {"a": 1}
        assert {g: parse_arrivals(v) for g, v in got.items()} == {
            "a": (int(now_ms), (1.0, 0.0, 0.0), (1.0, 0.0, 0.0)), "b": (int(now_ms), (2.0, 0.0, 0.0), (3.0, 0.0, 0.0))}
    finally:
        await c.aclose()
