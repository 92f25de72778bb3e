"""Faults: the shared admission state under crashes, Redis outages, partitions and bad clients.

Each fault runs on a fresh stack of real processes — a Redis-protocol server, two `floodgate
extproc` processors (each behind its own Envoy, or with `sigkill-shared` both behind one, as
the compose and Kubernetes deployments run them; each reaching Redis through its own small TCP
proxy that can cut, delay or black-hole its connections) and an upstream that records its own
concurrency — under sustained overload (open-loop arrivals at `--load` times the pool's
capacity, so waiters are queued at both processors when the fault hits). Every fault is an
object with `inject` and `recover` (see `Fault`); add one by appending to `FAULTS`.

Per fault it prints: the highest upstream concurrency vs the limit L (and the bound for a
partition), 5xx answered by Floodgate's path (upstream-injected errors excluded; the streams a
killed processor was carrying are counted apart), requests that waited past their class
timeout + 1 s (or never got an answer), leases in Redis held by no request one TTL after
recovery (phantoms) and waiters of nobody, and how long after the fault (a crash) or the
recovery (Redis back) the pool was serving at its limit again. `none` is the no-fault baseline.
The Cluster shard faults load three pools, one per shard, and report the pools on the live
shards apart from the dead shard's pool (`Fault.rows`), with each row's switches to local limits.

    floodgate bench faults                                    # every fault, shipped lease TTL (15 s)
    floodgate bench faults --faults sigkill redis-sigstop --ttl 3 --no-doc
    floodgate bench faults --faults cluster-shard-down cluster-shard-freeze

Unless --no-doc, the table and the command go into the "Faults" section of docs/benchmarks.md
(a run of some faults replaces only their rows there) when run from a checkout; installed, no
doc is written.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from floodgate.bench.doc_section import default_doc, replace_section
from floodgate.extproc.cancel import cancel_and_wait

SUMMARY = "faults: SIGKILL, Redis stop/restart, partition, client disconnects, upstream errors under load"

DEFAULT_DOC = default_doc()  # docs/benchmarks.md in a checkout; installed, none (bench/doc_section.py)
SECTION_START = "<!-- faults:begin -->"
SECTION_END = "<!-- faults:end -->"

PRIORITY_MIX = (0.2, 0.5, 0.3)
HOLD_MS = 300  # each admitted request streams for this long (3 chunks)


# --------------------------------------------------------------------------- records (pure)


@dataclass
class Rec:
    """One client request."""

    sent: float
    envoy: int
    priority: int
    timeout_s: float  # its class's queue timeout
    pool: str = "default"
    status: int = 0  # 0: no response (error / disconnected)
    first_byte: float | None = None
    done: float | None = None
    reason: str = ""  # x-floodgate-reject-reason
    floodgate_headers: bool = False  # the reply passed through Floodgate (any x-floodgate-*)
    injected: bool = False  # the upstream was asked to fail this one
    disconnected: bool = False  # the client gave up on purpose
    error: str = ""


@dataclass
class Result:
    fault: str
    limit: int
    bound: int  # the concurrency this fault may reach (L, or L + the cut-off share)
    max_concurrency: int
    requests: int
    ok: int
    rejected: int
    fivexx: int
    fivexx_killed: int  # on the streams of a killed processor (Envoy answers, failure_mode_allow: false)
    hung: int
    phantom_leases: int
    phantom_waiters: int
    serving_again_s: float | None  # None: never reached L again
    target_s: float  # serving again within this (one TTL of a crash, one renewal of Redis returning)
    local_entries: int = 0  # times a processor switched one of these pools to local limits
    local_allowed: bool = True
    local_at_end: int = 0  # processors still on local limits for these pools one TTL after recovery
    notes: str = ""
    injected_at: str = ""  # wall clock (UTC) of the injection, to read the processes' logs against

    def passed(self) -> bool:
        return ((self.local_allowed or self.local_entries == 0) and self.local_at_end == 0
                and self.max_concurrency <= self.bound and self.fivexx == 0 and self.hung == 0
                and self.phantom_leases == 0 and self.phantom_waiters == 0
                and (self.target_s < 0 or (self.serving_again_s is not None
                                           and self.serving_again_s <= self.target_s)))


def count_hung(recs: list[Rec], end: float) -> int:
    """Requests answered later than their class timeout + 1 s, or never answered (not counting
    clients that left on purpose, upstream-injected failures or a killed processor's streams)."""
    n = 0
    for r in recs:
        if r.disconnected or r.injected:
            continue
        answered = r.first_byte if r.first_byte is not None else (r.done if r.status else None)
        if answered is None:
            if r.error and "killed" not in r.error and end - r.sent > r.timeout_s + 1:
                n += 1
            continue
        if answered - r.sent > r.timeout_s + 1.0:
            n += 1
    return n


def bucket_means(series: list[tuple[float, int]], start: float, end: float, width: float = 0.1) -> list[float]:
    """Time-weighted mean concurrency per `width`-second bucket of [start, end)."""
    n = max(0, math.ceil((end - start) / width))
    sums = [0.0] * n
    level, t_prev = 0, start
    for t, v in [*series, (end, 0)]:
        t = min(max(t, start), end)
        if t > t_prev:
            for i in range(max(0, int((t_prev - start) / width)), min(n - 1, int((t - start) / width)) + 1):
                lo, hi = max(t_prev, start + i * width), min(t, start + (i + 1) * width)
                if hi > lo:
                    sums[i] += level * (hi - lo)
            t_prev = t
        level = v
    return [x / width for x in sums]


def serving_again(series: list[tuple[float, int]], since: float, limit: int, start: float, end: float,
                  width: float = 0.1) -> float | None:
    """Seconds after `since` until the pool was serving at its limit again: the end of the
    stretch of 100 ms buckets whose mean concurrency stayed below L - 1 (under overload it is at
    L otherwise) that began before `since` + 1 s and ends after `since`. 0 if it never dipped;
    None if it never came back."""
    means = bucket_means(series, start, end, width)
    worst = 0.0
    low_since: float | None = None
    for i, m in enumerate(means):
        t = start + i * width
        if m < limit - 1:
            if low_since is None:
                low_since = t
        elif low_since is not None:
            # the exact moment it came back: the first sample at L - 1 in the last low bucket
            back = next((ts for ts, v in series if ts >= t - width and v >= limit - 1), t)
            # only the dip the fault caused (from before `since` or right after it), not a
            # later lull of the open-loop arrivals
            if back > since and low_since <= since + 1.0:
                worst = max(worst, back - since)
            low_since = None
    if low_since is not None and low_since <= since + 1.0:
        return None  # the fault's dip never ended
    return worst


# --------------------------------------------------------------------------- the stack


class RedisProxy:
    """A TCP proxy in front of Redis for one processor: `pass`, `cut` (close every connection
    and refuse new ones), `blackhole` (accept, forward nothing) or `delay` (add latency)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self.delay_s = 0.0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()  # cleared while black-holed

    async def start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.cut_all()
        if self._server:
            self._server.close()

    def cut_all(self) -> None:
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        self.mode, self.delay_s = mode, delay_s
        if mode == "blackhole":
            self._flowing.clear()
        else:
            self._flowing.set()
        if mode == "cut":
            self.cut_all()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":
            writer.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._conns.update((writer, uw))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    await self._flowing.wait()
                    if self.mode == "delay" and self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pump(reader, uw), pump(ur, writer))
        self._conns.discard(writer)
        self._conns.discard(uw)


class Upstream:
    """An in-process model server that records its own concurrency over time. A request may
    ask (`x-fault`) for a 500 or a connection reset; those are marked so they are not blamed
    on Floodgate."""

    def __init__(self) -> None:
        self.inflight = 0
        self.max_inflight = 0
        self.series: list[tuple[float, int]] = []
        # The same per pool (the pool is the request's authority: `<pool>.invalid`, else default).
        self.pool_inflight: dict[str, int] = {}
        self.pool_max: dict[str, int] = {}
        self.pool_series: dict[str, list[tuple[float, int]]] = {}
        self.port = 0
        self._runner: Any = None

    def _level(self, d: int, pool: str = "default") -> None:
        now = time.monotonic()
        self.inflight += d
        self.max_inflight = max(self.max_inflight, self.inflight)
        self.series.append((now, self.inflight))
        n = self.pool_inflight[pool] = self.pool_inflight.get(pool, 0) + d
        self.pool_max[pool] = max(self.pool_max.get(pool, 0), n)
        self.pool_series.setdefault(pool, []).append((now, n))

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        host = request.host.split(":", 1)[0]
        pool = host[:-len(".invalid")] if host.endswith(".invalid") else "default"
        self._level(+1, pool)
        counted = True
        try:
            fault = request.headers.get("x-fault", "")
            if fault == "500":
                await asyncio.sleep(HOLD_MS / 3000)
                return web.json_response({"error": {"message": "injected", "type": "server_error"}},
                                         status=500, headers={"x-injected": "1"})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await asyncio.sleep(HOLD_MS / 3000)
                if fault == "reset" and i == 1:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write(f'data: {{"choices": [{{"text": " t{i}"}}]}}\n\n'.encode())
            await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
            # Done before the last bytes leave: Envoy cannot see the end (and release the
            # permit) before the count drops.
            self._level(-1, pool)
            counted = False
            await resp.write_eof()
            return resp
        finally:
            if counted:
                self._level(-1, pool)

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        # A request whose connection Envoy drops (client gone) stops at once, as vLLM aborts it.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


@dataclass
class Options:
    limit: int = 8
    ttl_s: float = 15.0
    reconnect_s: float = 0.5  # redis.reconnect_interval_s (shipped 0.5)
    load: float = 1.5  # offered load / capacity
    before_s: float = 4.0  # load before the fault
    after_s: float | None = None  # load after recovery (default: one TTL)
    seed: int = 1
    workdir: Path | None = None

    @property
    def capacity_rps(self) -> float:
        return self.limit / (HOLD_MS / 1000)


class Harness:
    """Redis, two processors (each via its own proxy, each behind its own Envoy), one upstream."""

    def __init__(self, opts: Options, sup: Any, topology: str = "single", loaded_pools: int = 1) -> None:
        from floodgate.stack import LocalStack

        self.opts = opts
        self.sup = sup
        # "single": one server behind per-processor proxies, each processor behind its own
        # Envoy; "shared": the same, with one Envoy in front of both processors (as the compose
        # and Kubernetes deployments run them); "sentinel": primary + replica + 3 sentinels;
        # "cluster": 3 primaries with a replica each (floodgate/redis_topology.py).
        self.topology = topology
        self.sentinel: Any = None
        self.cluster: Any = None
        self.other_pools: list[str] = []  # cluster: a pool on each other shard (`loaded`: with traffic)
        self.loaded = ["default"]  # the pools that get requests
        self.stack = LocalStack(sup)
        self.upstream = Upstream()
        self.proxies: list[RedisProxy] = []
        self.live_envoys = [0, 1]
        self.redis_port = 0
        self.killed: set[int] = set()  # processors SIGKILLed
        self.dead_envoys: set[int] = set()  # Envoys whose only processor was SIGKILLed
        self.killed_at: float | None = None  # "shared": when the processor died
        self.disconnect_fraction = 0.0
        self.upstream_fault_fraction = 0.0
        self.loaded_pools = loaded_pools
        self.clock_task: asyncio.Task[None] | None = None  # `redis-clock-step`: keeps the script's clock ahead

    def processor_config(self) -> dict[str, Any]:
        # Shipped defaults, except a static limit (so "<= L" is a fixed line) and the TTL.
        pools: list[dict[str, Any]] = [{"name": "default", "limit": {"mode": "static", "initial": self.opts.limit}}]
        for name in self.other_pools:
            pools.append({"name": name, "match_authority": f"{name}.invalid",
                          "limit": {"mode": "static", "initial": self.opts.limit}})
        return {"pools": pools,
                "admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
                "redis": {"lease_ttl_s": self.opts.ttl_s, "reconnect_interval_s": self.opts.reconnect_s}}

    async def start(self) -> None:
        if self.topology not in ("single", "shared"):
            await self._start_replicated()
            return
        url = self.stack.start_redis()
        self.redis_port = int(url.rsplit(":", 1)[1].split("/")[0])
        await self.upstream.start()
        for i in range(2):
            proxy = RedisProxy(self.redis_port)
            await proxy.start()
            self.proxies.append(proxy)
            self.stack.redis_url = f"redis://127.0.0.1:{proxy.port}/0"
            p = await asyncio.to_thread(self.stack.start_processor, self.processor_config(), name=f"extproc{i}")
            if self.topology == "single":
                await asyncio.to_thread(self.stack.start_envoy, [("127.0.0.1", self.upstream.port)], processors=[p])
        if self.topology == "shared":
            await asyncio.to_thread(self.stack.start_envoy, [("127.0.0.1", self.upstream.port)])
            self.live_envoys = [0]
        self.stack.redis_url = url

    def on_killed_path(self, rec: Rec) -> bool:
        """Could a killed processor have been carrying this request? Through its own Envoy, any
        request; through a shared Envoy, one already in the air when it died (one sent later
        that fails is a 5xx of the survivor's path: the retry and the outlier ejection are there
        to prevent it)."""
        if rec.envoy in self.dead_envoys:
            return True
        return self.killed_at is not None and rec.sent < self.killed_at and self.topology == "shared"

    async def _start_replicated(self) -> None:
        from floodgate.redis_topology import start_cluster, start_sentinel

        if self.topology == "sentinel":
            self.sentinel = await asyncio.to_thread(start_sentinel, self.sup)
            self.stack.redis_url = self.sentinel.url
        else:
            self.cluster = await asyncio.to_thread(start_cluster, self.sup, primaries=3, replicas=1)
            self.stack.redis_url = self.cluster.url
            # Pool names picked by slot: `default` on its shard, one more pool on each other shard.
            home = self.cluster.shard_of("fg:{default}:state")
            self.other_pools = [self.cluster.key_on_shard((home + i) % 3, prefix=f"pool{i}-") for i in (1, 2)]
            self.loaded = ["default", *self.other_pools][:self.loaded_pools]
        await self.upstream.start()
        for i in range(2):
            p = await asyncio.to_thread(self.stack.start_processor, self.processor_config(), name=f"extproc{i}")
            await asyncio.to_thread(self.stack.start_envoy, [("127.0.0.1", self.upstream.port)], processors=[p])

    async def stop(self) -> None:
        if self.clock_task is not None:
            # (Its Redis calls can lose a cancel: a single cancel() and await hung a CI run.)
            await cancel_and_wait([self.clock_task])
        for p in self.proxies:
            await p.stop()
        await self.upstream.stop()

    def shard_of_pool(self, pool: str) -> Any:
        return self.cluster.shards[self.cluster.shard_of(f"fg:{{{pool}}}:state")]

    async def pool_state(self, pool: str = "default") -> tuple[int, int]:
        """(unexpired leases, waiters) of `pool` in Redis now."""
        from floodgate.extproc.schema import key
        from floodgate.extproc.state import redis_client

        c = redis_client(self.stack.redis_url, op_timeout_s=2)
        try:
            now_s, now_us = await c.time()
            now_ms = int(now_s) * 1000 + int(now_us) // 1000
            fake = await c.get(key(pool, "admin_testclock"))  # the script's clock, when a fault set it
            if fake is not None:
                now_ms = int(fake)
            leases = await c.zcount(key(pool, "leases"), f"({now_ms}", "+inf")
            waiters = await c.zcard(key(pool, "queue"))
            return int(leases), int(waiters)
        finally:
            await c.aclose()

    def local_limits(self) -> tuple[dict[str, int], dict[str, int]]:
        """Per pool: how often the live processors switched it to local limits
        (floodgate_degraded_transitions_total{pool}), and how many are on them now
        (floodgate_pool_degraded{pool})."""
        from prometheus_client.parser import text_string_to_metric_families

        from floodgate.stack import http_get

        entries: dict[str, int] = {}
        now: dict[str, int] = {}
        for i, p in enumerate(self.stack.processors):
            if i in self.killed:
                continue
            for fam in text_string_to_metric_families(http_get(p.metrics_url).decode()):
                for smp in fam.samples:
                    out = {"floodgate_degraded_transitions_total": entries,
                           "floodgate_pool_degraded": now}.get(smp.name)
                    if out is not None:
                        pool = smp.labels.get("pool", "")
                        out[pool] = out.get(pool, 0) + int(smp.value)
        return entries, now

    def redis_signal(self, sig: int) -> None:
        assert self.stack.redis_child is not None
        self.stack.redis_child.kill(sig)

    def restart_redis_empty(self) -> None:
        self.stack.redis_child, _ = self.sup.start_redis(self.redis_port, name=f"redis-{time.monotonic():.0f}")


# --------------------------------------------------------------------------- faults


@dataclass
class Fault:
    """One fault: `inject` at the end of the warm-up, `recover` `hold_s` later. `measure_from`
    says whether "serving again" counts from the injection (a crash) or the recovery."""

    name: str
    description: str
    inject: Callable[[Harness], Awaitable[None]]
    recover: Callable[[Harness], Awaitable[None]]
    hold_s: Callable[[Options], float] = lambda o: 0.0
    measure_from: str = "recover"  # "inject" | "recover" | "" (no outage: not measured)
    target: Callable[[Options], float] = lambda o: o.ttl_s / 3  # one renewal period
    bound: Callable[[Options], int] = lambda o: o.limit
    topology: str = "single"  # which Redis the harness starts (see Harness)
    loaded_pools: int = 1  # pools with traffic (on a Cluster one per shard, `default` first)
    # Rows of the table when the pools fare differently: (label, which pools, bound, target,
    # measure_from). None: one row for every loaded pool, with the fault's bound and target.
    rows: Callable[[Harness], list[Row]] | None = None


@dataclass
class Row:
    label: str
    pools: list[str]
    bound: Callable[[Options], int]
    target: Callable[[Options], float]
    measure_from: str
    local_allowed: bool = True  # False: a processor switching these pools to local limits fails the row


async def _sentinel_kill_primary(h: Harness) -> None:
    await asyncio.to_thread(h.sentinel.kill_primary)


async def _sentinel_switchover(h: Harness) -> None:
    """`SENTINEL FAILOVER`: a replica is promoted while every server stays up; Sentinel makes the
    old primary a replica only ~10 s later, and it takes writes until then."""
    await asyncio.to_thread(h.sentinel.sentinels[0].client(3.0).execute_command, "SENTINEL", "FAILOVER",
                            h.sentinel.service)


async def _cluster_kill_pool_primary(h: Harness) -> None:
    """SIGKILL the primary serving the loaded pool's slot; its replica takes over."""
    node = await asyncio.to_thread(h.cluster.owner, "fg:{default}:state")
    await asyncio.to_thread(h.cluster.kill, node)


def _dead_pool(h: Harness) -> str:
    """The pool of the shard that `cluster-shard-down` kills (not `default`'s)."""
    return h.other_pools[0]


async def _cluster_kill_other_shard(h: Harness) -> None:
    """SIGKILL the primary and the replica of one pool's shard: no replica left to take over."""
    shard = h.shard_of_pool(_dead_pool(h))
    for node in (shard.primary, *shard.replicas):
        await asyncio.to_thread(h.cluster.kill, node)


async def _cluster_restart_other_shard(h: Harness) -> None:
    shard = h.shard_of_pool(_dead_pool(h))
    for node in (shard.primary, *shard.replicas):
        await asyncio.to_thread(h.cluster.restart, node)


async def _cluster_freeze_other_shard(h: Harness) -> None:
    """SIGSTOP the primary and the replica of one pool's shard: calls there hang (no refusal)
    until the client's timeout, and nothing fails over."""
    shard = h.shard_of_pool(_dead_pool(h))
    for node in (shard.primary, *shard.replicas):
        node.child.kill(signal.SIGSTOP)


async def _cluster_thaw_other_shard(h: Harness) -> None:
    shard = h.shard_of_pool(_dead_pool(h))
    for node in (shard.primary, *shard.replicas):
        node.child.kill(signal.SIGCONT)


def _shard_down_rows(h: Harness) -> list[Row]:
    dead = _dead_pool(h)
    return [
        # The pools on the live shards must not notice: never switched to local limits, <= L,
        # and no dip longer than a status tick (1 s) from the kill on.
        Row("pools on the live shards", [p for p in h.loaded if p != dead], lambda o: o.limit,
            lambda o: 1.0, "inject", local_allowed=False),
        # The dead shard's pool runs on local shares while its shard is away and comes back to
        # shared state after the restart (two clean reconciles), as after a failover.
        Row("the dead shard's pool", [dead], lambda o: o.limit + o.limit // 2,
            lambda o: 5.0 + o.reconnect_s, "recover"),
    ]


# One processor's share over L: L + ceil(L / 2 processors) (the rank shares add up to L; the
# lower ranks hold the rest). A failover cannot be told from an outage by the processors: each
# runs on its local share while the primary is gone; the first back re-asserts its permits and
# grants on shared state before the other has re-synced. A partition the same way (below).
_ONE_SHARE_OVER: Callable[[Options], int] = lambda o: o.limit + -(-o.limit // 2)  # noqa: E731


async def _nothing(h: Harness) -> None:
    return None


async def _sigkill(h: Harness) -> None:
    h.live_envoys = [1]  # clients stop sending to the dead processor's Envoy (as a load balancer would)
    h.killed.add(0)
    h.dead_envoys.add(0)
    h.stack.processors[0].child.kill(signal.SIGKILL)


async def _sigkill_shared(h: Harness) -> None:
    h.killed.add(0)
    h.killed_at = time.monotonic()
    h.stack.processors[0].child.kill(signal.SIGKILL)


async def _restart_same_id(h: Harness) -> None:
    """Start the killed processor again under its gateway id and port, on its own proxy to
    Redis (as Kubernetes restarts a container in its pod; the pod's name is the id)."""
    dead = h.stack.processors[0]
    url = h.stack.redis_url
    h.stack.redis_url = f"redis://127.0.0.1:{h.proxies[0].port}/0"
    try:
        p = await asyncio.to_thread(h.stack.start_processor, h.processor_config(), name=dead.child.name,
                                    port=dead.port)
    finally:
        h.stack.redis_url = url
    h.stack.processors[0] = h.stack.processors.pop()  # in the dead one's place
    h.killed.discard(0)
    assert p is h.stack.processors[0]


async def _sigstop_redis(h: Harness) -> None:
    h.redis_signal(signal.SIGSTOP)


async def _sigcont_redis(h: Harness) -> None:
    h.redis_signal(signal.SIGCONT)


async def _kill_redis(h: Harness) -> None:
    h.redis_signal(signal.SIGKILL)


async def _restart_redis(h: Harness) -> None:
    await asyncio.to_thread(h.restart_redis_empty)


async def _partition(h: Harness) -> None:
    h.proxies[1].set("cut")


async def _heal(h: Harness) -> None:
    h.proxies[1].set("pass")


async def _blackhole(h: Harness) -> None:
    for p in h.proxies:
        p.set("blackhole")


async def _unblackhole(h: Harness) -> None:
    for p in h.proxies:
        p.set("pass")


CLOCK_STEP_MS = 20_000  # past the shipped 15 s lease TTL


async def _clock_step(h: Harness) -> None:
    """The Redis host's clock steps ahead and stays (an NTP step, a VM resumed): the script's
    clock (`admin_testclock`, which it reads instead of TIME when set) is kept at the server's
    TIME + CLOCK_STEP_MS from now on, rewritten every 5 ms."""
    from floodgate.extproc.schema import key
    from floodgate.extproc.state import redis_client

    async def keep() -> None:
        c = redis_client(h.stack.redis_url, op_timeout_s=2)
        try:
            while True:
                s, us = await c.time()
                await c.set(key("default", "admin_testclock"), int(s) * 1000 + int(us) // 1000 + CLOCK_STEP_MS)
                await asyncio.sleep(0.005)
        finally:
            await c.aclose()

    h.clock_task = asyncio.create_task(keep())


async def _disconnects(h: Harness) -> None:
    h.disconnect_fraction = 0.10


async def _no_disconnects(h: Harness) -> None:
    h.disconnect_fraction = 0.0


async def _upstream_errors(h: Harness) -> None:
    h.upstream_fault_fraction = 0.10


async def _no_upstream_errors(h: Harness) -> None:
    h.upstream_fault_fraction = 0.0


FAULTS: list[Fault] = [
    Fault("none", "no fault (baseline)", _nothing, _nothing, measure_from=""),
    # One TTL, plus what a command the processor had already sent may still take to run (an
    # acquire that lands after the kill leases for a full TTL from then): 2 x op_timeout_s.
    Fault("sigkill", "SIGKILL a processor holding permits and waiters", _sigkill, _nothing,
          measure_from="inject", target=lambda o: o.ttl_s + 0.5),
    # The topology the compose and Kubernetes deployments run: clients keep sending to the one
    # Envoy, which must stop using the dead processor by itself.
    Fault("sigkill-shared", "SIGKILL one of two processors behind one Envoy, both holding permits and waiters",
          _sigkill_shared, _nothing, measure_from="inject", target=lambda o: o.ttl_s + 0.5, topology="shared"),
    # Restarted under its gateway id, the processor's first renewal drops what the dead one left
    # (its tickets are numbered above its predecessor's): serving at L again soon after the
    # restart, not one TTL after the kill.
    Fault("restart-same-id", "SIGKILL one of two processors behind one Envoy and start it again 1 s later "
          "under the same gateway id", _sigkill_shared, _restart_same_id, hold_s=lambda o: 1.0,
          # The restart waits until the dead one's claim on the id is one renewal old (gateway_claim.py).
          measure_from="inject", target=lambda o: 2.0 + o.ttl_s / 3, topology="shared"),
    Fault("redis-sigstop", "SIGSTOP Redis for 5 s", _sigstop_redis, _sigcont_redis, hold_s=lambda o: 5.0),
    Fault("redis-restart", "kill Redis, restart it empty 2 s later", _kill_redis, _restart_redis,
          hold_s=lambda o: 2.0),
    Fault("redis-blackhole", "black-hole every Redis connection for 5 s", _blackhole, _unblackhole,
          hold_s=lambda o: 5.0),
    Fault("partition", "cut one processor's Redis connections for 1.5 TTL (the other keeps them)",
          _partition, _heal, hold_s=lambda o: 1.5 * o.ttl_s,
          # The cut-off processor keeps admitting its share while its leases expire in Redis
          # (it cannot tell a partition from an outage), so the pool may run one share over.
          bound=_ONE_SHARE_OVER),
    # Every lease and gateway reads expired at once while the requests run: the gateway that
    # calls next holds the grants until all have re-asserted (leases.lua `start_hold`, jump).
    Fault("redis-clock-step", "the Redis host's clock steps 20 s ahead (past the TTL) and stays", _clock_step,
          _nothing, measure_from=""),
    Fault("client-disconnects", "10% of clients disconnect (queued or streaming)", _disconnects,
          _no_disconnects, hold_s=lambda o: 2 * o.before_s, measure_from=""),
    Fault("upstream-errors", "10% upstream answers: half 500s, half connection resets", _upstream_errors,
          _no_upstream_errors, hold_s=lambda o: 2 * o.before_s, measure_from=""),
]
FAULTS += [
    Fault("sentinel-failover", "SIGKILL the Sentinel-managed primary; a replica is promoted",
          _sentinel_kill_primary, _nothing, measure_from="inject", topology="sentinel",
          bound=_ONE_SHARE_OVER,
          # sentinel down-after (1 s) + election, then one reconnect and the reconcile
          target=lambda o: 5.0 + o.reconnect_s),
    # No server fails and no processor leaves shared state: the processors follow the sentinels
    # (every 0.5 s) and move every connection when the primary moves. The writes made on the old
    # primary after the promotion are lost; the first processor on the new one finds that and
    # Redis holds its grants until every processor has re-asserted there (leases.lua `held`), so
    # the bound is L (it read 14 of L 8 before the hold, in a loaded CI run).
    Fault("sentinel-switchover", "SENTINEL FAILOVER (planned: every server stays up, the old primary "
          "writable until Sentinel demotes it)", _sentinel_switchover, _nothing, measure_from="inject",
          topology="sentinel", target=lambda o: 5.0 + o.reconnect_s),
    Fault("cluster-failover", "SIGKILL the Cluster primary holding the pool's slot; its replica takes over",
          _cluster_kill_pool_primary, _nothing, measure_from="inject", topology="cluster",
          bound=_ONE_SHARE_OVER, target=lambda o: 5.0 + o.reconnect_s),
    Fault("cluster-shard-down", "three pools, one per shard, all loaded; SIGKILL the primary and "
          "replica of one pool's shard (nothing to fail over to), restart them after 2 x --before",
          _cluster_kill_other_shard, _cluster_restart_other_shard, hold_s=lambda o: 2 * o.before_s,
          topology="cluster", loaded_pools=3, rows=_shard_down_rows),
    Fault("cluster-shard-freeze", "as cluster-shard-down, but SIGSTOP the shard's primary and replica "
          "(calls hang until they time out) and SIGCONT them after 2 x --before",
          _cluster_freeze_other_shard, _cluster_thaw_other_shard, hold_s=lambda o: 2 * o.before_s,
          topology="cluster", loaded_pools=3, rows=_shard_down_rows),
]
FAULT_NAMES = [f.name for f in FAULTS]


# --------------------------------------------------------------------------- load


def _shipped_timeouts() -> tuple[float, float, float]:
    """The shipped queue timeouts per class (the processors here run the shipped classes)."""
    from floodgate.extproc.config import PoolConfig

    c = PoolConfig().classes
    return (c[0].queue_timeout_s, c[1].queue_timeout_s, c[2].queue_timeout_s)


CLASS_TIMEOUTS = _shipped_timeouts()  # 20 / 1.5 / 1 s; was hard-coded 20 / 10 / 5, an old default


async def _one(session: Any, h: Harness, rec: Rec, rng: random.Random) -> None:
    import aiohttp

    headers = {"x-request-priority": str(rec.priority), "x-tenant-id": rng.choice(["a", "b", "c"])}
    if rec.pool != "default":
        headers["host"] = f"{rec.pool}.invalid"  # the pool's match_authority
    if h.upstream_fault_fraction and rng.random() < h.upstream_fault_fraction:
        headers["x-fault"] = rng.choice(["500", "reset"])
        rec.injected = True
    url = h.stack.envoys[rec.envoy].url + "/v1/completions"
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 3}
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=rec.timeout_s + 15)) as r:
            rec.first_byte = time.monotonic()
            rec.status = r.status
            rec.reason = r.headers.get("x-floodgate-reject-reason", "")
            rec.floodgate_headers = any(k.lower().startswith("x-floodgate-") for k in r.headers)
            await r.read()
    except asyncio.CancelledError:
        rec.disconnected = True
        raise
    except Exception as exc:
        rec.error = type(exc).__name__ + (" killed" if h.on_killed_path(rec) else "")
    finally:
        rec.done = time.monotonic()


async def drive(h: Harness, opts: Options, stop_at: float, recs: list[Rec], rng: random.Random) -> None:
    """Open-loop Poisson arrivals until `stop_at`, then wait for every request to end."""
    import aiohttp

    rate = opts.capacity_rps * opts.load * len(h.loaded)  # each loaded pool at `load` x its capacity
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        while time.monotonic() < stop_at:
            await asyncio.sleep(rng.expovariate(rate))
            prio = rng.choices((0, 1, 2), PRIORITY_MIX)[0]
            rec = Rec(time.monotonic(), rng.choice(h.live_envoys), prio, CLASS_TIMEOUTS[prio],
                      pool=rng.choice(h.loaded))
            recs.append(rec)
            task = asyncio.create_task(_one(session, h, rec, rng))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if h.disconnect_fraction and rng.random() < h.disconnect_fraction:
                asyncio.get_running_loop().call_later(rng.uniform(0.05, 2.0), task.cancel)
        if tasks:
            await asyncio.wait(tasks, timeout=max(CLASS_TIMEOUTS) + 20)


# --------------------------------------------------------------------------- one run


async def run_fault(fault: Fault, opts: Options) -> list[Result]:
    """Run one fault; one Result per row (see `Fault.rows`)."""
    from floodgate.supervisor import Supervisor

    rng = random.Random(opts.seed)
    # Long enough after recovery for a crashed processor's leases to expire (< 1 TTL) and more.
    after = opts.after_s if opts.after_s is not None else 1.5 * opts.ttl_s + 2
    workdir = opts.workdir / fault.name if opts.workdir else None
    if workdir:
        workdir.mkdir(parents=True, exist_ok=True)
    with (Supervisor(workdir=workdir) if workdir else Supervisor()) as sup:
        h = Harness(opts, sup, fault.topology, fault.loaded_pools)
        await h.start()
        try:
            recs: list[Rec] = []
            t0 = time.monotonic()
            inject_at = t0 + opts.before_s
            recover_at = inject_at + fault.hold_s(opts)
            stop_at = recover_at + after
            load = asyncio.create_task(drive(h, opts, stop_at, recs, rng))
            await asyncio.sleep(max(0.0, inject_at - time.monotonic()))
            inject_at = time.monotonic()
            injected_wall = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S.%f")[:-3]
            await fault.inject(h)
            await asyncio.sleep(max(0.0, recover_at - time.monotonic()))
            recover_at = time.monotonic()
            await fault.recover(h)
            await load
            end = time.monotonic()
            # Phantoms: one TTL after recovery, and after the idle credits went back (1 s ticks).
            await asyncio.sleep(max(2.5, recover_at + opts.ttl_s - time.monotonic()))
            state = {p: await h.pool_state(p) for p in h.loaded}
            entries, local_now = await asyncio.to_thread(h.local_limits)
        finally:
            await h.stop()
    rows = fault.rows(h) if fault.rows else [
        Row("", list(h.loaded), fault.bound, fault.target, fault.measure_from)]
    out = []
    for row in rows:
        since = inject_at if row.measure_from == "inject" else recover_at
        bound = row.bound(opts)
        mine = [r for r in recs if r.pool in row.pools]
        series = {p: h.upstream.pool_series.get(p, []) for p in row.pools}
        over = sorted(f"{t - inject_at:+.2f}s" for p in row.pools for t, n in series[p] if n > bound)
        fivexx = [r for r in mine if r.status >= 500 and not r.injected]
        killed = [r for r in fivexx if h.on_killed_path(r) and not r.floodgate_headers]
        again: list[float | None] = [serving_again(series[p], since, opts.limit, t0 + 1.0, stop_at)
                                     for p in row.pools] if row.measure_from else [0.0]
        out.append(Result(
            fault=fault.name + (f": {row.label}" if row.label else ""), limit=opts.limit, bound=bound,
            max_concurrency=max(h.upstream.pool_max.get(p, 0) for p in row.pools), requests=len(mine),
            ok=sum(1 for r in mine if r.status == 200),
            rejected=sum(1 for r in mine if r.status in (429, 503) and r.reason),
            fivexx=len(fivexx) - len(killed),
            fivexx_killed=len(killed) + sum(1 for r in mine if "killed" in r.error),
            hung=count_hung(mine, end),
            phantom_leases=sum(state[p][0] for p in row.pools), phantom_waiters=sum(state[p][1] for p in row.pools),
            serving_again_s=None if None in again else max(a for a in again if a is not None),
            target_s=row.target(opts) if row.measure_from else -1.0,
            local_entries=sum(entries.get(p, 0) for p in row.pools), local_allowed=row.local_allowed,
            local_at_end=sum(local_now.get(p, 0) for p in row.pools),
            notes=("above the bound at " + ", ".join(over[:5]) + " from the fault") if over else "",
            injected_at=injected_wall))
    return out


# --------------------------------------------------------------------------- output


def table(results: list[Result], opts: Options) -> str:
    lines = [
        f"L = {opts.limit}, lease TTL {opts.ttl_s:g} s (renewal every {opts.ttl_s / 3:.3g} s), "
        f"reconnect interval {opts.reconnect_s:g} s, "
        f"offered load {opts.load:g}x capacity ({opts.capacity_rps * opts.load:.0f} req/s per loaded pool), "
        f"priority mix 20/50/30, shipped class timeouts {'/'.join(f'{t:g}' for t in CLASS_TIMEOUTS)} s.",
        "",
        "| fault | max concurrency (bound) | requests | 200 | 429/503 | 5xx | 5xx on a killed processor's streams "
        "| waited > timeout+1 s | phantom leases / waiters | serving at L again (target) "
        "| switches to local limits | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        again = "never" if r.serving_again_s is None else f"{r.serving_again_s:.2f} s"
        if r.target_s < 0:
            again, target = "n/a (no outage)", ""
        else:
            target = f" (≤ {r.target_s:.2f} s)"
        lines.append(
            f"| {r.fault} | {r.max_concurrency} ({r.bound}) | {r.requests} | {r.ok} | {r.rejected} | {r.fivexx} "
            f"| {r.fivexx_killed} | {r.hung} | {r.phantom_leases} / {r.phantom_waiters} "
            f"| {again}{target} | {r.local_entries} | {'yes' if r.passed() else 'NO'} |")
    return "\n".join(lines)


def doc_command(argv: list[str]) -> str:
    """The command to reproduce a run, without the flags that only say where files go."""
    out, skip = ["floodgate", "bench", "faults"], False
    for a in argv[2:] if argv[:2] == ["bench", "faults"] else []:
        if skip:
            skip = False
        elif a in ("--json", "--workdir", "--doc"):
            skip = True
        elif a != "--no-doc":
            out.append(a)
    return " ".join(out)


def _fault_of(row: str) -> str:
    return row.strip("| ").split("|", 1)[0].split(":", 1)[0].strip()


def merge_section(old: str, body: str, command: str, rerun: set[str]) -> str:
    """The section after rerunning only the faults in `rerun`: their rows replace the ones in
    `old` (a previous section), the other rows stay (with `–` in columns they predate), and the
    command list says which command produced which rows. Rows in FAULT_NAMES order."""
    lines = body.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| fault"))
    ncols = lines[header].count("|")
    new_rows = [ln for ln in lines[header + 2:] if ln.startswith("| ")]
    old_lines = old.splitlines()
    old_rows = [ln for ln in old_lines if ln.startswith("| ") and not ln.startswith("| fault")
                and _fault_of(ln) not in rerun]
    kept = []
    for ln in old_rows:
        cells = ln.strip().strip("|").split("|")
        while len(cells) + 1 < ncols:
            cells.insert(len(cells) - 1, " – ")  # a column added since: before the `ok` column
        kept.append("|" + "|".join(cells) + "|")
    order = {name: i for i, name in enumerate(FAULT_NAMES)}
    rows = sorted(kept + new_rows, key=lambda ln: order.get(_fault_of(ln), len(order)))
    commands = []
    if "```" in old:
        a = old.index("```") + 3
        commands = [c for c in old[a:old.index("```", a)].strip().splitlines()
                    if not any(f"# rows: {name}" in c or c.endswith(f"--faults {name}") for name in rerun)]
    commands.append(f"{command}  # rows: {', '.join(sorted(rerun))}")
    return "\n".join(["```", *commands, "```", "", *lines[:header + 2], *rows])


def write_doc(doc: Path, body: str, command: str, rerun: set[str] | None = None) -> None:
    """Replace the Faults section; with `rerun` (a subset of the faults), only their rows."""
    if rerun is not None and doc.exists() and SECTION_START in doc.read_text():
        text = doc.read_text()
        old = text[text.index(SECTION_START):text.index(SECTION_END)]
        section = f"{SECTION_START}\n{merge_section(old, body, command, rerun)}\n{SECTION_END}"
    else:
        section = f"{SECTION_START}\n```\n{command}\n```\n\n{body}\n{SECTION_END}"
    replace_section(doc, SECTION_START, SECTION_END, section, heading="## Faults\n\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", nargs="+", default=FAULT_NAMES, choices=FAULT_NAMES, metavar="FAULT",
                   help="which faults (default all): " + ", ".join(FAULT_NAMES))
    p.add_argument("--limit", type=int, default=8, help="static limit L of the pool (default 8)")
    p.add_argument("--ttl", type=float, default=15.0, metavar="S",
                   help="redis.lease_ttl_s (default 15, the shipped value)")
    p.add_argument("--reconnect", type=float, default=0.5, metavar="S",
                   help="redis.reconnect_interval_s (default 0.5, the shipped value)")
    p.add_argument("--load", type=float, default=1.5, help="offered load / capacity (default 1.5)")
    p.add_argument("--before", type=float, default=4.0, metavar="S", help="load before the fault (default 4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    p.add_argument("--workdir", type=Path, metavar="DIR", help="keep the processes' logs and configs here")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    opts = Options(limit=args.limit, ttl_s=args.ttl, reconnect_s=args.reconnect, load=args.load, before_s=args.before, seed=args.seed,
                   workdir=args.workdir)
    chosen = [f for f in FAULTS if f.name in args.faults]
    results: list[Result] = []
    for f in chosen:
        print(f"# {f.name}: {f.description}", file=sys.stderr, flush=True)
        rows = asyncio.run(run_fault(f, opts))
        results += rows
        for r in rows:
            print(f"#   {r}", file=sys.stderr, flush=True)
    body = table(results, opts)
    print(body)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    if not args.no_doc and args.doc is not None:
        rerun = None if set(args.faults) == set(FAULT_NAMES) else set(args.faults)
        write_doc(args.doc, body, doc_command(sys.argv[1:]), rerun)
    return 0 if all(r.passed() for r in results) else 1
