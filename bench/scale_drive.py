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
    gws: list[tuple[str, Any, dict[str, asyncio.Future[str]], Any, dict[str, int], dict[str, int]]] = []
    for gw in gateways:
        waiting: dict[str, asyncio.Future[str]] = {}

        def granted(ticket: str, endpoint: str, waiting: dict[str, asyncio.Future[str]] = waiting) -> None:
            f = waiting.get(ticket)
            if f is not None and not f.done():
                f.set_result(endpoint)

        st = PoolState(redis_client(url, op_timeout_s=2.0), pool, lease_ttl_s=ttl, settings=pool_settings(pcfg),
                       gateway=gw, on_grant=granted, batch_timeout_s=4.0)
        st._script = _TimedLeases(st._script, call_ms, window)  # type: ignore[assignment]
        gws.append((gw, st, waiting, granted, {"seq": 0}, {}))
    for gw, st, *_ in gws:
        await st.configure()
        await st.sync(gw, 1, {}, {})

    async def listen(gw: str, granted: Any) -> None:
        sub = await subscribe(make_client(url, op_timeout_s=2.0, blocking=True), [gateway_channel(gw, pool)])
        try:
            while True:
                msg = await sub.get_message(1.0)
                if msg is not None:
                    _, ticket, endpoint = [*msg[1].decode().split("|", 2), "", ""][:3]
                    granted(ticket, endpoint)
        finally:
            await sub.aclose()

    async def keep_alive(gw: str, st: Any, waiting: dict[str, asyncio.Future[str]], seqs: dict[str, int],
                         held: dict[str, int]) -> None:
        # As the processor's sync: re-assert the permits held and the waiters (a waiter it did
        # not assert would be dropped from the queue).
        while True:
            await asyncio.sleep(ttl / 3)
            await st.sync(gw, seqs["seq"] + 1, {t: (1, s, "") for t, s in list(held.items())},
                          {t: (1, int(t.rsplit("/", 1)[1]), 30.0, "") for t, f in list(waiting.items())
                           if not f.done()})

    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    lo, hi = t0 + warm, t0 + warm + duration
    window[0], window[1] = lo, hi

    async def loop(gw: str, st: Any, waiting: dict[str, asyncio.Future[str]], seqs: dict[str, int],
                   held: dict[str, int]) -> None:
        loop_ = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            if now >= hi:
                return
            seqs["seq"] += 1
            seq = seqs["seq"]
            ticket = f"{gw}/{seq}"
            fut: asyncio.Future[str] = loop_.create_future()
            waiting[ticket] = fut
            try:
                reply = await st.admit(ticket, gw, seq, 1, "", 0, 30.0)
                queued = not reply.granted
                if queued:
                    if not reply.enqueued:
                        counts["rejected"] += lo <= now < hi
                        continue
                    await asyncio.wait_for(fut, 30.0)
            except Exception as exc:  # counted, and said
                counts["errors"] += lo <= now < hi
                print(f"scale_drive {gw}: {type(exc).__name__}: {exc}", file=sys.stderr)
                await asyncio.sleep(0.01)
                continue
            finally:
                waiting.pop(ticket, None)
            took = time.monotonic() - now
            held[ticket] = seq
            if hold_s:
                await asyncio.sleep(rng.expovariate(1 / hold_s))
            del held[ticket]
            await st.release(ticket)
            if lo <= now < hi:
                lat.append(took * 1000)
                counts["admitted"] += 1
                counts["queued"] += queued

    bg = [asyncio.create_task(listen(gw, granted)) for gw, _, _, granted, _, _ in gws]
    bg += [asyncio.create_task(keep_alive(gw, st, waiting, seqs, held)) for gw, st, waiting, _, seqs, held in gws]
    await asyncio.sleep(0.2)  # subscribed before the first grant
    b0: list[tuple[int, int]] = []

    async def mark() -> None:
        await asyncio.sleep(max(0.0, lo - time.monotonic()))
        b0.extend((st.batches, st.batched_ops) for _, st, *_ in gws)

    marker = asyncio.create_task(mark())
    await asyncio.gather(*(loop(gw, st, waiting, seqs, held) for gw, st, waiting, _, seqs, held in gws
                           for _ in range(per_gateway)))
    await marker
    for t in bg:
        t.cancel()
    batches = sum(st.batches for _, st, *_ in gws) - sum(b for b, _ in b0)
    ops = sum(st.batched_ops for _, st, *_ in gws) - sum(o for _, o in b0)
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
