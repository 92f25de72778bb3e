"""Immediate rejections as the client sees them, next to Envoy's own local 429, in the same run.

A 429 that the processor decides at once (no queue wait) should cost the client about what any
Envoy-local answer costs, plus one ext_proc round trip. This benchmark measures exactly that gap
on a saturated pool, with real processes:

* Redis, one `floodgate sim` replica, one `floodgate extproc` per variant and one front Envoy
  (the shipped bootstrap, one worker) per variant. The pool's limit is pinned (Vegas with
  min = max, so sampled requests still stream their body to the processor as shipped), P2's
  `max_queue` is 0 so every P2 rejection is decided at once; everything else is the shipped
  default (classes, sample rate, local credits, server settings).
* Background: `floodgate load` sends an open-loop Poisson stream of P0/P1 streaming completions
  above the pool's capacity, so the pool stays full, P0/P1 queue, P1 is early-dropped, grants
  and releases run through Redis, and sampled responses stream chunks through the processor;
  it scrapes the processor's /metrics every `--scrape-interval` s, as monitoring would.
* Probes, at the same time, each a paced `wrk` (C, so the client adds little): P2 requests
  through Floodgate (all answered 429 by the processor), and requests to a route of the same
  Envoy that answers 429 itself (`direct_response`, ext_proc disabled): the floor.

Variants run one after another in each round (order rotating each round), each with its own
background and probes. Reported per (variant, phase), median over rounds: client
p50/p99 of the P2 rejections and of Envoy's local 429, their ratio and difference, and, from
the processor's /metrics over the same window, `floodgate_decision_seconds` of P2 rejections
(headers in to 429 out), `floodgate_event_loop_lag_seconds` and `floodgate_gc_pause_seconds`.

    floodgate bench reject                                 # 2 rounds x 20 s per phase
    floodgate bench reject --variant before='{"server": {"gc_freeze": false, "switch_interval_s": null}}'
"""

from __future__ import annotations

import argparse
import json
import os
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

# The q-quantile of a cumulative histogram (Prometheus' histogram_quantile): the overload bench's.
from floodgate.bench.overload import histogram_quantile as quantile

SUMMARY = "client latency of immediate P2 rejections vs Envoy's own local 429 (same run)"
TARGET_P99_MS = 10.0
LOCAL_429_PATH = "/local-429"
REJECT_BODY = ('{"error": {"message": "The model pool is at capacity.", "type": "rate_limit_exceeded", '
               '"param": null, "code": "early_drop"}}')
PROBE_BODY = '{"model": "floodgate-sim-8b", "prompt": "Say hi.", "max_tokens": 8}'

# A paced probe: each connection waits `delay` ms between requests (wrk measures from the send,
# so the pause is not in the latency); `done` prints the latency percentiles and status counts.
WRK_PROBE = """\
wrk.method = "POST"
wrk.path = "%(path)s"
wrk.body = '%(body)s'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-request-priority"] = "2"
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) n429 = 0; nother = 0; last = 0 end
function delay() return %(delay_ms)d end
function response(status, headers, body)
  if status == 429 then n429 = n429 + 1 else nother = nother + 1; last = status end
end
function done(summary, latency, requests)
  local a, b, l = 0, 0, 0
  for _, t in ipairs(threads) do a = a + t:get("n429"); b = b + t:get("nother"); l = math.max(l, t:get("last")) end
  io.write(string.format(
    'FLOODGATE_BENCH {"requests":%%d,"n429":%%d,"other":%%d,"other_status":%%d,"errors":%%d,' ..
    '"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,"p999_us":%%d,"max_us":%%d}\\n',
    summary.requests, a, b, l, summary.errors.connect + summary.errors.read + summary.errors.write +
    summary.errors.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
"""


@dataclass
class Variant:
    name: str
    overlay: dict[str, Any]
    proc: Any = None  # stack.Processor
    envoy: Any = None  # stack.Envoy


@dataclass
class Sample:
    variant: str
    phase: str
    round: int
    reject: dict[str, float]  # wrk numbers of the P2 probe (ms, counts)
    local: dict[str, float]  # wrk numbers of the local-429 probe
    proc: dict[str, float] = field(default_factory=dict)  # processor metrics over the window
    background: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------- metrics

def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def histogram_delta(before: dict[Any, float], after: dict[Any, float], name: str,
                    match: dict[str, str] | None = None) -> list[tuple[float, float]]:
    """Cumulative (le, count) of a histogram over a window, summed over the series matching."""
    sums: dict[float, float] = {}
    for (n, labels), v in after.items():
        if n != name + "_bucket":
            continue
        lab = dict(labels)
        if match and any(lab.get(k) != val for k, val in match.items()):
            continue
        le = float(lab["le"])
        sums[le] = sums.get(le, 0.0) + v - before.get((n, labels), 0.0)
    return sorted(sums.items())


def proc_window(before: dict[Any, float], after: dict[Any, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    dec = histogram_delta(before, after, "floodgate_decision_seconds", {"priority": "2", "outcome": "rejected"})
    if not dec:
        dec = histogram_delta(before, after, "floodgate_decision_seconds", {"priority": "P2", "outcome": "rejected"})
    for q in (0.5, 0.99):
        v = quantile(dec, q)
        if v is not None:
            out[f"decision_p{int(q * 100)}_ms"] = v * 1000
    lag = histogram_delta(before, after, "floodgate_event_loop_lag_seconds")
    for q in (0.5, 0.99, 0.999):
        v = quantile(lag, q)
        if v is not None:
            out[f"lag_p{str(q * 100).rstrip('0').rstrip('.').replace('.', '')}_ms"] = v * 1000
    out["local_rejections"] = sum(v - before.get((n, labels), 0.0) for (n, labels), v in after.items()
                                  if n == "floodgate_local_rejections_total" and dict(labels).get("priority") == "2")
    for gen in ("0", "1", "2"):
        g = histogram_delta(before, after, "floodgate_gc_pause_seconds", {"generation": gen})
        out[f"gc{gen}_n"] = g[-1][1] if g else 0.0
        key = ("floodgate_gc_pause_seconds_sum", (("generation", gen),))
        out[f"gc{gen}_ms"] = (after.get(key, 0.0) - before.get(key, 0.0)) * 1000
    return out


# ------------------------------------------------------------------------- processes

def envoy_with_local_429(stack: Any, upstreams: Sequence[tuple[str, int]], proc: Any, name: str) -> Any:
    """The shipped bootstrap plus one route that Envoy answers with a 429 itself (ext_proc off)."""
    from floodgate.envoy_config import render_local, write_config
    from floodgate.stack import Envoy
    from floodgate.supervisor import free_port, wait_for_port

    port, admin = free_port(), free_port()
    cfg = render_local(listen_port=port, admin_port=admin, processors=[("127.0.0.1", proc.port)],
                       upstreams=upstreams)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"].insert(0, {
        "match": {"path": LOCAL_429_PATH},
        "direct_response": {"status": 429, "body": {"inline_string": REJECT_BODY}},
        "response_headers_to_add": [{"header": {"key": "retry-after", "value": "1"}},
                                    {"header": {"key": "content-type", "value": "application/json"}}],
        "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}, "disabled": True}},
    })
    path = write_config(cfg, stack.sup.workdir / f"{name}.json")
    child = stack.sup.start_envoy(path, admin, name=name)
    wait_for_port("127.0.0.1", port, 20, child.proc)
    env = Envoy(child, port, admin)
    deadline = time.monotonic() + 20
    while env.stat("cluster.floodgate_extproc.membership_healthy") < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: processor never became healthy\n{child.log_tail()}")
        time.sleep(0.1)
    stack.envoys.append(env)
    return env


def processor_config(limit: int, overlay: dict[str, Any]) -> dict[str, Any]:
    from floodgate.extproc.config import PoolConfig

    from floodgate.stack import merge

    # Every class as shipped; P2 only with max_queue 0 (every P2 rejection decided at once).
    classes = {str(k): c.model_dump(exclude_none=True) for k, c in PoolConfig().classes.items()}
    classes["2"]["max_queue"] = 0
    base: dict[str, Any] = {
        "admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
        "pools": [{"name": "default",
                   "limit": {"mode": "vegas", "initial": limit, "min": limit, "max": limit},
                   "classes": classes}],
    }
    return merge(base, overlay)


# ------------------------------------------------------------------------- load

def start_wrk(wrk: str, script: Path, url: str, connections: int, duration: float) -> subprocess.Popen[str]:
    argv = [wrk, "-t", "1", "-c", str(connections), "-d", f"{duration:g}s", "--timeout", "5s",
            "--latency", "-s", str(script), url]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wrk_result(p: subprocess.Popen[str], timeout: float) -> dict[str, float]:
    out, err = p.communicate(timeout=timeout)
    line = next((ln for ln in out.splitlines() if ln.startswith("FLOODGATE_BENCH ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({p.returncode}):\n{out}\n{err}")
    w = json.loads(line.split(" ", 1)[1])
    return {"requests": w["requests"], "n429": w["n429"], "other": w["other"], "other_status": w["other_status"],
            "errors": w["errors"],
            "p50_ms": w["p50_us"] / 1000, "p90_ms": w["p90_us"] / 1000, "p99_ms": w["p99_us"] / 1000,
            "p999_ms": w["p999_us"] / 1000, "max_ms": w["max_us"] / 1000}


def start_background(url: str, rate: float, duration: float, out: Path, metrics_url: str,
                     scrape_s: float) -> subprocess.Popen[bytes]:
    scrape = ["--metrics-url", metrics_url, "--sample-interval", str(scrape_s)] if scrape_s > 0 else []
    argv = [sys.executable, "-m", "floodgate", "load", "--target", url, "--shape", "poisson",
            "--rate", str(rate), "--duration", str(duration), "--priority-mix", "0.3,0.7,0",
            "--output-mean", "64", "--prompt-mean", "256", "--timeout", "60", "--seed", "1",
            "--out", str(out), "--no-plots", "-q", *scrape]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def cpu_seconds(pid: int) -> float:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


def load_avg() -> float:
    return os.getloadavg()[0]


def measure(args: argparse.Namespace, variants: list[Variant], log: Any = sys.stderr) -> tuple[list[Sample], dict[str, Any]]:
    from floodgate.stack import LocalStack
    from floodgate.supervisor import Supervisor, free_port, wait_healthy

    wrk = shutil.which("wrk")
    if wrk is None:
        raise FileNotFoundError("wrk is not on PATH (sudo apt-get install -y wrk)")
    meta: dict[str, Any] = {"load_avg_start": load_avg(), "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    kwargs: dict[str, Any] = {}
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        kwargs["workdir"] = args.workdir
    with Supervisor(**kwargs) as sup:
        stack = LocalStack(sup)
        port = free_port()
        stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0",
                              "--log-level", "warning"], name="sim0", port=port)
        wait_healthy(f"http://127.0.0.1:{port}/health", 30)
        upstreams = [("127.0.0.1", port)]
        stack.start_redis()
        for v in variants:
            v.proc = stack.start_processor(processor_config(args.limit, v.overlay), name=f"extproc-{v.name}")
            v.envoy = envoy_with_local_429(stack, upstreams, v.proc, f"envoy-{v.name}")
        print(f"started {', '.join(v.name for v in variants)} (logs in {sup.workdir})", file=log, flush=True)
        scripts = {}
        for kind, path in (("reject", "/v1/completions"), ("local", LOCAL_429_PATH)):
            scripts[kind] = sup.workdir / f"probe-{kind}.lua"
            scripts[kind].write_text(WRK_PROBE % {"path": path, "body": PROBE_BODY, "delay_ms": args.probe_delay_ms})
        samples: list[Sample] = []
        runs = [(v, "loaded") for v in variants]
        for rnd in range(1, args.rounds + 1):
            k = (rnd - 1) % len(runs)
            for v, phase in runs[k:] + runs[:k]:
                bg = None
                if phase == "loaded":
                    bg = start_background(v.envoy.url, args.rate, args.duration + args.settle + 2,
                                          sup.workdir / f"load-{v.name}-{rnd}", v.proc.metrics_url,
                                          args.scrape_interval)
                    time.sleep(args.settle)  # let the pool fill and the queues form
                before = scrape(v.proc.metrics_url)
                cpu0 = cpu_seconds(v.proc.child.proc.pid), time.monotonic()
                pr = start_wrk(wrk, scripts["reject"], v.envoy.url, args.probe_connections, args.duration)
                pl = start_wrk(wrk, scripts["local"], v.envoy.url, args.probe_connections, args.duration)
                rej = wrk_result(pr, args.duration + 60)
                loc = wrk_result(pl, args.duration + 60)
                after = scrape(v.proc.metrics_url)
                s = Sample(v.name, phase, rnd, rej, loc, proc_window(before, after))
                s.proc["cpu_share"] = (cpu_seconds(v.proc.child.proc.pid) - cpu0[0]) / (time.monotonic() - cpu0[1])
                if bg is not None:
                    _, err = bg.communicate(timeout=args.duration + args.settle + 120)
                    if bg.returncode not in (0, 1):
                        raise RuntimeError(f"floodgate load failed ({bg.returncode}): {err.decode()[-2000:]}")
                    s.background = background_summary(before, after)
                samples.append(s)
                print(f"round {rnd} {v.name:<12} {phase:<6} reject p50 {rej['p50_ms']:6.2f} p99 {rej['p99_ms']:6.2f} | "
                      f"local p50 {loc['p50_ms']:5.2f} p99 {loc['p99_ms']:5.2f} | in proc p99 "
                      f"{s.proc.get('decision_p99_ms', float('nan')):5.2f} lag p99 {s.proc.get('lag_p99_ms', float('nan')):5.2f} "
                      f"gc2 {s.proc.get('gc2_n', 0):.0f} | 429 {rej['n429']:.0f}/{rej['requests']:.0f} "
                      f"load {load_avg():.2f}", file=log, flush=True)
                if rej["other"] or rej["errors"] or loc["other"] or loc["errors"]:
                    print(f"  warning: non-429 answers or socket errors: reject {rej}, local {loc}", file=log, flush=True)
                if bg is not None:
                    time.sleep(2)  # let the background's requests drain before the next window
        for c in sup.children:
            if not c.alive():
                raise RuntimeError(f"{c.name} died during the run:\n{c.log_tail()}")
    meta["load_avg_end"] = load_avg()
    return samples, meta


def background_summary(before: dict[Any, float], after: dict[Any, float]) -> dict[str, float]:
    """What the background made the processor do in the window (admissions, rejections)."""
    out: dict[str, float] = {}
    for (n, labels), v in after.items():
        if n == "floodgate_decisions_total":
            lab = dict(labels)
            key = f"{lab.get('outcome')}_{lab.get('priority')}"
            out[key] = out.get(key, 0.0) + v - before.get((n, labels), 0.0)
    return out


# ------------------------------------------------------------------------- report

@dataclass
class Row:
    variant: str
    phase: str
    reject_p50: float
    reject_p99: float
    local_p50: float
    local_p99: float
    proc_p99: float | None
    lag_p99: float | None
    lag_p999: float | None
    gc: dict[str, float]
    rejections: int
    rounds: int
    proc_cpu: float | None = None
    # Per round, then the median: each round's P2 p99 against Envoy's own 429 in the same
    # seconds, so the box's load in that round (other jobs) cancels out of the comparison.
    ratio: float = float("nan")
    gap_ms: float = float("nan")


def summarize(samples: Sequence[Sample]) -> list[Row]:
    rows = []
    keys = list(dict.fromkeys((s.variant, s.phase) for s in samples))
    for v, ph in keys:
        ss = [s for s in samples if s.variant == v and s.phase == ph]

        def med(vals: Sequence[float | None]) -> float | None:
            xs = [x for x in vals if x is not None]
            return statistics.median(xs) if xs else None

        rows.append(Row(
            v, ph,
            statistics.median(s.reject["p50_ms"] for s in ss), statistics.median(s.reject["p99_ms"] for s in ss),
            statistics.median(s.local["p50_ms"] for s in ss), statistics.median(s.local["p99_ms"] for s in ss),
            med([s.proc.get("decision_p99_ms") for s in ss]), med([s.proc.get("lag_p99_ms") for s in ss]),
            med([s.proc.get("lag_p999_ms") for s in ss]),
            {k: sum(s.proc.get(k, 0.0) for s in ss) for k in ("gc0_n", "gc1_n", "gc2_n", "gc2_ms")},
            int(sum(s.reject["n429"] for s in ss)), len(ss), med([s.proc.get("cpu_share") for s in ss]),
            statistics.median(s.reject["p99_ms"] / s.local["p99_ms"] if s.local["p99_ms"] else float("inf")
                              for s in ss),
            statistics.median(s.reject["p99_ms"] - s.local["p99_ms"] for s in ss)))
    return rows


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "–" if v is None else format(v, fmt)


def table(rows: Sequence[Row]) -> str:
    head = ("variant", "phase", "P2 reject p50 / p99 ms", "Envoy local 429 p50 / p99 ms", "p99 ratio (per round)",
            "p99 gap ms (per round)", "in processor p99 ms", "loop lag p99 / p99.9 ms", "GC gen0 / gen1 / gen2 (gen2 total ms)",
            "processor CPU", "P2 429s")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        gc = r.gc
        lines.append("| " + " | ".join((
            r.variant, r.phase, f"{r.reject_p50:.2f} / {r.reject_p99:.2f}", f"{r.local_p50:.2f} / {r.local_p99:.2f}",
            f"{r.ratio:.1f}x", f"{r.gap_ms:+.2f}", _f(r.proc_p99),
            f"{_f(r.lag_p99)} / {_f(r.lag_p999)}",
            f"{gc['gc0_n']:.0f} / {gc['gc1_n']:.0f} / {gc['gc2_n']:.0f} ({gc['gc2_ms']:.0f})",
            f"{_f(r.proc_cpu and r.proc_cpu * 100, '.0f')}%", str(r.rejections))) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------- CLI

def _variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, js = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError("expected NAME=JSON (a processor config overlay)")
    try:
        overlay = json.loads(js)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{name}: not JSON: {exc}") from exc
    if not isinstance(overlay, dict):
        raise argparse.ArgumentTypeError(f"{name}: the overlay must be a JSON object")
    return name, overlay


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=20.0, metavar="S", help="seconds per phase (default 20)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; median over them (default 2)")
    p.add_argument("--rate", type=float, default=40.0, help="background P0/P1 requests/s (default 40)")
    p.add_argument("--limit", type=int, default=32, help="the pool's pinned concurrency limit (default 32)")
    p.add_argument("--settle", type=float, default=4.0, metavar="S",
                   help="background seconds before the probes start (default 4)")
    p.add_argument("--scrape-interval", type=float, default=1.0, metavar="S",
                   help="the background also scrapes the processor's /metrics this often, as a monitoring "
                        "system (and `floodgate bench overload`'s load generator) does (default 1; 0: never)")
    p.add_argument("--probe-connections", type=int, default=2, help="connections per probe (default 2)")
    p.add_argument("--probe-delay-ms", type=int, default=20, help="pause between a connection's probes (default 20)")
    p.add_argument("--variant", type=_variant, action="append", default=[], metavar="NAME=JSON",
                   help="an extra processor, its config overlaid with JSON (repeatable); "
                        "`shipped` (no overlay) always runs")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write every sample and the rows here")
    p.add_argument("--workdir", type=Path, metavar="DIR", help="process logs and configs (default: temp dir)")


def variant_problem(limit: int, variants: list[Variant]) -> str | None:
    """What is wrong with a variant's processor config (None: nothing), checked before anything
    starts: a mistyped key (`gc_freez`) was a RuntimeError traceback, "process exited with 2
    before listening", with the field named only in that processor's log (a docs review)."""
    from floodgate.extproc.config import Config
    from pydantic import ValidationError

    from floodgate.yamlconfig import format_errors

    for v in variants:
        try:
            Config.model_validate(processor_config(limit, v.overlay))
        except ValidationError as exc:
            return f"--variant {v.name}: {format_errors(exc)}"
    return None


def run(args: argparse.Namespace) -> int:
    variants = [Variant("shipped", {})] + [Variant(n, o) for n, o in args.variant]
    if (problem := variant_problem(args.limit, variants)) is not None:
        print(f"floodgate bench reject: {problem}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    samples, meta = measure(args, variants)
    rows = summarize(samples)
    print()
    print(f"Immediate P2 rejections vs Envoy's local 429 ({meta['started']}, {args.rounds} rounds x "
          f"{args.duration:g} s per phase, background {args.rate:g} req/s P0/P1 into limit {args.limit}, "
          f"probes {args.probe_connections} conns paced {args.probe_delay_ms} ms; load average "
          f"{meta['load_avg_start']:.2f} -> {meta['load_avg_end']:.2f}; took {time.monotonic() - t0:.0f} s)")
    print()
    print(table(rows))
    print()
    for r in rows:
        if r.phase == "loaded":
            ok = r.reject_p99 < TARGET_P99_MS
            print(f"{'PASS' if ok else 'FAIL'} {r.variant}: immediate P2 reject p99 {r.reject_p99:.2f} ms client "
                  f"(target < {TARGET_P99_MS:g} ms; Envoy local 429 p99 {r.local_p99:.2f} ms, {r.ratio:.1f}x)")
    bad = [s for s in samples if s.reject["other"] or s.reject["errors"] or s.local["other"] or s.local["errors"]]
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "samples": [asdict(s) for s in samples],
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return 1 if bad else 0
