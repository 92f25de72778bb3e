"""A processor writes its demand counters to Redis soon after it turns a request away, not with
its next once-a-second status tick: the controller sizes scale-up from them (controller/demand.py).
Real Redis, a real processor (`Admitter`) whose clock is held still, so no status tick runs
after the first: every later write is the turned-away flush."""

from __future__ import annotations

import asyncio
import time

from floodgate.extproc.admission import DEMAND_FLUSH_S, Admitter, Permit
from floodgate.extproc.config import Config
from floodgate.extproc.policy import Reject
from floodgate.extproc.state import DemandBatch, read_demand, redis_client

from floodgate.stack import LocalStack


async def _hincrby_calls(c: object) -> int:
    stats = await c.info("commandstats")  # type: ignore[attr-defined]
    return int(stats.get("cmdstat_hincrby", {}).get("calls", 0))


async def _wait_for(pred: object, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not await pred():  # type: ignore[operator]
        assert time.monotonic() < end, "demand counters never reached Redis"
        await asyncio.sleep(0.02)


async def test_turned_away_demand_reaches_redis_without_a_status_tick(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    cfg = Config.model_validate({"redis": {"url": url}, "pools": [{"name": "d", "limit": {"mode": "static", "initial": 1}}]})
    a = Admitter(cfg, c, gateway_id="a", clock=lambda: 1000.0)  # ticks only once, at start
    held = None
    try:
        await a.start()
        rt = a.pools["d"]
        await _wait_for(lambda: asyncio.sleep(0, rt.last_status is not None))
        held = await a.admit("d", 0, "t")  # the only permit
        assert isinstance(held, Permit)
        before = await _hincrby_calls(c)
        r = await a.admit("d", 2, "t")
        assert isinstance(r, Reject)

        async def seen() -> bool:
            d = await read_demand(c, "d")
            return sum(d[2][o] for o in ("early_drop", "queue_full", "queue_timeout")) == 1 and d[0]["admitted"] == 1
        await _wait_for(seen)  # the admission before it goes along
        # Many turned away back to back: one write per DEMAND_FLUSH_S at most, not one each.
        t0, calls0 = time.monotonic(), await _hincrby_calls(c)
        for _ in range(50):
            assert isinstance(await a.admit("d", 2, "t"), Reject)

        async def all_seen() -> bool:
            d = await read_demand(c, "d")
            return sum(d[2][o] for o in ("early_drop", "queue_full", "queue_timeout")) == 51
        await _wait_for(all_seen)
        writes = await _hincrby_calls(c) - calls0  # one HINCRBY per (class, outcome) field written
        assert 1 <= writes <= 2 * ((time.monotonic() - t0) / DEMAND_FLUSH_S + 2), writes
        assert calls0 > before  # the first rejection's own write
    finally:
        if isinstance(held, Permit):
            await a.release(held)
        await a.stop()
        await c.aclose()


async def test_turned_away_during_a_write_goes_with_the_next_write(stack: LocalStack) -> None:
    # A request turned away while the flush's write is in the air found the flush already due
    # and scheduled none: with the status tick held still it was never written (a CI run of
    # the test above: 51 turned away, the last few stranded). Now the end of a write schedules
    # the next one when more were turned away meanwhile.
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    cfg = Config.model_validate({"redis": {"url": url}, "pools": [{"name": "w", "limit": {"mode": "static", "initial": 1}}]})
    a = Admitter(cfg, c, gateway_id="a", clock=lambda: 1000.0)  # no status tick after the first
    try:
        await a.start()
        rt = a.pools["w"]
        # the first (and only) status tick's own write is done: it set the time of the last write
        await _wait_for(lambda: asyncio.sleep(0, rt.demand_flushed_at == 1000.0))
        real = rt.state.add_demand
        interleaved = False

        async def add_demand(counts: dict[tuple[int, str], int], batch: DemandBatch | None = None) -> bool:
            nonlocal interleaved
            if not interleaved:  # one more turned away while this write is in the air
                interleaved = True
                a.count(rt, 2, "early_drop")
            return await real(counts, batch)

        rt.state.add_demand = add_demand  # type: ignore[method-assign]
        a.count(rt, 2, "queue_full")

        async def both() -> bool:
            d = await read_demand(c, "w")
            return d[2]["queue_full"] == 1 and d[2]["early_drop"] == 1
        await _wait_for(both, timeout_s=5.0)
        assert interleaved
    finally:
        await a.stop()
        await c.aclose()


async def test_a_client_that_leaves_while_queued_is_a_decision_in_the_metrics(stack: LocalStack) -> None:
    """A review: 10 queued clients that disconnected appeared in no Prometheus series (only in
    the Redis demand hash), so admitted + rejected did not add up to the requests decided."""
    from floodgate.extproc.metrics import Metrics

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    cfg = Config.model_validate({"redis": {"url": url}, "pools": [{"name": "d", "limit": {"mode": "static", "initial": 1}}]})
    m = Metrics()
    a = Admitter(cfg, c, gateway_id="a", metrics=m)
    try:
        await a.start()
        held = await a.admit("d", 0, "t")
        assert isinstance(held, Permit)
        waiters = [asyncio.create_task(a.admit("d", 0, "t")) for _ in range(3)]  # P0: 20 s, they queue
        assert await _until(lambda: len(a.pools["d"].waiting) == 3)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert m.decisions.labels("d", "0", "abandoned", "client_gone")._value.get() == 3
        await a.release(held)
    finally:
        await a.stop()
        await c.aclose()


async def _until(pred: object, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not pred():  # type: ignore[operator]
        if time.monotonic() > end:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_a_write_whose_reply_was_lost_is_counted_once(stack: LocalStack) -> None:
    # Redis froze while a demand write was in the air: the call timed out, the processor kept the
    # counts and sent them again with its next write; the server, resumed, had run the first one
    # too. Before, those counts were added twice (3 turned away read as 6); now the batch goes
    # again under its seq and Redis skips it.
    import signal

    url = stack.start_redis()
    assert stack.redis_child is not None
    c = redis_client(url, op_timeout_s=5)
    cfg = Config.model_validate({"redis": {"url": url, "op_timeout_s": 0.3},
                                 "pools": [{"name": "z", "limit": {"mode": "static", "initial": 1}}]})
    a = Admitter(cfg, redis_client(url, op_timeout_s=0.3), gateway_id="z1", clock=lambda: 1000.0)
    try:
        await a.start()
        rt = a.pools["z"]
        await _wait_for(lambda: asyncio.sleep(0, rt.demand_flushed_at == 1000.0))
        before = (await read_demand(c, "z"))[2]["early_drop"]
        for _ in range(3):
            a.count(rt, 2, "early_drop")
        stack.redis_child.kill(signal.SIGSTOP)
        try:
            await a._flush_demand(rt)  # times out: the server holds the call, unanswered
            assert rt.demand_unsent is not None
        finally:
            stack.redis_child.kill(signal.SIGCONT)

        async def ran() -> bool:  # the frozen server ran the first write once resumed
            return (await read_demand(c, "z"))[2]["early_drop"] == before + 3
        await _wait_for(ran, timeout_s=10.0)
        a.count(rt, 2, "queue_full")  # something new goes with the resend

        async def sent_again() -> bool:
            await a._flush_demand(rt)
            return rt.demand_unsent is None and not rt.demand
        await _wait_for(sent_again, timeout_s=10.0)
        d = await read_demand(c, "z")
        assert d[2]["early_drop"] == before + 3  # not + 6
        # (counted "degraded" if the processor has not yet left the local limits the timeout put it on)
        assert d[2]["queue_full"] + d[2]["degraded"] == 1
    finally:
        await a.stop()
        await c.aclose()


async def test_a_batch_key_of_another_type_does_not_stop_the_counts(stack: LocalStack) -> None:
    # Whatever sits under a processor's batch key (a hash someone wrote there), its counts go in.
    from floodgate.extproc.schema import DEMAND_BATCH, key
    from floodgate.extproc.state import PoolState

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    try:
        await c.hset(key("k", f"{DEMAND_BATCH}:g1"), "x", "y")
        st = PoolState(c, "k", lease_ttl_s=15)
        assert await st.add_demand({(1, "admitted"): 2}, DemandBatch("g1", "n", 1))
        assert not await st.add_demand({(1, "admitted"): 2}, DemandBatch("g1", "n", 1))  # sent again: once
        assert await st.add_demand({(1, "admitted"): 1}, DemandBatch("g1", "n", 2))
        assert await st.add_demand({(1, "admitted"): 1}, DemandBatch("g1", "other-run", 1))  # a restart
        assert (await read_demand(c, "k"))[1]["admitted"] == 4
    finally:
        await c.aclose()
