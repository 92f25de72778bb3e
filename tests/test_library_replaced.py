"""A function library under Floodgate's name that is not Floodgate's (docs/operations.md,
threat model). Any holder of the processors' Redis credentials may `FUNCTION LOAD REPLACE`
(processors load theirs so), and the controller, `floodgate status` and the processors call the
library by name: an attacker review's replacement answering junk (`{'limit'}`) stopped the
controller for good (a ValueError out of its scrape; a restarted one the same) and turned every
request into a 503 (the processors neither degraded nor loaded their library again). A reply
that cannot be read is now an outage: the controller's scrape fails (it holds), the processor
runs on local limits and loads its own library again, and shared state resumes."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from floodgate.controller.scrape import scrape_floodgate
from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.state import FUNCTION, FUNCTION_RO, LIBRARY, redis_client

from floodgate.stack import LocalStack
from tests.helpers import wait_until

JUNK = (f"#!lua name={FUNCTION}\n"
        "local function junk(keys, args) return {'limit'} end\n"
        f"redis.register_function{{function_name='{FUNCTION}', callback=junk}}\n"
        f"redis.register_function{{function_name='{FUNCTION_RO}', callback=junk, flags={{'no-writes'}}}}\n")


async def _library(c: aioredis.Redis) -> str:
    """The code of the library loaded under Floodgate's name ('' if none)."""
    for lib in await c.function_list(library=FUNCTION, withcode=True):
        info = lib if isinstance(lib, dict) else dict(zip(lib[::2], lib[1::2], strict=True))
        info = {k.decode() if isinstance(k, bytes) else k: v for k, v in info.items()}
        code = info.get("library_code", b"")
        return code.decode() if isinstance(code, bytes) else str(code)
    return ""


@contextlib.asynccontextmanager
async def _processor(stack: LocalStack) -> AsyncIterator[tuple[str, Any, aioredis.Redis, Metrics, Admitter]]:
    """A processor (gateway `gw`, pool `a`: static limit 4, no credits) on a fresh server, and a
    plain client of that server (the attacker's, or the test's own reads)."""
    url = stack.start_redis()
    cfg = Config.model_validate({
        "redis": {"url": url, "lease_ttl_s": 3, "op_timeout_s": 0.5, "reconnect_interval_s": 0.2},
        "pools": [{"name": "a", "local_credits": 0, "limit": {"mode": "static", "initial": 4}}]})
    client = redis_client(url, op_timeout_s=0.5)
    raw = aioredis.Redis.from_url(url)
    metrics = Metrics()
    admitter = Admitter(cfg, client, metrics=metrics, gateway_id="gw")
    await admitter.start()
    try:
        yield url, client, raw, metrics, admitter
    finally:
        await admitter.stop()
        await client.aclose()
        await raw.aclose()


async def test_a_replaced_library_degrades_the_processor_and_is_loaded_again(stack: LocalStack) -> None:
    async with _processor(stack) as (url, client, attacker, metrics, admitter):
        def degraded() -> float:
            return metrics.pool_degraded.labels("a")._value.get()

        first = await admitter.admit("a", 1, "t")
        assert isinstance(first, Permit) and degraded() == 0
        await attacker.function_load(JUNK, replace=True)
        # The controller's read of the pool: a failed scrape, not an exception out of its tick.
        sample = await scrape_floodgate(client, "a", 0.0)
        assert not sample.signal.ok and not sample.counters.ok and "unreadable" in (sample.error or "")
        # `floodgate status` says what it found, without a traceback.
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "floodgate", "status", "--redis-url", url],
                                      capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "cannot read" in out.stderr and "Traceback" not in out.stderr, out.stderr
        # The processor: the request is still decided (local limits), never an error.
        second = await admitter.admit("a", 1, "t")
        assert isinstance(second, Permit)
        assert degraded() == 1
        # ... and it loads its own library again: shared state resumes.
        assert await wait_until(lambda: degraded() == 0, 15)
        assert (await _library(attacker)).strip() == LIBRARY.strip()  # ours again, not the junk
        await admitter.release(first)
        await admitter.release(second)
        assert (await admitter.pools["a"].state.status()).inflight_total == 0
        assert (await scrape_floodgate(client, "a", 0.0)).signal.ok


JUNK_BATCH = (f"#!lua name={FUNCTION}\n"
              "local function junk(keys, args) if args[1] == 'batch' then return {{}, {'t'}, ''} end return {'limit'} end\n"
              f"redis.register_function{{function_name='{FUNCTION}', callback=junk}}\n"
              f"redis.register_function{{function_name='{FUNCTION_RO}', callback=junk, flags={{'no-writes'}}}}\n")


async def test_a_batch_reply_of_another_shape_is_the_callers_failure_not_a_hang(stack: LocalStack) -> None:
    """A review: a replacement answering a batch with `{{}, {'t'}, ''}` raised inside the batch
    sender after the reply, so the callers waited out their timeout and the processor stayed
    degraded for good, the library never checked. The shape is checked with the reply."""
    async with _processor(stack) as (_url, _client, attacker, metrics, admitter):
        first = await admitter.admit("a", 1, "t")
        assert isinstance(first, Permit)
        await attacker.function_load(JUNK_BATCH, replace=True)
        t0 = asyncio.get_running_loop().time()
        second = await admitter.admit("a", 1, "t")
        assert isinstance(second, Permit)  # on local limits, at once
        assert asyncio.get_running_loop().time() - t0 < 0.5
        assert await wait_until(lambda: metrics.pool_degraded.labels("a")._value.get() == 0, 15)
        assert (await _library(attacker)).strip() == LIBRARY.strip()
        for p in (first, second):
            await admitter.release(p)


async def test_an_unreadable_reply_from_our_own_library_is_not_mended_by_loading_it_again(
        stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parser that fails on our own library's replies (a bug, or a pool key holding what no
    Floodgate wrote) is not a replaced library: it is checked at most every
    `Leases.RELOAD_CHECK_S`, and ours is not loaded again (a review: 22 loads of the 95 KB
    library in 10 s, and the log blamed a foreign library)."""
    from floodgate.extproc import schema

    async with _processor(stack) as (_url, _client, raw, metrics, admitter):
        def broken(_raw: object) -> object:
            raise KeyError("a parser bug")

        loads_before = await _function_loads(raw)
        monkeypatch.setattr(schema.PoolStatus, "from_reply", staticmethod(broken))
        try:
            assert isinstance(await admitter.admit("a", 1, "t"), Permit)  # local limits
            await asyncio.sleep(3.0)
            assert metrics.pool_degraded.labels("a")._value.get() == 1
            assert await _function_loads(raw) == loads_before  # checked, found ours, not loaded
            assert admitter.pools["a"].state._script.foreign_loads == 0
        finally:
            monkeypatch.undo()  # (before the processor stops: its last calls read replies too)


async def _function_loads(raw: aioredis.Redis) -> int:
    stats = await raw.info("commandstats")
    return int(stats.get("cmdstat_function|load", {}).get("calls", 0))
