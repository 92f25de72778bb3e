"""A request queued at a processor that dies waits at the next one only as long as Envoy waits.

The shipped filter retries the ext_proc stream of a request whose processor died before it
answered (`grpc_service.retry_policy`, envoy/floodgate-filter.yaml) on another processor, which
queues it again; Envoy's `message_timeout` keeps running from the first send. Given a fresh
queue timeout there, a request that had already waited outlived Envoy's timer and its client got
Envoy's 504 "admission unavailable, retry after 1 s" instead of Floodgate's 429 with its
Retry-After (a review: P0s queued 18 s at a SIGKILLed processor, 504 at 35 s). The processor now
reads when Envoy took the request in (`request.time`) and ends its wait in time.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from floodgate.extproc.schema import key
from floodgate.extproc.server import request_age
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.helpers import post, wait_until

pytestmark = pytest.mark.integration

# Envoy's message_timeout (and the processors' envoy_message_timeout_s) 8 s, P1 queue timeout 6 s:
# a waiter retried 3 s in got 6 s more at the survivor, 9 s in all, past Envoy's 8 s.
MESSAGE_TIMEOUT_S = 8
QUEUE_TIMEOUT_S = 6


async def test_a_waiter_retried_from_a_dead_processor_gets_a_429_not_envoys_504(stack: LocalStack,
                                                                                   upstream: int) -> None:
    stack.start_redis()
    cfg = {"server": {"envoy_message_timeout_s": MESSAGE_TIMEOUT_S},
           # a long lease: the dead processor's permit keeps the pool full for the whole test
           "redis": {"lease_ttl_s": 120},
           "admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
           "pools": [{"name": "default", "local_credits": 0, "limit": {"mode": "static", "initial": 1},
                      "classes": {c: {"queue_timeout_s": QUEUE_TIMEOUT_S, "max_queue": 100, "share": share}
                                  for c, share in ((0, 0.5), (1, 0.3), (2, 0.1))}}]}
    first = stack.start_processor(cfg)
    stack.start_processor(cfg)
    envoy = stack.start_envoy([("127.0.0.1", upstream)], message_timeout_s=MESSAGE_TIMEOUT_S)
    async with aiohttp.ClientSession() as s:
        holder = asyncio.create_task(post(s, envoy.url, headers={"x-test-chunks": "1", "x-test-delay-ms": "60000"},
                                          timeout=120))

        async def served() -> bool:
            async with s.get(f"http://127.0.0.1:{upstream}/stats") as r:
                return int((await r.json())["inflight"]) == 1

        assert await wait_until(served, 10)
        waiters = [asyncio.create_task(post(s, envoy.url, headers={"x-request-priority": "1"}, timeout=60))
                   for _ in range(6)]

        raw = redis_client(stack.redis_url, op_timeout_s=2)

        async def queued_at_both() -> bool:  # Envoy spreads the streams over both processors
            tickets = [t.decode() for t in await raw.zrange(key("default", "queue"), 0, -1)]
            return {t.split("/", 1)[0] for t in tickets} == {"extproc0", "extproc1"} and len(tickets) == 6

        assert await wait_until(queued_at_both, 10)
        await asyncio.sleep(3)  # the waiters wait 3 s of their 6 s ...
        first.child.proc.kill()  # ... and one processor dies with some of them queued
        first.child.proc.wait(10)
        replies = await asyncio.gather(*waiters)
        holder.cancel()
        await raw.aclose()
    # Every waiter got Floodgate's answer, the ones Envoy moved to the survivor included: a 429
    # with its Retry-After, never Envoy's 504 at its message timeout.
    assert [r.status for r in replies] == [429] * 6, [(r.status, r.body[:200]) for r in replies]
    for r in replies:
        assert r.headers["x-floodgate-reject-reason"] == "queue_timeout", r.headers
        assert int(r.headers["retry-after"]) >= 1


def test_request_age_reads_envoys_request_time_and_ignores_what_it_cannot_use() -> None:
    now = 1_800_000_000.0
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now - 3))
    assert request_age(f"{stamp}.5+00:00", now, 35) == pytest.approx(2.5)
    assert request_age(f"{stamp}.123456789+00:00", now, 35) == pytest.approx(3 - 0.123456, abs=1e-5)
    assert request_age(f"{stamp}Z", now, 35) == pytest.approx(3)
    # absent, not a string, unreadable, huge, in the future, older than Envoy could wait: 0
    for value in (None, 12, "", "garbage", "9" * 500, f"{stamp}+00:00\u00e9"):
        assert request_age(value, now, 35) == 0.0, value
    assert request_age(f"{stamp}+00:00", now - 10, 35) == 0.0  # the processor's clock behind Envoy's
    assert request_age(f"{stamp}+00:00", now + 100, 35) == 0.0  # ... or far ahead
