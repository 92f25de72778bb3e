"""Drive one Redis shard with the processor's own admission code, without gRPC or Envoy.

`floodgate bench scale --saturate` runs several of these driver processes at once. Each hosts
G gateways: G real `Admitter`s (extproc/admission.py, backends.py, state.py, redis_client.py:
the processor's admission core, its batching of a pool's calls into one `batch` FCALL, its
pub/sub grant delivery, status/sync/poll loops), each with its own gateway id and its own
Redis connections, as G processors would. Each gateway runs C request loops on the contended
pool: `admit` (which queues: the pool's limit is far below the offered concurrency), hold the
permit for a random time (exponential, mean `hold_ms`: a fixed hold would keep the requests
granted together in step, so that their releases share calls more than real traffic's do),
`release` (which grants the next waiter: by SPUBLISH to another gateway, or
in the reply to its own). What is left out is only the gRPC stream around each decision, whose
CPU on this 2-core box starves Redis of the load the gRPC-driven rows would need to show it
busy.

Prints one JSON object: decisions, admitted/rejected/errors, the batch calls made and the ops
they carried, each batch call's round trip in ms (the `Leases` call timed around the FCALL:
what the Redis step of a decision costs in latency, queueing at a busy shard included), and
each admission decision's latency in ms (request start -> permit; under contention it includes
the wait in the pool's queue).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any


class _TimedLeases:
    """Times each `batch` call around the real `Leases` object (the measurement only)."""

    def __init__(self, inner: Any, sink: list[float], window: list[float]) -> None:
        self._inner = inner
        self._sink = sink
        self._window = window  # [lo, hi] monotonic
        self.functions = inner.functions

    async def __call__(self, keys: Sequence[str], args: Sequence[Any], *, read: bool = False) -> Any:
        t = time.monotonic()
        out = await self._inner(keys, args, read=read)
        if args and args[0] == "batch" and self._window[0] <= t < self._window[1]:
            self._sink.append((time.monotonic() - t) * 1000)
        return out

    async def load(self, key: str) -> bool:
        return bool(await self._inner.load(key))


async def drive(url: str, pool_cfg: dict[str, Any], gateways: Sequence[str], per_gateway: int, hold_s: float,
                start_at: float, warm: float, duration: float) -> dict[str, Any]:
    from floodgate.extproc.admission import Admitter
    from floodgate.extproc.backends import Permit
    from floodgate.extproc.config import Config
    from floodgate.extproc.redis_client import make_client
    from floodgate.extproc.state import redis_client

    cfg = Config.model_validate({"redis": {"url": url, "lease_ttl_s": 15, "op_timeout_s": 2.0},
                                 "pools": [pool_cfg]})
    pool = pool_cfg["name"]
    window = [float("inf"), float("inf")]
    call_ms: list[float] = []
    admitters = []
    for gw in gateways:
        a = Admitter(cfg, redis_client(url, op_timeout_s=2.0),
                     pubsub_client=make_client(url, op_timeout_s=2.0, blocking=True), gateway_id=gw)
        st = a.pools[pool].state
        st._script = _TimedLeases(st._script, call_ms, window)  # type: ignore[assignment]
        admitters.append(a)
    await asyncio.gather(*(a.start() for a in admitters))
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    lo, hi = t0 + warm, t0 + warm + duration
    window[0], window[1] = lo, hi
    lat: list[float] = []
    counts = {"admitted": 0, "rejected": 0, "errors": 0, "queued": 0}
    b0: list[tuple[int, int]] = []
    rng = random.Random(",".join(gateways))

    async def loop(a: Admitter) -> None:
        while True:
            now = time.monotonic()
            if now >= hi:
                return
            try:
                got = await a.admit(pool, 1, "")
            except Exception:  # counted (the admitter never raises by design)
                counts["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            took = time.monotonic() - now
            if isinstance(got, Permit):
                if hold_s:
                    await asyncio.sleep(rng.expovariate(1 / hold_s))
                await a.release(got)
            if lo <= now < hi:
                lat.append(took * 1000)
                if isinstance(got, Permit):
                    counts["admitted"] += 1
                    counts["queued"] += got.queued
                else:
                    counts["rejected"] += 1

    async def mark() -> None:
        await asyncio.sleep(max(0.0, lo - time.monotonic()))
        b0.extend((a.pools[pool].state.batches, a.pools[pool].state.batched_ops) for a in admitters)

    marker = asyncio.create_task(mark())
    await asyncio.gather(*(loop(a) for a in admitters for _ in range(per_gateway)))
    await marker
    batches = sum(a.pools[pool].state.batches for a in admitters) - sum(b for b, _ in b0)
    ops = sum(a.pools[pool].state.batched_ops for a in admitters) - sum(o for _, o in b0)
    degraded = sum(int(a.metrics.degraded_transitions.labels(pool)._value.get()) for a in admitters)
    for a in admitters:
        await a.stop()
    return {**counts, "batches": batches, "ops": ops, "degraded": degraded,
            "decisions": counts["admitted"] + counts["rejected"],
            "call_ms": [round(x, 3) for x in call_ms], "decision_ms": [round(x, 3) for x in lat]}


async def drive_state(url: str, pool_cfg: dict[str, Any], gateways: Sequence[str], per_gateway: int, hold_s: float,
                      start_at: float, warm: float, duration: float) -> dict[str, Any]:
    """The same contended sequence on the state layer alone (`--layer state`): per gateway one
    `PoolState` (state.py: the batching of a pool's calls, the `batch` FCALL, the in-reply
    grants) and one `subscribe()` (redis_client.py: the grant messages), a sync every TTL/3
    (liveness, as the processor's), and C loops of `admit` (queues), wait for the grant, hold,
    `release`. The admission policy and metrics a processor runs around each call are left out:
    they cost processor CPU, not Redis CPU, and leaving them out lets two cores push the shard
    harder."""
    from floodgate.extproc.admission import pool_settings
    from floodgate.extproc.config import PoolConfig
    from floodgate.extproc.redis_client import make_client, subscribe
    from floodgate.extproc.schema import gateway_channel
    from floodgate.extproc.state import PoolState, redis_client

    pcfg = PoolConfig.model_validate(pool_cfg)
    pool, ttl = pcfg.name, 15.0
    window = [float("inf"), float("inf")]
    call_ms: list[float] = []
    lat: list[float] = []
    counts = {"admitted": 0, "rejected": 0, "errors": 0, "queued": 0}
    rng = random.Random(",".join(gateways))

    class Gw:
        """One gateway's bookkeeping, as the processor keeps it for a pool (admission.py)."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.seq = 0
            self.waiting: dict[str, asyncio.Future[str]] = {}  # admit sent or queued, no permit taken yet
            self.enqueued: set[str] = set()  # the admit's reply said queued
            self.pending: dict[str, int] = {}  # ticket -> seq whose admit is in the air
            self.held: dict[str, int] = {}  # permits taken, not released
            self.st = PoolState(redis_client(url, op_timeout_s=2.0), pool, lease_ttl_s=ttl,
                                settings=pool_settings(pcfg), gateway=name, on_grant=self.granted, batch_timeout_s=4.0)
            self.st._script = _TimedLeases(self.st._script, call_ms, window)  # type: ignore[assignment]

        def granted(self, ticket: str, endpoint: str) -> None:
            f = self.waiting.get(ticket)
            if f is not None and not f.done():
                f.set_result(endpoint)

    gws = [Gw(name) for name in gateways]
    for g in gws:
        await g.st.configure()
        await g.st.sync(g.name, 1, {}, {})

    async def listen(g: Gw) -> None:
        sub = await subscribe(make_client(url, op_timeout_s=2.0, blocking=True), [gateway_channel(g.name, pool)])
        try:
            while True:
                msg = await sub.get_message(1.0)
                if msg is not None:
                    _, ticket, endpoint = [*msg[1].decode().split("|", 2), "", ""][:3]
                    g.granted(ticket, endpoint)
        finally:
            await sub.aclose()

    async def keep_alive(g: Gw) -> None:
        # The processor's sync (admission.py `_sync`): assert the permits held (and those granted
        # but not taken yet) and the queued waiters; the watermark stays below every admit still
        # in the air; afterwards hand back what was released or given up during the sync.
        while True:
            await asyncio.sleep(ttl / 3)
            held = {t: (1, s, "") for t, s in g.held.items()}
            held.update({t: (1, int(t.rsplit("/", 1)[1]), "") for t in g.enqueued if g.waiting[t].done()})
            waiting = {t: (1, int(t.rsplit("/", 1)[1]), 30.0, "") for t in g.enqueued if not g.waiting[t].done()}
            await g.st.sync(g.name, min(g.pending.values(), default=g.seq + 1), held, waiting)
            gone = [t for t in held if t not in g.held and t not in g.waiting]
            if gone:
                await g.st.release(*gone)
            for t in waiting:
                if t not in g.waiting and t not in g.held and await g.st.cancel(t) == 1:
                    await g.st.release(t)

    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    lo, hi = t0 + warm, t0 + warm + duration
    window[0], window[1] = lo, hi

    async def loop(g: Gw) -> None:
        loop_ = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            if now >= hi:
                return
            g.seq += 1
            seq = g.seq
            ticket = f"{g.name}/{seq}"
            fut: asyncio.Future[str] = loop_.create_future()
            g.waiting[ticket] = fut
            g.pending[ticket] = seq
            try:
                try:
                    reply = await g.st.admit(ticket, g.name, seq, 1, "", 0, 30.0)
                finally:
                    g.pending.pop(ticket, None)
                queued = not reply.granted
                if queued:
                    if not reply.enqueued:
                        counts["rejected"] += lo <= now < hi
                        continue
                    g.enqueued.add(ticket)
                    await asyncio.wait_for(asyncio.shield(fut), 30.0)
            except Exception as exc:  # counted, and said
                counts["errors"] += lo <= now < hi
                print(f"scale_drive {g.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                await asyncio.sleep(0.01)
                continue
            finally:
                g.waiting.pop(ticket, None)
                g.enqueued.discard(ticket)
            took = time.monotonic() - now
            g.held[ticket] = seq
            if hold_s:
                await asyncio.sleep(rng.expovariate(1 / hold_s))
            del g.held[ticket]
            await g.st.release(ticket)
            if lo <= now < hi:
                lat.append(took * 1000)
                counts["admitted"] += 1
                counts["queued"] += queued

    bg = [asyncio.create_task(listen(g)) for g in gws] + [asyncio.create_task(keep_alive(g)) for g in gws]
    await asyncio.sleep(0.2)  # subscribed before the first grant
    b0: list[tuple[int, int]] = []

    async def mark() -> None:
        await asyncio.sleep(max(0.0, lo - time.monotonic()))
        b0.extend((g.st.batches, g.st.batched_ops) for g in gws)

    marker = asyncio.create_task(mark())
    await asyncio.gather(*(loop(g) for g in gws for _ in range(per_gateway)))
    await marker
    for t in bg:
        t.cancel()
    batches = sum(g.st.batches for g in gws) - sum(b for b, _ in b0)
    ops = sum(g.st.batched_ops for g in gws) - sum(o for _, o in b0)
    return {**counts, "batches": batches, "ops": ops, "degraded": 0,
            "decisions": counts["admitted"] + counts["rejected"],
            "call_ms": [round(x, 3) for x in call_ms], "decision_ms": [round(x, 3) for x in lat]}


def main(argv: Sequence[str]) -> int:
    from floodgate.runtime import run_until_signalled

    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--pool", required=True, help="the contended pool's config, as JSON")
    p.add_argument("--gateways", required=True, help="comma-separated gateway ids")
    p.add_argument("--per-gateway", type=int, required=True)
    p.add_argument("--hold-ms", type=float, default=10.0)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--warm", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--layer", choices=("admitter", "state"), default="admitter")
    a = p.parse_args(argv)

    async def body(stop: asyncio.Event) -> dict[str, Any]:
        return await (drive if a.layer == "admitter" else drive_state)(a.url, json.loads(a.pool), a.gateways.split(","), a.per_gateway, a.hold_ms / 1000,
                           a.start_at, a.warm, a.duration)

    json.dump(run_until_signalled(body), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
