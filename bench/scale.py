"""How many admission decisions one Redis shard carries, and with how many processors.

Starts one Redis-protocol server and N processor processes (N = 1, 4, 8, 16 by default), and
drives their admission path over gRPC with load processes that speak ext_proc directly (no
Envoy): each simulated request opens a `Process` stream, sends request headers, waits for the
decision (admit or 429), then ends the stream (the processor releases the permit). Three pools
on every processor, chosen by :authority:

  contended     static limit L far below the offered concurrency, and each admitted request
                holds its permit --hold-ms (10) before it ends: a queue is always formed, so
                every request runs the script's full per-request path (acquire-or-enqueue in
                one call, wait for the grant, release grants the next waiter): the worst case.
                (Without the hold a permit is held for well under a millisecond, so with a fast
                script the pool drains between requests and the shipped local credits carry
                most decisions: not contention.) The `queued` column is the share of
                admissions in the window that waited in the queue (processors' metrics).
  uncontended   limit far above the concurrency, shipped defaults (local credits: most
                decisions need no Redis call at all).
  no-credits    uncontended with `local_credits: 0`: one acquire + one release per request.

For each: decisions/s, Redis CPU per decision (utime+stime of the server from /proc over the
measured window / decisions; `marginal` subtracts the CPU of an equal idle window with the same
processors running, which does not grow with traffic), script calls per decision (INFO
commandstats), p50/p99 decision latency (request headers sent -> decision received; under
contention that includes the queue wait, so the overhead column subtracts the queue time the
processor reports), and the decisions/s one shard would sustain at 80 % CPU at that CPU per
decision. These rows measure the end-to-end path (gRPC, processor, Redis); on this box's 2
cores the processors and load clients are the bottleneck and the shard stays far from busy.

Then the direct drive (--saturate): the contended pool without gRPC, from 2 driver processes
hosting 16 gateways (each its own id, Redis connections and batching), so that the shard gets
as busy as this box can make it. Layer `state`: the processor's state layer alone (PoolState:
batching into `batch` FCALLs, grants in the reply or by sharded pub/sub, syncs) with C request
loops per gateway: admit (queues), wait for the grant, hold, release. Layer `admitter`: whole
Admitters (policy, metrics, status and poll loops too: more Python per decision, so less load
on the shard). One point per hold time (a shorter hold offers more decisions/s). Per point:
the shard's CPU share (`Redis busy`), decisions/s, all of the shard's CPU per decision, ops per
batch call, p50/p99 of one batch call's round trip, p99 of the decision, and `runq wait`: the
share of the window the shard was runnable but waiting for a CPU (/proc/<pid>/task/*/schedstat),
i.e. held back by the other processes on the box rather than short of work. The per-shard
figure is 80 % of a core over the CPU per decision of the point with the most decisions/s (the
highest load this box puts on the shard): CPU per decision falls as the load grows (batch calls
carry more ops), so this is conservative as long as that point's shard is below 80 % busy.

  floodgate bench scale                       # N = 1,4,8,16; 4 s per point; then the direct drive
  floodgate bench scale --processors 1,4 --duration 2 --saturate state:10   # quick look
  floodgate bench scale --processors 1 --modes contended --sharded 0 --saturate state:20,state:5

Then, unless --sharded 0, the same contended load on P pools (one loader each) on a Cluster of
one shard and of P shards (one pool each): each shard's CPU per decision and CPU share, which
shows shards adding capacity across pools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUMMARY = "admission decisions/s and Redis CPU per decision for 1-16 processors on one Redis shard"
MODES = ("contended", "uncontended", "no-credits")
TARGET_PER_SHARD = 20_000  # decisions/s per shard under contention (issue 13)
DEFAULT_LEVELS = "state:160,state:80,state:40,state:20,state:10,state:5,admitter:10"


@dataclass
class Point:
    mode: str
    processors: int
    concurrency: int
    decisions: int
    admitted: int
    rejected: int
    errors: int
    seconds: float
    redis_cpu_s: float
    script_calls: int
    commands: int  # Redis commands run inside those scripts (and any outside)
    p50_ms: float
    p99_ms: float
    p99_overhead_ms: float
    degraded: int = 0  # processors' switches to local limits during the window (invalidates it)
    queued: int = 0  # admissions after waiting in the queue (processors' floodgate_decisions_total)
    immediate: int = 0  # admissions without waiting (at once, or from a local credit)
    idle_cpu_s: float = 0.0  # Redis CPU over an equal window with the same processors and no load

    @property
    def marginal_cpu_us(self) -> float:
        """CPU per decision above the idle baseline (Redis's own timers, the processors' 1 s
        status reads and renewals), which does not grow with traffic."""
        return max(0.0, self.redis_cpu_s - self.idle_cpu_s) * 1e6 / self.decisions if self.decisions else float("nan")

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        return self.redis_cpu_s * 1e6 / self.decisions if self.decisions else float("nan")

    @property
    def shard_rate(self) -> float:
        """Decisions/s one shard sustains at 80 % of one core: what is left of 0.8 s of CPU per
        second after the idle baseline, over the marginal CPU per decision."""
        if not self.decisions or self.marginal_cpu_us <= 0:
            return float("inf")
        return (0.8 - self.idle_cpu_s / self.seconds) * 1e6 / self.marginal_cpu_us

    @property
    def queued_share(self) -> float:
        total = self.queued + self.immediate
        return self.queued / total if total else 0.0

    @property
    def calls_per_decision(self) -> float:
        return self.script_calls / self.decisions if self.decisions else float("nan")

    @property
    def commands_per_decision(self) -> float:
        return self.commands / self.decisions if self.decisions else float("nan")


def processor_config(limit: int) -> dict[str, Any]:
    classes = {c: {"queue_timeout_s": 30, "max_queue": 100000, "share": s}
               for c, s in ((0, 0.5), (1, 0.3), (2, 0.1))}
    return {
        # The measured quantity is Redis's CPU per decision, so processors must stay on the
        # shared state: on a loaded box an event-loop stall past the shipped 0.25 s timeout
        # would switch them to local limits (counted in the `deg` column; must stay 0).
        "redis": {"lease_ttl_s": 15, "op_timeout_s": 2.0},
        "pools": [
            {"name": "contended", "match_authority": "contended", "classes": classes,
             "limit": {"mode": "static", "initial": limit}},
            {"name": "uncontended", "match_authority": "uncontended", "classes": classes,
             "limit": {"mode": "static", "initial": 100000, "max": 100000}},
            {"name": "no-credits", "match_authority": "no-credits", "classes": classes, "local_credits": 0,
             "limit": {"mode": "static", "initial": 100000, "max": 100000}},
        ],
    }


# ------------------------------------------------------------------------------ load worker


async def _drive(ports: Sequence[int], authority: str, concurrency: int, start_at: float, warm: float,
                 duration: float, hold_s: float = 0.0) -> dict[str, Any]:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
        ((":method", "POST"), (":path", "/v1/completions"), (":authority", authority),
         ("x-request-priority", "1"))]))
    first = pb.ProcessingRequest(request_headers=headers)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    stubs = [pb_grpc.ExternalProcessorStub(ch) for ch in channels]
    lat: list[float] = []
    overhead: list[float] = []
    counts = {"admitted": 0, "rejected": 0, "errors": 0}
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.monotonic()
    lo, hi = t0 + warm, t0 + warm + duration

    async def worker(stub: Any) -> None:
        while True:
            now = time.monotonic()
            if now >= hi:
                return
            call = stub.Process()
            try:
                await call.write(first)
                reply = await call.read()
                took = time.monotonic() - now
                if hold_s and reply is not grpc.aio.EOF and reply.WhichOneof("response") != "immediate_response":
                    await asyncio.sleep(hold_s)  # the admitted request holds its permit this long
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:  # until the processor ends the stream
                    pass
            except grpc.aio.AioRpcError:
                if lo <= now < hi:
                    counts["errors"] += 1
                await asyncio.sleep(0.01)
                continue
            if not lo <= now < hi:
                continue
            if reply is grpc.aio.EOF or reply.WhichOneof("response") == "immediate_response":
                counts["rejected"] += 1
            else:
                counts["admitted"] += 1
                queue_ms = 0.0
                for h in reply.request_headers.response.header_mutation.set_headers:
                    if h.header.key == "x-floodgate-queue-ms":
                        queue_ms = float((h.header.raw_value or h.header.value.encode()).decode())
                overhead.append(max(0.0, took * 1000 - queue_ms))
            lat.append(took * 1000)

    await asyncio.gather(*(worker(stubs[i % len(stubs)]) for i in range(concurrency)))
    for ch in channels:
        await ch.close()
    return {**counts, "latencies_ms": lat, "overhead_ms": overhead}


def worker_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True)
    p.add_argument("--authority", required=True)
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--warm", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--hold-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    res = asyncio.run(_drive([int(x) for x in a.ports.split(",")], a.authority, a.concurrency,
                             a.start_at, a.warm, a.duration, a.hold_ms / 1000))
    json.dump(res, sys.stdout)
    return 0


# ------------------------------------------------------------------------------ orchestration


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


_SCRIPT_CMDS = ("cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_evalsha", "cmdstat_eval")
_NOT_DATA = ("cmdstat_info", "cmdstat_config", "cmdstat_hello", "cmdstat_client", "cmdstat_script",
             "cmdstat_function", "cmdstat_ssubscribe", "cmdstat_subscribe", "cmdstat_ping")


def _script_calls(redis_port: int) -> tuple[int, int]:
    """(script runs, data commands) so far: the commands scripts run count inside the second."""
    import redis
    stats = redis.Redis(port=redis_port).info("commandstats")
    scripts = sum(int(v.get("calls", 0)) for k, v in stats.items() if k in _SCRIPT_CMDS)
    data = sum(int(v.get("calls", 0)) for k, v in stats.items()
               if k not in _SCRIPT_CMDS and not k.startswith(_NOT_DATA))
    return scripts, data


PROFILE: list[bool] = []  # --profile: print INFO commandstats per window


def _commandstats(redis_port: int) -> dict[str, tuple[int, int]]:
    import redis
    return {k.removeprefix("cmdstat_"): (int(v.get("calls", 0)), int(v.get("usec", 0)))
            for k, v in redis.Redis(port=redis_port).info("commandstats").items()}


def _print_profile(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], cpu_s: float) -> None:
    """Calls and server time per command in the window (a script's time includes its inner
    commands'); what no command accounts for is the event loop and network."""
    rows = sorted(((k, c - before.get(k, (0, 0))[0], u - before.get(k, (0, 0))[1]) for k, (c, u) in after.items()),
                  key=lambda r: -r[2])
    scripts = sum(u for k, _, u in rows if "cmdstat_" + k in _SCRIPT_CMDS)
    outer = sum(u for k, _, u in rows if "cmdstat_" + k in _SCRIPT_CMDS or (not any(
        "cmdstat_" + k == s for s in _SCRIPT_CMDS) and k in ("spublish", "publish", "info", "hincrby", "ping")))
    print(f"    profile: Redis CPU {cpu_s * 1e6:,.0f} µs, scripts {scripts:,} µs, "
          f"outside scripts' and listed commands' time ~{cpu_s * 1e6 - outer:,.0f} µs", flush=True)
    for k, c, u in rows[:14]:
        if c:
            print(f"      {k:<18} {c:8d} calls {u:9d} µs {u / c:7.2f} µs/call", flush=True)


def prologue_cost(redis_pid: int, redis_port: int, n: int = 20000) -> tuple[float, float, float, float]:
    """CPU µs of one `get_limit` call (the fixed per-call work: TIME, the settings check, one
    state read) as the Function (FCALL) and as the plain script (EVALSHA, the fallback for a
    server without Functions, which rebuilds every helper on each call), and of a `return 1`
    script; pipelined so that network cost is amortised; from /proc. Last, the same FCALL
    from one client one call at a time (each call's round trip wakes the shard): what the
    network and the wake-up add to a call on this machine."""
    import redis
    from floodgate.bench.overhead import cpu_seconds
    from floodgate.extproc.schema import script_keys
    from floodgate.extproc.state import _LUA, FUNCTION, LIBRARY

    r = redis.Redis(port=redis_port)
    r.function_load(LIBRARY, replace=True)
    keys = script_keys("contended")
    out = []
    calls: list[tuple[str, Any, list[str]]] = [
        ("fcall", FUNCTION, ["get_limit", "15000"]), ("evalsha", r.script_load(_LUA), ["get_limit", "15000"]),
        ("evalsha", r.script_load("return 1"), [])]
    for cmd, name, args in calls:
        c0 = cpu_seconds(redis_pid)
        pipe = r.pipeline(transaction=False)
        for _ in range(n):
            pipe.execute_command(cmd.upper(), name, len(keys), *keys, *args)
        pipe.execute()
        out.append((cpu_seconds(redis_pid) - c0) * 1e6 / n)
    cmd, name, args = calls[0]
    c0 = cpu_seconds(redis_pid)
    for _ in range(n // 4):
        r.execute_command(cmd.upper(), name, len(keys), *keys, *args)
    out.append((cpu_seconds(redis_pid) - c0) * 1e6 / (n // 4))
    return out[0], out[1], out[2], out[3]


def script_floor(redis_pid: int, redis_port: int, n: int = 20000, batch: int = 0, queue: int = 16) -> tuple[float, float]:
    """CPU µs and commands of the script work of one contended decision with the network taken
    out: `admit` of a new request (refused, queued behind 16 waiters of a full pool of 8) and
    the `release` that grants the queue's head, pipelined 500 decisions at a time. What a shard
    spends per contended decision at saturation, where round trips are amortised.

    batch = 0: one call per op (admit, release). batch = b: as a processor sends them, b admits
    and the release of b permits in one `batch` call, from two gateways in turn (so grants to
    the other's waiters are published, grants to its own come back in the reply)."""
    import collections

    import redis
    from floodgate.bench.overhead import cpu_seconds
    from floodgate.extproc.schema import PoolSettings, script_keys
    from floodgate.extproc.state import FUNCTION, LIBRARY

    r = redis.Redis(port=redis_port)
    r.function_load(LIBRARY, replace=True)
    pool = f"script-floor-{batch}-{queue}"
    keys = script_keys(pool)
    big = (10**6, 10**6, 10**6)
    settings = [x for kv in PoolSettings(8, (0.5, 0.3, 0.1), max_queue=big, tenant_cap=big).fields().items() for x in kv]

    def call(p: Any, op: str, *args: str) -> Any:
        return p.fcall(FUNCTION, len(keys), *keys, op, "15000", *args)

    call(r, "configure", pool, *settings)
    gws = ("g", "h")
    for g in gws:
        call(r, "sync", g, "0", "0")
    sub = r.pubsub()
    for g in gws:
        sub.ssubscribe(f"fg:{{{pool}}}:gw:{g}")  # grants are published to a subscriber, as in service
    held: collections.deque[str] = collections.deque()
    waiting: collections.deque[str] = collections.deque()
    seq = 0

    def admit_args(g: str) -> list[str]:
        nonlocal seq
        seq += 1
        return [f"{g}/{seq}", g, str(seq), "1", "", "0", "30000"]

    for _ in range(8 + queue):
        a = admit_args("g")
        call(r, "admit", *a)
        (held if len(held) < 8 else waiting).append(a[0])

    fence = dict.fromkeys(gws, 0)

    def run(count: int) -> None:
        step = 500 if batch == 0 else max(1, 500 // batch) * batch
        k = 0
        for _ in range(0, count, step):
            p = r.pipeline(transaction=False)
            if batch == 0:
                for _ in range(step):
                    a = admit_args("g")
                    call(p, "admit", *a)
                    waiting.append(a[0])
                    call(p, "release", held.popleft())
                    held.append(waiting.popleft())
            else:
                for _ in range(step // batch):
                    g = gws[k % 2]
                    k += 1
                    fence[g] += 1
                    argv = [g, str(fence[g])]  # with a fence, as a processor sends it (leases.lua OPS.batch)
                    for _ in range(batch):
                        a = admit_args(g)
                        argv += ["admit", str(len(a)), *a]
                        waiting.append(a[0])
                    done = [held.popleft() for _ in range(batch)]
                    argv += ["release", str(len(done)), *done]
                    held.extend(waiting.popleft() for _ in range(batch))
                    call(p, "batch", *argv)
            p.execute()

    run(2000)
    c0, (_, k0) = cpu_seconds(redis_pid), _script_calls(redis_port)
    run(n)
    c1, (_, k1) = cpu_seconds(redis_pid), _script_calls(redis_port)
    sub.close()
    return (c1 - c0) * 1e6 / n, (k1 - k0) / n


def admissions(metrics_urls: Sequence[str], pool: str) -> tuple[int, int]:
    """(admitted after queueing, admitted at once) so far in `pool`, over the processors."""
    from prometheus_client.parser import text_string_to_metric_families

    from floodgate.stack import http_get

    out = {"queued": 0.0, "immediate": 0.0}
    for url in metrics_urls:
        for fam in text_string_to_metric_families(http_get(url).decode()):
            for smp in fam.samples:
                lb = smp.labels
                if smp.name == "floodgate_decisions_total" and lb.get("pool") == pool \
                        and lb.get("outcome") == "admitted" and lb.get("reason") in out:
                    out[lb["reason"]] += smp.value
    return int(out["queued"]), int(out["immediate"])


def degraded_transitions(metrics_urls: Sequence[str]) -> int:
    from prometheus_client.parser import text_string_to_metric_families

    from floodgate.stack import http_get

    total = 0.0
    for url in metrics_urls:
        for fam in text_string_to_metric_families(http_get(url).decode()):
            for smp in fam.samples:
                if smp.name == "floodgate_degraded_transitions_total":
                    total += smp.value
    return int(total)


def measure_point(mode: str, ports: Sequence[int], redis_pid: int, redis_port: int, concurrency: int,
                  loaders: int, warm: float, duration: float, workdir: Path,
                  metrics_urls: Sequence[str] = (), hold_ms: float = 0.0) -> Point:
    from floodgate.bench.overhead import cpu_seconds

    deg0 = degraded_transitions(metrics_urls)
    start_at = time.time() + 1.5  # the loaders import grpc first
    per = [concurrency // loaders + (1 if i < concurrency % loaders else 0) for i in range(loaders)]
    procs = []
    for i, c in enumerate(per):
        mine = [p for j, p in enumerate(ports) if j % loaders == i] or list(ports)
        out = (workdir / f"load-{mode}-{len(ports)}-{i}.json").open("w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "floodgate.bench.scale", "--worker", "--ports", ",".join(map(str, mine)),
             "--authority", mode, "--concurrency", str(c), "--start-at", str(start_at),
             "--warm", str(warm), "--duration", str(duration),
             "--hold-ms", str(hold_ms if mode == "contended" else 0)], stdout=out), out))
    time.sleep(max(0.0, start_at + warm - time.time()))
    q0 = admissions(metrics_urls, mode)
    prof0 = _commandstats(redis_port) if PROFILE else {}
    cpu0, (calls0, cmds0), t0 = cpu_seconds(redis_pid), _script_calls(redis_port), time.monotonic()
    time.sleep(duration)
    cpu1, (calls1, cmds1), t1 = cpu_seconds(redis_pid), _script_calls(redis_port), time.monotonic()
    if PROFILE:
        _print_profile(prof0, _commandstats(redis_port), cpu1 - cpu0)
    q1 = admissions(metrics_urls, mode)
    lat: list[float] = []
    ovh: list[float] = []
    tot = {"admitted": 0, "rejected": 0, "errors": 0}
    for proc, out in procs:
        proc.wait(120)
        out.close()
        res = json.loads(Path(out.name).read_text())
        lat += res["latencies_ms"]
        ovh += res["overhead_ms"]
        for k in tot:
            tot[k] += res[k]
    decisions = tot["admitted"] + tot["rejected"]
    return Point(mode, len(ports), concurrency, decisions, tot["admitted"], tot["rejected"], tot["errors"],
                 t1 - t0, cpu1 - cpu0, calls1 - calls0, cmds1 - cmds0, _pct(lat, 0.5), _pct(lat, 0.99),
                 _pct(ovh, 0.99), degraded_transitions(metrics_urls) - deg0, queued=q1[0] - q0[0],
                 immediate=q1[1] - q0[1])


PROLOGUE: list[float] = []  # µs of CPU: leases.lua's fixed per-call work as FCALL, as EVALSHA; a trivial script
FLOOR: list[float] = []  # script_floor(): µs and commands of a contended decision's script work, unbatched, batched
FLOOR_BATCH = 4  # decisions per batch call in the second script_floor() figure


def run_all(counts: Sequence[int], modes: Sequence[str], duration: float, warm: float,
            per_processor: int, loaders: int, limit_per_processor: int, hold_ms: float = 0.0) -> list[Point]:
    from floodgate.bench.overhead import cpu_seconds

    from floodgate.stack import LocalStack
    from floodgate.supervisor import Supervisor

    points: list[Point] = []
    for n in counts:
        with Supervisor() as sup:
            stack = LocalStack(sup)
            stack.start_redis()
            assert stack.redis_child is not None
            redis_pid = stack.redis_child.proc.pid
            redis_port = int(stack.redis_url.rsplit(":", 1)[1].split("/")[0])
            cfg = processor_config(limit_per_processor * n)
            procs = [stack.start_processor(cfg, name=f"p{i}") for i in range(n)]
            ports = [p.port for p in procs]
            if not PROLOGUE:
                PROLOGUE.extend(prologue_cost(redis_pid, redis_port))
                FLOOR.extend(script_floor(redis_pid, redis_port))
                FLOOR.extend(script_floor(redis_pid, redis_port, batch=FLOOR_BATCH))
            time.sleep(warm)
            c0 = cpu_seconds(redis_pid)
            time.sleep(duration)
            idle = cpu_seconds(redis_pid) - c0
            for mode in modes:
                pt = measure_point(mode, ports, redis_pid, redis_port, per_processor * n,
                                   min(loaders, n), warm, duration, sup.workdir, [p.metrics_url for p in procs],
                                   hold_ms)
                pt.idle_cpu_s = idle * pt.seconds / duration
                points.append(pt)
                print(f"  N={n:<3} {mode:<12} {pt.rate:8.0f} decisions/s  {pt.cpu_us:7.1f} µs Redis CPU each  "
                      f"{pt.calls_per_decision:4.2f} scripts each  p99 {pt.p99_ms:6.1f} ms"
                      + (f"  ({pt.degraded} switches to local limits: not counted)" if pt.degraded else ""),
                      flush=True)
    return points


@dataclass
class ShardedRun:
    shards: int
    pools: int
    processors: int
    decisions: dict[str, int]  # per pool, in the window
    pool_shard: dict[str, int]  # pool -> shard index
    shard_cpu_s: list[float]
    seconds: float
    script_calls: int = 0

    @property
    def rate(self) -> float:
        return sum(self.decisions.values()) / self.seconds

    def shard_us(self, i: int) -> float:
        """Redis CPU per decision of the pools this shard holds (nan when it holds none)."""
        d = sum(n for p, n in self.decisions.items() if self.pool_shard[p] == i)
        return self.shard_cpu_s[i] * 1e6 / d if d else float("nan")


def run_sharded(shard_counts: Sequence[int], pools: int, n: int, duration: float, warm: float,
                per_processor: int, limit_per_processor: int, hold_ms: float = 0.0) -> list[ShardedRun]:
    """The same contended pools on a Cluster of 1 shard, then of `pools` shards (one pool each):
    each shard's CPU per decision and the total, to show shards add capacity across pools."""
    from floodgate.bench.overhead import cpu_seconds

    from floodgate.redis_topology import start_cluster
    from floodgate.stack import LocalStack
    from floodgate.supervisor import Supervisor

    runs: list[ShardedRun] = []
    for shards in shard_counts:
        with Supervisor() as sup:
            topo = start_cluster(sup, primaries=shards, replicas=0, name=f"scale{shards}")
            names = [topo.key_on_shard(i % shards, prefix=f"pool{i}-") for i in range(pools)]
            # Same contention per pool as the single-pool runs: limit = concurrency / 3.
            base = processor_config(max(1, limit_per_processor * n // pools))["pools"][0]
            cfg = {"redis": {"lease_ttl_s": 15, "op_timeout_s": 2.0},
                   "pools": [{**base, "name": nm, "match_authority": nm} for nm in names]}
            stack = LocalStack(sup)
            stack.redis_url = topo.url
            procs = [stack.start_processor(cfg, name=f"p{i}") for i in range(n)]
            ports = ",".join(str(p.port) for p in procs)
            start_at = time.time() + 1.5
            loaders = []
            for nm in names:
                out = (sup.workdir / f"load-{nm}.json").open("w")
                loaders.append((nm, subprocess.Popen(
                    [sys.executable, "-m", "floodgate.bench.scale", "--worker", "--ports", ports,
                     "--authority", nm, "--concurrency", str(per_processor * n // pools), "--start-at",
                     str(start_at), "--warm", str(warm), "--duration", str(duration), "--hold-ms", str(hold_ms)],
                    stdout=out), out))
            pids = [s.primary.child.proc.pid for s in topo.shards]
            time.sleep(max(0.0, start_at + warm - time.time()))
            ports_r = [s.primary.port for s in topo.shards]
            c0, k0, t0 = [cpu_seconds(p) for p in pids], [_script_calls(p)[0] for p in ports_r], time.monotonic()
            time.sleep(duration)
            c1, k1, t1 = [cpu_seconds(p) for p in pids], [_script_calls(p)[0] for p in ports_r], time.monotonic()
            decisions = {}
            for nm, proc, out in loaders:
                proc.wait(120)
                out.close()
                res = json.loads(Path(out.name).read_text())
                decisions[nm] = res["admitted"] + res["rejected"]
            run = ShardedRun(shards, pools, n, decisions, {nm: topo.shard_of(f"fg:{{{nm}}}:state") for nm in names},
                             [b - a for a, b in zip(c0, c1, strict=True)], t1 - t0,
                             sum(b - a for a, b in zip(k0, k1, strict=True)))
            runs.append(run)
            print(f"  {shards} shard(s), {pools} contended pools, N={n}: {run.rate:,.0f} decisions/s, "
                  f"{run.script_calls / max(1, sum(decisions.values())):.2f} scripts each; "
                  + ", ".join(f"shard {i}: {run.shard_us(i):.0f} µs/decision, {c / run.seconds:.0%} CPU"
                              for i, c in enumerate(run.shard_cpu_s)), flush=True)
    return runs


@dataclass
class LoadPoint:
    """One level of the direct drive (`--saturate`): driver processes, no gRPC."""

    layer: str  # "admitter": real Admitters; "state": their state layer alone (PoolState, subscribe)
    hold_ms: float
    gateways: int
    concurrency: int
    decisions: int
    rejected: int
    errors: int
    degraded: int
    queued: int
    seconds: float
    redis_cpu_s: float
    script_calls: int
    commands: int
    batches: int
    ops: int
    call_p50_ms: float
    call_p99_ms: float
    decision_p50_ms: float
    decision_p99_ms: float
    runq_wait_s: float = 0.0  # the shard runnable but waiting for a CPU (the box's other processes)

    @property
    def rate(self) -> float:
        return self.decisions / self.seconds if self.seconds else 0.0

    @property
    def busy(self) -> float:
        """Share of one core the shard used over the window."""
        return self.redis_cpu_s / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> float:
        """All of the shard's CPU over the window per decision (background work included)."""
        return self.redis_cpu_s * 1e6 / self.decisions if self.decisions else float("nan")

    @property
    def shard_rate(self) -> float:
        return 0.8e6 / self.cpu_us if self.decisions and self.cpu_us > 0 else float("inf")


def parse_levels(text: str) -> list[tuple[str, float]]:
    """`state:40,admitter:10` -> [("state", 40.0), ("admitter", 10.0)]."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if item:
            layer, _, hold = item.rpartition(":")
            if layer not in ("state", "admitter"):
                raise ValueError(f"bad --saturate level {item!r}: expected state:<hold ms> or admitter:<hold ms>")
            out.append((layer, float(hold)))
    return out


def _runq_wait_s(pid: int) -> float:
    """Seconds the process's threads spent runnable but waiting for a CPU (/proc schedstat)."""
    total = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1]) / 1e9
    except OSError:
        pass
    return total


def run_saturate(levels: Sequence[tuple[str, float]], drivers: int, gateways: int, per_gateway: int,
                 limit_per_gateway: int, duration: float, warm: float) -> list[LoadPoint]:
    """The contended pool driven directly by `drivers` processes hosting `gateways` gateways in
    all (bench/scale_drive.py: real Admitters, or their state layer alone), one level per
    (layer, hold time) — a longer hold offers fewer decisions/s (the pool's limit over the
    hold) — each on a fresh shard: the shard's CPU share, decisions/s and CPU per decision at
    each level, from /proc and the drivers' counts."""
    from floodgate.bench.overhead import cpu_seconds

    from floodgate.supervisor import Supervisor

    pts: list[LoadPoint] = []
    for layer, hold in levels:
        with Supervisor() as sup:
            child, url = sup.start_redis()
            pid, port = child.proc.pid, int(url.rsplit(":", 1)[1].split("/")[0])
            pool = processor_config(limit_per_gateway * gateways)["pools"][0]
            start_at = time.time() + 3.0  # the drivers import, connect and sync first
            procs = []
            for i in range(drivers):
                gws = [f"d{i}g{j}" for j in range(gateways) if j % drivers == i]
                out = (sup.workdir / f"drive-{i}.json").open("w")
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "floodgate.bench.scale_drive", "--url", url, "--pool", json.dumps(pool),
                     "--gateways", ",".join(gws), "--per-gateway", str(per_gateway), "--hold-ms", str(hold),
                     "--start-at", str(start_at), "--warm", str(warm), "--duration", str(duration),
                     "--layer", layer], stdout=out), out))
            time.sleep(max(0.0, start_at + warm - time.time()))
            prof0 = _commandstats(port) if PROFILE else {}
            w0 = _runq_wait_s(pid)
            cpu0, (k0, m0), t0 = cpu_seconds(pid), _script_calls(port), time.monotonic()
            time.sleep(duration)
            cpu1, (k1, m1), t1 = cpu_seconds(pid), _script_calls(port), time.monotonic()
            w1 = _runq_wait_s(pid)
            if PROFILE:
                _print_profile(prof0, _commandstats(port), cpu1 - cpu0)
            res = []
            for proc, out in procs:
                proc.wait(120)
                out.close()
                res.append(json.loads(Path(out.name).read_text()))
            calls = [x for r in res for x in r["call_ms"]]
            lat = [x for r in res for x in r["decision_ms"]]
            pt = LoadPoint(layer, hold, gateways, gateways * per_gateway, sum(r["decisions"] for r in res),
                           sum(r["rejected"] for r in res), sum(r["errors"] for r in res),
                           sum(r["degraded"] for r in res), sum(r["queued"] for r in res), t1 - t0, cpu1 - cpu0,
                           k1 - k0, m1 - m0, sum(r["batches"] for r in res), sum(r["ops"] for r in res),
                           _pct(calls, 0.5), _pct(calls, 0.99), _pct(lat, 0.5), _pct(lat, 0.99), w1 - w0)
            pts.append(pt)
            print(f"  {layer:<8} hold {hold:g} ms: {pt.rate:8,.0f} decisions/s, shard {pt.busy:4.0%} busy, "
                  f"{pt.cpu_us:6.1f} µs Redis CPU each, {pt.ops / max(1, pt.batches):4.1f} ops per call, "
                  f"call p99 {pt.call_p99_ms:5.2f} ms", flush=True)
    return pts


def per_call_fit(pts: Sequence[LoadPoint]) -> tuple[float, float] | None:
    """Least squares of CPU µs per decision against script calls per decision over `pts`:
    (µs per call, µs per decision). What a call costs whatever it carries (its round trip,
    waking the shard, the script's per-call reads and writes) against each decision's own work."""
    xy = [(p.script_calls / p.decisions, p.cpu_us) for p in pts if p.decisions and not p.errors and not p.degraded]
    if len(xy) < 3:
        return None
    mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    if sxx <= 0:
        return None
    a = sum((x - mx) * (y - my) for x, y in xy) / sxx
    return a, my - a * mx


def saturated_figure(pts: Sequence[LoadPoint]) -> LoadPoint | None:
    """The clean direct-drive point with the most decisions/s: the highest load this box put on
    the shard. Its CPU per decision is the per-shard figure's basis: calls carry more ops as
    the load grows, so the cost per decision falls with load (each point shows it)."""
    clean = [p for p in pts if p.decisions and not p.degraded and not p.errors]
    return max(clean, key=lambda p: p.rate) if clean else None


def saturate_table(pts: Sequence[LoadPoint]) -> str:
    head = (f"{'layer':<8} {'hold ms':>7} {'gw':>3} {'conc':>5} {'decisions/s':>11} {'Redis busy':>10} {'Redis µs/dec':>12} "
            f"{'scripts/dec':>11} {'ops/call':>8} {'cmds/dec':>8} {'queued':>6} {'call p50':>8} {'call p99':>8} "
            f"{'dec p99 ms':>10} {'runq wait':>9} {'@80% (this µs)':>14} {'rej':>4} {'err':>4} {'deg':>4}")
    lines = [head, "-" * len(head)]
    for p in pts:
        d = max(1, p.decisions)
        lines.append(f"{p.layer:<8} {p.hold_ms:>7g} {p.gateways:>3} {p.concurrency:>5} {p.rate:>11,.0f} {p.busy:>10.0%} "
                     f"{p.cpu_us:>12.1f} {p.script_calls / d:>11.2f} {p.ops / max(1, p.batches):>8.1f} "
                     f"{p.commands / d:>8.1f} {p.queued / d:>6.0%} {p.call_p50_ms:>8.2f} {p.call_p99_ms:>8.2f} "
                     f"{p.decision_p99_ms:>10.1f} {p.runq_wait_s / p.seconds:>9.0%} {p.shard_rate:>14,.0f} {p.rejected:>4} {p.errors:>4} {p.degraded:>4}")
    return "\n".join(lines)


def table(points: Sequence[Point]) -> str:
    head = (f"{'mode':<12} {'N':>3} {'conc':>5} {'decisions/s':>11} {'vs N=1':>7} {'Redis µs/dec':>12} {'marginal':>8} "
            f"{'scripts/dec':>11} {'cmds/dec':>8} {'queued':>6} {'p50 ms':>7} {'p99 ms':>7} {'p99 ovh ms':>10} {'shard @80%':>11} {'rej':>5} {'err':>4} {'deg':>4}")
    lines = [head, "-" * len(head)]
    base: dict[str, float] = {}
    for p in points:
        base.setdefault(p.mode, p.rate)
        ratio = p.rate / base[p.mode] if base[p.mode] else float("nan")
        shard = f"{p.shard_rate:11.0f}" if p.shard_rate != float("inf") else f"{'∞':>11}"
        lines.append(f"{p.mode:<12} {p.processors:>3} {p.concurrency:>5} {p.rate:>11.0f} {ratio:>6.2f}x "
                     f"{p.cpu_us:>12.1f} {p.marginal_cpu_us:>8.1f} {p.calls_per_decision:>11.2f} {p.commands_per_decision:>8.1f} {p.queued_share:>6.0%} {p.p50_ms:>7.2f} {p.p99_ms:>7.2f} "
                     f"{p.p99_overhead_ms:>10.2f} {shard} {p.rejected:>5} {p.errors:>4} {p.degraded:>4}")
    return "\n".join(lines)


def shard_figure(points: Sequence[Point], mode: str = "contended") -> float:
    """The per-shard figure for `mode`: marginal CPU per decision pooled over every N (total CPU
    above idle / total decisions, so the noisy small windows do not dominate), against what the
    largest idle baseline leaves of 80 % of a core."""
    pts = [p for p in points if p.mode == mode and p.decisions and not p.degraded]
    if not pts:
        return float("nan")
    marginal = sum(max(0.0, p.redis_cpu_s - p.idle_cpu_s) for p in pts) / sum(p.decisions for p in pts)
    idle = max(p.idle_cpu_s / p.seconds for p in pts)  # the largest N's baseline: conservative
    return (0.8 - idle) / marginal if marginal > 0 else float("inf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processors", default="1,4,8,16", help="processor counts to measure (default 1,4,8,16)")
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per point (default 4)")
    p.add_argument("--warm", type=float, default=1.5, help="unmeasured seconds before each window")
    p.add_argument("--per-processor", type=int, default=24,
                   help="concurrent streams per processor (default 24)")
    p.add_argument("--limit-per-processor", type=int, default=8,
                   help="contended pool limit per processor: far below --per-processor so a queue "
                        "always forms (default 8)")
    p.add_argument("--loaders", type=int, default=2, help="load processes (default 2)")
    p.add_argument("--hold-ms", type=float, default=10.0,
                   help="contended mode: how long an admitted request holds its permit, so that a queue "
                        "always forms (default 10)")
    p.add_argument("--json", metavar="FILE", help="also write the points as JSON")
    p.add_argument("--profile", action="store_true",
                   help="print the server's INFO commandstats (calls, µs) for every measured window")
    p.add_argument("--sharded", type=int, default=3, metavar="P",
                   help="also run P contended pools on a Cluster of 1 shard and of P shards (0: skip; default 3)")
    p.add_argument("--sharded-processors", type=int, default=4, help="processors for --sharded (default 4)")
    p.add_argument("--saturate", default=DEFAULT_LEVELS, metavar="LEVELS",
                   help="direct drive of one shard without gRPC, one point per LAYER:HOLD_MS: 'state' = the "
                        "processor's state layer alone (PoolState batching, batch FCALL, pub/sub grants), "
                        "'admitter' = whole Admitters; a shorter hold offers more decisions/s "
                        f"(default {DEFAULT_LEVELS}; '' skips)")
    p.add_argument("--saturate-drivers", type=int, default=2, help="driver processes for --saturate (default 2)")
    p.add_argument("--saturate-gateways", type=int, default=16,
                   help="gateways (each its own id, connections and batching) over the drivers (default 16)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "profile", False):
        PROFILE.append(True)
    counts = [int(x) for x in str(args.processors).split(",") if x]
    modes = [m for m in str(args.modes).split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not counts or any(c < 1 for c in counts):
        print(f"floodgate bench scale: bad --modes {bad} or --processors {args.processors}", file=sys.stderr)
        return 2
    print(f"floodgate bench scale: N={counts}, modes={modes}, {args.duration:g} s per point "
          f"({os.cpu_count()} CPUs shared by Redis, processors and load)", flush=True)
    points = run_all(counts, modes, args.duration, args.warm, args.per_processor, args.loaders,
                     args.limit_per_processor, args.hold_ms)
    print()
    print(table(points))
    print()
    for mode in modes:
        fig = shard_figure(points, mode)
        rates = [p.rate for p in points if p.mode == mode and not p.degraded]
        print(f"{mode:<12} one shard at 80% CPU: {fig:,.0f} decisions/s "
              f"(pooled over N={counts}; max measured here {max(rates, default=0):,.0f}/s)")
    contended = shard_figure(points, "contended") if "contended" in modes else float("nan")
    if PROLOGUE:
        print(f"script profile: a leases.lua call costs {PROLOGUE[0]:.1f} µs of Redis CPU before doing anything "
              f"(get_limit, pipelined; as EVALSHA on a server without Functions: {PROLOGUE[1]:.1f} µs; "
              f"a `return 1` script: {PROLOGUE[2]:.1f} µs); the same get_limit sent one call at a time "
              f"(a round trip each): {PROLOGUE[3]:.1f} µs")
    if FLOOR:
        print(f"script work of one contended decision (admit + the release that grants the next, pipelined: "
              f"no round trips): one call per op {FLOOR[0]:.1f} µs of Redis CPU, {FLOOR[1]:.1f} commands; "
              f"{FLOOR_BATCH} decisions per batch call {FLOOR[2]:.1f} µs, {FLOOR[3]:.1f} commands; one shard at 80 % "
              f"CPU: {0.8e6 / FLOOR[2]:,.0f} decisions/s if round trips cost nothing")
    try:
        levels = parse_levels(str(args.saturate or ""))
    except ValueError as exc:
        print(f"floodgate bench scale: {exc}", file=sys.stderr)
        return 2
    sat: list[LoadPoint] = []
    if levels:
        print()
        print(f"direct drive of one shard, contended pool, no gRPC: {args.saturate_gateways} gateways on "
              f"{args.saturate_drivers} driver processes, {args.per_processor} request loops per gateway, "
              f"limit {args.limit_per_processor} per gateway", flush=True)
        sat = run_saturate(levels, args.saturate_drivers, args.saturate_gateways, args.per_processor,
                           args.limit_per_processor, args.duration, args.warm)
        print()
        print(saturate_table(sat))
        print()
    fit = per_call_fit([p for p in sat if p.layer == "state"])
    if fit is not None:
        print(f"least-squares fit over the state-layer points, Redis µs per decision = a × calls per decision + b: "
              f"a = {fit[0]:.0f} µs per call, b = {fit[1]:.0f} µs per decision")
    busiest = saturated_figure(sat)  # the highest-load point
    if busiest is not None:
        trend = sorted((p for p in sat if p.layer == busiest.layer and not p.degraded and not p.errors),
                       key=lambda p: p.rate)
        print("Redis CPU per contended decision as the load grows (direct drive, "
              f"{busiest.layer} layer): " + ", ".join(f"{p.rate:,.0f}/s ({p.busy:.0%} busy) {p.cpu_us:.0f} µs"
                                                      for p in trend))
        print(f"highest load measured: {busiest.rate:,.0f} decisions/s with the shard {busiest.busy:.0%} busy, "
              f"{busiest.cpu_us:.1f} µs of Redis CPU per decision (all of its CPU, background included): "
              f"one shard at 80 % CPU at that cost: {busiest.shard_rate:,.0f} decisions/s")
    if "contended" in modes or busiest is not None:
        fig = busiest.shard_rate if busiest is not None else contended
        how = ("from the direct drive's highest-load point" if busiest is not None
               else "linear from the gRPC-driven points")
        ok = fig >= TARGET_PER_SHARD
        print(f"goal >= {TARGET_PER_SHARD:,} decisions/s per shard under contention: "
              f"{'MET' if ok else 'NOT MET'} ({fig:,.0f}, {how}"
              + (f"; gRPC-driven points, linear: {contended:,.0f})" if busiest is not None and "contended" in modes
                 else ")"))
    sharded: list[ShardedRun] = []
    if args.sharded > 0:
        print()
        print(f"pools over shards: {args.sharded} contended pools on {args.sharded_processors} processors, "
              f"on a Cluster of 1 and of {args.sharded} shards", flush=True)
        sharded = run_sharded(sorted({1, args.sharded}), args.sharded, args.sharded_processors, args.duration,
                              args.warm, args.per_processor, args.limit_per_processor, args.hold_ms)
        for r in sharded:
            us = [r.shard_us(i) for i in range(r.shards)]
            print(f"{r.shards} shard(s): busiest shard {max(r.shard_cpu_s) / r.seconds:.0%} CPU, "
                  f"Redis CPU per decision per shard {', '.join(f'{u:.0f}' for u in us)} µs")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"points": [{**asdict(p), "rate": p.rate, "cpu_us": p.cpu_us, "marginal_cpu_us": p.marginal_cpu_us,
                         "shard_rate": p.shard_rate}
                        for p in points], "prologue_us": PROLOGUE, "script_floor": FLOOR,
             "shard": {m: shard_figure(points, m) for m in modes},
             "sharded": [{**asdict(r), "rate": r.rate} for r in sharded],
             "saturate": [{**asdict(p), "rate": p.rate, "busy": p.busy, "cpu_us": p.cpu_us, "shard_rate": p.shard_rate}
                          for p in sat]}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
    print("run as `floodgate bench scale`", file=sys.stderr)
    sys.exit(2)
