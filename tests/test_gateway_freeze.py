"""A gateway Envoy that freezes, or that a partition cuts off from its processor, gives its
permits back (a fault review, real Envoy and processors).

A permit is released when the request's ext_proc stream ends, and only Envoy ends it. An Envoy
SIGSTOPped (or behind a partition that drops packets without closing the connection) held its
processor's permits for good, and since that processor stayed alive to Redis, every freed permit
went to the frozen gateway's queued requests: the pool served nothing until gRPC's 2-hour
default keepalive noticed (8 of 8 permits held, every other client 429). The processor now pings
each Envoy connection every 5 s and closes one that has not answered within 5 s: its streams
end and their permits, and the grants of its waiters, go back within about 10 s.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest

from floodgate.stack import LocalStack
from tests.helpers import pool_status, post, wait_until

pytestmark = pytest.mark.integration

TRUST_LOCAL = {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}}


async def test_a_frozen_gateway_envoy_gives_its_permits_back(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    cfg = {"pools": [{"name": "default", "limit": {"mode": "static", "initial": 2}, "local_credits": 0}], **TRUST_LOCAL}
    frozen_p = stack.start_processor(cfg)
    other_p = stack.start_processor(cfg)
    frozen = stack.start_envoy([("127.0.0.1", upstream)], processors=[frozen_p])
    other = stack.start_envoy([("127.0.0.1", upstream)], processors=[other_p])
    pid = frozen.child.proc.pid
    async with aiohttp.ClientSession() as s:
        # Two long requests hold the pool's 2 permits through the gateway about to freeze, and a
        # third waits behind them there.
        hold = {"x-request-priority": "0", "x-test-delay-ms": "60000"}
        held = [asyncio.create_task(post(s, frozen.url, headers=hold, timeout=90)) for _ in range(3)]

        async def full() -> bool:
            st = await pool_status(stack.redis_url)
            return st.inflight_total == 2 and st.queued_total == 1

        assert await wait_until(full, 10)
        os.kill(pid, signal.SIGSTOP)
        try:
            # Within ping interval + timeout (5 + 5 s, plus the release), every permit and the
            # waiter are back; before, they were held past 60 s.
            async def released() -> bool:
                st = await pool_status(stack.redis_url)
                return st.inflight_total == 0 and st.queued_total == 0

            assert await wait_until(released, 25), await pool_status(stack.redis_url)
            # ...and the other gateway serves.
            r = await post(s, other.url, headers={"x-request-priority": "1"}, timeout=20)
            assert r.status == 200, (r.status, r.error)
        finally:
            os.kill(pid, signal.SIGCONT)
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
