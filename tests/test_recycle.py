"""`server.max_requests`: a processor that recycles itself (drains as on SIGTERM, exits 0) after a
number of requests, a bound on the native memory grpcio leaks per request Envoy resets
(docs/operations.md, "What is kept, and for how long"). Through the real Envoy, two real
processors and a real Redis-protocol server, with requests streaming while it goes."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from floodgate.extproc.drain import RECYCLE_SPREAD, recycle_after

from floodgate.stack import LocalStack
from tests.helpers import drained, post, wait_until

TRUST_LOCAL = {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}}


def test_recycle_after_spreads_processors_started_together() -> None:
    assert recycle_after(0, 0.5) is None
    assert recycle_after(1000, 0.0) == 1000
    assert recycle_after(1000, 0.999) == 1000 + int(1000 * RECYCLE_SPREAD * 0.999) == 1249
    draws = {recycle_after(1000, i / 10) for i in range(10)}
    assert len(draws) == 10 and min(draws) == 1000 and max(draws) < 1000 * (1 + RECYCLE_SPREAD)


@pytest.mark.integration
async def test_a_processor_recycles_after_max_requests_without_failing_a_request(stack: LocalStack,
                                                                                 upstream: int) -> None:
    # Processor a recycles after 20-24 requests, b never; 4 clients keep 60 streaming requests
    # going through Envoy. a drains while streams are in flight on it (health NOT_SERVING,
    # Envoy moves new ones to b) and exits 0; every request succeeds; no permit is left.
    stack.start_redis()
    pool = {"name": "default", "limit": {"mode": "static", "initial": 32}}
    a = stack.start_processor({"pools": [pool], **TRUST_LOCAL,
                               "server": {"max_requests": 20, "shutdown_quiet_s": 2.0}}, name="a")
    stack.start_processor({"pools": [pool], **TRUST_LOCAL}, name="b")
    envoy = stack.start_envoy([("127.0.0.1", upstream)])
    replies = []
    async with aiohttp.ClientSession() as s:
        async def client(n: int) -> None:
            for _ in range(n):
                replies.append(await post(s, envoy.url, headers={"x-request-priority": "1", "x-test-chunks": "5",
                                                                 "x-test-delay-ms": "60"}))
        await asyncio.gather(*(client(15) for _ in range(4)))
        await wait_until(lambda: _exited(a), 30)
        assert a.child.proc.returncode == 0, a.child.log_tail()
        failed = [(r.status, r.error, r.body[:120]) for r in replies if r.status != 200]
        assert not failed, failed
        log = (stack.sup.workdir / "a.log").read_text()
        m = re.search(r"recycling after (\d+) requests", log)
        assert m and 20 <= int(m.group(1)) < 25, log[-2000:]
        assert "drained in" in log and "cutting" not in log, log[-2000:]
        assert (await drained(stack.redis_url)).inflight_total == 0


async def _exited(p: object) -> bool:
    return p.child.proc.poll() is not None  # type: ignore[attr-defined]
