"""Bad data in a pool key while permits are held and waiters queue: the processor says Redis
answered with an error (not that it is unreachable), runs on local limits meanwhile, and its
next renewal repairs the counts; no permit leaks (docs/operations.md, "A pool key deleted,
evicted or overwritten")."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import pytest
from floodgate.extproc.backends import Permit
from floodgate.extproc.schema import key

from floodgate.stack import LocalStack
from tests.helpers import Gateway, one_processor, wait_until

# A processor of limit 2 that notices a failing call, reconnects and polls within a fraction of a
# second: degraded and back within seconds.
QUICK: dict[str, Any] = {"limit": 2, "lease_ttl_s": 3, "op_timeout_s": 0.25, "reconnect_interval_s": 0.2, "poll_interval_s": 0.25}


def _degraded(g: Gateway) -> float:
    return float(g.metrics.pool_degraded.labels("a")._value.get())


def _transitions(g: Gateway) -> float:
    return float(g.metrics.degraded_transitions.labels("a")._value.get())


async def _status_is(g: Gateway, inflight: int, queued: int) -> bool:
    st = await g.admitter.pools["a"].state.status()
    return st.inflight_total == inflight and st.queued_total == queued


async def _hold_and_queue(g: Gateway, waiting: int) -> tuple[list[object], list[asyncio.Task[Any]]]:
    """Both permits held and `waiting` P1 requests queued behind them."""
    held = [await g.admitter.admit("a", 1, "t") for _ in range(2)]
    assert all(isinstance(p, Permit) for p in held)
    waiters = [asyncio.create_task(g.admitter.admit("a", 1, "t")) for _ in range(waiting)]
    assert await wait_until(lambda: _status_is(g, 2, waiting), 10)
    return held, waiters


async def _release_all(g: Gateway, results: list[object]) -> None:
    """Release every permit among `results`; then none is held, here or in Redis."""
    for p in results:
        if isinstance(p, Permit):
            await g.admitter.release(p)
    assert not g.admitter.pools["a"].held
    assert await wait_until(lambda: _status_is(g, 0, 0), 10)


async def test_a_count_that_is_not_a_number_is_an_error_reply_repaired_by_the_renewal(
        stack: LocalStack, caplog: pytest.LogCaptureFixture) -> None:
    async with one_processor(stack, **QUICK) as g:
        admitter, metrics, raw = g.admitter, g.metrics, g.raw
        held, waiters = await _hold_and_queue(g, 3)
        # A peer of another version, or a hand, writes a count the script cannot read.
        await raw.hset(key("a", "counts"), "i1", "abc")
        with caplog.at_level(logging.WARNING, logger="floodgate.admission"):
            late = asyncio.create_task(admitter.admit("a", 1, "t"))
            # degraded (it may be back before a poll sees it), then back: the reconcile's
            # renewal dropped and recounted the count
            assert await wait_until(lambda: _transitions(g) >= 1, 10)
            assert await wait_until(lambda: _degraded(g) == 0, 20)
        said = [r.getMessage() for r in caplog.records]
        assert any("Redis answered with an error" in m and "not an outage" in m for m in said), said
        assert not any(m.startswith("redis unreachable") for m in said), said
        assert sum(s.value for m in metrics.redis_error_replies.collect() for s in m.samples
                   if s.name.endswith("_total")) >= 1
        assert (await raw.hget(key("a", "counts"), "i1")) not in (None, b"abc")
        await _release_all(g, [*held, *await asyncio.gather(*waiters, late)])


async def test_settings_an_older_processor_stored_after_a_restart_are_replaced(stack: LocalStack) -> None:
    # A review: Redis emptied during a settings rollout (epoch 0 -> 1), the old processor's call
    # came first and stored epoch 0; the new processor configured only at start, so the pool ran
    # on the old settings for good, and its settings_mismatch read 0.
    from floodgate.extproc.admission import pool_settings
    from floodgate.extproc.config import PoolConfig
    from floodgate.extproc.state import PoolState

    async with one_processor(stack, limit=8, lease_ttl_s=3, op_timeout_s=0.25, pool={"settings_epoch": 1}) as g:
        rt = g.admitter.pools["a"]
        assert (await rt.state.status()).settings_epoch == 1
        old = PoolState(g.client, "a", lease_ttl_s=3, gateway="old", settings=pool_settings(PoolConfig.model_validate(
            {"name": "a", "local_credits": 0, "limit": {"mode": "static", "initial": 4}})))
        await g.raw.flushall()
        await old.configure()  # the old processor's call comes first
        assert (await rt.state.status()).settings_epoch == 0

        async def newer_back() -> bool:
            return (await rt.state.status()).settings_epoch == 1

        assert await wait_until(newer_back, 5)
        assert (await rt.state.configure()).initial_limit == 8  # (configure returns what is stored)


WANT_TYPE = {"counts": b"hash", "queue": b"zset", "leases": b"zset", "state": b"hash", "settings": b"hash",
             "qmeta": b"hash", "gws": b"zset"}


@pytest.mark.parametrize("name", sorted(WANT_TYPE))
async def test_a_pool_key_of_the_wrong_type_is_deleted_and_rebuilt(
        stack: LocalStack, caplog: pytest.LogCaptureFixture, name: str) -> None:
    # Permits held and waiters queued when something writes a list where a pool key is: every
    # call failed with WRONGTYPE and the processor ran on local limits for good, until someone
    # removed the key. Its reconcile now deletes the keys of the wrong type and asserts its
    # permits and waiters into fresh ones; nothing leaks.
    async with one_processor(stack, **QUICK) as g:
        admitter, metrics, raw = g.admitter, g.metrics, g.raw
        held, waiters = await _hold_and_queue(g, 2)
        await raw.delete(key("a", name))
        await raw.rpush(key("a", name), "junk")
        with caplog.at_level(logging.WARNING, logger="floodgate.admission"):
            late = asyncio.create_task(admitter.admit("a", 1, "t"))
            assert await wait_until(lambda: _transitions(g) >= 1, 10)
            assert await wait_until(lambda: _degraded(g) == 0, 20), "still degraded: the key was not repaired"
        said = [r.getMessage() for r in caplog.records]
        assert any("wrong type deleted" in m and key("a", name) in m for m in said), said
        assert (await raw.type(key("a", name))) in (WANT_TYPE[name], b"none")
        assert metrics.reconciled.labels("a", "repaired_keys")._value.get() >= 1
        await _release_all(g, [*held, *await asyncio.gather(*waiters, late)])


async def test_a_shared_limit_redis_lost_is_restored_from_what_the_processor_last_saw(
        stack: LocalStack, caplog: pytest.LogCaptureFixture) -> None:
    # An operator's review: a Vegas pool at limit 322 fell to 38 (the initial) after a FLUSHALL
    # and turned away 230 of 1,165 requests while it climbed back. The processor that notices
    # the loss (its next call finds its fence gone) writes back the limit it last saw.
    from floodgate.extproc.limit import LimitState

    vegas = {"limit": {"mode": "vegas", "initial": 10, "min": 1, "max": 200}}
    async with one_processor(stack, limit=10, lease_ttl_s=3, op_timeout_s=0.5, pool=vegas,
                             poll_interval_s=0.25) as g:
        admitter, raw = g.admitter, g.raw
        rt = admitter.pools["a"]
        rec = await rt.state.get_limit()
        assert await rt.state.set_limit(rec.version, LimitState(50.0, rtt_noload=0.2))  # what Vegas learned
        assert await wait_until(lambda: rt.last_status is not None and rt.last_status.limit == 50.0, 5)
        held = await admitter.admit("a", 1, "t")  # work in flight
        assert isinstance(held, Permit)
        await raw.flushall()
        with caplog.at_level(logging.WARNING, logger="floodgate.admission"):
            more = await admitter.admit("a", 1, "t")  # its reply shows the fence gone: lost writes
            assert await wait_until(lambda: _limit_is(rt, 50.0), 10), (await rt.state.get_limit()).state
        said = [r.getMessage() for r in caplog.records]
        assert any("restored the 50.0 this process last saw" in m for m in said), said
        for p in (held, more):
            if isinstance(p, Permit):
                await admitter.release(p)


async def _limit_is(rt: object, want: float) -> bool:
    return bool((await rt.state.get_limit()).state.limit == want)  # type: ignore[attr-defined]


async def test_requests_turned_away_on_local_limits_are_no_demand(stack: LocalStack) -> None:
    # An operator's review: after a FLUSHALL the processors ran ~2 s on local limits, turned a
    # few requests away, and the controller read them as demand the pool lacked and woke two
    # warm replicas. Turned away for want of shared state, they are counted as `degraded` (no
    # demand: schema.NOT_DEMAND), not as early drops or timeouts.
    from floodgate.controller.demand import ClassCounters
    from floodgate.extproc.state import read_demand

    async with one_processor(stack, **QUICK) as g:
        admitter = g.admitter
        rt = admitter.pools["a"]
        held, _ = await _hold_and_queue(g, 0)
        assert stack.redis_child is not None
        stack.redis_child.kill(signal.SIGSTOP)
        try:
            assert await wait_until(lambda: rt.degraded, 10)
            turned = await asyncio.gather(*(admitter.admit("a", 2, "t") for _ in range(3)))  # the pool is full
            assert all(not isinstance(p, Permit) for p in turned), turned
        finally:
            stack.redis_child.kill(signal.SIGCONT)
        assert await wait_until(lambda: _degraded(g) == 0, 20)
        await admitter._flush_demand(rt)
        counts = ClassCounters.from_mapping((await read_demand(g.client, "a")).get(2, {}))
        assert counts.degraded == 3 and counts.turned_away == 0, counts
        await _release_all(g, held)
