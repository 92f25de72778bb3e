"""Overload: the same pool and the same burst, with and without admission control.

One invocation starts a fixed pool of `floodgate sim` replicas and replays one seeded, open-loop
arrival plan against each configuration in turn, every one on fresh processes:

* `none`        Envoy alone, no admission control;
* `adaptive`    Envoy's `adaptive_concurrency` filter (gradient controller), 429 when over;
* `static-N`    Floodgate with a static limit of N concurrent requests (one run per N: the best
                one is the hand-tuned reference);
* `vegas-SIG`   Floodgate with the untuned Vegas limit fed by signal SIG (ttft, tpot, combined);
* `X@tuned`     a Floodgate config with hand-tuned class settings instead of the shipped ones;
* `X@engine-priority` a Floodgate config with the emulators on vLLM's `--scheduling-policy
                priority` and the pool's `engine_priority` {0: -1} (a deployment choice);
* `X@sampleR`   a Vegas config with `limit.sample_rate` R (an A/B of the sampled response
                streams' cost, e.g. `vegas-combined@sample0.1`);
* `X@picking`   a Floodgate config with endpoint picking (the processor routes each request
                through Envoy's ORIGINAL_DST cluster, as the shipped compose, Kubernetes and
                `floodgate up` deployments do; the replicas are registered active in Redis),
                with the shipped prefill-aware picking (`prefill_tokens_per_s`).

Beside the load generator, a P2 probe in its own process (bench/reject_probe.py, `--probe-rate`)
times P2 rejections from a client that has nothing else to do.

The plan: an unloaded phase, a steady phase at ~70 % of the pool's capacity, a burst at 3x
capacity, then recovery and a sparse-P0 phase; priority mix 20/50/30 % P0/P1/P2 (`--mix`).
The reference for P0's TTFT is measured once per invocation, before the configs, in a
dedicated pass: the unloaded phase's load for `--reference-s` seconds through Envoy alone,
every request P0 (hundreds of samples: the unloaded phase's few P0s cannot give a p99). Capacity
is derived first from the pure engine model (`sim/engine.py`, the same code the replicas run)
and, by default, the pool's best steady goodput is then measured on the real pool with a short
step sweep without admission control.

    floodgate bench overload                                  # the headline, shipped defaults, ~21 min
    floodgate bench overload --configs none vegas-tpot --scale 0.2 --no-calibrate --no-doc

Writes `--out` (default docs/benchmarks/overload/ in a checkout, runs/bench/overload/ when
installed): results.json (every number of the table,
the plan and the measured CPU use), one `<config>.json.gz` per config (every request record
and metric sample, as `sim.report.write_json`), and timeline.png; and, unless --no-doc, the
"Overload" section of `--doc` (default docs/benchmarks.md in a checkout, none when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import math
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
from floodgate.bench.doc_section import default_doc, default_out, kept_notes, replace_section
from floodgate.bench.doc_section import num as _num
from floodgate.bench.doc_section import pct as _pct
from floodgate.bench.overhead import cpu_seconds, register_active
from floodgate.extproc.config import PoolConfig

SUMMARY = "overload: Envoy alone vs adaptive_concurrency vs Floodgate static vs Vegas under a 3x burst"

# In a checkout: docs/benchmarks/overload and docs/benchmarks.md; installed: runs/bench/overload
# under the working directory and no doc (bench/doc_section.py).
DEFAULT_OUT = default_out("overload")
DEFAULT_DOC = default_doc()
SECTION_START = "<!-- overload:begin -->"
SECTION_END = "<!-- overload:end -->"

# Targets from issue 3.
TARGET_P0_SUCCESS = 0.999
TARGET_P0_TTFT_RATIO = 2.0
TARGET_GOODPUT_RATIO = 0.95
# the FIFO bound's sweep (bench/p0_bound.py): sequences per replica, prefill backlog caps (tokens)
BOUND_SEEDS = (1, 2, 3)
BOUND_NS = (24, 32, 40, 48, 64)
BOUND_CAPS = (0.0, 1024.0, math.inf)
TARGET_P2_REJECT_MS = 10.0

# The P2 probe's rate (per second; bench/reject_probe.py): ~480 probes over the burst, recovery and
# sparse-P0 phases, tiny requests (32 prompt tokens, 2 output), ~1 % of the pool's work when admitted.
PROBE_RATE = 8.0
# The probe's niceness (bench/reject_probe.py --nice): ahead of the box's other processes, as a
# client on its own machine would be; Envoy, the processor and the load generator keep theirs.
PROBE_NICE = -10

FLOODGATE_METRICS = ("floodgate_limit", "floodgate_inflight", "floodgate_queue_depth")
ADAPTIVE_LIMIT = "envoy_http_adaptive_concurrency_gradient_controller_concurrency_limit"
ADAPTIVE_METRICS = (ADAPTIVE_LIMIT, "envoy_http_adaptive_concurrency_gradient_controller_rq_blocked")


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    load: float  # multiple of the pool's capacity
    # Sparse P0: the load is P1/P2 only and P0 arrives on its own at this rate (req/s), so
    # the pool is saturated by lower classes while P0 is rare (early drop must not reject it).
    p0_rate: float | None = None


# The unloaded reference pass (seconds; scaled with --scale, at least REFERENCE_MIN_S). At the
# unloaded phase's load (0.3x of ~19 req/s) 80 s give ~450 P0 TTFTs: a p99 over hundreds.
REFERENCE_S = 80.0
REFERENCE_MIN_S = 10.0
REFERENCE_WARMUP_S = 5.0

DEFAULT_PHASES = (
    Phase("unloaded", 6, 0.3),
    Phase("steady", 14, 0.7),
    Phase("burst", 20, 3.0),
    Phase("recovery", 10, 0.7),
    Phase("sparse-p0", 30, 1.5, p0_rate=0.3),
)


@dataclass(frozen=True)
class Workload:
    replicas: int = 2
    time_scale: float = 1.0
    max_num_seqs: int = 256
    prompt_mean: int = 512
    output_mean: int = 64
    length_sigma: float = 0.5
    priority_shares: tuple[float, float, float] = (0.2, 0.5, 0.3)
    seed: int = 1
    phases: tuple[Phase, ...] = DEFAULT_PHASES

    def engine_config(self) -> Any:
        from floodgate.sim.engine import EngineConfig

        return EngineConfig(max_num_seqs=self.max_num_seqs).scaled(self.time_scale)

    def mix(self) -> Any:
        from floodgate.sim.arrivals import LengthDist, Mix

        return Mix(priority_shares=self.priority_shares,
                   tenants=(("tenant-a", 0.5), ("tenant-b", 0.5)),
                   prompt=LengthDist(self.prompt_mean, self.length_sigma, max=4 * self.prompt_mean),
                   output=LengthDist(self.output_mean, self.length_sigma, max=4 * self.output_mean))

    def windows(self) -> dict[str, tuple[float, float]]:
        out, t = {}, 0.0
        for p in self.phases:
            out[p.name] = (t, t + p.duration_s)
            t += p.duration_s
        return out


def build_plan(w: Workload, capacity_rps: float) -> list[Any]:
    from floodgate.sim.arrivals import Mix, constant_profile, step_profile, synthetic_plan

    profile = step_profile([(p.duration_s, p.load * capacity_rps) for p in w.phases])
    plan = list(synthetic_plan(profile, w.mix(), seed=w.seed))
    for p in w.phases:
        if p.p0_rate is None:
            continue
        a, b = w.windows()[p.name]
        # In a sparse-P0 phase the offered load is P1/P2 (P0 arrivals become P1) ...
        plan = [replace(r, priority=1) if a <= r.t_offset < b and r.priority == 0 else r for r in plan]
        # ... and P0 arrives on its own, rarely.
        mix = w.mix()
        p0_mix = Mix(priority_shares=(1.0, 0.0, 0.0), tenants=mix.tenants, prompt=mix.prompt, output=mix.output)
        p0 = synthetic_plan(constant_profile(p.p0_rate, b - a), p0_mix, seed=w.seed + 17)
        plan += [replace(r, t_offset=r.t_offset + a) for r in p0]
    plan.sort(key=lambda r: r.t_offset)
    return plan


def reference_plan(w: Workload, capacity_rps: float, duration_s: float) -> list[Any]:
    """The unloaded reference: the lightest phase's load for `duration_s`, every request P0.
    Without admission control the emulator never sees a priority, so each request is a P0
    sample of the unloaded pool's TTFT (same lengths as the workload's mix)."""
    from floodgate.sim.arrivals import Mix, constant_profile, synthetic_plan

    unloaded = min(w.phases, key=lambda p: p.load)
    mix = w.mix()
    p0_mix = Mix(priority_shares=(1.0, 0.0, 0.0), tenants=mix.tenants, prompt=mix.prompt, output=mix.output)
    return list(synthetic_plan(constant_profile(unloaded.load * capacity_rps, duration_s), p0_mix,
                               seed=w.seed + 29))


def measure_reference(w: Workload, capacity_rps: float, duration_s: float, *, timeout_s: float,
                      progress: bool) -> dict[str, Any]:
    """Run the reference pass on fresh processes (Envoy alone: the processor's own overhead is
    not in the reference, so it counts against the Floodgate rows) and return its P0 TTFT p99
    over every request after a short warm-up."""
    from floodgate.sim.loadgen import OK
    from floodgate.sim.report import percentile

    plan = reference_plan(w, capacity_rps, duration_s)
    run = run_config(BenchConfig("reference", "none"), w, plan, timeout_s=timeout_s, progress=progress)
    warm = min(REFERENCE_WARMUP_S, duration_s / 4)
    recs = [r for r in run.result.records if r.t_planned >= warm]
    ttft = [r.ttft_s for r in recs if r.outcome == OK and r.ttft_s is not None]
    unloaded = min(w.phases, key=lambda p: p.load)
    return {"duration_s": duration_s, "load": unloaded.load, "rate_rps": unloaded.load * capacity_rps,
            "offered": len(recs), "samples": len(ttft),
            "failed": sum(1 for r in recs if r.outcome != OK),
            "p0_ttft_p50_s": percentile(ttft, 50), "p0_ttft_p99_s": percentile(ttft, 99),
            "cpu": run.cpu, "machine_busy": run.machine_busy}


# --------------------------------------------------------------------------- capacity (offline)


@dataclass
class CapacityPoint:
    rate_rps: float
    goodput_tok_s: float
    slo_attainment: float
    ttft_p99_s: float
    tpot_p50_s: float


def simulate_pool(w: Workload, rate: float, duration: float, slo_ttft: float, slo_tpot: float) -> CapacityPoint:
    """Constant Poisson load on `replicas` pure engines behind least-request balancing, on a
    virtual clock: what the real pool would serve if the client, Envoy and the emulators' event
    loops cost nothing. Statistics over arrivals after a 30 % warm-up."""
    import numpy as np
    from floodgate.sim.arrivals import constant_profile, synthetic_plan
    from floodgate.sim.engine import Engine, TokenTimes

    plan = synthetic_plan(constant_profile(rate, duration), w.mix(), seed=w.seed + 1000)
    engines = [Engine(w.engine_config()) for _ in range(w.replicas)]
    times = TokenTimes()

    def advance(t: float) -> None:
        for e in engines:
            for ev in e.advance(t):
                times.record(ev)

    for i, p in enumerate(plan):
        advance(p.t_offset)
        e = min(engines, key=lambda e: e.num_running + e.num_waiting)
        e.add_request(str(i), p.prompt_tokens, p.output_tokens, p.t_offset)
    t = duration
    while any(e.has_work() for e in engines) and t < duration * 20:
        t += 1.0
        advance(t)
    good_tokens, met, n = 0, 0, 0
    ttft, tpot = [], []
    for i, p in enumerate(plan):
        if p.t_offset < 0.3 * duration:
            continue
        n += 1
        rid = str(i)
        if rid not in times.first:
            continue
        a = times.first[rid] - p.t_offset
        b = times.tpot(rid)
        ttft.append(a)
        tpot.append(b)
        if a <= slo_ttft and b <= slo_tpot:
            met += 1
            good_tokens += times.count[rid]
    return CapacityPoint(rate, good_tokens / (0.7 * duration), met / max(1, n),
                         float(np.percentile(ttft, 99)) if ttft else math.inf,
                         float(np.percentile(tpot, 50)) if tpot else math.inf)


def derive_capacity(w: Workload, slo_ttft: float, slo_tpot: float,
                    duration: float = 60.0) -> tuple[float, float, list[CapacityPoint]]:
    """(capacity req/s, best goodput tok/s, curve): capacity is the highest rate at which at
    least 99 % of requests still meet the SLO, searched on the engine model."""
    cfg = w.engine_config()
    # First guess from the engine's cost model: prefill plus ~one decode step per output token
    # at a moderate batch, per replica.
    per_req = cfg.prefill_per_token_s * w.prompt_mean + w.output_mean * (
        cfg.decode_base_s / 16 + cfg.decode_per_seq_s)
    guess = w.replicas / per_req
    curve: list[CapacityPoint] = []
    lo, hi = 0.2 * guess, 2.0 * guess
    for _ in range(9):  # bisection on "meets the SLO for >= 99 % of requests"
        mid = (lo + hi) / 2
        pt = simulate_pool(w, mid, duration, slo_ttft, slo_tpot)
        curve.append(pt)
        if pt.slo_attainment >= 0.99:
            lo = mid
        else:
            hi = mid
    capacity = lo
    for f in (0.8, 0.9, 1.0, 1.1):
        curve.append(simulate_pool(w, capacity * f, duration, slo_ttft, slo_tpot))
    curve.sort(key=lambda p: p.rate_rps)
    best = max(p.goodput_tok_s for p in curve)
    return capacity, best, curve


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class BenchConfig:
    name: str
    kind: str  # none | adaptive | static | vegas
    limit: int | None = None
    signal: str | None = None
    tuned: bool = False  # `@tuned`: the hand-tuned class settings (slo_classes), else the shipped ones
    # `@engine-priority`: the emulators run vLLM's `--scheduling-policy priority` and the pool
    # sets `engine_priority` (ENGINE_PRIORITY): a deployment choice matching the engines' flag
    engine_priority: bool = False
    # `@picking`: endpoint picking (ORIGINAL_DST cluster, the replicas registered active)
    picking: bool = False
    # `@sampleR` (Vegas rows): `limit.sample_rate` R instead of the shipped one (an A/B of what
    # the sampled response streams cost the processor, not a deployment choice)
    sample: float | None = None

    @property
    def floodgate(self) -> bool:
        return self.kind in ("static", "vegas")


# The pool's `engine_priority` in `@engine-priority` rows: P0 first in the engines' waiting
# queues (vLLM: lower is first; P1/P2 keep the default 0 and are not buffered).
ENGINE_PRIORITY = {0: -1}


def parse_config(name: str) -> BenchConfig:
    base, at, suffix = name.partition("@")
    if at and suffix.startswith("sample"):
        cfg = parse_config(base)
        try:
            rate = float(suffix[len("sample"):])
        except ValueError:
            rate = -1.0
        if cfg.kind != "vegas" or not 0 <= rate <= 1:
            raise argparse.ArgumentTypeError(f"{name!r}: @sampleR is for Vegas rows, with R in [0, 1] (the sample rate)")
        return replace(cfg, name=name, sample=rate)
    if at:
        if suffix not in ("tuned", "engine-priority", "picking"):
            raise argparse.ArgumentTypeError(
                f"unknown config suffix {suffix!r} in {name!r}: only @tuned, @engine-priority or @picking")
        cfg = parse_config(base)
        if not cfg.floodgate:
            raise argparse.ArgumentTypeError(f"{name!r}: @{suffix} is for Floodgate configs only")
        return replace(cfg, name=name, tuned=suffix == "tuned", engine_priority=suffix == "engine-priority",
                       picking=suffix == "picking")
    if name in ("none", "adaptive"):
        return BenchConfig(name, name)
    kind, _, arg = name.partition("-")
    if kind == "static" and arg.isdigit() and int(arg) > 0:
        return BenchConfig(name, "static", limit=int(arg))
    if kind == "vegas" and arg in ("ttft", "tpot", "combined"):
        return BenchConfig(name, "vegas", signal=arg)
    if name == "vegas":
        from floodgate.extproc.config import LimitConfig

        sig = LimitConfig().signal
        return BenchConfig(f"vegas-{sig}", "vegas", signal=sig)
    raise argparse.ArgumentTypeError(
        f"unknown config {name!r}: none, adaptive, static-N, vegas, vegas-ttft|tpot|combined, "
        "each Floodgate one optionally with @tuned, @engine-priority or @picking (Vegas ones also @sampleR)")


# The static limits swept in every default run: "best static" is the best of them in the same
# run. It was static-96, picked once on 2026-11-29 from an older plan and code; a review ran
# 64/96/128/160 side by side and static-128 beat it by 7 % (Vegas: 104 % of static-96, 99 % of
# static-128).
STATIC_SWEEP = (64, 96, 128, 160)


def default_configs() -> list[str]:
    """The headline: shipped defaults against Envoy alone, adaptive_concurrency and static
    limits (`STATIC_SWEEP`: the best of them is the static reference); the hand-tuned class
    settings as a second Vegas row; and Floodgate again with engine priority (a deployment
    choice: engines started with vLLM's `--scheduling-policy priority`, pool setting
    `engine_priority`; static-96 and Vegas), and again with endpoint picking (how the shipped
    compose, Kubernetes and `floodgate up` deployments route: the static sweep and Vegas, so its
    Vegas row has a best static of its own)."""
    return ["none", "adaptive", *(f"static-{n}" for n in STATIC_SWEEP), "vegas-combined", "vegas-combined@tuned",
            "static-96@engine-priority", "vegas-combined@engine-priority",
            *(f"static-{n}@picking" for n in STATIC_SWEEP), "vegas-combined@picking"]


def adaptive_concurrency_filter() -> dict[str, Any]:
    """Envoy's gradient controller, set up to give it a fair chance with LLM requests.

    The stock example (request_count 50, min_concurrency 3, 60 s interval) pins concurrency at
    3 while it collects 50 samples; a sample is a whole streamed completion (seconds), so that
    window alone would last about a minute. Fewer samples at a higher pinned concurrency keep
    the minRTT measurement short; the buffer and percentile are Envoy's documented defaults.
    """
    return {
        "name": "envoy.filters.http.adaptive_concurrency",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3.AdaptiveConcurrency",
            "gradient_controller_config": {
                "sample_aggregate_percentile": {"value": 50},
                "concurrency_limit_params": {
                    "max_concurrency_limit": 1000,
                    "concurrency_update_interval": "0.5s",
                },
                "min_rtt_calc_params": {
                    "interval": "60s",
                    "request_count": 20,
                    "jitter": {"value": 10},
                    "min_concurrency": 16,
                    "buffer": {"value": 25},
                },
            },
            # 429 like Floodgate, so the client counts blocked requests as rejections.
            "concurrency_limit_exceeded_status": {"code": 429},
        },
    }


SHIPPED_CLASSES: dict[int, dict[str, Any]] = {
    c: v.model_dump() for c, v in PoolConfig().classes.items()}
LIMIT_SIGNAL = PoolConfig().limit.signal


def slo_classes(slo_ttft_s: float) -> dict[int, dict[str, Any]]:
    """Hand-tuned class settings (the `@tuned` rows): P1 waits at most ~3/4 of the TTFT SLO,
    sheddable P2 never queues (max_queue 0: rejected at once when no permit is free), P0
    waits up to 30 s. The shipped defaults derive similar timeouts from the class SLOs
    (config.ClassConfig) but let P2 queue for half its TTFT target.
    """
    return {
        0: {"queue_timeout_s": 30, "max_queue": 1000, "share": 0.5},
        1: {"queue_timeout_s": round(0.75 * slo_ttft_s, 3), "max_queue": 1000, "share": 0.3},
        2: {"queue_timeout_s": round(0.5 * slo_ttft_s, 3), "max_queue": 0, "share": 0.1},
    }


def floodgate_config(cfg: BenchConfig, classes: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    # Trust the load generator's priority header (it runs on loopback).
    out: dict[str, Any] = {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}}
    if cfg.kind == "static":
        assert cfg.limit is not None
        limit: dict[str, Any] = {"mode": "static", "initial": cfg.limit, "max": max(512, cfg.limit)}
    else:
        # The shipped limiter: only a non-default signal is set, everything else is LimitConfig's.
        limit = {"mode": "vegas"}
        if cfg.signal != LIMIT_SIGNAL:
            limit["signal"] = cfg.signal
    if cfg.sample is not None:
        limit["sample_rate"] = cfg.sample
    pool: dict[str, Any] = {"name": "default", "limit": limit}
    if cfg.engine_priority:
        pool["engine_priority"] = dict(ENGINE_PRIORITY)
    if cfg.picking:
        pool["endpoint_picking"] = True
    if classes is not None:
        pool["classes"] = classes
    out["pools"] = [pool]
    return out


# --------------------------------------------------------------------------- running


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, for the CPU headroom check."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    total = sum(t)
    return total - idle, total


@dataclass
class RunOutput:
    config: BenchConfig
    result: Any  # sim.loadgen.LoadResult
    cpu: dict[str, float] = field(default_factory=dict)  # process -> share of one core
    machine_busy: float = 0.0  # share of all cores busy during the run (everyone's work)


def probe_window(w: Workload) -> tuple[float, float]:
    """Where the P2 probe runs (plan seconds): from the burst's start to the end of the plan, the
    phases where the pool is saturated (burst, sparse-P0) and the recovery between them."""
    win = w.windows()
    a = win["burst"][0] if "burst" in win else 0.0
    return a, max(b for _, b in win.values())


def run_config(cfg: BenchConfig, w: Workload, plan: Sequence[Any], *, timeout_s: float,
               progress: bool, classes: dict[int, dict[str, Any]] | None = None,
               workdir: Path | None = None, probe_rate: float = 0.0, probe_nice: int = 0) -> RunOutput:
    import subprocess
    import tempfile

    from floodgate.sim.loadgen import run_load_detailed

    from floodgate.stack import LocalStack
    from floodgate.supervisor import Supervisor, free_port, wait_healthy

    kwargs: dict[str, Any] = {"workdir": workdir} if workdir else {}
    with Supervisor(**kwargs) as sup:
        stack = LocalStack(sup)
        upstreams = []
        for i in range(w.replicas):
            port = free_port()
            stack.start_upstream(
                [sys.executable, "-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0",
                 "--time-scale", str(w.time_scale), "--max-num-seqs", str(w.max_num_seqs),
                 "--scheduling-policy", "priority" if cfg.engine_priority else "fcfs",
                 "--log-level", "warning"], name=f"sim{i}", port=port)
            wait_healthy(f"http://127.0.0.1:{port}/health", 20, interval=0.05)
            upstreams.append(("127.0.0.1", port))
        metrics_url: str | None = None
        metrics: tuple[str, ...] = ()
        # Envoy's own timings of every request (envoy_config.ACCESS_LOG_FORMAT): where a probe's
        # time went, Envoy or the processor.
        access_log = sup.workdir / "envoy-access.log"
        if cfg.floodgate:
            stack.start_redis()
            if cfg.picking:
                asyncio.run(register_active(stack.redis_url, "default", upstreams, replica_prefix="sim"))
            proc = stack.start_processor(floodgate_config(cfg, classes))
            envoy = stack.start_envoy(upstreams, processors=[proc], access_log=access_log, picking=cfg.picking)
            metrics_url, metrics = proc.metrics_url, FLOODGATE_METRICS
        elif cfg.kind == "adaptive":
            envoy = stack.start_envoy(upstreams, processors=[], admission=False,
                                      extra_filters=[adaptive_concurrency_filter()], access_log=access_log)
            metrics_url = f"http://127.0.0.1:{envoy.admin_port}/stats/prometheus"
            metrics = ADAPTIVE_METRICS
        else:
            envoy = stack.start_envoy(upstreams, processors=[], admission=False, access_log=access_log)
        pids = {c.name: c.proc.pid for c in sup.children}
        cpu0 = {n: cpu_seconds(p) for n, p in pids.items()}
        self0 = time.process_time()
        busy0 = _machine_busy()
        probe = None
        if probe_rate > 0:
            # The P2 probe: its own process and event loop (bench/reject_probe.py), started now so
            # its imports are done long before its window; aligned to the plan by unix time.
            pa, pb = probe_window(w)
            probe_out = Path(tempfile.mkstemp(prefix="fg-probe-", suffix=".json")[1])
            probe = subprocess.Popen(
                [sys.executable, "-m", "floodgate.bench.reject_probe", "--url", envoy.url,
                 "--start-unix", str(time.time() + pa), "--duration", str(pb - pa),
                 "--rate", str(probe_rate), "--nice", str(probe_nice), "--out", str(probe_out)])
        t0 = time.monotonic()
        try:
            result = asyncio.run(run_load_detailed(
                plan, envoy.url, request_timeout=timeout_s, metrics_url=metrics_url,
                metrics=metrics or ("none",), progress=progress))
        except BaseException:
            if probe is not None:
                probe.kill()
                probe.wait()
            raise
        wall = max(1e-9, time.monotonic() - t0)
        if probe is not None:
            if probe.wait(timeout=60) != 0:
                raise RuntimeError(f"the P2 probe failed in the {cfg.name} run (exit {probe.returncode})")
            data = json.loads(probe_out.read_text())
            probe_out.unlink()
            t0_unix = float(result.meta["unix_time_at_t0"])
            envoy_lines = probe_access_lines(access_log, len(data["probes"]))
            result.meta["probe"] = {"rate": probe_rate, "nice": data.get("nice"), "probes": [
                {"t_planned": p["t_unix_planned"] - t0_unix, "t_sent": p["t_unix_sent"] - t0_unix,
                 "lag_s": p["lag_s"], "latency_s": p["latency_s"], "status": p["status"],
                 "reason": p["reason"], **({"error": p["error"]} if "error" in p else {}),
                 **({"envoy": envoy_side(envoy_lines[p["id"]], p["t_unix_sent"])}
                    if p.get("id") in envoy_lines else {})}
                for p in data["probes"]]}
        if cfg.floodgate and metrics_url:
            result.meta["decision_seconds"], result.meta["local_rejections_p2"] = decision_histogram(metrics_url)
            result.meta["engine_priority"] = engine_priority_counts(metrics_url)
            result.meta["processor_health"] = processor_health(metrics_url)
        busy1 = _machine_busy()
        cpu = {n: (cpu_seconds(p) - cpu0[n]) / wall for n, p in pids.items()}
        cpu["client"] = (time.process_time() - self0) / wall
        machine = (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1])
        for c in sup.children:
            if not c.alive():
                raise RuntimeError(f"{c.name} died during the {cfg.name} run:\n{c.log_tail()}")
    result.meta["config"] = cfg.name
    return RunOutput(cfg, result, cpu, machine)


def probe_access_lines(path: Path, n: int, wait_s: float = 5.0) -> dict[int, dict[str, Any]]:
    """Envoy's access-log lines of the probe's requests, by probe id. Envoy writes its access log
    from a buffer flushed every second: wait (up to `wait_s`) for the last probe's line."""
    deadline = time.monotonic() + wait_s
    lines: dict[int, dict[str, Any]] = {}
    while True:
        lines = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    lines[int(rec["probe"])] = rec
                except (ValueError, KeyError, TypeError):
                    continue  # not a probe's line ("probe": null) or a torn last line
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def envoy_side(rec: dict[str, Any], t_unix_sent: float) -> dict[str, Any]:
    """One probe's time as Envoy saw it (ms): from the probe's send to Envoy's start of the
    request (connection accept and the worker's read), Envoy's whole duration, and the
    ext_proc filter's request-headers call (send to the processor's reply)."""
    def num(v: Any) -> float | None:
        try:
            return float(v)
        except (TypeError, ValueError):
            return None
    start = num(rec.get("start"))
    ext_us = num(rec.get("ext_proc_header_us"))
    return {"to_start_ms": None if start is None else round((start - t_unix_sent) * 1000, 3),
            "duration_ms": num(rec.get("duration_ms")),
            "ext_proc_ms": None if ext_us is None else ext_us / 1000,
            "code": rec.get("code"), "details": rec.get("details")}


def decision_histogram(metrics_url: str) -> tuple[dict[str, list[list[float]]], int]:
    """The processor's `floodgate_decision_seconds` histogram (request headers in -> reply out)
    for P2 rejections: reason -> [[le, cumulative count], ...]; and how many P2 early drops it
    decided without a Redis round trip (`floodgate_local_rejections_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[list[float]]] = {}
    local = 0
    for fam in text_string_to_metric_families(text):
        if fam.name == "floodgate_local_rejections":
            local += int(sum(x.value for x in fam.samples if x.name.endswith("_total") and x.labels.get("priority") == "2"))
        if fam.name != "floodgate_decision_seconds":
            continue
        for smp in fam.samples:
            lab = smp.labels
            if smp.name.endswith("_bucket") and lab.get("priority") == "2" and lab.get("outcome") == "rejected":
                out.setdefault(lab["reason"], []).append([float(lab["le"]), float(smp.value)])
    for v in out.values():
        v.sort()
    return out, local


def processor_health(metrics_url: str) -> dict[str, Any]:
    """What held the processor's event loop over the run: `floodgate_event_loop_lag_seconds`
    (how late a 50 ms timer ran: the wait of a message arriving at a random moment) as
    [[le, cumulative count], ...], every GC pause by generation (count, total seconds, and
    buckets), and the sampled body chunks it handled (`floodgate_sampled_body_chunks_total`)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    lag: list[list[float]] = []
    gc: dict[str, dict[str, Any]] = {}
    chunks = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == "floodgate_event_loop_lag_seconds":
            lag = sorted([float(x.labels["le"]), float(x.value)] for x in fam.samples if x.name.endswith("_bucket"))
        elif fam.name == "floodgate_gc_pause_seconds":
            for x in fam.samples:
                g = gc.setdefault(x.labels.get("generation", "?"), {"count": 0.0, "sum_s": 0.0, "buckets": []})
                if x.name.endswith("_bucket"):
                    g["buckets"].append([float(x.labels["le"]), float(x.value)])
                elif x.name.endswith("_count"):
                    g["count"] = float(x.value)
                elif x.name.endswith("_sum"):
                    g["sum_s"] = float(x.value)
        elif fam.name == "floodgate_sampled_body_chunks":
            chunks += sum(float(x.value) for x in fam.samples if x.name.endswith("_total"))
    for g in gc.values():
        g["buckets"].sort()
    return {"loop_lag": lag, "gc": gc, "body_chunks": chunks}


def engine_priority_counts(metrics_url: str) -> dict[str, int]:
    """The processor's `floodgate_engine_priority_total` by outcome (set, not_json, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "floodgate_engine_priority":
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    k = smp.labels["outcome"]
                    out[k] = out.get(k, 0) + int(smp.value)
    return out


def histogram_quantile(buckets: Sequence[Sequence[float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket holding the q-quantile."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 1.0)
        prev_le, prev_n = le, n
    return prev_le


def _merge(hists: list[list[list[float]]]) -> list[list[float]]:
    acc: dict[float, float] = {}
    for h in hists:
        for le, n in h:
            acc[le] = acc.get(le, 0.0) + n
    return [[le, n] for le, n in sorted(acc.items())]


# --------------------------------------------------------------------------- evaluation


@dataclass
class Row:
    config: str
    offered: int
    admitted: int
    rejected: int
    errors: int
    consistent: bool
    p0_success: float | None
    p0_burst_success: float | None
    p0_ttft_p99_unloaded_s: float | None  # the unloaded phase's few P0s (not a p99: see reference)
    p0_ttft_p99_burst_s: float | None
    p0_ttft_ratio: float | None  # burst p99 / the reference pass's p99 (the phase's when none)
    p0_queue_p99_burst_ms: float | None  # Floodgate queue wait (x-floodgate-queue-ms) of burst P0s
    goodput_steady_tok_s: float | None
    goodput_burst_tok_s: float | None
    goodput_recovery_tok_s: float | None
    goodput_ratio: float | None
    p2_reject_p99_ms: float | None
    p2_rejected: int
    sparse_p0_offered: int
    sparse_p0_admitted: int
    sparse_p0_early_drops: int  # P0 turned away by early drop while it was rare (target 0)
    sparse_p0_ttft_p99_s: float | None
    reject_p99_ms: float | None
    success_by_class: dict[str, float | None]
    rejected_by_reason: dict[str, int]
    errors_by_kind: dict[str, int]
    limit_mean_burst: float | None
    cpu: dict[str, float]
    machine_busy: float
    send_lag_p99_s: float | None
    p2_reject_p50_ms: float | None = None
    p2_reject_timeouts: int = 0  # P2 rejections that waited out their queue timeout
    p2_immediate_reject_p99_ms: float | None = None  # client: P2 rejections that did not wait
    # Processor-side (floodgate_decision_seconds: request headers in -> 429 out) for P2 rejections
    p2_reject_proc_p50_ms: float | None = None
    p2_reject_proc_p99_ms: float | None = None
    p2_immediate_reject_proc_p99_ms: float | None = None
    p2_local_rejections: int | None = None  # P2 early drops decided without a Redis round trip
    p0_unloaded_n: int = 0  # P0s behind p0_ttft_p99_unloaded_s
    p0_ttft_ratio_phase: float | None = None  # burst p99 / the unloaded phase's few-sample "p99"
    p0_ttft_ref_p99_s: float | None = None  # the reference pass's P0 TTFT p99 (hundreds of samples)
    # The P2 probe (bench/reject_probe.py, its own process): its rejected probes, send -> 429
    probe_sent: int = 0
    probe_rejected: int = 0
    probe_reject_timeouts: int = 0
    probe_reject_p50_ms: float | None = None
    probe_reject_p99_ms: float | None = None
    probe_reject_burst_p99_ms: float | None = None  # only probes sent in the burst
    probe_reject_burst_n: int = 0
    probe_send_lag_p99_ms: float | None = None
    probe_errors: int = 0  # probes answered neither 200 nor 429 (or not at all)
    # Envoy's access log of the rejected probes: probe send -> Envoy starts the request, and the
    # ext_proc filter's request-headers call (Envoy's send to the processor's reply), p99 ms
    probe_to_envoy_p99_ms: float | None = None
    probe_ext_proc_p99_ms: float | None = None
    # `@engine-priority` rows: admitted requests whose body got vLLM's priority, by outcome
    engine_priority: dict[str, int] = field(default_factory=dict)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate(out: RunOutput, w: Workload, slo: Any, best_goodput: float,
             reference: dict[str, Any] | None = None) -> Row:
    import numpy as np
    from floodgate.sim.loadgen import OK, REJECTED
    from floodgate.sim.report import percentile, produced_goodput, summarize

    recs = out.result.records
    win = w.windows()
    whole = summarize(recs, slo)
    whole.check()
    phases = {}
    for name, (a, b) in win.items():
        s = summarize(recs, slo, window=(a, b))
        s.check()
        phases[name] = s
    rej = [r for r in recs if r.outcome == REJECTED and r.e2e_s is not None]
    p2_rej = [r.e2e_s for r in rej if r.priority == 2]
    burst = phases.get("burst")
    unloaded = phases.get("unloaded")
    limit_name = FLOODGATE_METRICS[0] if out.config.floodgate else ADAPTIVE_LIMIT
    limit_mean = None
    if burst is not None and burst.window is not None:
        vals = [s.values[limit_name] for s in out.result.samples
                if limit_name in s.values and burst.window[0] <= s.t < burst.window[1]]
        limit_mean = float(np.mean(vals)) if vals else None
    if out.config.kind == "static":
        limit_mean = float(out.config.limit or 0)
    p0_unloaded = unloaded.per_priority[0].ttft_p99 if unloaded else None
    ref_p99 = reference.get("p0_ttft_p99_s") if reference else None
    p0_burst = burst.per_priority[0].ttft_p99 if burst else None
    # By production: the tokens made inside the burst window (a burst's arrivals finish after it).
    g_burst = produced_goodput(recs, slo, *burst.window) if burst is not None and burst.window else None
    o = whole.overall
    sparse = [r for r in recs if r.priority == 0 and any(
        p.p0_rate is not None and win[p.name][0] <= r.t_planned < win[p.name][1] for p in w.phases)]
    sparse_ttft = [r.ttft_s for r in sparse if r.outcome == OK and r.ttft_s is not None]
    p2_now = [r.e2e_s for r in rej if r.priority == 2 and r.reject_reason != "queue_timeout"]
    hist = out.result.meta.get("decision_seconds") or {}
    h_all = _merge(list(hist.values()))
    h_now = _merge([v for k, v in hist.items() if k != "queue_timeout"])

    def proc_ms(h: list[list[float]], q: float) -> float | None:
        v = histogram_quantile(h, q)
        return None if v is None else v * 1000

    probes = (out.result.meta.get("probe") or {}).get("probes") or []
    p_rej = [p for p in probes if p["status"] == 429 and p["latency_s"] is not None]
    p_rej_burst = [p["latency_s"] for p in p_rej if burst is not None and burst.window is not None
                   and burst.window[0] <= p["t_planned"] < burst.window[1]]
    p_lag = [p["lag_s"] for p in probes]

    def p_ms(v: list[float], q: float) -> float | None:
        return (percentile(v, q) or 0) * 1000 if v else None

    return Row(
        engine_priority=dict(out.result.meta.get("engine_priority") or {}),
        probe_sent=len(probes), probe_rejected=len(p_rej),
        probe_reject_timeouts=sum(1 for p in p_rej if p["reason"] == "queue_timeout"),
        probe_reject_p50_ms=p_ms([p["latency_s"] for p in p_rej], 50),
        probe_reject_p99_ms=p_ms([p["latency_s"] for p in p_rej], 99),
        probe_reject_burst_p99_ms=p_ms(p_rej_burst, 99), probe_reject_burst_n=len(p_rej_burst),
        probe_send_lag_p99_ms=p_ms(p_lag, 99),
        probe_errors=sum(1 for p in probes if p["status"] not in (200, 429)),
        probe_to_envoy_p99_ms=percentile(
            [v for p in p_rej if (v := (p.get("envoy") or {}).get("to_start_ms")) is not None], 99),
        probe_ext_proc_p99_ms=percentile(
            [v for p in p_rej if (v := (p.get("envoy") or {}).get("ext_proc_ms")) is not None], 99),
        config=out.config.name, offered=o.offered, admitted=o.admitted, rejected=o.rejected,
        errors=o.errors, consistent=o.offered == o.admitted + o.rejected + o.errors,
        p0_success=whole.per_priority[0].success_rate,
        p0_burst_success=burst.per_priority[0].success_rate if burst else None,
        p0_ttft_p99_unloaded_s=p0_unloaded, p0_ttft_p99_burst_s=p0_burst,
        p0_ttft_ratio=_ratio(p0_burst, ref_p99 if ref_p99 else p0_unloaded),
        p0_ttft_ratio_phase=_ratio(p0_burst, p0_unloaded), p0_ttft_ref_p99_s=ref_p99,
        p0_unloaded_n=sum(1 for r in recs if r.priority == 0 and r.outcome == OK and r.ttft_s is not None
                          and unloaded is not None and unloaded.window is not None
                          and unloaded.window[0] <= r.t_planned < unloaded.window[1]),
        p0_queue_p99_burst_ms=burst.per_priority[0].queue_ms_p99 if burst else None,
        goodput_steady_tok_s=produced_goodput(recs, slo, *win["steady"]) if "steady" in win else None,
        goodput_burst_tok_s=g_burst,
        goodput_recovery_tok_s=produced_goodput(recs, slo, *win["recovery"]) if "recovery" in win else None,
        goodput_ratio=_ratio(g_burst, best_goodput),
        p2_reject_p99_ms=(percentile(p2_rej, 99) or 0) * 1000 if p2_rej else None,
        p2_rejected=len(p2_rej),
        p2_reject_p50_ms=(percentile(p2_rej, 50) or 0) * 1000 if p2_rej else None,
        p2_reject_timeouts=sum(1 for r in rej if r.priority == 2 and r.reject_reason == "queue_timeout"),
        p2_immediate_reject_p99_ms=(percentile(p2_now, 99) or 0) * 1000 if p2_now else None,
        p2_reject_proc_p50_ms=proc_ms(h_all, 0.5), p2_reject_proc_p99_ms=proc_ms(h_all, 0.99),
        p2_immediate_reject_proc_p99_ms=proc_ms(h_now, 0.99),
        p2_local_rejections=out.result.meta.get("local_rejections_p2"),
        sparse_p0_offered=len(sparse), sparse_p0_admitted=sum(1 for r in sparse if r.outcome == OK),
        sparse_p0_early_drops=sum(1 for r in sparse if r.outcome == REJECTED and r.reject_reason == "early_drop"),
        sparse_p0_ttft_p99_s=percentile(sparse_ttft, 99) if sparse_ttft else None,
        reject_p99_ms=(percentile([r.e2e_s for r in rej if r.e2e_s is not None], 99) or 0) * 1000 if rej else None,
        success_by_class={f"P{k}": v.success_rate for k, v in whole.per_priority.items()},
        rejected_by_reason=o.rejected_by_reason, errors_by_kind=o.errors_by_kind,
        limit_mean_burst=limit_mean, cpu=out.cpu, machine_busy=out.machine_busy,
        send_lag_p99_s=out.result.meta.get("send_lag_p99_s"),
    )


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{1000 * v:.0f}"


def render_table(rows: Sequence[Row]) -> str:
    head = ("| config | offered | admitted | rejected | errors | P0 success "
            "| P0 TTFT p99 burst ms (vs reference) | unloaded phase: P0s, their p99 ms (burst vs it) "
            "| P0 queue p99 burst ms | burst goodput tok/s (vs best) | P2 reject p50 / p99 ms (timeouts of rejects) "
            "| P2 reject in processor p50 / p99 ms (immediate only p99; local) "
            "| P2 probe: reject p50 / p99 ms (burst only p99; rejected of sent; probe send lag p99 ms) "
            "| P2 probe in Envoy p99 ms: to Envoy / ext_proc call "
            "| limit in burst | sparse P0: admitted / early drops / TTFT p99 ms |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        lines.append(
            f"| {r.config} | {r.offered} | {r.admitted} | {r.rejected} | {r.errors} "
            f"| {_pct(r.p0_success, 2)} | {_ms(r.p0_ttft_p99_burst_s)} ({_num(r.p0_ttft_ratio, '.2f')}x) "
            f"| {r.p0_unloaded_n}, {_ms(r.p0_ttft_p99_unloaded_s)} ({_num(r.p0_ttft_ratio_phase, '.1f')}x) "
            f"| {_num(r.p0_queue_p99_burst_ms)} | {_num(r.goodput_burst_tok_s)} ({_pct(r.goodput_ratio, 0)}) "
            f"| {_num(r.p2_reject_p50_ms, '.1f')} / {_num(r.p2_reject_p99_ms, '.1f')} ({r.p2_reject_timeouts}/{r.p2_rejected}) "
            f"| {_num(r.p2_reject_proc_p50_ms, '.1f')} / {_num(r.p2_reject_proc_p99_ms, '.1f')} "
            f"({_num(r.p2_immediate_reject_proc_p99_ms, '.1f')}; {'–' if r.p2_local_rejections is None else r.p2_local_rejections}) "
            f"| {_num(r.probe_reject_p50_ms, '.1f')} / {_num(r.probe_reject_p99_ms, '.1f')} "
            f"({_num(r.probe_reject_burst_p99_ms, '.1f')}; {r.probe_rejected}/{r.probe_sent}; "
            f"{_num(r.probe_send_lag_p99_ms, '.1f')}) "
            f"| {_num(r.probe_to_envoy_p99_ms, '.1f')} / {_num(r.probe_ext_proc_p99_ms, '.1f')} "
            f"| {_num(r.limit_mean_burst)} "
            f"| {r.sparse_p0_admitted}/{r.sparse_p0_offered} / {r.sparse_p0_early_drops} / {_ms(r.sparse_p0_ttft_p99_s)} |")
    return head + "\n".join(lines) + "\n"


# "Best static limit" needs a sweep: fewer static rows of a deployment variant than this and the
# Vegas rows of that variant are not judged against them.
MIN_STATIC_SWEEP = 3


def best_static(rows: Sequence[Row], variant: str = "") -> Row | None:
    """The static row with the most burst goodput among those run with this deployment variant
    (`@picking`, `@engine-priority`; "" the plain rows, also for `@tuned`, which changes only
    the class settings)."""
    def suffix(config: str) -> str:
        v = config.partition("@")[2]
        return "" if v == "tuned" else v
    static = [r for r in rows if r.config.startswith("static-") and suffix(r.config) == suffix(variant)]
    return max(static, key=lambda r: r.goodput_burst_tok_s or 0.0, default=None)


def verdicts(rows: Sequence[Row]) -> list[str]:
    """One line per target, per Floodgate config, PASS/FAIL with the number."""
    out = []

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    for r in rows:
        if not (r.config.startswith("static-") or r.config.startswith("vegas-")):
            continue
        p0 = r.p0_success is not None and r.p0_success >= TARGET_P0_SUCCESS
        tt = r.p0_ttft_ratio is not None and r.p0_ttft_ratio <= TARGET_P0_TTFT_RATIO
        gp = r.goodput_ratio is not None and r.goodput_ratio >= TARGET_GOODPUT_RATIO
        p2 = r.p2_reject_p99_ms is None or r.p2_reject_p99_ms < TARGET_P2_REJECT_MS
        p2p = r.p2_reject_proc_p99_ms is None or r.p2_reject_proc_p99_ms < TARGET_P2_REJECT_MS
        # Judged on the probe when it ran (a client with nothing else to do); the load
        # generator's figure, which carries its own send lag, is reported beside it.
        probed = r.probe_reject_p99_ms is not None
        if probed:
            p2 = r.probe_reject_p99_ms is not None and r.probe_reject_p99_ms < TARGET_P2_REJECT_MS
        p2_text = (f"{_num(r.probe_reject_p99_ms, '.1f')} ms at the probe client over {r.probe_rejected} "
                   f"probe rejections (send lag p99 {_num(r.probe_send_lag_p99_ms, '.1f')} ms), "
                   f"{_num(r.p2_reject_p99_ms, '.1f')} ms at the load generator"
                   if probed else f"{_num(r.p2_reject_p99_ms, '.1f')} ms client")
        line = (f"{r.config}: P0 success {mark(p0)} ({_pct(r.p0_success, 2)}), "
                f"P0 TTFT p99 burst/reference {mark(tt)} ({_num(r.p0_ttft_ratio, '.2f')}x), "
                f"burst goodput {mark(gp)} ({_pct(r.goodput_ratio, 0)} of best steady), "
                f"P2 reject p99 {mark(p2)} ({p2_text}, "
                f"{mark(p2p)} {_num(r.p2_reject_proc_p99_ms, '.1f')} ms in the processor), "
                f"sparse P0 early drops {mark(r.sparse_p0_early_drops == 0)} "
                f"({r.sparse_p0_early_drops} of {r.sparse_p0_offered})")
        bs = best_static(rows, r.config) if r.config.startswith("vegas-") else None
        if bs is not None:
            ran = sorted((x.config for x in rows if x.config.startswith("static-")
                          and best_static([x], r.config) is not None), key=lambda c: int(c[7:].split("@")[0]))
            g, s = r.goodput_burst_tok_s or 0.0, bs.goodput_burst_tok_s or 0.0
            if len(ran) >= MIN_STATIC_SWEEP:
                line += (f", vs best static ({bs.config}, of {', '.join(ran)} in this run) "
                         f"{mark(g >= 0.95 * s)} ({_pct(_ratio(g, s), 0)})")
            else:
                # One or two hand-picked limits are no "best static": a review found the
                # variants' rows judged against a sweep of one.
                line += (f", vs {', '.join(ran)} (not judged: fewer than {MIN_STATIC_SWEEP} static limits of "
                         f"this deployment ran, no best-static reference) {_pct(_ratio(g, s), 0)}")
        out.append(line)
    for r in rows:
        if r.config in ("none", "adaptive"):
            out.append(f"{r.config}: burst goodput {_pct(r.goodput_ratio, 0)} of best steady, "
                       f"P0 success {_pct(r.p0_success, 2)}, P0 TTFT p99 burst/reference "
                       f"{_num(r.p0_ttft_ratio, '.1f')}x")
    return out


# --------------------------------------------------------------------------- outputs


def plot_timeline(runs: Sequence[RunOutput], w: Workload, slo: Any, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from floodgate.sim.loadgen import OK

    end = sum(p.duration_s for p in w.phases)
    bin_s = max(1.0, end / 60)
    edges = np.arange(0.0, end + bin_s, bin_s)
    fig, axes = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    ax_good, ax_p0, ax_rej, ax_lim = axes
    for i, out in enumerate(runs):
        color = f"C{i % 10}"  # the same colour for a config in every panel
        recs = out.result.records
        good = np.histogram([r.t_planned for r in recs if slo.met(r)], bins=edges,
                            weights=[r.tokens for r in recs if slo.met(r)])[0] / bin_s
        ax_good.plot(edges[:-1], good, label=out.config.name, drawstyle="steps-post", color=color)
        p99 = []
        for a, b in itertools.pairwise(edges):
            v = [r.ttft_s for r in recs if r.priority == 0 and r.outcome == OK and r.ttft_s is not None
                 and a <= r.t_planned < b]
            p99.append(np.percentile(v, 99) if v else np.nan)
        ax_p0.plot(edges[:-1], p99, label=out.config.name, drawstyle="steps-post", color=color)
        rej = np.histogram([r.t_planned for r in recs if r.outcome != OK], bins=edges)[0] / bin_s
        ax_rej.plot(edges[:-1], rej, label=out.config.name, drawstyle="steps-post", color=color)
        name = FLOODGATE_METRICS[0] if out.config.floodgate else ADAPTIVE_LIMIT
        pts = [(s.t, s.values[name]) for s in out.result.samples if name in s.values]
        if pts:
            ax_lim.plot([p[0] for p in pts], [p[1] for p in pts], label=out.config.name, color=color)
    for ax in axes:
        t = 0.0
        for p in w.phases:
            if p.name == "burst":
                ax.axvspan(t, t + p.duration_s, color="0.9", zorder=0)
            t += p.duration_s
        ax.grid(alpha=0.3)
    ax_good.set_ylabel("goodput (tok/s, SLO met)")
    ax_p0.set_ylabel("P0 TTFT p99 (s)")
    ax_p0.set_yscale("log")
    ax_p0.axhline(slo.ttft_s, color="k", ls=":", lw=1)
    ax_rej.set_ylabel("rejected + errors (req/s)")
    ax_lim.set_ylabel("concurrency limit")
    ax_lim.set_xlabel("arrival time (s); burst shaded")
    ax_good.legend(ncol=4, fontsize=8)
    ax_good.set_title("Overload: same pool, same arrivals, by configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_raw(out_dir: Path, run: RunOutput, slo: Any) -> Path:
    from floodgate.sim.report import result_to_json

    path = out_dir / f"{run.config.name}.json.gz"
    data = result_to_json(run.result, slo)
    data["meta"]["cpu_share_of_one_core"] = run.cpu
    data["meta"]["machine_busy_share"] = run.machine_busy
    with gzip.open(path, "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    return path


def render_section(report: dict[str, Any], rows: Sequence[Row], verdict_lines: Sequence[str],
                   rel_out: str, notes: str) -> str:
    w = report["workload"]
    cap = report["capacity"]
    phases = ", ".join(f"{p['name']} {p['duration_s']:.0f} s at {p['load']:.1f}x" for p in w["phases"])
    cpu_lines = "\n".join(
        f"| {r.config} | " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(r.cpu.items()) if v >= 0.02)
        + f" | {100 * r.machine_busy:.0f}% | {_num(r.send_lag_p99_s, '.3f')} |" for r in rows)
    sweep = ""
    if report.get("calibration"):
        c = report["calibration"]
        sweep = ("Measured on the real pool (no admission, steps of "
                 + ", ".join(f"{s['load']:.2f}x: {s['goodput_tok_s']:.0f}" for s in c["steps"])
                 + f" tok/s): best {c['best_goodput_tok_s']:.0f} tok/s.")
    return f"""{SECTION_START}
## Overload

`floodgate bench overload` (bench/overload.py) replays one seeded open-loop plan against the
same emulated pool in several configurations, each on fresh processes, and prints the table
below. Raw data (every request record and metric sample, gzipped JSON as written by
`sim.report.write_json`) and `results.json` are in `{rel_out}/`.
Reproduce: `floodgate bench overload` (about 27 minutes with the reference pass, the static sweep 64/96/128/160 with Envoy's balancing and with `@picking`, the two `@engine-priority` rows and Vegas `@picking`; `--help` for a shorter run).

**Pool.** {w['replicas']} `floodgate sim` replicas, default timings × time-scale
{w['time_scale']}, `--max-num-seqs {w['max_num_seqs']}`, behind one Envoy (LEAST_REQUEST; `@picking` rows: ORIGINAL_DST, the processor picks).
Prompts lognormal mean {w['prompt_mean']} tokens, outputs mean {w['output_mean']} tokens
(sigma {w['length_sigma']}), two tenants, priority mix {w['priority_shares']} (P0/P1/P2).
SLO for goodput: TTFT ≤ {report['slo']['ttft_s']} s and TPOT ≤ {report['slo']['tpot_s']} s
(client-measured: TTFT includes any Floodgate queue wait).

**Capacity.** Derived on the pure engine model (the replicas' own `sim/engine.py`, virtual
clock): highest rate with ≥ 99 % SLO attainment = **{cap['capacity_rps']:.1f} req/s**, best
steady goodput {cap['derived_best_goodput_tok_s']:.0f} tok/s. {sweep} Goodput ratios below are
against the higher of the two, **{cap['best_goodput_tok_s']:.0f} tok/s**. Every goodput here is
counted by production: the output tokens that requests meeting the SLO produced inside the
window, whenever they arrived (counted by arrival, a burst's requests also brought the tokens
they make after it ends, and rows read 6-16 points above 100 %: an edge effect, not a better
batch).

**Floodgate** (static and Vegas alike): one processor, one Redis, priority header trusted
from loopback. Rows without `@tuned` run the **shipped class defaults** (each class's queue
timeout derived from its SLO: `{json.dumps(report['classes'].get('shipped') if isinstance(report['classes'], dict) else None)}`);
`@engine-priority` rows are a deployment choice, not the default: the emulators run vLLM's
`--scheduling-policy priority` (waiting queue by the body's `priority`, then arrival) and the pool
sets `engine_priority: {json.dumps(ENGINE_PRIORITY)}` (the processor writes `"priority": -1` into each
P0's body; P1/P2 untouched). `@picking` rows route as the shipped compose, Kubernetes and
`floodgate up` deployments do: `endpoint_picking: true`, the replicas registered active in Redis,
Envoy's ORIGINAL_DST cluster steered by the processor (shipped prefill-aware picking:
`prefill_tokens_per_s` {PoolConfig().prefill_tokens_per_s:.0f}, `prefill_request_tokens`
{PoolConfig().prefill_request_tokens:.0f}, `prefill_pace_tokens` {PoolConfig().prefill_pace_tokens:.0f},
`prefill_bytes_per_token` {PoolConfig().prefill_bytes_per_token:g}, `prefill_max_request_tokens`
{PoolConfig().prefill_max_request_tokens:.0f}: each request counts its content-length / bytes per token);
the other rows leave the choice of replica to Envoy. Every other processor setting of the rows is the code's default, not the deployment configs' overrides: `fair_order` true (the compose and Kubernetes configs set it false; the bench's two tenants are ordered by it), the Vegas limit's `min` 1 / `max` 512 (compose: 2 / 192). `@tuned` rows the hand-tuned ones (`{json.dumps(report['classes'].get('tuned') if isinstance(report['classes'], dict) else report['classes'])}`).
Vegas rows run the shipped `LimitConfig` (signal `{LIMIT_SIGNAL}`); a `vegas-SIG` row with another signal sets only `signal`.
**adaptive_concurrency**: `{json.dumps(report['adaptive_concurrency_filter']['typed_config']['gradient_controller_config'])}`.

**Plan.** {phases} (seed {w['seed']}; {report['plan_requests']} requests). "Burst" numbers
are over requests that *arrived* during the burst.

{render_reference(report.get("reference"))}

{render_table(rows)}
Columns: P0 success over the whole run; P0 TTFT p99 of the burst's P0s and its ratio to the
reference above; the unloaded phase's own P0s (how many, their p99, the burst p99 over it — few
samples, so an underestimate of the unloaded p99, kept for comparison with earlier runs);
goodput = output tokens/s produced in the burst by requests that met the SLO, vs the best steady goodput;
P2 reject p50 / p99 = time from send to the 429 for rejected P2 requests (in brackets: how many
of them waited out their queue timeout, of all P2 rejections; the adaptive row's is Envoy's own
local 429, measured in the same invocation: a reference for client-observed times on this box, not a floor, since Floodgate rows have read below it); P2 reject in processor = the
processor's `floodgate_decision_seconds` for P2 rejections, request headers in to the 429 out
(p50 / p99 of all; in brackets p99 of those that did not wait out a timeout, histogram buckets
so interpolated within a bucket; and how many were decided from the last seen state without a
Redis round trip); P2 probe = `bench/reject_probe.py`, a separate process sending
{report.get('probe', {}).get('rate', '–')} P2 requests/s (32-token prompts, 2 output tokens, tenant
`reject-probe`) through the same Envoy from the burst's start to the end of the plan, at niceness
change {report.get('probe', {}).get('nice_change', '–')} (ahead of the box's other processes, as a
client on its own machine): send to the whole 429 read, monotonic clock, p50 / p99 of its
rejections (in brackets the p99 of those sent in the burst, how many of its probes were
rejected, and its own send lag p99: how late it sent; the adaptive row's probe meets Envoy's own
429); P2 probe in Envoy = Envoy's access log of the same rejected probes (`x-probe-id`,
`envoy_config.ACCESS_LOG_FORMAT`): p99 of the time from the probe's send to Envoy's start of the
request (connection read by Envoy's worker) and of the ext_proc filter's request-headers call
(Envoy's send to the processor's reply: the gRPC transport and the processor's event loop, with
the decision inside); the load generator's P2 figures above are kept: its lag lands in them; limit = mean concurrency
limit during the burst (static: the configured value); sparse P0 = the last phase, where P1/P2
saturate the pool and P0 arrives rarely: P0 admitted of offered, P0 turned away by early drop
(target 0), their TTFT p99. offered = admitted + rejected + errors holds for every row (checked).

{render_bound(report.get("p0_bound"), rows)}
![timeline]({rel_out}/timeline.png)

### Verdict per target

{chr(10).join('- ' + v for v in verdict_lines)}

{notes}

### CPU during each run

Share of one core per process (the machine has 2 cores; other engineers' jobs may run at the
same time, so compare ratios within one run), share of all cores busy machine-wide, and the
load generator's p99 send lag (late sends mean the client, not the pool, was the bottleneck).

| config | processes (share of one core) | machine busy | send lag p99 s |
|---|---|---:|---:|
{cpu_lines}
{SECTION_END}
"""


def render_reference(ref: dict[str, Any] | None) -> str:
    """The unloaded reference paragraph: what every row's P0 TTFT ratio divides by."""
    if not ref or not ref.get("p0_ttft_p99_s"):
        return ("**Reference for P0 TTFT:** none measured (this run's ratios divide by the unloaded "
                "phase's few P0s).")
    return (f"**Reference for P0 TTFT** (measured first, in the same invocation): "
            f"{ref['duration_s']:.0f} s at the unloaded phase's load ({ref['load']:.1f}x, "
            f"{ref['rate_rps']:.1f} req/s) through Envoy alone, every request P0, on fresh processes; "
            f"{ref['samples']} TTFTs after a {REFERENCE_WARMUP_S:.0f} s warm-up ({ref['failed']} failed): "
            f"p50 {1000 * ref['p0_ttft_p50_s']:.0f} ms, **p99 {1000 * ref['p0_ttft_p99_s']:.0f} ms**. "
            "The processor's own overhead is not in it, so it counts against the Floodgate rows.")


def render_bound(bound: dict[str, Any] | None, rows: Sequence[Row]) -> str:
    """The P0 TTFT bound paragraph (bench/p0_bound.py, FIFO_NOTE): the floor no admission policy
    beats on FIFO engines and the best point an oracle pacing policy reaches."""
    if not bound or "p0_alone" not in bound:
        return ""
    pts = bound["points"]
    unl = bound["unloaded_p0_ttft_p99_s"]
    b = bound["best"]
    ref = next((r.p0_ttft_ref_p99_s for r in rows if r.p0_ttft_ref_p99_s), None)
    alone = bound["p0_alone"]

    def vs(x: float) -> str:
        return f"{x / unl:.2f}x" + (f" ({x / ref:.2f}x this run's reference)" if ref else "")

    caps = sorted({p["backlog_cap"] for p in pts})
    ns = sorted({p["n_per_replica"] for p in pts})
    cap_name = lambda k: "no cap" if math.isinf(k) else f"K = {k:.0f}"  # noqa: E731
    head = "| sequences per replica (N) | " + " | ".join(str(n) for n in ns) + " |\n"
    head += "|---|" + "---:|" * len(ns) + "\n"
    for k in caps:
        by_n = {p["n_per_replica"]: p for p in pts if p["backlog_cap"] == k}
        head += (f"| {cap_name(k)}: P0 TTFT p99 ms (goodput tok/s) | "
                 + " | ".join(f"{1000 * by_n[n]['p0_ttft_p99_s']:.0f} ({by_n[n]['goodput_tok_s']:.0f})"
                              for n in ns) + " |\n")
    if b is None:
        best = f"no point reaches {bound['target_goodput_tok_s']:.0f} tok/s"
    else:
        best = (f"the best point reaching {bound['target_goodput_tok_s']:.0f} tok/s (95 % of the best steady "
                f"goodput) is N = {b['n_per_replica']}, {cap_name(b['backlog_cap'])}: P0 TTFT p99 "
                f"{1000 * b['p0_ttft_p99_s']:.0f} ms = **{vs(b['p0_ttft_p99_s'])}**")
    return f"""**P0 TTFT on FIFO engines, whatever the admission policy** (`bench/p0_bound.py`, the replicas'
own engine model on a virtual clock, the burst's P0 rate, seeds {", ".join(str(x) for x in BOUND_SEEDS)}
pooled, {alone['p0_count']} P0s per point; the engines' unloaded P0 TTFT p99 {1000 * unl:.0f} ms, every
request a P0 at the unloaded phase's load). vLLM's default `fcfs` engine queue cannot be
reordered: a P0 waits for every prompt admitted before it. **Floor estimate** (no policy beats it on the
engine model, under the assumptions in `p0_bound.FIFO_NOTE`; an estimate for this run: other arrivals, and the model rather than the live pool): the burst's P0s alone, {1000 * alone['p0_ttft_p99_s']:.0f} ms =
**{vs(alone['p0_ttft_p99_s'])}**. **Achievable** (an oracle that knows each engine's queue: P0 at once
to the replica with the least prefill left; a lower-class request enters a replica only at a
step's start, while it runs fewer than N sequences and has at most K prompt tokens left to
prefill): {best}. The optimum lies between the two.

{head}"""


def update_doc(doc: Path, section: str) -> None:
    """Replace our section between the markers, or append it; never touch the rest."""
    replace_section(doc, SECTION_START, SECTION_END, section)


DEFAULT_NOTES = "<!-- notes: filled in by hand after a full run -->"


def _existing_notes(doc: Path) -> str:
    """Hand-written analysis between the verdict and the CPU table survives a rerun."""
    return kept_notes(doc, "<!-- notes:begin -->", "<!-- notes:end -->", DEFAULT_NOTES)


# --------------------------------------------------------------------------- calibration


def calibrate(w: Workload, capacity: float, slo: Any, *, timeout_s: float, step_s: float,
              progress: bool) -> dict[str, Any]:
    """Best steady goodput measured on the real pool: constant steps, no admission control.
    Each step's first quarter is left out (the pool settles)."""
    from floodgate.sim.arrivals import step_profile, synthetic_plan
    from floodgate.sim.report import produced_goodput, summarize

    loads = (0.6, 0.8, 0.9, 1.0, 1.1)
    profile = step_profile([(step_s, f * capacity) for f in loads])
    plan = synthetic_plan(profile, w.mix(), seed=w.seed + 7)
    run = run_config(BenchConfig("calibration", "none"), w, plan, timeout_s=timeout_s, progress=progress)
    steps: list[dict[str, Any]] = []
    for i, f in enumerate(loads):
        a, b = i * step_s + step_s / 4, (i + 1) * step_s
        s = summarize(run.result.records, slo, window=(a, b))
        s.check()
        steps.append({"load": f, "rate_rps": f * capacity,
                      "goodput_tok_s": produced_goodput(run.result.records, slo, a, b),
                      "slo_attainment": s.overall.slo_attainment})
    return {"steps": steps, "best_goodput_tok_s": max(float(s["goodput_tok_s"]) for s in steps),
            "cpu": run.cpu, "machine_busy": run.machine_busy}


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", type=parse_config, default=None, metavar="CONFIG",
                   help="none, adaptive, static-N, vegas (the default signal), vegas-ttft|tpot|combined; "
                        "a Floodgate one with @tuned (hand-tuned classes), @engine-priority, @picking or, "
                        "Vegas only, @sampleR (sample rate R) appended "
                        f"(default: {' '.join(default_configs())})")
    p.add_argument("--replicas", type=int, default=2, help="emulated replicas in the pool")
    p.add_argument("--time-scale", type=float, default=1.0, help="emulator --time-scale")
    p.add_argument("--max-num-seqs", type=int, default=256, help="emulator --max-num-seqs per replica")
    p.add_argument("--prompt-mean", type=int, default=512)
    p.add_argument("--output-mean", type=int, default=64)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every phase duration (0.1 for a smoke run)")
    p.add_argument("--capacity", type=float, default=None,
                   help="pool capacity in req/s (default: derived from the engine model)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="skip the measured steady-goodput sweep; use the derived best goodput")
    p.add_argument("--calibrate-step", type=float, default=10.0, help="seconds per calibration step")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mix", type=float, nargs=3, default=None, metavar=("P0", "P1", "P2"),
                   help="priority mix of the plan (shares of P0/P1/P2 in every phase but sparse-p0; "
                        "default 0.2 0.5 0.3)")
    p.add_argument("--reference-s", type=float, default=REFERENCE_S,
                   help="seconds of the unloaded reference pass (scaled by --scale; 0 = none: the "
                        "ratio then divides by the unloaded phase's few P0s)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=20.0, help="client timeout per request, s")
    p.add_argument("--p0-reserve", choices=["when_waiting", "always"], default="when_waiting",
                   help="P0's `reserve` setting (always: its share stays free as headroom)")
    p.add_argument("--p0-share", type=float, default=None, help="P0's share of the limit")
    p.add_argument("--shipped-classes", action="store_true",
                   help="(the default) Floodgate configs without @tuned run the processor's shipped "
                        "class settings")
    p.add_argument("--tuned-classes", action="store_true",
                   help="every Floodgate config with the hand-tuned class settings (as @tuned: P1 waits "
                        "0.75 x SLO TTFT, P2 never queues, P0 30 s)")
    p.add_argument("--probe-rate", type=float, default=PROBE_RATE,
                   help="P2 probes per second from a separate process (bench/reject_probe.py) from the "
                        "burst's start to the end of the plan, in every config; 0 = no probe")
    p.add_argument("--probe-nice", type=int, default=PROBE_NICE,
                   help="the probe process's niceness change (negative: ahead of the bench's other "
                        "processes, as a client with its own CPU; needs privileges, else it runs as is)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"directory for JSON and plots (default {DEFAULT_OUT})")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC,
                   help=f"markdown file to update (default {DEFAULT_DOC or 'none: installed, not in a checkout'})")
    p.add_argument("--no-doc", action="store_true", help="do not update the markdown file")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--from-raw", action="store_true",
                   help="run nothing: re-evaluate the raw JSON already in --out and rewrite the "
                        "table, plot and doc section")


def _load_raw(out_dir: Path, report: dict[str, Any]) -> list[RunOutput]:
    """The runs of an earlier invocation, from its raw JSON (for --from-raw)."""
    from floodgate.sim.loadgen import LoadResult, Record, Sample

    runs = []
    for row in report["rows"]:
        with gzip.open(out_dir / f"{row['config']}.json.gz", "rt") as f:
            d = json.load(f)
        samples = [Sample(float(x.pop("t")), {k: float(v) for k, v in x.items()}) for x in d["samples"]]
        result = LoadResult([Record.from_dict(r) for r in d["records"]], samples, d["meta"])
        runs.append(RunOutput(parse_config(row["config"]), result,
                              d["meta"].get("cpu_share_of_one_core", {}),
                              d["meta"].get("machine_busy_share", 0.0)))
    return runs


def run(args: argparse.Namespace) -> int:
    from floodgate.sim.report import SLO

    slo = SLO(args.slo_ttft, args.slo_tpot)
    started = time.monotonic()
    if args.from_raw:
        report = json.loads((args.out / "results.json").read_text())
        w = Workload(**{**report["workload"], "priority_shares": tuple(report["workload"]["priority_shares"]),
                        "phases": tuple(Phase(**p) for p in report["workload"]["phases"])})
        slo = SLO(**report["slo"])
        runs = _load_raw(args.out, report)
        cap = report["capacity"]
        measured = report["calibration"]["best_goodput_tok_s"] if report.get("calibration") else 0.0
        cap["best_goodput_tok_s"] = max(cap["derived_best_goodput_tok_s"], measured)
        best = cap["best_goodput_tok_s"]
        rows = [evaluate(out, w, slo, best, report.get("reference")) for out in runs]
    else:
        report, runs, rows = _measure(args, slo)
        best = report["capacity"]["best_goodput_tok_s"]
    table = render_table(rows)
    lines = verdicts(rows)
    print()
    print(table)
    print("\n".join(lines))
    report["rows"] = [asdict(r) for r in rows]
    report["verdicts"] = lines
    if not args.from_raw:
        report["elapsed_s"] = time.monotonic() - started
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    if not args.no_plots and runs:
        plot_timeline(runs, w if args.from_raw else _workload(args), slo, args.out / "timeline.png")
    doc = None if args.no_doc else args.doc
    if doc is not None:
        try:
            rel = os.path.relpath(args.out, doc.parent)
        except ValueError:
            rel = str(args.out)
        update_doc(doc, render_section(report, rows, lines, rel, _existing_notes(doc)))
    print(f"\nwrote {args.out}/results.json" + ("" if doc is None else f" and {doc}")
          + f" in {time.monotonic() - started:.0f} s (best steady goodput {best:.0f} tok/s)")
    return 0 if all(r.consistent for r in rows) else 1


def _workload(args: argparse.Namespace) -> Workload:
    w = Workload(replicas=args.replicas, time_scale=args.time_scale, max_num_seqs=args.max_num_seqs,
                 prompt_mean=args.prompt_mean, output_mean=args.output_mean, seed=args.seed)
    if args.mix is not None:
        w = replace(w, priority_shares=tuple(args.mix))
    return replace(w, phases=tuple(replace(p, duration_s=p.duration_s * args.scale) for p in w.phases))


def _measure(args: argparse.Namespace, slo: Any) -> tuple[dict[str, Any], list[RunOutput], list[Row]]:
    configs: list[BenchConfig] = args.configs or [parse_config(c) for c in default_configs()]
    w = _workload(args)
    progress = not args.quiet and sys.stderr.isatty()

    derived_cap, derived_best, curve = derive_capacity(w, slo.ttft_s, slo.tpot_s)
    capacity = args.capacity or derived_cap
    if args.capacity:
        derived_best = max(float(simulate_pool(w, capacity * f, 60, slo.ttft_s, slo.tpot_s).goodput_tok_s)
                           for f in (0.9, 1.0))
    print(f"capacity {capacity:.1f} req/s (engine model), best steady goodput {derived_best:.0f} tok/s",
          flush=True)
    calibration = None
    best = derived_best
    if not args.no_calibrate:
        calibration = calibrate(w, capacity, slo, timeout_s=args.timeout,
                                step_s=args.calibrate_step * args.scale, progress=progress)
        # The stricter of the two references: a short measured sweep can miss the peak.
        best = max(derived_best, calibration["best_goodput_tok_s"])
        print("calibration: " + ", ".join(f"{s['load']:.2f}x {s['goodput_tok_s']:.0f} tok/s"
                                          for s in calibration["steps"]), flush=True)
    from floodgate.bench.p0_bound import p0_fifo_bound

    bound = p0_fifo_bound(w, capacity, best, slo.ttft_s, slo.tpot_s, target_share=TARGET_GOODPUT_RATIO,
                          duration=max(40.0, 200.0 * args.scale), seeds=BOUND_SEEDS, ns=BOUND_NS,
                          caps=BOUND_CAPS).to_dict()
    print(f"P0 TTFT on FIFO engines (engine model): floor {bound['floor_ratio']:.2f}x unloaded, "
          f"achievable {_num(bound['ratio'], '.2f')}x", flush=True)
    reference = None
    if args.reference_s > 0:
        ref_s = max(REFERENCE_MIN_S, args.reference_s * args.scale)
        reference = measure_reference(w, capacity, ref_s, timeout_s=args.timeout, progress=progress)
        print(f"reference: P0 TTFT p99 {_ms(reference['p0_ttft_p99_s'])} ms over {reference['samples']} "
              f"requests at {reference['load']:.1f}x ({ref_s:.0f} s, Envoy alone)", flush=True)
    plan = build_plan(w, capacity)

    def classes_for(cfg: BenchConfig) -> dict[int, dict[str, Any]] | None:
        """None = the processor's shipped class defaults (the headline)."""
        classes = slo_classes(slo.ttft_s) if (cfg.tuned or args.tuned_classes) else None
        if args.p0_reserve != "when_waiting" or args.p0_share is not None:
            classes = classes or {c: dict(v) for c, v in SHIPPED_CLASSES.items()}
            classes[0]["reserve"] = args.p0_reserve
            if args.p0_share is not None:
                classes[0]["share"] = args.p0_share
        return classes
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[RunOutput] = []
    rows: list[Row] = []
    for cfg in configs:
        t = time.monotonic()
        print(f"[{cfg.name}] {len(plan)} requests over {sum(p.duration_s for p in w.phases):.0f} s ...",
              flush=True)
        out = run_config(cfg, w, plan, timeout_s=args.timeout, progress=progress, classes=classes_for(cfg),
                         probe_rate=args.probe_rate, probe_nice=args.probe_nice)
        runs.append(out)
        row = evaluate(out, w, slo, best, reference)
        rows.append(row)
        write_raw(args.out, out, slo)
        print(f"[{cfg.name}] done in {time.monotonic() - t:.0f} s: admitted {row.admitted}, "
              f"rejected {row.rejected}, errors {row.errors}, burst goodput "
              f"{_num(row.goodput_burst_tok_s)} tok/s", flush=True)
    report = {
        "workload": {**asdict(w), "phases": [asdict(p) for p in w.phases]},
        "slo": asdict(slo),
        "capacity": {"capacity_rps": capacity, "derived_capacity_rps": derived_cap,
                     "derived_best_goodput_tok_s": derived_best, "best_goodput_tok_s": best,
                     "curve": [asdict(c) for c in curve]},
        "calibration": calibration,
        "p0_bound": bound,
        "reference": reference,
        "plan_requests": len(plan),
        "probe": {"rate": args.probe_rate, "nice_change": args.probe_nice, "window_s": list(probe_window(w)),
                  "tenant": "reject-probe",
                  "prompt_tokens": 32, "output_tokens": 2},
        "classes": {"shipped": SHIPPED_CLASSES, "tuned": slo_classes(slo.ttft_s)},
        "adaptive_concurrency_filter": adaptive_concurrency_filter(),
        "floodgate_configs": {c.name: floodgate_config(c, classes_for(c)) for c in configs if c.floodgate},
    }
    return report, runs, rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
