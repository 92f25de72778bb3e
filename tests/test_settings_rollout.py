"""Pool settings rolled out processor by processor (a rolling-upgrade review, real Redis).

- A static limit is a setting like the others: the processors whose settings are the stored
  ones set it. Every processor forced its own at start: the first one restarted with limit 16
  beside one at 8 ran the pool at 16 while its error said the stored 8 applied, and one
  restarted on the old config would have set 8 again.
- A processor whose settings a newer `settings_epoch` replaced says so (the gauge and an
  error), not only at its start.
- Settings stored by a version before the fair order have no `fair` field: read as off, as
  that version queued (read as on, an upgrade turned the fair order on under configs that say
  `fair_order: false`).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import pytest
from floodgate.extproc.admission import Admitter, pool_settings
from floodgate.extproc.backends import Permit
from floodgate.extproc.config import Config
from floodgate.extproc.limit import Latency
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.schema import key
from floodgate.extproc.state import PoolState, redis_client

from floodgate.stack import LocalStack
from tests.helpers import wait_until

pytestmark = pytest.mark.integration


def _config(url: str, limit: int, epoch: int) -> Config:
    return Config.model_validate({
        "redis": {"url": url, "lease_ttl_s": 3, "op_timeout_s": 1},
        "pools": [{"name": "a", "local_credits": 0, "settings_epoch": epoch,
                   "limit": {"mode": "static", "initial": limit}}]})


async def _processor(stack: AsyncExitStack, url: str, gid: str, limit: int, epoch: int) -> Admitter:
    client = redis_client(url, op_timeout_s=1)
    stack.push_async_callback(client.aclose)
    a = Admitter(_config(url, limit, epoch), client, metrics=Metrics(), gateway_id=gid)
    await a.start()
    stack.push_async_callback(a.stop)
    return a


def _mismatch(a: Admitter) -> float:
    return float(a.metrics.settings_mismatch.labels("a")._value.get())


async def _limit(a: Admitter) -> float:
    return (await a.pools["a"].state.status()).limit


async def test_a_static_limit_changes_with_the_settings_epoch_only(stack: LocalStack) -> None:
    url = stack.start_redis()
    async with AsyncExitStack() as s:
        old = await _processor(s, url, "old", limit=8, epoch=0)
        assert await _limit(old) == 8
        # A config with another limit but the same epoch: the stored settings (limit 8) apply,
        # as its error says.
        same_epoch = await _processor(s, url, "b", limit=16, epoch=0)
        assert _mismatch(same_epoch) == 1 and await _limit(old) == 8
        # The new epoch replaces the stored settings and the limit with them ...
        new = await _processor(s, url, "new", limit=16, epoch=1)
        assert _mismatch(new) == 0 and await _limit(new) == 16

        # ... and the processor still on epoch 0 says its settings are no longer the pool's.
        async def old_says_so() -> bool:
            return _mismatch(old) == 1

        assert await wait_until(old_says_so, 10)
        # One restarted on the old config does not set the old limit again.
        again = await _processor(s, url, "again", limit=8, epoch=0)
        assert _mismatch(again) == 1 and await _limit(again) == 16


async def test_settings_stored_without_the_fair_order_read_as_arrival_order(stack: LocalStack) -> None:
    url = stack.start_redis()
    cfg = Config.model_validate({"pools": [{"name": "p", "local_credits": 0, "fair_order": True,
                                            "limit": {"mode": "static", "initial": 1}}]})
    c = redis_client(url, op_timeout_s=5)
    try:
        st = PoolState(c, "p", lease_ttl_s=30, settings=pool_settings(cfg.pools[0]), gateway="g")
        await st.configure()
        # As a version before the fair order stored them: no `fair` field.
        await c.hdel(key("p", "settings"), "fair")
        assert (await st.configure()).fair is False
        assert (await st.acquire("g/1", "g", 1, 1, "noisy")).granted
        for i in range(2, 5):
            assert (await st.admit(f"g/{i}", "g", i, 1, "noisy", 0, 30.0)).enqueued
        quiet: Any = await st.admit("g/5", "g", 5, 1, "quiet", 0, 30.0)
        assert quiet.enqueued and quiet.ahead == 3, quiet  # behind the flood: arrival order
    finally:
        await c.aclose()


async def test_a_redis_flush_mid_rollout_ends_on_the_new_epochs_limit(stack: LocalStack) -> None:
    """A review: epoch-0 (static 8) and epoch-1 (static 16) processors side by side, Redis
    emptied; the old processor's first call stored its settings and limit again, the new one put
    back its newer settings at its next status tick but not the limit: the pool ran at 8 under
    the epoch-1 settings and nothing reported it."""
    url = stack.start_redis()
    async with AsyncExitStack() as s:
        old = await _processor(s, url, "old", limit=8, epoch=0)
        new = await _processor(s, url, "new", limit=16, epoch=1)
        assert await _limit(new) == 16
        c = redis_client(url, op_timeout_s=2)
        try:
            await c.flushall()
            await old.pools["a"].state.configure()  # the old processor's call comes first
        finally:
            await c.aclose()

        async def back_to_the_new_epoch() -> bool:
            st = await new.pools["a"].state.status()
            return st.settings_epoch == 1 and st.limit == 16

        assert await wait_until(back_to_the_new_epoch, 15)
        assert _mismatch(new) == 0


@pytest.mark.parametrize("busy", ["listen", "metrics"])
async def test_a_processor_that_cannot_listen_leaves_the_shared_settings_alone(stack: LocalStack, busy: str) -> None:
    """A processor that exits 2 on a busy port stored its pool settings first: a rollout's new
    `settings_epoch` (limit 5) was in force on the running fleet (limit 40) though no processor
    ran it (an operator review). Now the ports are bound before anything is written."""
    import subprocess
    import sys

    import yaml

    from floodgate.supervisor import free_port

    url = stack.start_redis()
    old = stack.start_processor({"pools": [{"name": "a", "limit": {"mode": "static", "initial": 40}}]})
    client = redis_client(url, op_timeout_s=1)
    try:
        assert await wait_until(lambda: _stored_limit(client, "40"), 10)
        listen = f"127.0.0.1:{old.port}" if busy == "listen" else f"127.0.0.1:{free_port()}"
        metrics = f"127.0.0.1:{old.metrics_port}" if busy == "metrics" else f"127.0.0.1:{free_port()}"
        path = stack.sup.workdir / f"new-{busy}.yaml"
        path.write_text(yaml.safe_dump({
            "server": {"listen": listen, "metrics_listen": metrics, "gateway_id": f"new-{busy}"},
            "redis": {"url": url},
            "pools": [{"name": "a", "settings_epoch": 1, "limit": {"mode": "static", "initial": 5}}]}))
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "floodgate", "extproc", "--config", str(path)],
                                    capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"server.{busy}" in r.stderr and "cannot listen" in r.stderr, r.stderr[-2000:]
        settings = await client.hgetall(key("a", "settings"))
        assert settings.get(b"epoch", b"0") in (b"0", b""), settings
        assert await _stored_limit(client, "40")
    finally:
        await client.aclose()


async def _stored_limit(client: Any, want: str) -> bool:
    raw = await client.hget(key("a", "state"), "limit")
    return raw is not None and float(raw) == float(want)


async def test_local_credits_give_way_to_a_lower_limit_rolled_out_beside_them(stack: LocalStack) -> None:
    """An operator review: a processor still on epoch 0 (static 64) held 31 idle local credits,
    leased while the pool was nearly empty, when a processor on epoch 1 stored a limit of 8. The
    old one kept admitting P1 from its credits (no Redis round trip, and no queue ever formed to
    recall them): 20 requests in flight through it against L 8, for as long as they kept coming.
    Once a status read shows the leases above the limit, the credits go back to Redis."""
    url = stack.start_redis()
    classes = {"0": {"share": 0.5, "max_queue": 100}, "1": {"share": 0.1, "max_queue": 0},  # P1: no wait
               "2": {"share": 0.0, "max_queue": 0}}

    def config(limit: int, epoch: int) -> Config:
        return Config.model_validate({
            "redis": {"url": url, "lease_ttl_s": 30, "op_timeout_s": 1},
            "pools": [{"name": "a", "local_credits": 32, "settings_epoch": epoch, "classes": classes,
                       "limit": {"mode": "static", "initial": limit}}]})

    async with AsyncExitStack() as s:
        procs = []
        for gid, limit, epoch in (("old", 64, 0), ("new", 8, 1)):
            client = redis_client(url, op_timeout_s=1)
            s.push_async_callback(client.aclose)
            a = Admitter(config(limit, epoch), client, metrics=Metrics(), gateway_id=gid)
            s.push_async_callback(a.stop)
            procs.append(a)
        old, new = procs
        await old._start_pool(old.pools["a"])  # configure + first sync, without the background loops
        first = await old.admit("a", 1, "t")
        assert isinstance(first, Permit)
        await old.release(first)  # back among its idle credits
        rt = old.pools["a"]
        assert len(rt.credits) >= 20
        await new._start_pool(new.pools["a"])  # the rollout: epoch 1 stores limit 8
        old.observe(rt, await rt.state.status(old.gateway_id))  # the old one's next status tick

        async def returned() -> bool:
            return sum((await rt.state.status()).inflight) == 0

        assert await wait_until(returned, 10)
        admitted = [p for p in [await old.admit("a", 1, "t") for _ in range(20)] if isinstance(p, Permit)]
        assert len(admitted) == 8, [p.credit for p in admitted]  # before: 20, every one on a credit
        st = await rt.state.status()
        assert sum(st.inflight) == 8 and st.limit == 8


async def test_an_adaptive_processor_left_on_the_old_epoch_does_not_move_the_new_static_limit(stack: LocalStack) -> None:
    """An operator review, real Envoy and processors: a rollout from `vegas` (epoch 0) to
    `static` 4 (epoch 1). The first new processor set 4; the one still on the old config went
    on applying its Vegas windows to the shared limit: 10 two seconds later, 34 from four seconds
    on, 14-16 requests in flight upstream, for as long as it ran. The limit is the newer epoch's to set."""
    url = stack.start_redis()
    clock = [1000.0]

    def config(epoch: int, limit: dict[str, Any]) -> Config:
        return Config.model_validate({
            "redis": {"url": url, "lease_ttl_s": 30, "op_timeout_s": 1},
            "pools": [{"name": "a", "local_credits": 0, "settings_epoch": epoch, "limit": limit}]})

    async with AsyncExitStack() as s:
        procs = []
        for gid, cfg in (("old", config(0, {"mode": "vegas", "initial": 4, "max": 64, "signal": "ttft",
                                             "window_min_samples": 1, "window_s": 0.1})),
                         ("new", config(1, {"mode": "static", "initial": 4}))):
            client = redis_client(url, op_timeout_s=1)
            s.push_async_callback(client.aclose)
            a = Admitter(cfg, client, metrics=Metrics(), gateway_id=gid, clock=lambda: clock[0])
            s.push_async_callback(a.stop)
            procs.append(a)
        old, new = procs
        rt = old.pools["a"]
        await old._start_pool(rt)  # without the background loops
        await new._start_pool(new.pools["a"])  # the rollout: epoch 1 stores the static limit 4
        await old._configure(rt)  # what the old one's status tick does on seeing the newer epoch
        assert _mismatch(old) == 1 and await _limit(old) == 4
        for _ in range(3):  # full windows of fast answers: Vegas on its own would raise the limit
            permits = [await old.admit("a", 1, "t") for _ in range(4)]
            old.observe(rt, await rt.state.status(old.gateway_id))  # 4 in flight: the limit is used
            clock[0] += 0.2
            for p in permits:
                assert isinstance(p, Permit)
                old.finish(p, "success", Latency(ttft=0.05, tpot=None))
                await old.release(p)
            await asyncio.gather(*list(old._background))
        assert await _limit(old) == 4  # before: 10
