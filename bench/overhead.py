"""Admission overhead: what Floodgate's ext_proc path costs next to a no-op processor.

One invocation starts, side by side, a fast upstream (a second Envoy answering
`POST /v1/completions` with a `direct_response`) and one front Envoy (one worker) per config:

* `envoy`      Envoy alone, no ext_proc filter (`render_local(admission=False)`);
* `noop`       Envoy + `bench.noop_processor` (empty replies): the ceiling a Python grpc.aio
               processor can reach, and the reference for every ratio;
* `floodgate`  Envoy + the real `floodgate extproc` on a real Redis, static limit 100000 (never
               queues), `sample_rate` 0, no endpoint picking: the plain admission path (local
               credits, else acquire + release in Redis);
* `floodgate-sampled`  the same with a Vegas limit and the default `sample_rate` (0.5), so a
               half of the requests also stream their response body to the processor. Still no
               endpoint picking, so it admits from local credits: how a config without picking
               runs (the mesh sidecars, deploy/istio/processor.yaml);
* `floodgate-picking`  `floodgate-sampled` with endpoint picking, as the shipped compose,
               Kubernetes and `floodgate up` deployments route: the upstream registered active in
               the pool's Redis registry, Envoy's ORIGINAL_DST cluster (`model_picked`) steered by
               the processor. Local credits are not used with picking: every request does its own
               acquire (the pick) and release in Redis.

Each run also counts the requests Envoy sent through the `model_picked` cluster (the endpoint
the processor picked) and the Lua script calls (FCALL) Redis served: a picking row whose
requests did not all go through `model_picked` is an error, so the row cannot silently measure
the credits path.

`wrk` drives each (config, connections) pair for `--duration` seconds. Runs are interleaved
(every config at one concurrency, then the next concurrency, then the next round) so noise from
other work on the machine lands on all configs alike; the table reports the median over rounds.
Correctness is checked at the same time: every non-2xx response (from Envoy's own counters) and
every wrk socket error is reported, and each ext_proc config must have opened one ext_proc
stream per request.

    floodgate bench overhead                       # defaults: 8 s x 2 rounds at 1, 16, 64 conns
    floodgate bench overhead --duration 2 --rounds 1 --connections 1 --configs noop floodgate-picking
    floodgate bench overhead --duration 2 --rounds 1 --connections 1 16 --configs noop floodgate
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
from floodgate.sim.cli import non_negative_int, positive_int

from floodgate.envoy_config import write_config
from floodgate.stack import Envoy, LocalStack, Processor
from floodgate.supervisor import Supervisor, free_port, wait_for_port

SUMMARY = "admission overhead: Envoy alone vs no-op processor vs Floodgate (wrk)"
CONFIGS = ("envoy", "noop", "floodgate", "floodgate-sampled", "floodgate-picking")
REFERENCE = "noop"
DEFAULT_CONFIGS = CONFIGS
# The configs with endpoint picking (Envoy's ORIGINAL_DST cluster `model_picked`).
PICKING_CONFIGS = ("floodgate-picking",)
# Which row stands for which deployment, in the order the verdict prints them.
ROLES = {
    "floodgate-picking": "the shipped gateway deployments (compose, Kubernetes, `floodgate up`): "
                         "endpoint picking, acquire + release in Redis per request",
    "floodgate-sampled": "no endpoint picking (the mesh sidecars, deploy/istio): Vegas, "
                         "sample_rate 0.5, local credits",
    "floodgate": "no endpoint picking, static limit, sample_rate 0: local credits",
}
# Targets of issue 2 item 9.
TARGET_THROUGHPUT_RATIO = 0.80
TARGET_ADDED_P50_MS = 0.5

WRK_INSTALL_HINT = (
    "`wrk` (the HTTP load generator) is not on PATH. Install it with\n"
    "    sudo apt-get install -y wrk        # Debian/Ubuntu\n"
    "    brew install wrk                   # macOS\n"
    "or build it from https://github.com/wg/wrk, then rerun."
)

REQUEST_BODY = '{"model": "bench", "prompt": "Say hi.", "max_tokens": 8}'
# A small non-streamed OpenAI completion, with `usage` as a real server would send it.
UPSTREAM_BODY = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "text": " Hi!", "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
}, separators=(",", ":"))

# The wrk script: POST with a body and a priority header; `done` prints one machine-readable
# line (latency in microseconds) next to wrk's own --latency report.
WRK_SCRIPT = """\
wrk.method = "POST"
wrk.path = "/v1/completions"
wrk.body = '%(body)s'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-request-priority"] = "1"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'FLOODGATE_BENCH {"requests":%%d,"duration_us":%%d,"status":%%d,"connect":%%d,' ..
    '"read":%%d,"write":%%d,"timeout":%%d,"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,"mean_us":%%.1f}\\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""

# Floodgate processor configs: a limit so high nothing ever queues, so the benchmark measures
# the admission path itself (Redis acquire + release per request), not queueing.
_FLOODGATE_POOL: dict[str, Any] = {"name": "bench", "limit": {
    "mode": "static", "initial": 100000, "min": 1, "max": 100000, "sample_rate": 0.0}}
_SAMPLED_POOL: dict[str, Any] = {"name": "bench-sampled", "limit": {
    # Vegas only samples in vegas mode; min keeps the limit far above any concurrency here
    # whatever the (meaningless, sub-millisecond) latency signal does. `ttft` because the
    # direct_response body is one chunk, which gives no TPOT.
    "mode": "vegas", "initial": 100000, "min": 50000, "max": 100000, "signal": "ttft"}}
# (sample_rate: the shipped default)
# The shipped compose / Kubernetes pool (deploy/compose/processor.yaml,
# deploy/kubernetes/config.yaml): endpoint picking (with the default prefill-aware picking), an
# allowlist, fair_order off; the limit as in `floodgate-sampled`, never binding.
_PICKING_POOL: dict[str, Any] = {
    "name": "bench-picking", "endpoint_picking": True, "allowed_endpoints": ["127.0.0.1/32"],
    "fair_order": False, "limit": dict(_SAMPLED_POOL["limit"])}
_POOLS = {"floodgate": _FLOODGATE_POOL, "floodgate-sampled": _SAMPLED_POOL, "floodgate-picking": _PICKING_POOL}


@dataclass
class Target:
    """One front Envoy (and what it depends on) that wrk can drive."""

    name: str
    envoy: Envoy
    cpu_pids: dict[str, int] = field(default_factory=dict)  # role -> pid whose CPU we account
    redis_url: str | None = None  # whose script calls we count
    picking: bool = False


@dataclass
class Run:
    config: str
    connections: int
    round: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    ext_proc_streams: int | None
    cpu_us_per_req: dict[str, float]
    # Requests Envoy sent through `model_picked` (the endpoint the processor picked); None
    # without picking.
    picked: int | None = None
    completed: int | None = None  # requests the front Envoy completed (wrk's and cut-off ones)
    # Lua script calls (FCALL / FCALL_RO) Redis served during the run, per request: the
    # processors' background calls (renewals, status) are in it too, a few per second. A call
    # may carry several acquires / releases (state.PoolState batches those made while one is out).
    redis_calls_per_req: float | None = None


@dataclass
class Row:
    config: str
    connections: int
    rps: float
    p50_ms: float
    p99_ms: float
    rps_min: float
    rps_max: float
    non_2xx: int
    socket_errors: int
    proc_cpu_us: float | None
    redis_cpu_us: float | None
    redis_calls_per_req: float | None = None
    picked_share: float | None = None  # requests routed via `model_picked` / requests served (at most 1)
    # Requests served that did not go through `model_picked`, beyond one per connection and run
    # (a request in flight when a run's counters are read is counted by one side only).
    unpicked: int | None = None
    throughput_ratio: float | None = None
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None


def wrk_binary() -> str | None:
    return shutil.which("wrk")


# ------------------------------------------------------------------------- processes

def upstream_bootstrap(port: int, admin_port: int) -> dict[str, Any]:
    """An Envoy that answers everything itself: fast, and in C++, so it is never the bottleneck."""
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [{
            "name": "upstream",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network."
                             "http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": "upstream",
                    "route_config": {"virtual_hosts": [{
                        "name": "all", "domains": ["*"],
                        "routes": [{
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": UPSTREAM_BODY}},
                            "response_headers_to_add": [{"header": {
                                "key": "content-type", "value": "application/json"}}],
                        }],
                    }]},
                    # Buffer the request body first: a direct_response sent before the POST body
                    # is read resets the connection (downstream_rq_response_before_rq_complete),
                    # and the front Envoy then reconnects for every request.
                    "http_filters": [
                        {"name": "envoy.filters.http.buffer", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                            "max_request_bytes": 65536}},
                        {"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
                    ],
                },
            }]}],
        }]},
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads); 0.0 once it is gone."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def envoy_stats(envoy: Envoy, pattern: str) -> dict[str, int]:
    """Every counter whose name matches `pattern` (a regex), in one admin call."""
    url = f"http://127.0.0.1:{envoy.admin_port}/stats?filter={pattern}&format=json"
    with urllib.request.urlopen(url, timeout=5) as r:
        stats = json.load(r)["stats"]
    return {s["name"]: int(s["value"]) for s in stats if "value" in s and isinstance(s["value"], int)}


_STATS_RE = (r"^(http\.gateway\.(downstream_rq_[0-9]xx|downstream_rq_completed)|.*ext_proc\.streams_started"
             r"|cluster\.model_picked\.upstream_rq_total)$")


def redis_script_calls(url: str) -> int:
    """Lua script calls (FCALL, FCALL_RO, EVALSHA, EVAL) the Redis server has served so far."""
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(v["calls"]) for k, v in stats.items()
               if k in ("cmdstat_fcall", "cmdstat_fcall_ro", "cmdstat_evalsha", "cmdstat_eval"))


def _sum(stats: dict[str, int], suffix: str) -> int:
    return sum(v for k, v in stats.items() if k.endswith(suffix))


def probe(envoy: Envoy) -> dict[str, str]:
    """One request through the target before measuring: fail loudly rather than benchmark errors."""
    req = urllib.request.Request(envoy.url + "/v1/completions", data=REQUEST_BODY.encode(), method="POST",
                                 headers={"content-type": "application/json", "x-request-priority": "1"})
    with urllib.request.urlopen(req, timeout=5) as r:
        if r.status != 200:
            raise RuntimeError(f"probe through {envoy.url} answered {r.status}")
        return {k.lower(): v for k, v in r.headers.items()}


def start_targets(stack: LocalStack, configs: Sequence[str]) -> list[Target]:
    sup = stack.sup
    up_port, up_admin = free_port(), free_port()
    up_cfg = write_config(upstream_bootstrap(up_port, up_admin), sup.workdir / "upstream-envoy.json")
    sup.start_envoy(up_cfg, up_admin, name="upstream-envoy")
    wait_for_port("127.0.0.1", up_port, 20)
    upstreams = [("127.0.0.1", up_port)]

    targets: list[Target] = []
    if any(c.startswith("floodgate") for c in configs):
        stack.start_redis()
    redis_pid = stack.redis_child.proc.pid if stack.redis_child else None
    redis_url = stack.redis_url or None
    for name in configs:
        if name == "envoy":
            env = stack.start_envoy(upstreams, processors=[], name="envoy-alone", admission=False)
            targets.append(Target(name, env))
        elif name == "noop":
            port = free_port()
            child = sup.start_python("noop-processor", ["-m", "floodgate.bench.noop_processor", "--port", str(port)])
            wait_for_port("127.0.0.1", port, 20, child.proc)
            proc = Processor(child, port, 0, Path("/dev/null"))
            env = stack.start_envoy(upstreams, processors=[proc], name="envoy-noop")
            targets.append(Target(name, env, {"proc": child.proc.pid}))
        elif name in _POOLS:
            pool = _POOLS[name]
            picking = name in PICKING_CONFIGS
            if picking:
                # What the scaling controller writes in a deployment (this bench runs none): the
                # upstream as the pool's one active endpoint.
                asyncio.run(register_active(stack.redis_url, pool["name"], upstreams))
            proc = stack.start_processor({"pools": [pool]}, name=f"extproc-{name}")
            env = stack.start_envoy(upstreams, processors=[proc], name=f"envoy-{name}", picking=picking)
            pids = {"proc": proc.child.proc.pid}
            if redis_pid is not None:
                pids["redis"] = redis_pid
            targets.append(Target(name, env, pids, redis_url, picking))
        else:
            raise ValueError(f"unknown config {name!r} (choose from {', '.join(CONFIGS)})")
    for t in targets:
        before = envoy_stats(t.envoy, _STATS_RE) if t.picking else {}
        headers = probe(t.envoy)
        if t.name.startswith("floodgate") and "x-floodgate-priority" not in headers:
            raise RuntimeError(f"{t.name}: response lacks x-floodgate-priority; admission did not run")
        if t.picking and _sum(envoy_stats(t.envoy, _STATS_RE), "model_picked.upstream_rq_total") \
                <= _sum(before, "model_picked.upstream_rq_total"):
            raise RuntimeError(f"{t.name}: the probe did not go through the model_picked cluster; "
                               "endpoint picking is not in effect")
    return targets


async def register_active(redis_url: str, pool: str, upstreams: Sequence[tuple[str, int]],
                          replica_prefix: str = "upstream") -> None:
    """The upstreams in the pool's registry as active endpoints, replicas `<prefix><i>` (what the
    scaling controller writes in a deployment; the picking rows here and bench/overload.py's
    `@picking` run none)."""
    from floodgate.extproc.registry import Registry
    from floodgate.extproc.state import redis_client

    client = redis_client(redis_url, op_timeout_s=5)
    try:
        reg = Registry(client, pool)
        for i, (host, port) in enumerate(upstreams):
            await reg.set(f"{host}:{port}", "active", f"{replica_prefix}{i}")
    finally:
        await client.aclose()


# ------------------------------------------------------------------------- load

def run_wrk(wrk: str, script: Path, target: Target, connections: int, duration: float,
            threads: int, round_no: int) -> Run:
    before = envoy_stats(target.envoy, _STATS_RE)
    calls0 = redis_script_calls(target.redis_url) if target.redis_url else 0
    cpu0 = {role: cpu_seconds(pid) for role, pid in target.cpu_pids.items()}
    argv = [wrk, "-t", str(max(1, min(threads, connections))), "-c", str(connections),
            "-d", f"{duration:g}s", "--timeout", "5s", "--latency", "-s", str(script), target.envoy.url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60, check=False)
    cpu = {role: cpu_seconds(pid) - cpu0[role] for role, pid in target.cpu_pids.items()}
    after = envoy_stats(target.envoy, _STATS_RE)
    calls = redis_script_calls(target.redis_url) - calls0 if target.redis_url else None
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("FLOODGATE_BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    w = json.loads(line.split(" ", 1)[1])
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    completed = _sum(diff, "downstream_rq_completed")
    ok = _sum(diff, "downstream_rq_2xx")
    streams = _sum(diff, "ext_proc.streams_started") if target.name != "envoy" else None
    requests = int(w["requests"])
    seconds = w["duration_us"] / 1e6
    return Run(
        config=target.name, connections=connections, round=round_no, requests=requests,
        seconds=seconds, rps=requests / seconds if seconds else 0.0,
        p50_ms=w["p50_us"] / 1000, p90_ms=w["p90_us"] / 1000, p99_ms=w["p99_us"] / 1000,
        # Envoy's own counters see every response, also the ones wrk cut off at the end.
        non_2xx=max(completed - ok, int(w["status"])),
        socket_errors=sum(int(w[k]) for k in ("connect", "read", "write", "timeout")),
        ext_proc_streams=streams,
        cpu_us_per_req={role: s * 1e6 / max(1, requests) for role, s in cpu.items()},
        # Envoy's counters, not wrk's: they include the requests wrk cut off at the end.
        picked=_sum(diff, "model_picked.upstream_rq_total") if target.picking else None,
        completed=completed,
        redis_calls_per_req=None if calls is None else calls / max(1, completed),
    )


def summarize(runs: Sequence[Run], configs: Sequence[str], levels: Sequence[int]) -> list[Row]:
    rows: list[Row] = []
    for conns in levels:
        level_rows: dict[str, Row] = {}
        for cfg in configs:
            rs = [r for r in runs if r.config == cfg and r.connections == conns]
            if not rs:
                continue

            def med_cpu(role: str, rs: list[Run] = rs) -> float | None:
                vals = [r.cpu_us_per_req[role] for r in rs if role in r.cpu_us_per_req]
                return statistics.median(vals) if vals else None

            level_rows[cfg] = Row(
                config=cfg, connections=conns,
                rps=statistics.median(r.rps for r in rs),
                p50_ms=statistics.median(r.p50_ms for r in rs),
                p99_ms=statistics.median(r.p99_ms for r in rs),
                rps_min=min(r.rps for r in rs), rps_max=max(r.rps for r in rs),
                non_2xx=sum(r.non_2xx for r in rs), socket_errors=sum(r.socket_errors for r in rs),
                proc_cpu_us=med_cpu("proc"), redis_cpu_us=med_cpu("redis"),
                redis_calls_per_req=(statistics.median(r.redis_calls_per_req for r in rs
                                                       if r.redis_calls_per_req is not None)
                                     if any(r.redis_calls_per_req is not None for r in rs) else None),
                picked_share=(min(1.0, sum(r.picked or 0 for r in rs) / max(1, sum(r.completed or 0 for r in rs)))
                              if any(r.picked is not None for r in rs) else None),
                unpicked=(sum(max(0, (r.completed or 0) - (r.picked or 0) - r.connections) for r in rs)
                          if any(r.picked is not None for r in rs) else None))
        ref = level_rows.get(REFERENCE)
        for row in level_rows.values():
            if ref is not None:
                row.throughput_ratio = row.rps / ref.rps if ref.rps else None
                row.added_p50_ms = row.p50_ms - ref.p50_ms
                row.added_p99_ms = row.p99_ms - ref.p99_ms
            rows.append(row)
    return rows


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: Sequence[Row]) -> str:
    """A Markdown table: readable in a terminal and pasteable into docs/benchmarks.md."""
    head = ("config", "conns", "req/s", "p50 ms", "p99 ms", f"req/s vs {REFERENCE}",
            "+p50 ms", "+p99 ms", "non-2xx", "sock err", "proc CPU µs/req", "redis CPU µs/req",
            "redis calls/req")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ratio = "-" if r.throughput_ratio is None else f"{r.throughput_ratio:.2f}"
        cells = (r.config, str(r.connections), f"{r.rps:,.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", ratio,
                 _f(r.added_p50_ms, "+.2f"), _f(r.added_p99_ms, "+.2f"), str(r.non_2xx), str(r.socket_errors),
                 _f(r.proc_cpu_us, ".0f"), _f(r.redis_cpu_us, ".0f"), _f(r.redis_calls_per_req, ".2f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline(configs: Sequence[str]) -> list[str]:
    """Which measured row stands for which deployment."""
    return [f"- {c}: {ROLES[c]}" for c in ROLES if c in configs]


def verdict(rows: Sequence[Row]) -> tuple[dict[str, bool], list[str]]:
    """Check the issue's targets for each Floodgate row against `noop` of the same run: the
    shipped gateway path (`floodgate-picking`) first, then the local-credits rows."""
    met: dict[str, bool] = {}
    notes: list[str] = []
    for cfg in ROLES:
        fg = [r for r in rows if r.config == cfg and r.throughput_ratio is not None]
        if not fg:
            continue
        ok = True
        for r in fg:
            assert r.throughput_ratio is not None
            good = r.throughput_ratio >= TARGET_THROUGHPUT_RATIO
            ok &= good
            notes.append(f"{cfg}: {'PASS' if good else 'FAIL'} throughput at {r.connections} conns: "
                         f"{r.throughput_ratio:.0%} of noop (target >= {TARGET_THROUGHPUT_RATIO:.0%})")
        low = min(fg, key=lambda r: r.connections)
        assert low.added_p50_ms is not None
        good = low.added_p50_ms <= TARGET_ADDED_P50_MS
        ok &= good
        notes.append(f"{cfg}: {'PASS' if good else 'FAIL'} added p50 at {low.connections} conns: "
                     f"{low.added_p50_ms:+.2f} ms over noop (target <= +{TARGET_ADDED_P50_MS} ms)")
        met[cfg] = ok
    if not met:
        notes.append("(no Floodgate + noop pair measured: no verdict)")
    return met, notes


def measure(configs: Sequence[str], levels: Sequence[int], duration: float, rounds: int,
            threads: int = 1, warmup: float = 1.0, workdir: Path | None = None,
            log: Any = sys.stderr) -> list[Run]:
    wrk = wrk_binary()
    if wrk is None:
        raise FileNotFoundError(WRK_INSTALL_HINT)
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    with (Supervisor(workdir=workdir) if workdir else Supervisor()) as sup:
        stack = LocalStack(sup)
        script = sup.workdir / "post.lua"
        script.write_text(WRK_SCRIPT % {"body": REQUEST_BODY})
        print(f"starting {', '.join(configs)} (logs in {sup.workdir})", file=log, flush=True)
        targets = start_targets(stack, configs)
        if warmup > 0:
            # Fill connection pools, JIT-free but cache-warm paths, Redis script cache.
            for t in targets:
                run_wrk(wrk, script, t, max(levels), warmup, threads, 0)
        runs: list[Run] = []
        for rnd in range(1, rounds + 1):
            for conns in levels:
                # Rotate the order each round so no config always runs first (or last).
                order = targets[(rnd - 1) % len(targets):] + targets[:(rnd - 1) % len(targets)]
                for t in order:
                    r = run_wrk(wrk, script, t, conns, duration, threads, rnd)
                    runs.append(r)
                    print(f"round {rnd}/{rounds} {t.name:<18} c={conns:<3} {r.rps:>9,.0f} req/s "
                          f"p50 {r.p50_ms:6.2f} ms p99 {r.p99_ms:6.2f} ms non-2xx {r.non_2xx}",
                          file=log, flush=True)
                    if r.ext_proc_streams is not None and r.ext_proc_streams < r.requests:
                        print(f"  warning: {r.ext_proc_streams} ext_proc streams for {r.requests} "
                              "requests: some requests bypassed the processor", file=log, flush=True)
                    if r.picked is not None and r.picked + r.connections < (r.completed or 0):
                        print(f"  error: {r.picked} of {r.completed} requests went through model_picked: "
                              "the rest were not routed by endpoint picking", file=log, flush=True)
        for t in targets:
            for role, pid in t.cpu_pids.items():
                if not any(c.proc.pid == pid and c.alive() for c in sup.children):
                    raise RuntimeError(f"{t.name}: {role} process {pid} died during the run")
        return runs


# ------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    # Whole seconds: wrk's -d takes no fraction (1.5 failed the run after the set-up).
    p.add_argument("--duration", type=positive_int, default=8, metavar="S",
                   help="whole seconds of load per (config, connections) run (default 8)")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds; the table shows the median (default 2)")
    p.add_argument("--connections", type=int, nargs="+", default=[1, 16, 64], metavar="N",
                   help="wrk connection counts (default 1 16 64)")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=CONFIGS,
                   help="which stacks to measure (default all)")
    p.add_argument("--threads", type=int, default=1, help="wrk threads (default 1: the box has 2 cores)")
    p.add_argument("--warmup", type=non_negative_int, default=1, metavar="S",
                   help="whole warm-up seconds per config (0: none)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every run and the summary here")
    p.add_argument("--workdir", type=Path, metavar="DIR",
                   help="where process logs and configs go (default: a new temp directory)")


def run(args: argparse.Namespace) -> int:
    if wrk_binary() is None:
        print(f"floodgate bench overhead: {WRK_INSTALL_HINT}", file=sys.stderr)
        return 2
    configs = [c for c in CONFIGS if c in args.configs]  # canonical order
    levels = sorted(set(args.connections))
    total = len(configs) * len(levels) * args.rounds * args.duration + len(configs) * args.warmup
    print(f"# admission overhead: {len(configs)} configs x {levels} connections x {args.rounds} rounds "
          f"x {args.duration:g} s (~{total / 60:.1f} min of load)", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    runs = measure(configs, levels, args.duration, args.rounds, args.threads, args.warmup, args.workdir)
    rows = summarize(runs, configs, levels)
    met, notes = verdict(rows)
    print()
    print(f"Admission overhead (wrk -t{args.threads}, {args.duration:g} s x {args.rounds} rounds, "
          f"median; one Envoy worker; took {time.monotonic() - t0:.0f} s)")
    roles = headline(configs)
    if roles:
        print()
        print("Which row is which (ratios against noop of this run):")
        for line in roles:
            print(line)
    print()
    print(table(rows))
    print()
    for n in notes:
        print(n)
    bad = [r for r in rows if r.non_2xx or r.socket_errors]
    for r in bad:
        print(f"ERROR {r.config} at {r.connections} conns: {r.non_2xx} non-2xx, {r.socket_errors} socket errors")
    unpicked = [r for r in rows if r.unpicked]
    for r in unpicked:
        print(f"ERROR {r.config} at {r.connections} conns: {r.unpicked} requests did not go through the "
              f"model_picked cluster ({r.picked_share:.1%} did): endpoint picking not in effect for them")
    if args.json:
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in runs], "rows": [asdict(r) for r in rows],
                                         "targets_met": met}, indent=1))
    # Missing the performance target is a finding, not a failure; wrong answers are.
    return 1 if bad or unpicked else 0
