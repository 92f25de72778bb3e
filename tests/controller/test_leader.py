"""Leader lease: one active controller at a time, failover when the holder's lease expires."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from floodgate.controller.leader import LeaderLease
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.controller.live import controller_config, process_actuator, running, wait_for

pytestmark = pytest.mark.integration


async def test_one_leader_and_failover_on_expiry(stack: LocalStack) -> None:
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=2)
    try:
        a = LeaderLease(c, "fg:test:leader", holder="a", ttl_s=0.9)
        b = LeaderLease(c, "fg:test:leader", holder="b", ttl_s=0.9)
        assert await a.try_acquire_or_renew()
        assert await a.try_acquire_or_renew()  # idempotent renewal
        assert not await b.try_acquire_or_renew()
        for _ in range(4):  # a keeps renewing past its ttl: b never gets it
            await asyncio.sleep(0.3)
            assert await a.try_acquire_or_renew()
            assert not await b.try_acquire_or_renew()
        # a stops renewing (hung or dead): it steps down locally before the lease expires
        await asyncio.sleep(0.7)
        assert not a.is_leader
        await asyncio.sleep(0.3)
        assert await b.try_acquire_or_renew()
        assert await b.holder_now() == "b"
        assert not await a.try_acquire_or_renew()  # a cannot extend b's lease
        await b.release()
        assert await b.holder_now() is None
    finally:
        await c.aclose()


async def test_two_controllers_only_one_acts(stack: LocalStack) -> None:
    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 0}, warm_pool={"enabled": False},
                            leader={"ttl_s": 3})
    act1 = process_actuator(stack, stack.sup.workdir / "r1")
    act2 = process_actuator(stack, stack.sup.workdir / "r2")
    async with contextlib.AsyncExitStack() as s_two:
        async with running(cfg, act1, holder="one") as one:
            two = await s_two.enter_async_context(running(cfg, act2, holder="two", wait_ready=False))
            await asyncio.sleep(1.0)
            assert one.is_leader and not two.is_leader
            assert one.pools and not two.pools  # the standby keeps no view and acts on nothing
            assert two.metrics.ticks._value.get() == 0
        # one stopped and released its lease: two is elected without waiting for expiry
        await wait_for(lambda: _ready(two), 5)
        assert two.is_leader and two.pools


async def _ready(ctl: object) -> bool:
    return bool(ctl.ready.is_set())  # type: ignore[attr-defined]


async def test_a_leader_whose_lease_another_took_acts_on_nothing_and_steps_down(stack: LocalStack) -> None:
    # Redis lost the lease (a flush, a failover) and a standby took it: the old leader trusted
    # its last renewal for up to a renewal period and acted beside the new one (a review: two
    # leaders for 0.9 s and an extra cold start). Now it asks Redis before it acts. Here its
    # replica dies right after the lease changed hands: it must not start a replacement.
    import dataclasses
    import os
    import signal

    url = stack.start_redis()
    act = process_actuator(stack, stack.sup.workdir / "replicas")
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 2}, warm_pool={"enabled": False},
                            leader={"ttl_s": 60},  # renewed every 20 s: none in this test's window
                            timeouts={"crash_loop_s": 0})  # (a young replica's death would hold the start back)
    c = redis_client(url, op_timeout_s=2)
    try:
        async with running(cfg, act, holder="a") as ctl:
            pc = ctl.pools["default"]
            await wait_for(lambda: _one_active(pc), 30)
            (h,) = [h for h in await act.list() if h.running]
            await wait_for(lambda: _just_renewed(c, cfg.leader.key), 30)
            reg = ctl.metrics.registry
            assert reg.get_sample_value("floodgate_desired_replicas", {"pool": "default"}) == 1
            def ups() -> float:
                return sum(s.value for m in reg.collect() if m.name == "floodgate_scale_events"
                           for s in m.samples if s.name.endswith("_total") and s.labels.get("direction") == "up")

            ups_before = ups()
            # The switch happens between two ticks, not during one: a tick that had decided
            # (on the old floor, nothing to do) and was asking Redis whether it still leads while
            # the key changed stepped down without a start to skip (a fresh-clone run saw it once).
            ticked = asyncio.Event()
            tick = pc.tick

            async def tick_then_say(envoy: object) -> object:
                result = await tick(envoy)
                ticked.set()
                return result

            pc.tick = tick_then_say
            await ticked.wait()  # right after a tick: the next one starts a tick interval later
            # The pool's floor rises (the next decision is a scale-up, 1 -> 2), its replica dies,
            # and a standby holds the lease now.
            pc.dcfg = dataclasses.replace(pc.dcfg, policy=pc.dcfg.policy.model_copy(update={"min_replicas": 2}))
            os.kill(int(h.labels["pid"]), signal.SIGKILL)
            await c.set(cfg.leader.key, "b", px=60_000)
            await wait_for(lambda: _stepped_down(ctl), 10)
            # A controller that stepped down exports no decisions (an operator review: KEDA's
            # max(floodgate_desired_replicas) read the old leader's 3 over the new one's 1).
            async def forgotten() -> bool:
                return all(reg.get_sample_value(name, {"pool": "default"}) is None for name in (
                    "floodgate_desired_replicas", "floodgate_actual_replicas", "floodgate_warm_pool_target"))

            await wait_for(forgotten, 10)
            assert reg.get_sample_value("floodgate_replicas", {"pool": "default", "state": "active"}) is None
            assert reg.get_sample_value("floodgate_controller_leader") == 0
            skipped = [e for e in pc.events if e["event"] == "not_leader"]
            assert skipped and any(a.startswith("start:") for e in skipped for a in e["skipped"]), list(pc.events)[-5:]
            # The decision it did not act on is no scale event either (it was counted before the
            # leader check: `floodgate_scale_events_total` said up while nothing started).
            assert ups() == ups_before
            await asyncio.sleep(1)
            assert [x.replica_id for x in await act.list() if x.running] == []  # no replacement started
    finally:
        await c.aclose()


async def _one_active(pc: object) -> bool:
    return sum(1 for r in pc.replicas.values() if r.view.state.value == "active") == 1  # type: ignore[attr-defined]


async def _just_renewed(c: object, key: str) -> bool:
    return int(await c.pttl(key)) > 58_000  # type: ignore[attr-defined]


async def _stepped_down(ctl: object) -> bool:
    return not ctl.is_leader  # type: ignore[attr-defined]


async def test_cancel_and_wait_cancels_again_a_task_that_lost_its_cancellation() -> None:
    """A cancellation lost inside a library (Python 3.11's wait_for race) kept the controller's
    stop waiting for a pool tick or a start's health polling; the stop cancels again."""
    import asyncio

    from floodgate.extproc.cancel import cancel_and_wait

    async def loses_one() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # lost, as inside the library
        await asyncio.sleep(30)

    t = asyncio.create_task(loses_one())
    await asyncio.sleep(0)
    await cancel_and_wait([t], nudge_s=0.05)
    assert t.cancelled()  # a single cancel() and await would have run the second sleep out


def test_a_promotion_is_a_pool_hit_only_for_a_replica_pooled_before_the_scale_up() -> None:
    from floodgate.controller.app import pool_hit

    assert pool_hit(started_at=100.0, scale_up_since=200.0)  # pooled before the burst
    assert pool_hit(started_at=None, scale_up_since=200.0)  # adopted
    assert not pool_hit(started_at=205.0, scale_up_since=200.0)  # a refill started during it
    assert pool_hit(started_at=205.0, scale_up_since=None)  # no scale-up under way


async def test_cancel_and_wait_names_a_task_that_will_not_end(caplog: pytest.LogCaptureFixture) -> None:
    """A task that swallows its cancellations is cancelled again with growing pauses (1, 2, 4,
    8, 16, 16 ... x the nudge), and named in a warning once it has run 60 nudges past its first
    cancel (30 s at the default 0.5 s): the stop that waits for it says why."""
    import asyncio
    import logging

    from floodgate.extproc import cancel

    async def stubborn() -> None:
        for _ in range(8):  # ends after its 8th cancel: 1+2+4+8+16+16+16 = 63 nudges
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                pass

    t = asyncio.create_task(stubborn(), name="stubborn-loop")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="floodgate.cancel"):
        await asyncio.wait_for(cancel.cancel_and_wait([t], nudge_s=0.002), 10)
    assert t.done()
    assert "stubborn-loop" in caplog.text


async def test_a_slow_but_answering_redis_keeps_the_leader(stack: LocalStack) -> None:
    """Renewals are timed from the start of the last call, which is where the lease counts
    from (a review: timed from its end, answers of 1.5 s with a 3 s TTL left the holder leader
    20 % of the time, 11 changes in 15 s, while Redis named it throughout). Each answer here
    takes a quarter of the TTL (under the config's bound, `redis.op_timeout_s` <= a third)."""
    import time

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    lease = LeaderLease(c, "fg:test:leader", holder="a", ttl_s=3.0)
    real = lease._acquire

    async def slow(*args: object, **kw: object) -> object:
        await asyncio.sleep(0.75)
        return await real(*args, **kw)  # type: ignore[arg-type]

    lease._acquire = slow  # type: ignore[assignment]
    stop = asyncio.Event()
    task = asyncio.create_task(lease.run(stop))
    try:
        await wait_for(lambda: _leader(lease), 5)
        lapses = 0
        end = time.monotonic() + 8
        while time.monotonic() < end:
            await asyncio.sleep(0.05)
            lapses += not lease.is_leader
        assert lapses == 0
        assert await lease.holder_now() == "a"
    finally:
        stop.set()
        await task
        await c.aclose()


async def _leader(lease: LeaderLease) -> bool:
    return lease.is_leader


def test_a_lease_shorter_than_three_redis_calls_is_refused() -> None:
    from floodgate.controller.config import ConfigError, parse_config

    pools = [{"name": "p", "actuator": {"kind": "static", "endpoints": ["127.0.0.1:1"]}}]
    with pytest.raises(ConfigError, match=r"leader.ttl_s \(3\) must be at least 3 x redis.op_timeout_s \(1.5\)"):
        parse_config({"redis": {"op_timeout_s": 1.5}, "leader": {"ttl_s": 3}, "pools": pools}, env={})
    parse_config({"redis": {"op_timeout_s": 1.0}, "leader": {"ttl_s": 3}, "pools": pools}, env={})
    parse_config({"redis": {"op_timeout_s": 1.5}, "leader": {"enabled": False, "ttl_s": 3}, "pools": pools}, env={})


async def test_an_operation_resumed_after_the_lease_lapsed_stops_and_writes_nothing(stack: LocalStack) -> None:
    # A controller paused past its lease (SIGSTOP, a VM freeze, a long GC) resumes the replica
    # operations it had under way before its main loop notices the loss and steps down. A
    # review's SIGSTOPped leader wrote a promotion's role after the new leader had recycled the
    # replica; a stop that resumed would kill a replica the new leader had adopted and serves on
    # (a drained one out of the registry is found awake with its role `active`). The operations
    # now check that this controller still counts itself leader before each write or stop.
    from floodgate.controller.signals import ReplicaState

    from tests.controller.live import count, registry_states

    url = stack.start_redis()
    act = process_actuator(stack, stack.sup.workdir / "replicas")
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 1}, warm_pool={"enabled": False},
                            leader={"ttl_s": 3})

    async def one_active() -> bool:
        return count(await registry_states(url), "active") == 1

    async with running(cfg, act) as ctl:
        await wait_for(one_active, 40)
        pc = ctl.pools["default"]
        ((rid, rep),) = pc.replicas.items()
        assert ctl.lease is not None

        async def held_by_another(*_: object, **__: object) -> int:
            return 0

        ctl.lease._acquire = held_by_another  # type: ignore[assignment]  # another controller took it
        ctl.lease._valid_until = 0.0  # paused past the lease; not noticed yet
        await pc._stop(rep)  # a stop it had decided, resumed now
        await pc._fail(rep, "a check that ended now", kind="unresponsive")
        await pc._set_registry(rep)
        assert [h.replica_id for h in await act.list() if h.running] == [rid]  # not stopped
        assert (await registry_states(url)).get(rid) == "active"  # not taken out of routing
        # Kept, and tried again if it leads on. (The controller's own tick may run between these
        # calls and plan the FAILED replica's stop, TERMINATED-but-present: refused as well; a run
        # of the controller tests on a busy box saw it.)
        assert pc.replicas.get(rid) is rep and rep.stop_failures >= 1
        assert rep.view.state in (ReplicaState.FAILED, ReplicaState.TERMINATED)
    await act.stop_all()
