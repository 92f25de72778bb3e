"""How long one `/metrics` scrape of a processor holds the interpreter, with and without the
`*_created` series (same run, alternating, so the box's load cancels in the ratio).

A scrape runs in the metrics server's thread but holds the interpreter lock while
prometheus_client formats every line; gRPC messages arriving meanwhile wait for it (docs/
benchmarks.md, "Immediate rejections as the client sees them"). prometheus_client adds one
`<name>_created` sample per counter and histogram label set: the time the series was created,
which Prometheus ingests as a series of its own unless its created-timestamps feature is on. The processor and the controller turn them off
at start (`prometheus_client.disable_created_metrics()` in `extproc/app.py`, `controller/metrics.py`).

The registry is the processor's own (`extproc.metrics.Metrics`), with the label sets a loaded
processor carries: its counters prepared at 0 for one pool, and every decision, queue-wait,
TTFT and TPOT histogram observed for each class.
"""

from __future__ import annotations

import argparse
import statistics
import time

SUMMARY = "time one processor /metrics scrape, with and without the *_created samples, text and OpenMetrics (same run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=20, help="alternating rounds (default 20)")
    p.add_argument("--scrapes", type=int, default=20, help="scrapes per round and variant (default 20)")


def loaded_registry() -> object:
    from floodgate.extproc.metrics import Metrics

    m = Metrics()
    m.prepare("default")
    for prio in "012":
        for outcome, reason in (("admitted", "immediate"), ("admitted", "queued"), ("rejected", "early_drop"),
                                ("rejected", "queue_full"), ("rejected", "queue_timeout"),
                                ("abandoned", "client_gone")):
            m.decision_time.labels("default", prio, outcome, reason).observe(0.003)
        m.queue_wait.labels("default", prio).observe(0.1)
        m.ttft.labels("default", prio).observe(0.2)
        m.tpot.labels("default", prio).observe(0.03)
    return m.registry


def run(args: argparse.Namespace) -> int:
    import gc

    import prometheus_client
    from prometheus_client import generate_latest, metrics
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    registry = loaded_registry()
    # Prometheus asks for OpenMetrics first when it scrapes (prometheus_client serves it when
    # asked); the plain text format is what a scrape without that Accept header gets.
    formats = {"text": generate_latest, "OpenMetrics": generate_openmetrics}
    variants = [(f, created) for f in formats for created in (True, False)]
    sizes: dict[tuple[str, bool], tuple[int, int]] = {}
    times: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    was = metrics._use_created  # the process's setting, given back at the end
    gc.disable()  # a collection landing in one variant's round is noise, not the scrape
    try:
        for i in range(args.rounds):
            for fmt, created in variants if i % 2 == 0 else reversed(variants):
                if created:
                    prometheus_client.enable_created_metrics()
                else:
                    prometheus_client.disable_created_metrics()
                body = formats[fmt](registry)  # type: ignore[operator]
                sizes[fmt, created] = (len(body), body.count(b"\n"))
                t = time.perf_counter()
                for _ in range(args.scrapes):
                    formats[fmt](registry)  # type: ignore[operator]
                times[fmt, created].append((time.perf_counter() - t) / args.scrapes)
    finally:
        gc.enable()
        metrics._use_created = was
    print("| format | variant | bytes | lines | scrape ms (median of rounds) | vs with _created |")
    print("|---|---|---:|---:|---:|---:|")
    for fmt, created in variants:
        med, base = statistics.median(times[fmt, created]), statistics.median(times[fmt, True])
        b, n = sizes[fmt, created]
        name = "with _created" if created else "without"
        print(f"| {fmt} | {name} | {b:,} | {n:,} | {med * 1000:.2f} | {med / base:.2f}x |")
    return 0
