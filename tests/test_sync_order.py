"""A renewal (`sync`) and a release of the same permit, made in that order by one processor,
must reach Redis in that order, against a real Redis-protocol server.

The sync re-asserts the permits the processor held when it was made: a lease Redis lacks is
created again. If the release reached Redis first, the sync re-created a lease that nobody
holds, and the pool counted it in flight until its TTL ran out: a phantom permit (seen as a
flaky `inflight_total == 2` after every permit was released in the frozen-shard test).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from floodgate.extproc.admission import Admitter
from floodgate.extproc.backends import Permit

from floodgate.stack import LocalStack
from tests.helpers import one_processor


@contextlib.asynccontextmanager
async def _one_processor(stack: LocalStack) -> AsyncIterator[Admitter]:
    """One processor with one pool `a` (static limit 64, no credits) on a fresh Redis. Its
    TTL is far longer than a test: a phantom lease would still be there at the end."""
    async with one_processor(stack, limit=64, lease_ttl_s=120, op_timeout_s=2) as g:
        yield g.admitter


async def test_a_release_made_after_a_sync_is_never_undone_by_it(stack: LocalStack) -> None:
    async with _one_processor(stack) as admitter:
        rt = admitter.pools["a"]
        for rnd in range(60):
            permits = [await admitter.admit("a", 1, "t") for _ in range(4)]
            assert all(isinstance(p, Permit) for p in permits)
            # Another op in the air on some rounds (the batch sender then holds the release).
            busy = asyncio.create_task(admitter.admit("a", 1, "t")) if rnd % 2 else None
            sync = asyncio.create_task(admitter._sync(rt))  # takes its snapshot of the held permits
            for _ in range(rnd % 4):
                await asyncio.sleep(0)
            for p in permits:
                await admitter.release(p)  # type: ignore[arg-type]
            await sync
            if busy is not None:
                extra = await busy
                assert isinstance(extra, Permit)
                await admitter.release(extra)
            st = await rt.state.status()
            assert st.inflight_total == 0, f"round {rnd}: {st.inflight_total} leases nobody holds"


async def test_one_pools_writes_are_in_the_air_one_call_at_a_time(stack: LocalStack) -> None:
    """The order is kept by construction: a sync made while a batch is in the air waits for
    it and goes out before anything made after it. Every call the pool's state sends is
    recorded at the real server's client (ops named, calls in the air counted)."""
    async with _one_processor(stack) as admitter:
        await _writes_in_order(admitter)


async def _writes_in_order(admitter: Admitter) -> None:
    rt = admitter.pools["a"]
    real = rt.state._script
    sent: list[list[str]] = []
    in_air, most = 0, 0

    class Recorded:
        async def __call__(self, keys: Sequence[str], args: Sequence[Any], *, read: bool = False) -> Any:
            nonlocal in_air, most
            if read:
                return await real(keys, args, read=read)
            ops = [str(args[0])] if args[0] != "batch" else \
                [str(a) for a in args[3:] if str(a) in ("admit", "acquire", "release", "sync", "cancel", "enqueue")]
            sent.append(ops)
            in_air += 1
            most = max(most, in_air)
            try:
                return await real(keys, args, read=read)
            finally:
                in_air -= 1

    rt.state._script = Recorded()  # type: ignore[assignment]
    try:
        held = await admitter.admit("a", 1, "t")
        assert isinstance(held, Permit)
        sent.clear()
        busy = asyncio.create_task(admitter.admit("a", 1, "t"))
        await asyncio.sleep(0.001)  # its batch is sent and in the air
        sync = asyncio.create_task(admitter._sync(rt))
        await asyncio.sleep(0)  # the sync is made (its snapshot holds `held`) ...
        await admitter.release(held)  # ... and then the release
        await sync
        extra = await busy
        assert isinstance(extra, Permit)
        await admitter.release(extra)
        assert most == 1, sent
        flat = [op for call in sent for op in call]
        assert flat.index("sync") < flat.index("release"), sent
        assert (await rt.state.status()).inflight_total == 0
    finally:
        rt.state._script = real
