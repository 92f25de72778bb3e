"""Elastic: the whole loop — admission and scaling together — against either one alone.

One invocation replays one seeded open-loop plan (a diurnal ramp, then a burst at 3x the ramp's
top — 6x one replica's capacity — then recovery, then a second, smaller burst that the warm
pool — the replicas drained after the first — can hold) against three configurations, each on fresh processes on this machine:

* `admission`  admission only: Envoy + Floodgate (Vegas) in front of a FIXED pool;
* `scaling`    scaling only: the controller with the process actuator and a warm pool, but no
               admission (a processor that admits everything and only picks endpoints) and an
               HPA-like rule: replicas proportional to running + waiting, ±10 % tolerance,
               scale-down stabilization, no burst triggers, no offered demand, no learning;
* `floodgate`  both: Vegas admission + the controller on its shipped policy (queue and KV
               triggers, offered demand incl. what admission turned away, learned capacity).

Replicas are `floodgate sim` processes with a real cold start (counted from process spawn)
and vLLM sleep mode; the
controller's operational times (cold start, wake, stabilization and panic windows, drain and
anti-churn times) are multiplied by `--ops-scale` (0.1: a 150 s cold start takes 15 s), the
request timings are not scaled.

    floodgate bench elastic                        # full run, ~11 min
    floodgate bench elastic --scale 0.3 --configs floodgate --no-doc   # a quick look

Writes `--out` (default docs/benchmarks/elastic/ in a checkout, runs/bench/elastic/ when
installed): results.json, one `<config>.json.gz` per config (request records and replica
samples) and timeline.png; and, unless --no-doc, the "Elastic" section of `--doc` (default
docs/benchmarks.md in a checkout, none when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import math
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from floodgate.bench.doc_section import default_doc, default_out, kept_notes, replace_section
from floodgate.bench.doc_section import num as _num
from floodgate.bench.doc_section import pct as _pct

SUMMARY = "elastic: admission only vs scaling only vs Floodgate (both) through a diurnal ramp and a 3x burst"

# In a checkout: docs/benchmarks/elastic and docs/benchmarks.md; installed: runs/bench/elastic
# under the working directory and no doc (bench/doc_section.py).
DEFAULT_OUT = default_out("elastic")
DEFAULT_DOC = default_doc()
SECTION_START = "<!-- elastic:begin -->"
SECTION_END = "<!-- elastic:end -->"
CONFIGS = ("admission", "scaling", "floodgate", "floodgate-tuned")
DEFAULT_CONFIGS = ("admission", "scaling", "floodgate")

# Goals from issue 14.
TARGET_P0_SUCCESS = 0.999
TARGET_SLO = 0.99
REJECT_RATE_DONE = 0.01
BIN_S = 2.0
# The controller's tick in this bench (shipped: 1 s; not scaled like the other durations).
TICK_S = 0.5
# The deadlines and the window left out of the SLO count from the burst's start plus at most
# this much detection: a controller that reacts later is not given a later deadline (a review:
# with the measured detection as the allowance, a slower detector scored better).
DETECTION_ALLOWANCE_S = 2 * TICK_S
MODEL = "floodgate-sim-8b"  # the emulator's default model name


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float
    load: float  # multiple of ONE replica's capacity at the start of the phase
    load_end: float | None = None  # ramps linearly (cosine) to this by the end


DEFAULT_PHASES = (
    Phase("warmup", 15, 1.0),
    Phase("ramp", 45, 1.0, 2.0),  # the diurnal ramp: the fixed pool ends at its capacity
    Phase("burst", 40, 6.0),  # 3x the ramp's top
    Phase("recovery", 60, 1.5),  # long enough for the pool to drain back down
    Phase("burst2", 20, 4.0),  # a repeat the drained replicas (now the warm pool) can hold
    Phase("tail", 10, 1.5),
)
BURSTS = ("burst", "burst2")


@dataclass(frozen=True)
class Workload:
    replicas: int = 2  # the fixed pool; the scaling configs start here (min_replicas)
    max_replicas: int = 10
    max_num_seqs: int = 8
    prompt_mean: int = 256
    output_mean: int = 64
    length_sigma: float = 0.5
    priority_shares: tuple[float, float, float] = (0.2, 0.5, 0.3)
    seed: int = 1
    ops_scale: float = 0.1
    cold_start_s: float = 150.0  # before ops_scale
    wake_s: float = 10.0  # vLLM sleep level 1 wake, before ops_scale
    phases: tuple[Phase, ...] = DEFAULT_PHASES
    # The controllers' per-replica capacity prior (policy.target_concurrency); None: shipped.
    target_concurrency: float | None = None
    # The floodgate controller's `capacity.max_factor` (learning above the prior); None: shipped.
    capacity_max_factor: float | None = None

    @property
    def capacity_prior(self) -> float:
        """The prior both controllers size with: `target_concurrency`, else the shipped default."""
        from floodgate.controller.policy import PolicyConfig

        return PolicyConfig().target_concurrency if self.target_concurrency is None else self.target_concurrency

    @property
    def cold_start(self) -> float:
        return self.cold_start_s * self.ops_scale

    @property
    def wake(self) -> float:
        return self.wake_s * self.ops_scale

    def windows(self) -> dict[str, tuple[float, float]]:
        out, t = {}, 0.0
        for p in self.phases:
            out[p.name] = (t, t + p.duration_s)
            t += p.duration_s
        return out

    @property
    def duration(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def overload_workload(self) -> Any:
        from floodgate.bench.overload import Workload as OW

        return OW(replicas=1, max_num_seqs=self.max_num_seqs, prompt_mean=self.prompt_mean,
                  output_mean=self.output_mean, length_sigma=self.length_sigma,
                  priority_shares=self.priority_shares, seed=self.seed)


def segments(w: Workload, per_replica_rps: float, step_s: float = 2.5) -> list[tuple[float, float]]:
    """(duration, rate) segments of the plan; ramps are cosine-shaped steps of `step_s`."""
    out: list[tuple[float, float]] = []
    for p in w.phases:
        if p.load_end is None:
            out.append((p.duration_s, p.load * per_replica_rps))
            continue
        n = max(1, round(p.duration_s / step_s))
        for i in range(n):
            x = (i + 0.5) / n
            f = p.load + (p.load_end - p.load) * (1 - math.cos(math.pi * x)) / 2
            out.append((p.duration_s / n, f * per_replica_rps))
    return out


def build_plan(w: Workload, per_replica_rps: float) -> list[Any]:
    from floodgate.sim.arrivals import step_profile, synthetic_plan

    return list(synthetic_plan(step_profile(segments(w, per_replica_rps)), w.overload_workload().mix(),
                               seed=w.seed))


def offered_rate(w: Workload, per_replica_rps: float, t: float) -> float:
    start = 0.0
    for d, r in segments(w, per_replica_rps):
        if start <= t < start + d:
            return r
        start += d
    return 0.0


# --------------------------------------------------------------------------- configurations


def sim_args(w: Workload) -> list[str]:
    return ["--cold-start", f"{w.cold_start:g}", "--wake-delay-level1", f"{w.wake:g}",
            "--sleep-delay", f"{0.5 * w.ops_scale:g}", "--max-num-seqs", str(w.max_num_seqs),
            "--log-level", "warning"]


def processor_config(name: str, w: Workload, slo_ttft_s: float) -> dict[str, Any]:
    """`admission` and `floodgate` run the processor's shipped defaults (classes derived from
    the SLO by config.ClassConfig); only `floodgate-tuned` sets the overload benchmark's
    hand-tuned classes (P2 never queues)."""
    from floodgate.bench.overload import slo_classes

    pool: dict[str, Any] = {"name": "default"}
    if name == "scaling":
        # No admission: every request is let through at once; the processor only picks endpoints
        # (by the fewest permits routed: prefill pacing would hold lower classes while a P0 runs).
        pool["limit"] = {"mode": "static", "initial": 100000, "min": 1, "max": 100000}
        pool["prefill_tokens_per_s"] = 0
    elif name == "floodgate-tuned":
        pool["classes"] = slo_classes(slo_ttft_s)
    if name != "admission":
        pool["endpoint_picking"] = True
    return {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}}, "pools": [pool]}


def shipped_classes() -> dict[int, dict[str, Any]]:
    """The processor's default classes (what `admission` and `floodgate` run with)."""
    from floodgate.extproc.config import PoolConfig

    return {c: {k: v for k, v in cc.model_dump().items() if k in ("queue_timeout_s", "max_queue", "share")}
            for c, cc in PoolConfig().classes.items()}


def ops_scaled(w: Workload) -> dict[str, Any]:
    """The shipped controller defaults with every operational duration x ops_scale."""
    from floodgate.controller.lifecycle import WarmPoolConfig
    from floodgate.controller.policy import PolicyConfig

    p, wp, s = PolicyConfig(), WarmPoolConfig(), w.ops_scale
    return {
        "policy": {"stabilization_window_s": p.stabilization_window_s * s,
                   "scale_down_interval_s": p.scale_down_interval_s * s,
                   "panic_window_s": p.panic_window_s * s},
        "warm_pool": {"warm_min_age_s": wp.warm_min_age_s * s, "burst_window_s": wp.burst_window_s * s,
                      "burst_memory_s": wp.burst_memory_s * s, "max_drain_s": wp.max_drain_s * s},
    }


def controller_config(name: str, w: Workload, redis_url: str, envoy_admin: str, metrics_port: int,
                      state_dir: Path) -> dict[str, Any]:
    from floodgate.controller.actuators.process import sim_command

    scaled = ops_scaled(w)
    policy: dict[str, Any] = {**scaled["policy"], "min_replicas": w.replicas, "max_replicas": w.max_replicas}
    if w.target_concurrency is not None:
        policy["target_concurrency"] = w.target_concurrency
    pool: dict[str, Any] = {
        "name": "default",
        "policy": policy,
        "warm_pool": scaled["warm_pool"],
        "timeouts": {"health_s": 10 * w.cold_start + 30, "wake_s": 30, "warmup_s": 30},
        "actuator": {"kind": "process", "command": sim_command(*sim_args(w)), "state_dir": str(state_dir)},
    }
    if w.capacity_max_factor is not None:
        pool["capacity"] = {"max_factor": w.capacity_max_factor}
    if name == "scaling":
        # HPA-like: proportional on running + waiting, no burst triggers.
        policy.update({"queue_pressure_per_replica": 1e9, "kv_pressure_threshold": 1.0,
                       "panic_threshold": 1e9, "wave_backlog_once": False})
        pool.update(_optional_off())
    return {
        "redis": {"url": redis_url},
        "envoy": {"admin_url": envoy_admin},
        "tick_interval_s": TICK_S,
        "metrics_listen": f"127.0.0.1:{metrics_port}",
        "leader": {"enabled": False},
        "pools": [pool],
    }


def _optional_off() -> dict[str, Any]:
    """Offered demand, learned capacity and the admission ceiling off, where this controller
    has them."""
    from floodgate.controller.config import PoolConfig

    fields = PoolConfig.model_fields
    return {k: {"enabled": False} for k in ("demand", "capacity", "admission_ceiling") if k in fields}


# --------------------------------------------------------------------------- running


@dataclass
class ReplicaSample:
    t: float
    states: dict[str, float]
    desired: float | None = None
    # The processor's view at the same moment: its shared concurrency limit and the pool's
    # in-flight and queued requests (all classes), as its gauges last saw them.
    limit: float | None = None
    inflight: float | None = None
    queued: float | None = None


@dataclass
class RunOutput:
    name: str
    result: Any  # sim.loadgen.LoadResult
    replicas: list[ReplicaSample] = field(default_factory=list)
    controller_log: list[dict[str, Any]] = field(default_factory=list)
    startup_s: float = 0.0


def _get(url: str, timeout: float = 1.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def read_replica_states(metrics_url: str) -> tuple[dict[str, float], float | None]:
    from prometheus_client.parser import text_string_to_metric_families

    states: dict[str, float] = {}
    desired = None
    for fam in text_string_to_metric_families(_get(metrics_url)):
        for s in fam.samples:
            if s.name == "floodgate_replicas":
                states[s.labels["state"]] = states.get(s.labels["state"], 0.0) + s.value
            elif s.name == "floodgate_desired_replicas":
                desired = s.value
    return states, desired


def read_processor(metrics_url: str) -> tuple[float | None, float, float]:
    """(limit, in-flight, queued) from the processor's gauges."""
    from prometheus_client.parser import text_string_to_metric_families

    limit, inflight, queued = None, 0.0, 0.0
    for fam in text_string_to_metric_families(_get(metrics_url)):
        for s in fam.samples:
            if s.name == "floodgate_limit":
                limit = s.value
            elif s.name == "floodgate_inflight":
                inflight += s.value
            elif s.name == "floodgate_queue_depth":
                queued += s.value
    return limit, inflight, queued


async def sample_replicas(metrics_url: str, t0: float, stop: asyncio.Event, out: list[ReplicaSample],
                          interval: float = 0.5, processor_url: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            states, desired = await asyncio.to_thread(read_replica_states, metrics_url)
            sample = ReplicaSample(loop.time() - t0, states, desired)
            if processor_url is not None:
                sample.limit, sample.inflight, sample.queued = await asyncio.to_thread(read_processor, processor_url)
            out.append(sample)
        except OSError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


def wait_pool_ready(metrics_url: str, active: int, timeout: float) -> float:
    """Wait until the controller reports `active` active replicas and its warm pool filled."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            states, _ = read_replica_states(metrics_url)
            pooled = states.get("warm", 0.0)
            starting = sum(states.get(k, 0.0) for k in ("cold", "loading", "warming", "waking"))
            if states.get("active", 0.0) >= active and pooled >= 1 and starting == 0:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"pool not ready after {timeout:.0f} s")


def run_config(name: str, w: Workload, plan: Sequence[Any], slo: Any, *, timeout_s: float,
               progress: bool) -> RunOutput:
    from floodgate.sim.loadgen import run_load_detailed

    from floodgate.stack import LocalStack
    from floodgate.supervisor import Supervisor, free_port

    with Supervisor() as sup:
        stack = LocalStack(sup)
        redis_url = stack.start_redis()
        proc = stack.start_processor(processor_config(name, w, slo.ttft_s))
        ctl_metrics = None
        t_start = time.monotonic()
        if name == "admission":
            upstreams = []
            for i in range(w.replicas):
                port = free_port()
                stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port),
                                      *sim_args(replace(w, cold_start_s=0))], name=f"sim{i}", port=port)
                upstreams.append(("127.0.0.1", port))
            _wait_all_healthy([p for _, p in upstreams])
            envoy = stack.start_envoy(upstreams, processors=[proc])
        else:
            envoy = stack.start_envoy([("127.0.0.1", 1)], processors=[proc], picking=True)
            mport = free_port()
            cfg = controller_config(name, w, redis_url, f"http://127.0.0.1:{envoy.admin_port}", mport,
                                    sup.workdir / "replicas")
            path = sup.workdir / "controller.yaml"
            import yaml

            path.write_text(yaml.safe_dump(cfg))
            sup.start_python("controller", ["-m", "floodgate", "controller", "--config", str(path),
                                            "--log-level", "info", "--stop-replicas-on-exit"])
            ctl_metrics = f"http://127.0.0.1:{mport}/metrics"
            wait_pool_ready(ctl_metrics, w.replicas, timeout=3 * w.cold_start + 60)
        startup = time.monotonic() - t_start
        samples: list[ReplicaSample] = []

        async def go() -> Any:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            t0 = loop.time() + 0.05  # run_load_detailed's own t0 is within a few ms of this
            task = asyncio.create_task(sample_replicas(
                ctl_metrics, t0, stop, samples, processor_url=f"http://127.0.0.1:{proc.metrics_port}/metrics",
            )) if ctl_metrics else None
            try:
                return await run_load_detailed(plan, envoy.url, model=MODEL, request_timeout=timeout_s,
                                               progress=progress)
            finally:
                stop.set()
                if task is not None:
                    await task

        result = asyncio.run(go())
        log: list[dict[str, Any]] = []
        pids = _replica_pids(sup.workdir / "replicas")
        for c in sup.children:
            if c.name == "controller":
                c.stop()
                log = _decisions(c.log_path)
            elif not c.alive():
                raise RuntimeError(f"{c.name} died during the {name} run:\n{c.log_tail()}")
        _kill_leftovers(sup.workdir / "replicas")
    result.meta["config"] = name
    result.meta["replica_pids"] = pids  # running at the end; stopped with the controller
    result.meta["loadavg_1m"] = os.getloadavg()[0]  # the box is shared: how busy it was
    return RunOutput(name, result, samples, log, startup)


def _replica_pids(state_dir: Path) -> list[int]:
    from floodgate.controller.actuators.process import read_table

    return [int(e["pid"]) for e in read_table(state_dir)[1].values() if isinstance(e.get("pid"), int)]


def _wait_all_healthy(ports: Sequence[int], timeout: float = 30.0) -> None:
    from floodgate.supervisor import wait_healthy

    for p in ports:
        wait_healthy(f"http://127.0.0.1:{p}/health", timeout, interval=0.05)


# The controller's events the raw data keeps: its decisions and promotions (what the verdicts
# read), and what it told the processors (the admission ceiling, the capacity on its way).
KEPT_EVENTS = ("decision", "promoted", "ceiling", "arriving")


def _decisions(path: Path) -> list[dict[str, Any]]:  # KEPT_EVENTS, in order
    out = []
    try:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                if d.get("event") in KEPT_EVENTS:
                    out.append(d)
    except OSError:
        pass
    return out


def _kill_leftovers(state_dir: Path) -> None:
    """Replicas the controller started run in their own process groups: make sure none
    outlives the run (the controller stops them on exit; this is the safety net)."""
    import signal

    from floodgate.controller.actuators.process import live_entries, read_table

    for pid in live_entries(read_table(state_dir)[1]).values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


# --------------------------------------------------------------------------- evaluation


@dataclass
class BurstResult:
    """One burst of the plan, as this configuration got through it (times from its start)."""

    name: str
    start: float
    load: float
    detection_s: float | None  # burst start -> the controller's first scale-up decision
    reject_stop_s: float | None  # burst start -> rejection rate < 1 % for good (until the next burst)
    slo_recover_s: float | None  # burst start -> SLO attainment >= 99 % for good (until the next burst)
    active_at_start: float | None  # replicas at the burst's start (samples)
    pooled_at_start: float | None
    slo: float | None  # SLO attainment of the burst's arrivals
    # The burst fits the pool when active + pooled replicas at its start cover its load.
    fits_pool: bool | None = None
    slo_settle_s: float | None = None  # as slo_recover_s, not rounded to a bin (`slo_settle`)


@dataclass
class Row:
    config: str
    offered: int
    admitted: int
    rejected: int
    errors: int
    consistent: bool
    p0_success: float | None
    success_by_class: dict[str, float | None]
    slo_by_class: dict[str, float | None]
    slo_overall: float | None
    # Outside the first cold start: leaves out arrivals in [burst start, burst start +
    # detection + cold start) of the first burst, detection measured from the decision log.
    slo_outside_cold_start: float | None
    goodput_by_class: dict[str, float | None]
    goodput_burst_tok_s: float | None
    reject_stop_s: float | None  # first burst: start -> rejection rate < 1 % for good
    slo_recover_s: float | None  # first burst: start -> SLO attainment >= 99 % for good
    active_replica_s: float
    pooled_replica_s: float
    starting_replica_s: float
    peak_active: float
    rejected_by_reason: dict[str, int]
    errors_by_kind: dict[str, int]
    send_lag_p99_s: float | None
    loadavg_1m: float | None = None
    # The first cold start as it really took: burst start -> the first replica cold-started
    # after it is active (decision log), and SLO attainment outside that window (cross-check).
    measured_cold_start_s: float | None = None
    slo_outside_measured_cold_start: float | None = None
    detection_s: float | None = None  # first burst: start -> first scale-up decision
    cold_window_s: float | None = None  # detection (at most DETECTION_ALLOWANCE_S) + the configured cold start
    met_slo: int = 0  # requests that met the SLO (cost per request served in time)
    bursts: list[BurstResult] = field(default_factory=list)


def first_cold_start(log: Sequence[dict[str, Any]], t0_unix: float, after: float) -> float | None:
    """Seconds (run clock) at which the first replica cold-started after `after` became active."""
    rid = None
    for e in log:
        t = e.get("ts", 0.0) - t0_unix
        if rid is None and e.get("event") == "decision" and t >= after:
            starts = [a.split(":")[1] for a in e.get("actions") or [] if a.startswith("start:")]
            rid = starts[0] if starts else None
        elif rid is not None and e.get("event") == "promoted" and e.get("replica") == rid:
            return t
    return None


def first_scale_up(log: Sequence[dict[str, Any]], t0_unix: float, after: float, before: float) -> float | None:
    """Seconds (run clock) of the first decision in [after, before) that raised the desired count."""
    for e in log:
        t = e.get("ts", 0.0) - t0_unix
        if e.get("event") == "decision" and after <= t < before and e.get("desired", 0) > e.get("previous", 0):
            return t
    return None


def _bins(records: Sequence[Any], slo: Any, t_end: float) -> list[dict[str, float]]:
    from floodgate.sim.loadgen import OK, REJECTED

    n = math.ceil(t_end / BIN_S)
    bins = [{"t": i * BIN_S, "offered": 0.0, "admitted": 0.0, "rejected": 0.0, "met": 0.0} for i in range(n)]
    for r in records:
        i = min(n - 1, int(r.t_planned // BIN_S))
        b = bins[i]
        b["offered"] += 1
        if r.outcome == OK:
            b["admitted"] += 1
        elif r.outcome == REJECTED:
            b["rejected"] += 1
        if slo.met(r):
            b["met"] += 1
    return bins


def settle_time(bins: Sequence[dict[str, float]], start: float, end: float, bad: Any) -> float | None:
    """Seconds from `start` until `bad(bin)` is false for every bin up to `end` (0: never bad);
    None when the last bin before `end` is still bad."""
    inside = [b for b in bins if start <= b["t"] < end]
    last_bad = None
    for b in inside:
        if b["offered"] > 0 and bad(b):
            last_bad = b
    if last_bad is None:
        return 0.0
    if last_bad is inside[-1]:
        return None
    return last_bad["t"] + BIN_S - start


def rejection_settle(records: Sequence[Any], start: float, end: float, window: float = BIN_S,
                     rate: float = REJECT_RATE_DONE) -> float | None:
    """Seconds from `start` until the rejection rate stays below `rate` for good (up to `end`),
    not rounded to a bin edge: the last rejection in [start, end) at which the arrivals of the
    trailing `window` seconds (its own included) were rejected at `rate` or more. 0 when there is
    none; None when it falls in the last `window` before `end` (the rate never shown to fall).
    Fixed bins (`settle_time`) round a settle time up to the next bin edge, so a verdict read
    from them is off by up to a bin either way; this is the moment itself."""
    from floodgate.sim.loadgen import REJECTED

    return miss_settle(records, start, end, lambda r: r.outcome == REJECTED, window, rate)


def slo_settle(records: Sequence[Any], start: float, end: float, slo: Any, window: float = BIN_S) -> float | None:
    """As `rejection_settle`, for SLO attainment (a 429 a miss): seconds from `start` until the
    arrivals of every trailing `window` meet the SLO at `TARGET_SLO` or more, up to `end`. A pool
    that queues a burst instead of turning it away is not done when its rejections stop (a review:
    scaling only read 0.0 s on rejections while its SLO took 18 s to recover)."""
    return miss_settle(records, start, end, lambda r: not slo.met(r), window, 1 - TARGET_SLO, strict=True)


def miss_settle(records: Sequence[Any], start: float, end: float, missed: Any, window: float, rate: float,
                strict: bool = False) -> float | None:
    """Seconds from `start` until the share of `missed` arrivals over every trailing `window`
    stays below `rate` (`strict`: at or below) for good, up to `end` (see `rejection_settle`)."""
    recs = sorted((r for r in records if start - window < r.t_planned < end), key=lambda r: r.t_planned)
    times = [r.t_planned for r in recs]
    bad = [missed(r) for r in recs]
    counted = [0]
    for b in bad:
        counted.append(counted[-1] + b)
    last_bad = None
    lo = 0
    for i, r in enumerate(recs):
        if not bad[i] or r.t_planned < start:
            continue
        while times[lo] <= r.t_planned - window:
            lo += 1
        n, k = i + 1 - lo, counted[i + 1] - counted[lo]
        if (k > rate * n) if strict else (k >= rate * n):
            last_bad = r.t_planned
    if last_bad is None:
        return 0.0
    if last_bad >= end - window:
        return None
    return last_bad - start


def replica_seconds(samples: Sequence[ReplicaSample], t_end: float) -> tuple[float, float, float, float]:
    """(active, pooled, starting, peak active) replica-seconds over [0, t_end] from samples
    (each sample holds until the next)."""
    act = pooled = starting = peak = 0.0
    for i, s in enumerate(samples):
        if s.t > t_end:
            break
        nxt = samples[i + 1].t if i + 1 < len(samples) else t_end
        dt = max(0.0, min(nxt, t_end) - max(s.t, 0.0))
        a = s.states.get("active", 0.0) + s.states.get("draining", 0.0) + s.states.get("waking", 0.0)
        act += a * dt
        pooled += s.states.get("warm", 0.0) * dt
        # (a failed replica holds its GPU until it is stopped: counted with the starts)
        starting += sum(s.states.get(k, 0.0) for k in ("cold", "loading", "warming", "failed")) * dt
        peak = max(peak, s.states.get("active", 0.0))
    return act, pooled, starting, peak


def pool_at(samples: Sequence[ReplicaSample], t: float) -> tuple[float | None, float | None]:
    """(active, pooled) replicas in the last sample at or before `t`."""
    last = None
    for s in samples:
        if s.t > t:
            break
        last = s
    if last is None:
        return None, None
    return last.states.get("active", 0.0), last.states.get("warm", 0.0)


def allowed_detection(detection_s: float | None) -> float:
    """What a deadline counts for the controller's detection of a burst: the measured one, at
    most `DETECTION_ALLOWANCE_S` (a later one is the controller's delay, not the bound's)."""
    return DETECTION_ALLOWANCE_S if detection_s is None else min(detection_s, DETECTION_ALLOWANCE_S)


def evaluate(out: RunOutput, w: Workload, slo: Any) -> Row:
    from floodgate.sim.report import produced_goodput, summarize

    recs = out.result.records
    t_end = w.duration
    t0_unix = out.result.meta.get("unix_time_at_t0", 0.0)
    whole = summarize(recs, slo, window=(0.0, t_end))
    whole.check()
    windows = w.windows()
    loads = {p.name: p.load for p in w.phases}
    names_b = [n for n in BURSTS if n in windows]
    bins = _bins(recs, slo, t_end)
    bursts: list[BurstResult] = []
    for i, bn in enumerate(names_b):
        a, b = windows[bn]
        nxt = windows[names_b[i + 1]][0] if i + 1 < len(names_b) else t_end
        det = None
        if out.name != "admission":
            d = first_scale_up(out.controller_log, t0_unix, a, b)
            det = None if d is None else d - a
        act, pooled = pool_at(out.replicas, a) if out.name != "admission" else (float(w.replicas), 0.0)
        fits = None if act is None else (act + (pooled or 0.0)) >= math.ceil(loads[bn] - 1e-9)
        bursts.append(BurstResult(
            name=bn, start=a, load=loads[bn], detection_s=det,
            reject_stop_s=rejection_settle(recs, a, nxt),
            slo_recover_s=settle_time(bins, a, nxt, lambda x: x["met"] / x["offered"] < TARGET_SLO),
            slo_settle_s=slo_settle(recs, a, nxt, slo),
            active_at_start=act, pooled_at_start=pooled,
            slo=summarize(recs, slo, window=(a, b)).overall.slo_attainment, fits_pool=fits))
    first = bursts[0]
    burst_a, burst_b = windows["burst"]
    cold_window = allowed_detection(first.detection_s) + w.cold_start
    outside = [r for r in recs if not (burst_a <= r.t_planned < burst_a + cold_window)]
    out_s = summarize(outside, slo, window=(0.0, t_end))
    measured = first_cold_start(out.controller_log, t0_unix, burst_a)
    slo_measured = None
    if measured is not None:
        keep = [r for r in recs if not (burst_a <= r.t_planned < measured)]
        slo_measured = summarize(keep, slo, window=(0.0, t_end)).overall.slo_attainment
    if out.name == "admission":
        act, pooled, starting, peak = w.replicas * t_end, 0.0, 0.0, float(w.replicas)
    else:
        act, pooled, starting, peak = replica_seconds(out.replicas, t_end)
    o = whole.overall
    names = {k: f"P{k}" for k in whole.per_priority}
    return Row(
        config=out.name, offered=o.offered, admitted=o.admitted, rejected=o.rejected, errors=o.errors,
        consistent=o.offered == o.admitted + o.rejected + o.errors,
        p0_success=whole.per_priority[0].success_rate,
        success_by_class={names[k]: v.success_rate for k, v in whole.per_priority.items()},
        slo_by_class={names[k]: v.slo_attainment for k, v in whole.per_priority.items()},
        slo_overall=o.slo_attainment, slo_outside_cold_start=out_s.overall.slo_attainment,
        goodput_by_class={names[k]: v.goodput_tok_s for k, v in whole.per_priority.items()},
        goodput_burst_tok_s=produced_goodput(recs, slo, burst_a, burst_b),
        reject_stop_s=first.reject_stop_s, slo_recover_s=first.slo_recover_s,
        active_replica_s=act, pooled_replica_s=pooled, starting_replica_s=starting, peak_active=peak,
        rejected_by_reason=o.rejected_by_reason, errors_by_kind=o.errors_by_kind,
        send_lag_p99_s=out.result.meta.get("send_lag_p99_s"),
        loadavg_1m=out.result.meta.get("loadavg_1m"),
        measured_cold_start_s=None if measured is None else measured - burst_a,
        slo_outside_measured_cold_start=slo_measured,
        detection_s=first.detection_s, cold_window_s=None if out.name == "admission" else cold_window,
        met_slo=sum(1 for r in recs if slo.met(r)), bursts=bursts,
    )


def _capped(detection_s: float | None) -> str:
    """How the verdicts say a detection was capped at `DETECTION_ALLOWANCE_S`."""
    if detection_s is None:
        return " (the controller made no scale-up decision: counted as the allowance)"
    if detection_s <= DETECTION_ALLOWANCE_S:
        return ""
    return f" (measured {detection_s:.1f} s, counted at most {DETECTION_ALLOWANCE_S:g})"


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.0f} s"


def _secs1(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} s"


def _secs1n(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


def render_table(rows: Sequence[Row]) -> str:
    head = ("| config | offered | ok / 429 / err | P0 success | SLO P0 / P1 / P2 "
            "| SLO all (outside 1st cold start) | burst goodput tok/s "
            "| detection | 429 < 1 % after | SLO ≥ 99 % after "
            "| burst 2: active + pool at start, detection, 429 < 1 % after, SLO "
            "| replica-s active / pooled / starting | peak active |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        s = r.slo_by_class
        b2 = r.bursts[1] if len(r.bursts) > 1 else None
        b2s = "–" if b2 is None else (
            f"{_num(b2.active_at_start)} + {_num(b2.pooled_at_start)}, {_secs1(b2.detection_s)}, "
            f"{_secs1n(b2.reject_stop_s)}, {_pct(b2.slo)}")
        win = "" if r.cold_window_s is None else f", {r.cold_window_s:.1f} s"
        lines.append(
            f"| {r.config} | {r.offered} | {r.admitted} / {r.rejected} / {r.errors} | {_pct(r.p0_success, 2)} "
            f"| {_pct(s.get('P0'))} / {_pct(s.get('P1'))} / {_pct(s.get('P2'))} "
            f"| {_pct(r.slo_overall)} ({_pct(r.slo_outside_cold_start)}{win}) | {_num(r.goodput_burst_tok_s)} "
            f"| {_secs1(r.detection_s)} | {_secs1n(r.reject_stop_s)} | {_secs(r.slo_recover_s)} | {b2s} "
            f"| {r.active_replica_s:.0f} / {r.pooled_replica_s:.0f} / {r.starting_replica_s:.0f} | {r.peak_active:.0f} |")
    return head + "\n".join(lines) + "\n"


def verdicts(rows: Sequence[Row], w: Workload) -> list[str]:
    """The issue's goals, for the Floodgate row (shipped defaults)."""
    by = {r.config: r for r in rows}
    out: list[str] = []

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    sc = by.get("scaling")
    fg = by.get("floodgate")
    if fg is None:
        return out
    name = fg.config
    det = allowed_detection(fg.detection_s)
    out += [f"{name}: P0 success ≥ 99.9 %: {mark((fg.p0_success or 0) >= TARGET_P0_SUCCESS)} "
            f"({_pct(fg.p0_success, 2)})",
            f"{name}: SLO attainment ≥ 99 % outside the first cold start (burst start + detection "
            f"{det:.1f} s{_capped(fg.detection_s)} + cold start {w.cold_start:.0f} s = {det + w.cold_start:.1f} s): "
            f"{mark((fg.slo_outside_cold_start or 0) >= TARGET_SLO)} ({_pct(fg.slo_outside_cold_start, 2)}; "
            f"outside the measured one, {_num(fg.measured_cold_start_s, '.1f')} s: "
            f"{_pct(fg.slo_outside_measured_cold_start, 2)})"]
    for i, b in enumerate(fg.bursts):
        d = allowed_detection(b.detection_s)
        capped = _capped(b.detection_s)
        measured = ""
        if b.fits_pool:
            bound, what = d + w.wake, f"one warm promotion (detection {d:.1f} s{capped} + wake {w.wake:g} s)"
        else:
            bound, what = d + w.cold_start, f"one cold start (detection {d:.1f} s{capped} + {w.cold_start:g} s)"
            # The configured cold start counts from process spawn to loaded; a replica serves
            # only after its warm-up request and promotion (docs/controller.md, lifecycle),
            # which the measured one (burst start -> the first replica cold-started after it is
            # active, detection included) counts too. Against the configured one the verdict
            # turns on which side of a 2 s bin edge those few hundred ms fall.
            if i == 0 and fg.measured_cold_start_s is not None:
                mb = fg.measured_cold_start_s
                measured = (f"; within the measured cold start ({mb:.1f} s incl. detection): "
                            f"{mark(b.reject_stop_s is not None and b.reject_stop_s <= mb)}")
        out.append(f"{name}: {b.name} ({b.load:g}×, pool {'holds' if b.fits_pool else 'does not hold'} it: "
                   f"{_num(b.active_at_start)} active + {_num(b.pooled_at_start)} pooled): rejections below 1 % "
                   f"within {what} = {bound:.1f} s: "
                   f"{mark(b.reject_stop_s is not None and b.reject_stop_s <= bound)} "
                   f"({_secs1(b.reject_stop_s)}{measured}); SLO ≥ 99 % (a 429 a miss) within it too: "
                   f"{mark(b.slo_settle_s is not None and b.slo_settle_s <= bound)} ({_secs1n(b.slo_settle_s)})")
    if sc is not None:
        cost_fg = fg.active_replica_s + fg.pooled_replica_s + fg.starting_replica_s
        cost_sc = sc.active_replica_s + sc.pooled_replica_s + sc.starting_replica_s
        out.append(f"{name}: cost no higher than scaling only: {mark(cost_fg <= cost_sc * 1.0001)} "
                   f"({cost_fg:.0f} vs {cost_sc:.0f} replica-s, {cost_fg / max(cost_sc, 1e-9):.3f}x; per request "
                   f"that met the SLO {cost_fg / max(fg.met_slo, 1):.3f} vs {cost_sc / max(sc.met_slo, 1):.3f} "
                   f"replica-s)")
    return out


# --------------------------------------------------------------------------- plot


def plot_timeline(runs: Sequence[RunOutput], w: Workload, per_replica_rps: float, slo: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.0 * len(runs)), sharex=True, squeeze=False)
    for ax, out in zip(axes[:, 0], runs, strict=True):
        bins = _bins(out.result.records, slo, w.duration)
        t = [b["t"] + BIN_S / 2 for b in bins]
        ax.plot(t, [b["offered"] / BIN_S for b in bins], color="0.5", label="offered req/s")
        ax.plot(t, [b["admitted"] / BIN_S for b in bins], color="tab:blue", label="served req/s")
        ax.plot(t, [b["met"] / BIN_S for b in bins], color="tab:green", lw=0.8, label="met SLO req/s")
        if out.name == "admission":
            ax.axhline(w.replicas * per_replica_rps, color="tab:red", ls="--", label="capacity (active × per-replica)")
        else:
            st = [s.t for s in out.replicas]
            ax.step(st, [s.states.get("active", 0.0) * per_replica_rps for s in out.replicas], where="post",
                    color="tab:red", ls="--", label="capacity (active × per-replica)")
            ax.step(st, [s.states.get("warm", 0.0) * per_replica_rps for s in out.replicas], where="post",
                    color="tab:orange", lw=0.8, label="warm pool × per-replica")
        lim = [(x.t, x.limit) for x in out.replicas if x.limit is not None]
        if lim and out.name != "scaling":  # scaling's processor holds a static 100000
            ax2 = ax.twinx()
            ax2.step([t for t, _ in lim], [v for _, v in lim], where="post", color="tab:purple", lw=0.8)
            ax2.set_ylabel("processor limit (concurrency)", color="tab:purple", fontsize=7)
        for name, (a, b) in w.windows().items():
            if name in BURSTS:
                ax.axvspan(a, b, color="0.9", zorder=0)
        ax.set_title(out.name)
        ax.set_ylabel("req/s")
        ax.legend(loc="upper left", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("seconds (bursts shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- doc


def render_section(report: dict[str, Any], rows: Sequence[Row], verdict_lines: Sequence[str], rel_out: str,
                   notes: str) -> str:
    w = report["workload"]
    phases = ", ".join(
        f"{p['name']} {p['duration_s']:.0f} s at {p['load']:g}"
        + (f"→{p['load_end']:g}" if p.get("load_end") is not None else "") + "×" for p in w["phases"])
    return f"""{SECTION_START}
## Elastic

`floodgate bench elastic` (bench/elastic.py) runs the whole loop on this machine — Envoy, the
processor, Redis, the controller with the process actuator, and `floodgate sim` replicas with a
real (scaled) cold start, counted from process spawn, and a warm pool — and replays one seeded
open-loop plan against each configuration below, each on fresh processes. Raw data in
`{rel_out}/`.
Reproduce: `{report['command']}` ({report['elapsed_s'] / 60:.0f} min here).

**Configurations.** *admission*: Floodgate (Vegas, shipped limiter defaults) in front of a
fixed pool of {w['replicas']}. *scaling*: the controller and warm pool, no admission (the
processor admits everything and only picks endpoints, by the fewest permits routed: no prefill pacing), HPA-like rule (replicas ∝ running +
waiting, ±10 %, stabilized scale-down, no queue/KV triggers, the whole backlog counted every
tick (`wave_backlog_once: false`), no offered demand, no learned
capacity). *floodgate*: both, on the controller's shipped policy and the processor's shipped
defaults (limiter and classes; nothing is tuned here). *floodgate-tuned* (only when asked
for with `--configs`): the overload benchmark's hand-tuned classes. The controller ticks every 0.5 s (shipped:
1 s; not scaled like the durations below, so in the scaled time it looks every 5 s). Controller durations
(stabilization, panic, scale-down interval, warm-pool ages, drains) and the replicas' cold start
({w['cold_start_s']:.0f} s) and wake ({w['wake_s']:.0f} s) are × {w['ops_scale']} (so
{w['cold_start_s'] * w['ops_scale']:.0f} s and {w['wake_s'] * w['ops_scale']:.0f} s); request
timings are not scaled. Pools start at {w['replicas']} active + the warm pool; max
{w['max_replicas']}; the controllers' capacity prior (`policy.target_concurrency`) {report.get('capacity_prior', Workload().capacity_prior):g} per
replica of {w['max_num_seqs']} slots. Classes (shipped, `config.ClassConfig` derived from the TTFT SLO): `{json.dumps(report['classes'])}`.

**Plan.** Loads are multiples of one replica's capacity, **{report['per_replica_rps']:.2f} req/s**
(highest rate with ≥ 99 % SLO attainment on the engine model, `--max-num-seqs {w['max_num_seqs']}`,
prompts mean {w['prompt_mean']}, outputs mean {w['output_mean']} tokens): {phases}
(seed {w['seed']}, {report['plan_requests']} requests, priorities {w['priority_shares']}).
The second burst comes after the pool has drained back down: the replicas drained after the
first burst are its warm pool.
SLO: TTFT ≤ {report['slo']['ttft_s']} s and TPOT ≤ {report['slo']['tpot_s']} s, client-measured.

{render_table(rows)}
Columns: SLO = share of *offered* requests that succeeded within the SLO (a 429 is a miss);
detection = the first burst's start → the controller's first scale-up decision (decision
log); "outside 1st cold start" leaves out arrivals from the first burst's start for
detection (at most {DETECTION_ALLOWANCE_S:g} s: two controller ticks) + the configured cold start ({w['cold_start_s'] * w['ops_scale']:.0f} s; the window's length after the comma);
burst goodput = output tokens/s produced during the first burst by requests that met the SLO; "429 < 1 % after"
= seconds from the burst's start to its last rejection (up to the next burst) at which the
arrivals of the {BIN_S:.0f} s before it were rejected at 1 % or more (the verdicts below compare
this moment with their bounds, unrounded; never: it falls in the last {BIN_S:.0f} s before the next
burst); "SLO ≥ 99 % after" = seconds from the burst's start until every later {BIN_S:.0f} s bin up
to the next burst is at or above 99 % SLO (never: the last bin is still bad);
burst 2: active and pooled replicas at its start, detection, rejection settle time and its
SLO attainment; replica-seconds over the plan: active (incl. waking and draining), pooled
(warm or asleep), starting (cold starts, and failed replicas until stopped). offered = ok + 429 + errors holds for every row
(checked).
The box (2 cores) is shared: 1-minute load average at the end of each run
{', '.join(f"{r.config} {_num(r.loadavg_1m, '.1f')}" for r in rows)}; client send lag p99
{', '.join(f"{r.config} {_num(r.send_lag_p99_s, '.2f')} s" for r in rows)}.

![timeline]({rel_out}/timeline.png)

### Verdict (Floodgate, shipped defaults; controller tick 0.5 s, see Configurations)

A burst "fits the pool" when active + pooled replicas at its start cover its load (loads are
multiples of one replica's capacity); then the deadline is one warm promotion, else one cold
start, both counted from the burst's start plus the controller's detection, **at most
{DETECTION_ALLOWANCE_S:g} s** (two ticks: a controller that detects later is not given a later
deadline). Each burst's deadline is checked twice: rejections below 1 %, and SLO attainment
(a 429 a miss) back at 99 % over every trailing {BIN_S:.0f} s, unrounded: a pool that queues a
burst instead of turning it away is not done when its rejections stop. These are the goal's pass
deadlines, not bounds a policy cannot beat: a pool that holds the burst can stop sooner (burst 2's
0.0 s). The cost line also gives replica-seconds per request that met the SLO.

{chr(10).join('- ' + v for v in verdict_lines)}

{notes}
{SECTION_END}
"""


DEFAULT_NOTES = "<!-- elastic-notes:begin -->\n<!-- elastic-notes:end -->"


def _existing_notes(doc: Path) -> str:
    return kept_notes(doc, "<!-- elastic-notes:begin -->", "<!-- elastic-notes:end -->", DEFAULT_NOTES)


def update_doc(doc: Path, section: str) -> None:
    replace_section(doc, SECTION_START, SECTION_END, section)


# --------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(DEFAULT_CONFIGS), metavar="CONFIG",
                   help=f"configurations to run, of {', '.join(CONFIGS)} (default: {' '.join(DEFAULT_CONFIGS)}); "
                        "floodgate-tuned: floodgate with the overload benchmark's hand-tuned classes instead "
                        "of the shipped ones")
    p.add_argument("--replicas", type=int, default=2,
                   help="fixed pool size (admission) / the controller's min replicas (default 2)")
    p.add_argument("--max-replicas", type=int, default=10, help="the controller's max replicas (default 10)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="emulator --max-num-seqs per replica (default 8)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase duration (default 1)")
    p.add_argument("--ops-scale", type=float, default=0.1,
                   help="multiply cold start, wake and the controller's windows (default 0.1: 10x faster)")
    p.add_argument("--cold-start", type=float, default=150.0,
                   help="replica cold start before --ops-scale, s (default 150)")
    p.add_argument("--target-concurrency", type=float, default=None, metavar="N",
                   help="the controllers' per-replica capacity prior, policy.target_concurrency, in every "
                        "configuration (default: shipped, 7: 7/8 of the default 8 slots; with bigger "
                        "replicas set it as a user would, or see how the shipped prior does)")
    p.add_argument("--capacity-max-factor", type=float, default=None, metavar="X",
                   help="the floodgate controller's capacity.max_factor: learned capacity may rise to X x the "
                        "prior (default: shipped, 1: learning only lowers it)")
    p.add_argument("--per-replica-rps", type=float, default=None,
                   help="one replica's capacity (default: derived from the engine model)")
    p.add_argument("--seed", type=int, default=1, help="seed of the request plan (default 1)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, s (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="goodput SLO on TPOT, s (default 0.1)")
    p.add_argument("--timeout", type=float, default=30.0, help="client timeout per request, s (default 30)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for results.json, the raw runs and timeline.png (default {DEFAULT_OUT})")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, metavar="FILE",
                   help="markdown file whose Elastic section is rewritten (default "
                        f"{DEFAULT_DOC or 'none: installed, not in a checkout'})")
    p.add_argument("--no-doc", action="store_true", help="do not update --doc")
    p.add_argument("--no-plots", action="store_true", help="skip timeline.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--from-raw", action="store_true",
                   help="run nothing: re-evaluate the raw data already in --out with the workload and SLO "
                        "its results.json recorded (a workload flag that disagrees with it is refused) "
                        "and rewrite results.json, the plot and the doc section")


def _workload(args: argparse.Namespace) -> Workload:
    w = Workload(replicas=args.replicas, max_replicas=args.max_replicas, max_num_seqs=args.max_num_seqs,
                 seed=args.seed, ops_scale=args.ops_scale, cold_start_s=args.cold_start,
                 target_concurrency=args.target_concurrency, capacity_max_factor=args.capacity_max_factor)
    return replace(w, phases=tuple(replace(p, duration_s=p.duration_s * args.scale) for p in w.phases))


def recorded_workload(d: dict[str, Any]) -> Workload:
    """The workload a results.json recorded (`--from-raw` re-evaluates that run: its deadlines,
    windows and plan come from what ran, not from this command's flags). Fields an older file
    lacks take their defaults."""
    known = {f.name for f in fields(Workload)}
    kw: dict[str, Any] = {k: v for k, v in d.items() if k in known and k != "phases"}
    if "priority_shares" in kw:
        kw["priority_shares"] = tuple(kw["priority_shares"])
    if "phases" in d:
        kw["phases"] = tuple(Phase(**p) for p in d["phases"])
    return Workload(**kw)


def _differences(given: Any, recorded: Any) -> list[str]:
    return [f"{f.name} {getattr(recorded, f.name)!r} recorded, {getattr(given, f.name)!r} given"
            for f in fields(given) if getattr(given, f.name) != getattr(recorded, f.name)]


def _load_raw(out_dir: Path, name: str) -> RunOutput:
    from floodgate.sim.loadgen import LoadResult, Record

    with gzip.open(out_dir / f"{name}.json.gz", "rt") as f:
        d = json.load(f)
    result = LoadResult([Record.from_dict(r) for r in d["records"]], [], d["meta"])
    return RunOutput(name, result, [ReplicaSample(**s) for s in d["replicas"]], d["controller"])


def write_raw(out_dir: Path, out: RunOutput) -> None:
    with gzip.open(out_dir / f"{out.name}.json.gz", "wt") as f:
        json.dump({"meta": out.result.meta, "records": [r.to_dict() for r in out.result.records],
                   "replicas": [asdict(s) for s in out.replicas], "controller": out.controller_log}, f)


def check_workload(w: Workload, configs: Sequence[str]) -> str | None:
    """The controller config each configuration would run, validated as the controller will
    validate it: a bad flag (`--capacity-max-factor 0.5`, `--replicas 12 --max-replicas 10`)
    stops the bench before anything starts, naming the field, not minutes later when the
    controller it spawned refuses its config."""
    from floodgate.controller.config import parse_config

    from floodgate.yamlconfig import ConfigError

    for name in configs:
        if name == "admission":
            continue  # no controller
        raw = controller_config(name, w, "redis://127.0.0.1:6379/0", "http://127.0.0.1:9901", 9000,
                                Path("state"))
        try:
            parse_config(raw, env={})
        except ConfigError as exc:
            return f"the {name} controller's config (from this command's flags) is invalid: {exc}"
    return None


def run(args: argparse.Namespace) -> int:
    from floodgate.bench.overload import derive_capacity, slo_classes
    from floodgate.sim.report import SLO

    started = time.monotonic()
    slo = SLO(args.slo_ttft, args.slo_tpot)
    w = _workload(args)
    if args.from_raw:
        # Re-evaluate what ran: the recorded workload and SLO, never this command's flags (a
        # review: `--from-raw --cold-start 300` turned a recorded FAIL at 16.1 s against 16.0
        # into a PASS against 31.0, and wrote the flag's 300 into results.json). A flag that
        # disagrees with the record is refused.
        recorded = json.loads((args.out / "results.json").read_text())
        rec_w = recorded_workload(recorded.get("workload", {}))
        rec_slo = SLO(**recorded["slo"]) if "slo" in recorded else SLO()
        clash = ([] if w in (Workload(), rec_w) else _differences(w, rec_w)) + \
            ([] if slo in (SLO(), rec_slo) else _differences(slo, rec_slo))
        if clash:
            print(f"floodgate bench elastic: --from-raw re-evaluates the recorded run in {args.out}; these flags "
                  f"disagree with it: {'; '.join(clash)}", file=sys.stderr)
            return 2
        w, slo = rec_w, rec_slo
    problem = None if args.from_raw else check_workload(w, args.configs)
    if problem:
        print(f"floodgate bench elastic: {problem}", file=sys.stderr)
        return 2
    per_replica = args.per_replica_rps
    if args.from_raw:
        per_replica = json.loads((args.out / "results.json").read_text())["per_replica_rps"]
    if per_replica is None:
        per_replica, _, _ = derive_capacity(w.overload_workload(), slo.ttft_s, slo.tpot_s)
    print(f"one replica: {per_replica:.2f} req/s (engine model); cold start {w.cold_start:g} s, "
          f"wake {w.wake:g} s", flush=True)
    plan = build_plan(w, per_replica)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = not args.quiet and sys.stderr.isatty()
    runs: list[RunOutput] = []
    rows: list[Row] = []
    previous: dict[str, Any] = {}
    if args.from_raw:
        previous = json.loads((args.out / "results.json").read_text())
        for name in [r["config"] for r in previous["rows"]]:
            out = _load_raw(args.out, name)
            runs.append(out)
            rows.append(evaluate(out, w, slo))
    for name in [] if args.from_raw else args.configs:
        t = time.monotonic()
        print(f"[{name}] {len(plan)} requests over {w.duration:.0f} s ...", flush=True)
        out = run_config(name, w, plan, slo, timeout_s=args.timeout, progress=progress)
        runs.append(out)
        row = evaluate(out, w, slo)
        rows.append(row)
        write_raw(args.out, out)
        print(f"[{name}] done in {time.monotonic() - t:.0f} s (start-up {out.startup_s:.0f} s): "
              f"ok {row.admitted}, 429 {row.rejected}, errors {row.errors}, P0 {_pct(row.p0_success, 2)}, "
              f"SLO {_pct(row.slo_overall)}", flush=True)
    table = render_table(rows)
    lines = verdicts(rows, w)
    print()
    print(table)
    print("\n".join(lines))
    argv = " ".join(a for a in sys.argv[1:] if a != "--from-raw") if sys.argv and sys.argv[0].endswith("floodgate") else ""
    report: dict[str, Any] = {
        "command": previous.get("command") or ("floodgate " + argv if argv.startswith("bench") else "floodgate bench elastic"),
        "workload": {**asdict(w), "phases": [asdict(p) for p in w.phases]},
        "slo": asdict(slo),
        "per_replica_rps": per_replica,
        "plan_requests": len(plan),
        "classes": shipped_classes(),
        "tuned_classes": slo_classes(slo.ttft_s),
        "controller_overrides": ops_scaled(w),
        # The prior both controllers size with (shipped unless --target-concurrency).
        "capacity_prior": w.capacity_prior,
        "capacity_max_factor": w.capacity_max_factor,
        "rows": [asdict(r) for r in rows],
        "verdicts": lines,
        "elapsed_s": previous.get("elapsed_s") or time.monotonic() - started,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    if not args.no_plots and runs:
        plot_timeline(runs, w, per_replica, slo, args.out / "timeline.png")
    doc = None if args.no_doc else args.doc
    if doc is not None:
        rel = os.path.relpath(args.out, doc.parent)
        update_doc(doc, render_section(report, rows, lines, rel, _existing_notes(doc)))
    print(f"\nwrote {args.out}/results.json in {time.monotonic() - started:.0f} s")
    return 0 if all(r.consistent for r in rows) else 1
