"""A controller starts whatever another writer left in its stored keys (a controller review: a
`fg:{pool}:ctl:seq` of "1.0" or "abc" raised in `rebuild` and stopped every start, while the
neighbouring `ctl:desired` and `ctl:history` were already read defensively)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from floodgate.controller.actuators.process import ProcessActuator, sim_command
from floodgate.controller.app import Controller, parse_seq
from floodgate.extproc import schema
from floodgate.extproc.state import redis_client
from redis.asyncio import Redis

from floodgate.stack import LocalStack
from tests.controller.live import SIM_ARGS, controller_config, count, registry_states, wait_for


def test_parse_seq() -> None:
    assert parse_seq(None) == 0 and parse_seq(b"") == 0
    assert parse_seq(b"7") == 7 and parse_seq("12") == 12
    for bad in (b"1.0", b"abc", b"-3", b" 4", "\u0663", b"9" * 40):
        assert parse_seq(bad) is None, bad


@pytest.mark.integration
@pytest.mark.parametrize("value", ["1.0", "abc"])
async def test_a_controller_starts_over_a_stored_sequence_that_is_no_number(
        stack: LocalStack, tmp_path: Path, value: str) -> None:
    async with _serving_over(stack, tmp_path, {schema.CTL_SEQ: value, schema.CTL_DESIRED: value}) as (_, c):
        assert await c.get(schema.key("default", schema.CTL_SEQ)) == b"1"  # r0 started: the sequence goes on


@asynccontextmanager
async def _serving_over(stack: LocalStack, tmp_path: Path, stored: dict[str, str]
                        ) -> AsyncIterator[tuple[Controller, Redis]]:
    """A controller started over `stored` (its pool's keys set first), once it serves one active
    replica (it must not have exited meanwhile)."""
    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    for k, v in stored.items():
        await c.set(schema.key("default", k), v)
    a = ProcessActuator(sim_command(*SIM_ARGS), tmp_path / "r", supervisor=stack.sup)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 2}, warm_pool={"enabled": False})
    ctl = Controller(cfg, {"default": a}, holder="t")
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    try:
        async def one_active() -> bool:
            assert not task.done(), f"controller exited: {task.exception()!r}"
            return count(await registry_states(url), "active") == 1
        await wait_for(one_active, 30)
        yield ctl, c
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        await c.aclose()
        await a.stop_all()


@pytest.mark.integration
@pytest.mark.parametrize("history", [
    '{"end_minute": Infinity, "values": [1.0]}',  # int(inf): OverflowError, which the read did not catch
    '{"end_minute": 1e300, "values": [1.0]}',
    '{"end_minute": 99999999999, "values": [1.0, 2.0]}',  # far ahead of the clock
])
async def test_a_controller_starts_over_a_stored_history_it_cannot_use(
        stack: LocalStack, tmp_path: Path, history: str) -> None:
    """A stored demand history with an end no clock reaches (a hand edit, another writer):
    the history starts empty with a warning; an infinite end crash-looped every start."""
    import time

    from floodgate.controller import forecast as fc

    async with _serving_over(stack, tmp_path, {schema.CTL_HISTORY: history}) as (ctl, _):
        h = ctl.pools["default"].state.history
        assert h is not None and h.end_minute <= fc.minute_of(time.time()) + 1
