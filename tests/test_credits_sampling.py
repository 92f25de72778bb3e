"""Two things the processor decides on its own, without Redis: whether an idle local credit may
admit a request (the onset ramp must still pace lower classes), and whether an admitted request
streams its body to measure latency (bounded, so the cost does not grow with the limit).

The credit test runs the real script on a real Redis-protocol server with its clock frozen
(`admin_testclock`), so the ramp's bucket does not refill while the test runs, however loaded the box.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.limit import sample_request
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.policy import Reject, credit_admits, credits_usable
from floodgate.extproc.schema import key
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack


def test_credits_do_not_admit_what_the_ramp_paces() -> None:
    assert credit_admits(1, (0, 30, 0), ramp=True)  # no P0 in flight: nothing to protect
    assert not credit_admits(1, (1, 30, 0), ramp=True)
    assert credit_admits(1, (1, 30, 0), ramp=False)  # no ramp configured
    # A credit is a P1 lease: P0 and P2 ask Redis, which then counts them in their class
    assert not credit_admits(0, (3, 30, 0), ramp=True) and not credit_admits(0, (0, 0, 0), ramp=False)
    assert not credit_admits(2, (0, 0, 30), ramp=False)


def test_sampling_is_bounded_by_the_streams_in_flight() -> None:
    assert sample_request(0.1, 0.5, streaming=0, cap=32)
    assert not sample_request(0.9, 0.5, streaming=0, cap=32)  # the rate as before
    assert not sample_request(0.0, 1.0, streaming=32, cap=32)  # full: not even a sure draw
    assert sample_request(0.0, 1.0, streaming=31, cap=32)
    assert sample_request(0.0, 1.0, streaming=10_000, cap=0)  # 0: no bound


def _config(url: str, **limit: object) -> Config:
    return Config.model_validate({
        "redis": {"url": url},
        "pools": [{"name": "p", "local_credits": 32,
                   "limit": {"mode": "static", "initial": 100, **limit},
                   # a P1 that cannot be admitted at once is turned away at once (no queue wait)
                   "classes": {"0": {"share": 0.5, "headroom": 0.1, "max_queue": 100}, "1": {"share": 0.1, "max_queue": 0},
                               "2": {"share": 0.0, "max_queue": 0}}}]})


@pytest.fixture
async def admitter(stack: LocalStack) -> AsyncIterator[Admitter]:
    url = stack.start_redis()
    client = redis_client(url)
    a = Admitter(_config(url), client, metrics=Metrics(), gateway_id="gw")
    # The script's clock, frozen: the onset ramp's bucket does not refill during the test.
    await client.set(key("p", "admin_testclock"), 1_000_000)
    await a._start_pool(a.pools["p"])  # configure + first sync, without the background loops
    try:
        yield a
    finally:
        await a.stop()
        await client.aclose()


async def test_idle_credits_do_not_bypass_the_onset_ramp(admitter: Admitter) -> None:
    """A processor holding idle credits while a P0 is in flight: a burst of P1 must go through
    the ramp in Redis, not through the credits (before: the idle credits admitted as many of them
    without a round trip while the ramp's bucket was empty)."""
    rt = admitter.pools["p"]
    p1 = await admitter.admit("p", 1, "t")  # a P1 fetches credits (a P0 does not: it never uses one)
    assert isinstance(p1, Permit) and not p1.credit
    assert len(rt.credits) >= 3  # far below half full: credits came with the grant (as many as ramp tokens)
    p0 = await admitter.admit("p", 0, "t")
    assert isinstance(p0, Permit) and not p0.credit
    admitter.observe(rt, await rt.state.status(admitter.gateway_id))  # the status loop's read
    assert rt.last_status is not None and rt.last_status.inflight[0] == 1
    idle = len(rt.credits)
    results = [await admitter.admit("p", 1, "t") for _ in range(20)]
    by_credit = [r for r in results if isinstance(r, Permit) and r.credit]
    assert by_credit == []
    assert len(rt.credits) == idle  # still idle: the ramp, not the credits, decided
    # The bucket was spent on the credits themselves (a credit takes its token when leased)
    # and the clock does not move: the ramp admits none of the burst now.
    assert all(isinstance(r, Reject) for r in results)
    # P0 is never paced: it is admitted at once, by Redis (counted as P0 there), not from a credit
    p0b = await admitter.admit("p", 0, "t")
    assert isinstance(p0b, Permit) and not p0b.credit
    for r in [p1, p0, p0b, *results]:
        if isinstance(r, Permit):
            await admitter.release(r)


async def test_sampled_streams_are_bounded_per_processor(stack: LocalStack) -> None:
    url = stack.start_redis()
    client: aioredis.Redis = redis_client(url)
    a = Admitter(_config(url, mode="vegas", initial=16, sample_rate=1.0, max_sampled=3), client,
                 gateway_id="gw", rng=lambda: 0.0)
    try:
        assert [a.sample("p") for _ in range(5)] == [True, True, True, False, False]
        a.sampled_done("p")
        assert a.sample("p") and not a.sample("p")
        # a static limit measures nothing
        s = Admitter(_config(url, sample_rate=1.0), client, gateway_id="gs", rng=lambda: 0.0)
        assert not s.sample("p")
    finally:
        await client.aclose()


async def test_completions_on_credits_count_in_the_release_rate(admitter: Admitter) -> None:
    """A request admitted from an idle credit hands the credit back to its processor, not to
    Redis: no release, so the pool's release rate (what early drop and Retry-After divide by)
    missed it (a review: 0.00/s read against 10/s of completions, then P1 early-dropped after a
    load step; 316 of 316 served with credits off). The status tick reports them."""
    rt = admitter.pools["p"]
    first = await admitter.admit("p", 1, "t")  # fetches the credits
    assert isinstance(first, Permit) and rt.credits
    before = (await rt.state.status(admitter.gateway_id)).release_n
    for _ in range(20):
        p = await admitter.admit("p", 1, "t")
        assert isinstance(p, Permit) and p.credit
        await admitter.release(p)
    assert rt.credit_done == 20
    await admitter._tick(rt)
    assert rt.credit_done == 0
    assert (await rt.state.status(admitter.gateway_id)).release_n == before + 20
    await admitter.release(first)


async def test_before_any_status_only_p1_takes_or_fetches_credits(admitter: Admitter) -> None:
    """A processor's first requests, before it has read any status: a P0 neither fetches
    credits (they would idle) nor, once a P1 fetched some, takes one (Redis would count it P1)."""
    rt = admitter.pools["p"]
    rt.last_status = None
    p0 = await admitter.admit("p", 0, "t")
    assert isinstance(p0, Permit) and not p0.credit and not rt.credits
    rt.last_status = None
    p1 = await admitter.admit("p", 1, "t")
    assert isinstance(p1, Permit) and rt.credits
    rt.last_status = None
    p0b = await admitter.admit("p", 0, "t")
    assert isinstance(p0b, Permit) and not p0b.credit
    for p in (p0, p1, p0b):
        await admitter.release(p)


def test_credits_are_used_only_within_the_limit() -> None:
    assert credits_usable(0, (0, 31, 0), limit=64)
    assert not credits_usable(1, (0, 3, 0), limit=64)  # something waits
    assert credits_usable(0, (0, 8, 0), limit=8)  # full with them: still within
    assert not credits_usable(0, (0, 31, 0), limit=8)  # the limit fell below the leases


def test_a_sample_rate_of_zero_never_samples() -> None:
    """Mutation review: `limit.sample_rate` 0 switches latency sampling off, even for a random
    draw of exactly 0.0 (`random.random()` can return it); read as `rand <= rate` it sampled."""
    assert not sample_request(0.0, 0.0, 0, 0)
    assert sample_request(0.0, 0.5, 0, 0)
