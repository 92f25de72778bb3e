"""Cluster-wide admission state in Redis: a thin async wrapper over `leases.lua`.

This is also Floodgate's public state API: the controller reads a pool's queue depth, in-flight
count, limit and demand counters through `read_pool_status` / `read_demand` (it may import this
module; extproc never imports the controller). Key names live in `schema.py`.

The script runs as a Redis Function library (FUNCTION LOAD, FCALL; Redis/Valkey >= 7): its
helpers are compiled once at load time instead of on every call, and a library is replicated
and persisted with the data, so a promoted replica has it. A server that answers "Function not
found" (a restart without persistence, a new Cluster node, FUNCTION FLUSH) gets the library
loaded again (on a Cluster: on every primary) and the call retried; a server without Functions
(Redis 6) runs the same source as an EVALSHA script (redis-py's `Script` reloads it on
NOSCRIPT). The admission calls of one pool (acquire, admit, enqueue, cancel, release, the renewal
`sync`, return_credits) that a processor makes while a call is in the air go together as one `batch`
call, sent in order once the previous one has answered: one round trip and one read of the
pool's state for all of them, and a grant to one of this processor's own waiters comes back in
that reply instead of as a pub/sub message. Each batch carries a fence that only grows: a batch
that reaches Redis after a later one of the same processor (its caller gave up while the server
was frozen; the bytes ran when it thawed) is refused instead of undoing what the later one did.
The library's name carries a hash of the source, so processors of two versions sharing one
Redis each call their own. A pool whose settings are missing (a fresh or restarted Redis) is
configured from this processor's settings and the call retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from floodgate.extproc.redis_client import is_cluster, make_client
from floodgate.extproc.schema import (
    ARRIVALS,
    CLASSES,
    DEMAND,
    DEMAND_BATCH,
    DEMAND_OUTCOMES,
    IDLE_CREDITS,
    PoolSettings,
    PoolStatus,
    demand_field,
    expand_snapshots,
    gateway_channel,
    key,
    parse_arrivals,
    parse_fields,
    parse_idle_credits,
    script_keys,
)
from floodgate.extproc.vegas import VegasState
from redis.exceptions import ResponseError

log = logging.getLogger("floodgate.state")

__all__ = ["LimitRecord", "PoolSettings", "PoolState", "PoolStatus", "SyncResult", "gateway_channel",
           "read_demand", "read_pool_status", "redis_client"]

_SOURCE = resources.files("floodgate.extproc").joinpath("leases.lua").read_text()
FUNCTION = "fg_leases_" + hashlib.sha1(_SOURCE.encode()).hexdigest()[:16]
FUNCTION_RO = FUNCTION + "_ro"  # reads only (`status`, `get_limit`): allowed on replicas and under OOM
LIBRARY = (f"#!lua name={FUNCTION}\n{_SOURCE}\n"
           f"redis.register_function{{function_name='{FUNCTION}', callback=main}}\n"
           f"redis.register_function{{function_name='{FUNCTION_RO}', callback=main, flags={{'no-writes'}}}}\n")
# The same source as a plain script, for a server without Functions.
_LUA = f"{_SOURCE}\nif redis.replicate_commands then redis.replicate_commands() end\nreturn main(KEYS, ARGV)\n"


class Leases:
    """Runs leases.lua on one client: FCALL of the library, loaded when a server lacks it;
    EVALSHA on a server without Functions."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.functions: bool | None = None  # None: not known yet
        # A reply could not be read (schema.UNREADABLE_REPLY): the library under our name may be
        # another's, so the next call checks it first and loads ours again if it is not (at most
        # every RELOAD_CHECK_S: a reply this version cannot parse from its own library is a bug
        # or data no Floodgate wrote, and loading 95 KB twice a second would not mend it).
        self.reload = False
        self.foreign_loads = 0  # libraries under our name found not ours, and replaced
        self._checked_at = -math.inf
        self._script = client.register_script(_LUA)

    RELOAD_CHECK_S = 5.0

    async def __call__(self, keys: Sequence[str], args: Sequence[Any], *, read: bool = False) -> Any:
        if self.reload and self.functions is not False and time.monotonic() - self._checked_at >= self.RELOAD_CHECK_S:
            self.reload = False
            self._checked_at = time.monotonic()
            if not await self.ours(keys[0]):
                await self.load(keys[0])
                self.foreign_loads += 1
                log.error("the function library %s in Redis was not this version's (replaced by a holder of the "
                          "processors' credentials?): loaded ours again", FUNCTION)
            else:
                log.error("Redis answered a reply this version cannot read from its own function library %s: a "
                          "pool key holds data no Floodgate wrote, or a bug in this version (degraded meanwhile)",
                          FUNCTION)
        if self.functions is not False:
            # A read goes by FCALL_RO: the server refuses every write inside it, whatever the
            # library now holds. Any holder of the processors' credentials can load a library
            # under our name (FUNCTION LOAD REPLACE: processors load theirs so); called with
            # FCALL by the controller or by `floodgate status` as admin, its code ran with their
            # rights (a review rewrote the registry and ran FLUSHALL that way).
            call = self.client.fcall_ro if read else self.client.fcall
            name = FUNCTION_RO if read else FUNCTION
            try:
                return await call(name, len(keys), *keys, *args)
            except ResponseError as exc:
                msg = str(exc).lower()
                if "function not found" not in msg and "unknown command" not in msg:
                    raise
            if await self.load(keys[0]):
                return await call(name, len(keys), *keys, *args)
        return await self._script(keys=keys, args=args)

    async def _on_shard(self, key: str, *args: Any) -> Any:
        """A command on the server that holds `key` (on a Cluster, that shard's primary: a shard
        that is down elsewhere must not stop it)."""
        if is_cluster(self.client):
            node = self.client.get_node_from_key(key)  # type: ignore[attr-defined]
            return await self.client.execute_command(*args, target_nodes=node)
        return await self.client.execute_command(*args)

    async def ours(self, key: str) -> bool:
        """Is the library under our name the code this version loads (or none at all: a call
        loads it)? On a Cluster, on the shard that holds `key`."""
        libs = await self._on_shard(key, "FUNCTION", "LIST", "LIBRARYNAME", FUNCTION, "WITHCODE")
        for lib in libs or []:
            info = lib if isinstance(lib, dict) else dict(zip(lib[::2], lib[1::2], strict=False))
            info = {_text(k): v for k, v in info.items()}
            if _text(info.get("library_name", "")) == FUNCTION:
                return _text(info.get("library_code", "")).strip() == LIBRARY.strip()
        return True

    async def load(self, key: str) -> bool:
        """Load the library (REPLACE: idempotent) on the server that holds `key` (`_on_shard`).
        False when the server has no Functions: calls run as a script from now on."""
        try:
            await self._on_shard(key, "FUNCTION", "LOAD", "REPLACE", LIBRARY)
        except ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                raise
            self.functions = False
            return False
        self.functions = True
        return True


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@dataclass(frozen=True)
class DemandBatch:
    """One write of a processor's demand counts (`PoolState.add_demand`): `gateway` names its
    batch key, `nonce` the process (a restart under the same gateway id starts a new run of
    `seq`), `seq` grows with each new batch and stays the same when one is sent again."""

    gateway: str
    nonce: str
    seq: int


@dataclass(frozen=True)
class LimitRecord:
    state: VegasState
    version: int


@dataclass(frozen=True)
class SyncResult:
    status: PoolStatus
    reasserted: int  # permits live requests hold that Redis had lost, leased again
    requeued: int  # waiters Redis had lost, queued again
    dropped: int  # this gateway's leases/waiters nobody holds any more (abandoned calls, outages)
    recounted: int = 0  # counts that disagreed with the entries they count (a key lost or overwritten)


def _size(tokens: float | None) -> tuple[str, ...]:
    """An op's optional last argument, the request's prompt tokens (absent: the pool's pf_size)."""
    return () if tokens is None else (repr(float(tokens)),)


# `sync` rides with them so that one processor's writes to a pool reach Redis in the order it
# made them: a renewal sent beside a batch could land after a release made later and lease the
# released permit again (a phantom until its TTL).
BATCHED = frozenset({"acquire", "admit", "enqueue", "cancel", "release", "return_credits", "sync", "credit_done",
                     "refund"})

_Pending = tuple[str, Sequence[Any], "asyncio.Future[Any]"]


class PoolState:
    """The shared state of one pool. Every call is one atomic script run; the admission calls
    (`BATCHED`) made while one is in the air are sent together as one `batch` run, in order.

    `gateway` and `on_grant(ticket, endpoint)`: a batch that grants a permit to one of this
    gateway's waiters reports it in its reply, and `on_grant` is told before the batch's
    callers get their replies (other gateways' waiters get a pub/sub message, as before).
    `batch_timeout_s` bounds one batch call (a caller's own timeout may be shorter).
    `on_lost()`: a batch's reply shows that Redis lost writes of this processor it had
    acknowledged (the fence it held was below one already answered)."""

    def __init__(self, client: aioredis.Redis, pool: str, *, lease_ttl_s: float,
                 settings: PoolSettings | None = None, gateway: str = "",
                 on_grant: Callable[[str, str], None] | None = None, batch_timeout_s: float = 5.0) -> None:
        self.client = client
        self.pool = pool
        self.settings = settings
        self.keys = script_keys(pool)
        self._script = Leases(client)
        self._ttl = str(int(lease_ttl_s * 1000))
        self.stored: PoolSettings | None = None  # what Redis holds, after configure()
        self.gateway = gateway
        self.on_grant = on_grant
        self.batch_timeout_s = batch_timeout_s
        self._queue: list[_Pending] = []
        self._sender: asyncio.Task[None] | None = None  # sends batches while ops are queued
        self._fence = 0  # the last batch's fence
        self._acked = 0  # the highest fence of a batch whose reply arrived
        self.on_lost: Callable[[], None] | None = None
        self.batches = 0  # batch calls sent, and the ops they carried (tests, metrics)
        self.batched_ops = 0

    async def _run(self, op: str, *args: Any) -> Any:
        if op in BATCHED:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queue.append((op, args, fut))
            if self._sender is None:
                self._sender = asyncio.create_task(self._send(), name=f"fg-batch-{self.pool}")
            return await fut
        return await self._run_configured([op, self._ttl, *args])

    async def _run_configured(self, argv: list[Any]) -> Any:
        try:
            return await self._script(self.keys, argv)
        except ResponseError as exc:
            if "FGNOSETTINGS" not in str(exc) or self.settings is None:
                raise
        await self.configure()
        return await self._script(self.keys, argv)

    async def _send(self) -> None:
        """Send what is queued as one batch, and again until nothing is: one batch in the air
        at a time, so ops reach Redis in the order they were made (a `cancel` never overtakes
        the `admit` it undoes). An op whose caller gave up before it was sent is not sent."""
        try:
            await asyncio.sleep(0)  # the rest of this event-loop turn's calls join the first batch
            while self._queue:
                todo = [p for p in self._queue if not p[2].done()]
                self._queue = []
                if todo:
                    await self._send_batch(todo)
        finally:
            self._sender = None
            for _, _, fut in self._queue:  # (only when cancelled: the loop is closing)
                fut.cancel()
            self._queue = []

    async def _send_batch(self, todo: list[_Pending]) -> None:
        argv: list[Any] = ["batch", self._ttl, self.gateway]
        fence = 0
        if self.gateway:
            # A fence that only grows (leases.lua `OPS.batch`): microseconds of the wall clock,
            # so a restarted process with the same gateway id starts above its predecessor's.
            # (A state without a gateway, a tool's or a test's, is not one sender: no fence.)
            fence = self._fence = max(self._fence + 1, time.time_ns() // 1000)
            argv.append(fence)
            if self._acked:  # so Redis sees a loss of acknowledged writes too (and holds its grants)
                argv.append(f"@{self._acked}")
        for op, args, _ in todo:
            argv += [op, len(args), *args]
        self.batches += 1
        self.batched_ops += len(todo)
        try:
            async with asyncio.timeout(self.batch_timeout_s):
                reply = await self._run_configured(argv)
            replies, grants = expand_snapshots(reply[0]), reply[1]
            # A reply of another shape (a library under our name that is not ours) is the callers'
            # failure like any other, not an exception out of this task that leaves them waiting
            # (schema.UNREADABLE_REPLY: they degrade and the library is checked).
            if len(replies) != len(todo) or len(grants) % 2 or (fence and len(reply) < 3):
                raise ValueError(f"batch reply of {len(replies)} for {len(todo)} ops, {len(grants)} grant fields")
            before = _text(reply[2]) if fence else ""
        except asyncio.CancelledError:
            for _, _, fut in todo:
                fut.cancel()
            raise
        except Exception as exc:  # each caller sees the failure (and degrades)
            for _, _, fut in todo:
                if not fut.done():
                    fut.set_exception(exc)
            return
        if fence:
            # The fence Redis held before this batch, below one it acknowledged already: Redis
            # lost acknowledged writes of this processor (a failover, a restart, or it was
            # declared dead). Told before the callers get their replies.
            if self._acked and (not before.isdigit() or int(before) < self._acked) and self.on_lost is not None:
                with contextlib.suppress(Exception):
                    self.on_lost()
            self._acked = max(self._acked, fence)
        if self.on_grant is not None:
            it = iter(grants)
            for ticket, endpoint in zip(it, it, strict=True):
                with contextlib.suppress(Exception):  # a bad callback must not lose the replies
                    self.on_grant(_text(ticket), _text(endpoint))
        for (_, _, fut), r in zip(todo, replies, strict=True):
            if fut.done():
                continue
            if isinstance(r, list) and len(r) == 2 and _text(r[0]) == "err":
                fut.set_exception(ResponseError(_text(r[1])))
            else:
                fut.set_result(r)

    async def configure(self) -> PoolSettings:
        """Store this processor's settings unless the pool has some (or these have a higher
        epoch); returns the stored ones, which every grant uses."""
        if self.settings is None:
            raise ValueError(f"pool {self.pool}: no settings to configure")
        flat = [x for kv in self.settings.fields().items() for x in kv]
        raw = await self._script(self.keys, ["configure", self._ttl, self.pool, *flat])
        self.stored = PoolSettings.from_fields(parse_fields(raw))
        return self.stored

    async def acquire(self, ticket: str, gateway: str, seq: int, cls: int, tenant: str,
                      credits: int = 0, tokens: float | None = None) -> PoolStatus:
        """`tokens`: the request's prompt tokens for the prefill estimate (prefill.prompt_tokens;
        None: the pool's `pf_size`), here and in `admit` / `enqueue`."""
        return PoolStatus.from_reply(await self._run("acquire", ticket, gateway, seq, cls, tenant, credits,
                                                     *_size(tokens)))

    async def admit(self, ticket: str, gateway: str, seq: int, cls: int, tenant: str, credits: int,
                    timeout_s: float, tokens: float | None = None) -> PoolStatus:
        """`acquire`, and when refused, `enqueue` in the same call (one call per contended
        request). Refused: the snapshot `acquire` returns (the state before this waiter joined),
        `enqueued` when it was queued, or `rejected` with the cap that refused it. A caller whose
        policy rejects the request on that snapshot must `cancel` the waiter."""
        return PoolStatus.from_reply(await self._run("admit", ticket, gateway, seq, cls, tenant, credits,
                                                     max(1, round(timeout_s * 1000)), *_size(tokens)))

    async def return_credits(self, *tickets: str, idle: str | None = None) -> None:
        """Hand idle credits back; `idle`: this gateway's idle credits now (schema.IDLE_CREDITS),
        written at once (a queue formed: the count shared at the last status tick would hide
        requests really in flight from `floodgate status` until the next)."""
        if tickets:
            await self._run("return_credits", *tickets)
        if idle is not None and self.gateway:
            await self.client.hset(key(self.pool, IDLE_CREDITS), self.gateway, idle)

    async def enqueue(self, ticket: str, gateway: str, seq: int, cls: int, tenant: str,
                      timeout_s: float, tokens: float | None = None) -> PoolStatus:
        return PoolStatus.from_reply(await self._run("enqueue", ticket, gateway, seq, cls, tenant,
                                                     max(1, round(timeout_s * 1000)), *_size(tokens)))

    async def cancel(self, ticket: str) -> int:
        """0: removed from the queue; 1: it had been granted (the caller owns a permit); 2: gone."""
        return int(await self._run("cancel", ticket))

    async def credit_done(self, n: int) -> int:
        """`n` requests admitted from this gateway's idle credits completed (their credits came
        back here, not to Redis): counted in the pool's release rate."""
        return int(await self._run("credit_done", n)) if n > 0 else 0

    async def refund(self, endpoint: str, tokens: float) -> int:
        """A request routed to `endpoint` ended with nothing back from it: `tokens` of its
        prompt leave the endpoint's prefill estimate (prefill.unprefilled). 1 if applied."""
        return int(await self._run("refund", endpoint, repr(float(tokens))))

    async def repair(self) -> list[str]:
        """Delete this pool's keys whose type is wrong (a WRONGTYPE on every call); their names."""
        gone = await self._script(self.keys, ["repair", self._ttl])
        return [g.decode() if isinstance(g, bytes) else str(g) for g in gone or []]

    async def release(self, *tickets: str) -> int:
        return int(await self._run("release", *tickets)) if tickets else 0

    async def sync(self, gateway: str, watermark: int, held: dict[str, tuple[int, int, str]],
                   waiting: dict[str, tuple[int, int, float, str]]) -> SyncResult:
        """Re-assert this gateway's permits (ticket -> class, seq, endpoint) and waiters
        (ticket -> class, seq, remaining seconds, tenant); drop its other entries older than
        `watermark`. Extends its leases and proves it alive for one TTL."""
        held_args = [f"{t}|{c}|{s}|{ep}" for t, (c, s, ep) in held.items()]
        wait_args = [f"{t}|{c}|{s}|{max(1, round(rem * 1000))}|{tenant}"
                     for t, (c, s, rem, tenant) in waiting.items()]
        raw = await self._run("sync", gateway, watermark, len(held_args), *held_args, *wait_args)
        f = parse_fields(raw)
        return SyncResult(PoolStatus.from_reply(raw), int(f["reasserted"]), int(f["requeued"]),
                          int(f["dropped"]), int(f.get("recounted", 0)))

    async def granted_among(self, tickets: list[str]) -> dict[str, str]:
        """Which of these waiting tickets hold a permit now, and the endpoint each was routed to."""
        if not tickets:
            return {}
        got = [_text(t) for t in await self._run("mine", *tickets)]
        return dict(zip(got[::2], got[1::2], strict=True))

    async def waiting_among(self, tickets: list[str], *, deaf: str | None = None,
                            deaf_ms: int = 1000) -> tuple[dict[str, str], set[str]]:
        """`granted_among`, and which of them Redis no longer has at all (neither leased nor
        queued: dropped because no one heard this gateway's grant channel when their turn came,
        or lost in a failover), which this gateway re-queues with a sync. `deaf`: this gateway
        (named) is not subscribed to its grant channel; grants to it are made anyway for
        `deaf_ms` (its polls find them)."""
        if not tickets and not deaf:
            return {}, set()
        flag = ["!deaf", deaf, deaf_ms] if deaf else ["!gone"]
        got = [_text(t) for t in await self._run("mine", *flag, *tickets)]
        pairs = dict(zip(got[::2], got[1::2], strict=True))
        gone = {t for t, ep in pairs.items() if ep == "!gone"}
        return {t: ep for t, ep in pairs.items() if t not in gone}, gone

    async def sync_times(self) -> dict[str, float]:
        """Gateway -> server time (ms) of its last `sync`, for gateways that share this
        process's lease TTL (`gws` holds the time plus the TTL)."""
        rows: list[Any] = await self.client.zrange(key(self.pool, "gws"), 0, -1, withscores=True)
        ttl = float(self._ttl)
        return {(g.decode() if isinstance(g, bytes) else str(g)): float(score) - ttl for g, score in rows}

    async def leave(self, gateway: str) -> None:
        """A gateway that stopped cleanly (its permits released) says so: it no longer counts as
        live (`floodgate status`, the local shares of a Redis outage) for its last TTL, and its
        fields go with it, as the reclaim drops a dead gateway's: its highest ticket number, its
        batch fence, its poll time and its place among the creditors. Left behind, each clean
        exit under a new id (a rolling update: the pod name is the id) added two fields to the
        state hash for good, and a restart under the same id found its old fence with no
        liveness and held every grant of the pool as after a clock step (a soak review)."""
        # (one round trip, in this order: the liveness goes last; the keys share the pool's slot)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hdel(key(self.pool, "state"), f"hw:{gateway}", f"bx:{gateway}", f"pl:{gateway}")
            pipe.srem(key(self.pool, "creditors"), gateway)
            pipe.zrem(key(self.pool, "gws"), gateway)
            await pipe.execute()
        # Its fence is gone on purpose: a late batch of this process (a release racing the stop)
        # must not read as Redis having lost it (leases.lua starts a hold for that).
        self._acked = 0

    def reload_library(self) -> None:
        """Load the function library again before the next call (a reply could not be read:
        `Leases.reload`)."""
        self._script.reload = True

    async def status(self, gateway: str = "") -> PoolStatus:
        """A read: never grants, reclaims or stores anything."""
        return PoolStatus.from_reply(await self._script(self.keys, ["status", self._ttl, gateway], read=True))

    async def get_limit(self) -> LimitRecord:
        f = parse_fields(await self._script(self.keys, ["get_limit", self._ttl], read=True))
        x = [v for v in f.get("extra", "").split(",") if v]
        st = VegasState(limit=float(f["limit"]), rtt_noload=float(f["rtt_noload"]),
                        probe_count=int(f["probe_count"]), probe_jitter=float(f["probe_jitter"]))
        if len(x) >= 3:  # the baseline bookkeeping (vegas.py), stored opaquely by the script
            st = replace(st, noload_inflight=int(x[0]), epoch_rtt=float(x[1]), epoch_inflight=int(x[2]))
        if len(x) >= 4:  # the endpoint count the limit was sized for (limit.follow_endpoints)
            st = replace(st, endpoints=int(x[3]))
        return LimitRecord(st, int(f["version"]))

    async def eject(self, endpoint: str, seconds: float) -> float:
        """Leave `endpoint` out of every processor's picks for `seconds` (extproc/ejection.py;
        a longer ejection already stored stands). Returns the seconds it is ejected for."""
        return int(await self._run("eject", endpoint, max(1, round(seconds * 1000)))) / 1000.0

    async def ejections(self) -> dict[str, float]:
        """The ejected endpoints and the seconds each has left (a read)."""
        got = [_text(x) for x in await self._script(self.keys, ["ejections", self._ttl], read=True)]
        return {ep: int(ms) / 1000.0 for ep, ms in zip(got[::2], got[1::2], strict=True)}

    async def uneject(self, *endpoints: str) -> int:
        """End the ejections of `endpoints` (they turned active again in the registry)."""
        return int(await self._run("uneject", *endpoints)) if endpoints else 0

    async def set_limit(self, expected_version: int, st: VegasState, ramp_credit: int = 0,
                        credit_s: float = 0.0) -> bool:
        """Compare-and-set the limit. `ramp_credit` (with the onset ramp on): growth lower
        classes may take at once for `credit_s`, beside the ramp's bucket (policy.ramp_credit:
        endpoints that just turned active)."""
        args: list[object] = [expected_version, repr(st.limit), repr(st.rtt_noload), st.probe_count,
                              repr(st.probe_jitter),
                              f"{st.noload_inflight},{st.epoch_rtt!r},{st.epoch_inflight},{st.endpoints}"]
        if ramp_credit >= 1 and credit_s > 0:
            args += [int(ramp_credit), max(1, round(credit_s * 1000))]
        f = parse_fields(await self._run("set_limit", *args))
        return f["ok"] == "1"

    async def add_demand(self, counts: dict[tuple[int, str], int], batch: DemandBatch | None = None) -> bool:
        """Add to the pool's per-class demand counters (schema.DEMAND_OUTCOMES), once per `batch`:
        a batch sent again (its first reply was lost: a timeout on a frozen server that then ran
        it) is skipped by Redis. False when it was in already. Without `batch`, a one-off."""
        if not counts:
            return True
        b = batch or DemandBatch("once-" + uuid.uuid4().hex, secrets.token_hex(8), 1)
        pairs = [x for (cls, outcome), n in counts.items() for x in (demand_field(cls, outcome), n)]
        keys = [*self.keys, key(self.pool, DEMAND), key(self.pool, f"{DEMAND_BATCH}:{b.gateway}")]
        return int(await self._script(keys, ["add_demand", self._ttl, b.nonce, b.seq, *pairs])) == 1


    async def share_arrivals(self, gateway: str, mine: str, forget_before_ms: float,
                             forget_after_ms: float = float("inf"), idle: str | None = None
                             ) -> tuple[dict[str, str], dict[str, str]]:
        """Write this gateway's arrival rates (schema.ARRIVALS) and, when given, its idle local
        credits (schema.IDLE_CREDITS), and read every gateway's of both; entries stamped before
        `forget_before_ms` (gateways gone for good) or after `forget_after_ms` (a writer's clock
        far ahead of this one's) are dropped."""
        k, kc = key(self.pool, ARRIVALS), key(self.pool, IDLE_CREDITS)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hset(k, gateway, mine)
            if idle is not None:
                pipe.hset(kc, gateway, idle)
            pipe.hgetall(k)
            pipe.hgetall(kc)
            *_, raw, raw_idle = await pipe.execute()
        out = {_text(f): _text(v) for f, v in raw.items()}
        credits = {_text(f): _text(v) for f, v in raw_idle.items()}
        for hkey, entries, parse in ((k, out, parse_arrivals), (kc, credits, parse_idle_credits)):
            old = [g for g, v in entries.items()
                   if (p := parse(v)) is None or not forget_before_ms <= p[0] <= forget_after_ms]
            if old:
                await self.client.hdel(hkey, *old)
        return out, credits


async def read_pool_status(client: aioredis.Redis, pool: str) -> PoolStatus:
    """Queue depth and in-flight per class and the current limit of `pool` (for the
    controller). A read: it never grants, reclaims or writes settings."""
    return await PoolState(client, pool, lease_ttl_s=1).status()


async def read_demand(client: aioredis.Redis, pool: str) -> dict[int, dict[str, int]]:
    """Cumulative per-class demand counters: {class: {outcome: count}} (0 when never seen)."""
    raw = await client.hgetall(key(pool, DEMAND))
    out = {c: dict.fromkeys(DEMAND_OUTCOMES, 0) for c in CLASSES}
    for k, v in raw.items():
        cls, _, outcome = _text(k).partition(":")
        text = _text(v)
        # Counters only the processors write, by HINCRBY; anything else (another writer) is skipped.
        if cls.isdigit() and int(cls) in out and text.isascii() and text.isdigit():
            out[int(cls)][outcome] = int(text)
    return out


def redis_client(url: str, *, password: str | None = None, op_timeout_s: float = 0.25) -> aioredis.Redis:
    """A client whose calls fail fast: a dead Redis must degrade admission, not hang it. Any
    URL redis_client.make_client takes: one server, a Sentinel primary, or a Cluster (whose
    client routes each script by its pool's slot)."""
    # RedisCluster is no Redis subclass but speaks the subset the callers use (scripts on one
    # pool's keys, single-key commands, same-slot pipelines).
    return make_client(url, password=password, op_timeout_s=op_timeout_s)  # type: ignore[return-value]
