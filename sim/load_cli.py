"""`floodgate load`: drive a target with open-loop streaming traffic and report what happened."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from floodgate.sim.arrivals import (
    DEFAULT_TRACE,
    LengthDist,
    Mix,
    PlannedRequest,
    RateProfile,
    arrival_times,
    assign,
    burst_profile,
    constant_profile,
    load_trace,
    step_profile,
    trace_plan,
)
from floodgate.sim.cli import non_negative, non_negative_int, positive, positive_int

from floodgate.validators import out_dir

T = TypeVar("T")

EPILOG = """\
examples:
  floodgate load --rate 20 --duration 60 --out runs/base
  floodgate load --shape burst --rate 10 --duration 90 --burst-start 30 \\
      --burst-duration 20 --burst-multiplier 5 --metrics-url http://127.0.0.1:9464/metrics --out runs/burst
  floodgate load --shape step --phases 30:5,30:20,30:5
  floodgate load --shape trace --speedup 20 --rate-scale 0.5 --duration 120
  floodgate load --shape poisson --rate 50 --duration 10 --dry-run

Every request carries x-request-priority, x-tenant-id, x-sim-prompt-tokens and
x-sim-output-tokens. Results: requests.json (every request + run metadata), summary.md and
rates.png / latency.png / metrics.png in --out; the summary is also printed to stdout.
"""


def _floats(text: str, n: int | None = None) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if n is not None and len(vals) != n:
        raise argparse.ArgumentTypeError(f"expected {n} comma-separated numbers, got {text!r}")
    return vals


def priority_mix(text: str) -> tuple[float, float, float]:
    a, b, c = _floats(text, 3)
    if min(a, b, c) < 0 or not 0 < a + b + c < math.inf:
        raise argparse.ArgumentTypeError("priority shares must be >= 0 with a positive sum")
    return (a, b, c)


def phases(text: str) -> list[tuple[float, float]]:
    out = []
    for part in text.split(","):
        d, sep, r = part.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((float(d), float(r)))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"phases are DURATION:RATE,..., got {part!r}") from exc
        if not (0 <= out[-1][0] < math.inf and 0 <= out[-1][1] < math.inf):
            raise argparse.ArgumentTypeError(f"a phase's duration and rate must be >= 0, got {part!r}")
    return out


def tenants(text: str) -> tuple[tuple[str, float], ...]:
    """`4` (tenant-0..3, equal), `a,b,c` (equal) or `a:0.7,b:0.3` (weighted)."""
    text = text.strip()
    if text.isdigit():
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError("need at least one tenant")
        return tuple((f"tenant-{i}", 1.0) for i in range(n))
    out = []
    for part in text.split(","):
        name, sep, share = part.strip().partition(":")
        try:
            out.append((name, float(share) if sep else 1.0))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"tenants are NAME[:SHARE],..., got {part!r}") from exc
    if not out or any(not n for n, _ in out):
        raise argparse.ArgumentTypeError(f"bad tenant list {text!r}")
    if any(not 0 <= s < math.inf for _, s in out) or sum(s for _, s in out) <= 0:
        raise argparse.ArgumentTypeError(f"tenant shares must be >= 0 with a positive sum, got {text!r}")
    return tuple(out)


def window(text: str) -> tuple[str, float, float]:
    name, sep, span = text.partition("=")
    t0, sep2, t1 = span.partition(":")
    try:
        if not sep or not sep2:
            raise ValueError
        start, end = float(t0), float(t1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"windows are NAME=T0:T1, got {text!r}") from exc
    if not 0 <= start < end < math.inf:
        raise argparse.ArgumentTypeError(f"a window needs 0 <= T0 < T1, got {text!r}")
    return name, start, end


def header(text: str) -> tuple[str, str]:
    k, sep, v = text.partition(":")
    if not sep or not k.strip():
        raise argparse.ArgumentTypeError(f"headers are NAME:VALUE, got {text!r}")
    return k.strip(), v.strip()


def http_url(text: str) -> str:
    """An http:// or https:// URL with a host: anything else would fail every request or scrape."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # ValueError when out of range or not a number
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


def register(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "load",
        help="open-loop streaming load generator (synthetic shapes or trace replay)",
        description=(
            "Send OpenAI /v1/completions streaming requests open-loop (at planned times, regardless "
            "of completions) to a target, record per-request outcome, TTFT, TPOT and Floodgate's "
            "rejection headers, and write a summary and plots."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("target")
    g.add_argument("--target", default="http://127.0.0.1:10000", type=http_url,
                   help="base URL, http:// or https:// (default: %(default)s, Envoy's local listener)")
    g.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    g.add_argument("--model", help="model name (default: first of the target's /v1/models)")
    g.add_argument("--timeout", type=positive, default=120.0, help="per-request timeout, s (default: %(default)s)")
    g.add_argument("--retry", type=non_negative_int, default=0, metavar="N",
                   help="retry a rejected request up to N times after its Retry-After, each retry saying so "
                        "in x-stainless-retry-count as OpenAI's SDKs do (default: 0)")
    g.add_argument("--retry-max-wait", type=non_negative, default=30.0,
                   help="cap on one Retry-After wait, s (default: %(default)s)")
    g.add_argument("--header", type=header, action="append", default=[], metavar="NAME:VALUE",
                   help="extra request header (repeatable)")

    g = p.add_argument_group("arrivals")
    g.add_argument("--shape", choices=("poisson", "constant", "step", "burst", "trace"), default="poisson",
                   help="poisson: Poisson at --rate; constant: evenly spaced at --rate; step: --phases; "
                        "burst: --rate with a --burst-multiplier window; trace: replay --trace "
                        "(default: %(default)s)")
    g.add_argument("--rate", type=positive, default=10.0, help="requests/s (base rate for burst; default: %(default)s)")
    g.add_argument("--duration", type=positive,
                   help="run length, s (default 60; for trace: replay window after --speedup, default whole trace)")
    g.add_argument("--arrival", choices=("poisson", "uniform"), default="poisson",
                   help="arrival process within step/burst segments (default: %(default)s)")
    g.add_argument("--phases", type=phases, metavar="D:R,D:R,...",
                   help="step shape: phases of DURATION seconds at RATE req/s")
    g.add_argument("--burst-start", type=non_negative, default=None, help="burst start, s (default: duration/3)")
    g.add_argument("--burst-duration", type=non_negative, default=None, help="burst length, s (default: duration/3)")
    g.add_argument("--burst-multiplier", type=non_negative, default=5.0, help="rate multiplier during the burst (default: %(default)s)")
    g.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                   help="CSV with TIMESTAMP,ContextTokens,GeneratedTokens (default: the Azure conv trace)")
    g.add_argument("--speedup", type=positive, default=1.0, help="trace time compression factor (default: %(default)s)")
    g.add_argument("--rate-scale", type=positive, default=1.0,
                   help="trace rate multiplier: <1 thins, >1 duplicates (default: %(default)s)")
    g.add_argument("--trace-start", type=non_negative, default=0.0, help="trace window start, trace seconds (default: 0)")
    g.add_argument("--seed", type=non_negative_int, default=0, help="random seed; same seed, same plan (default: 0)")

    g = p.add_argument_group("request mix")
    g.add_argument("--priority-mix", type=priority_mix, default=(0.2, 0.5, 0.3), metavar="P0,P1,P2",
                   help="shares of priorities 0,1,2 (default: 0.2,0.5,0.3)")
    g.add_argument("--tenants", type=tenants, default=(("tenant-a", 1.0),), metavar="SPEC",
                   help="N (tenant-0..N-1), a,b,c (equal) or a:0.7,b:0.3 (default: tenant-a)")
    g.add_argument("--prompt-mean", type=positive, default=512, help="synthetic prompt tokens, lognormal mean (default: %(default)s)")
    g.add_argument("--prompt-sigma", type=non_negative, default=0.8, help="lognormal sigma, 0 = fixed (default: %(default)s)")
    g.add_argument("--prompt-max", type=positive_int, default=None, help="clip prompt tokens (default 4096; trace: unclipped)")
    g.add_argument("--output-mean", type=positive, default=128, help="synthetic output tokens, lognormal mean (default: %(default)s)")
    g.add_argument("--output-sigma", type=non_negative, default=0.8, help="lognormal sigma, 0 = fixed (default: %(default)s)")
    g.add_argument("--output-max", type=positive_int, default=None, help="clip output tokens (default 1024; trace: unclipped)")

    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft", type=positive, default=2.0, help="goodput SLO on TTFT, s (default: %(default)s)")
    g.add_argument("--slo-tpot", type=positive, default=0.1, help="goodput SLO on TPOT, s (default: %(default)s)")
    g.add_argument("--metrics-url", type=http_url, help="Prometheus endpoint to sample during the run, e.g. http://127.0.0.1:9464/metrics")
    g.add_argument("--metrics", default="floodgate_queue_depth,floodgate_limit,floodgate_inflight",
                   help="comma-separated metric names to sample (summed across labels; default: %(default)s)")
    g.add_argument("--sample-interval", type=positive, default=1.0, help="metrics scrape period, s (default: %(default)s)")
    g.add_argument("--window", type=window, action="append", default=[], metavar="NAME=T0:T1",
                   help="extra summary for requests arriving in [T0,T1) s (repeatable; burst adds one)")
    g.add_argument("--out", type=out_dir, help="directory for requests.json, summary.md and plots")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--dry-run", action="store_true", help="print the plan's statistics and exit without sending")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no summary on stdout")
    # build_plan's errors (options that disagree, an unreadable --trace) are usage errors too.
    p.set_defaults(handler=main, usage_error=p.error)
    return p


class PlanError(ValueError):
    """The options describe no plan: reported like argparse's own errors (exit 2)."""


def build_plan(args: argparse.Namespace) -> tuple[list[PlannedRequest], dict[str, tuple[float, float]]]:
    """The plan the arguments describe, plus named windows to summarize (e.g. the burst)."""
    mix = Mix(
        priority_shares=args.priority_mix,
        tenants=args.tenants,
        prompt=LengthDist(args.prompt_mean, args.prompt_sigma, max=args.prompt_max or 4096),
        output=LengthDist(args.output_mean, args.output_sigma, max=args.output_max or 1024),
    )
    windows = {name: (t0, t1) for name, t0, t1 in args.window}
    if args.shape == "trace":
        if not Path(args.trace).exists():
            raise PlanError(f"argument --trace: no such file: {args.trace}")
        try:
            trace = load_trace(str(args.trace))
        except ValueError as exc:  # names the file
            raise PlanError(f"argument --trace: {exc}") from None
        except OSError as exc:
            raise PlanError(f"argument --trace: cannot read {args.trace}: {exc.strerror or exc}") from None
        plan = trace_plan(
            trace, speedup=args.speedup, rate_scale=args.rate_scale,
            start=args.trace_start, duration=args.duration, mix=mix,
            max_prompt_tokens=args.prompt_max, max_output_tokens=args.output_max, seed=args.seed,
        )
        return plan, windows
    duration = 60.0 if args.duration is None else args.duration
    profile: RateProfile
    process = args.arrival
    if args.shape == "poisson":
        profile, process = constant_profile(args.rate, duration), "poisson"
    elif args.shape == "constant":
        profile, process = constant_profile(args.rate, duration), "uniform"
    elif args.shape == "step":
        if not args.phases:
            raise PlanError("--shape step needs --phases D:R,D:R,...")
        profile = step_profile(args.phases)
    else:
        bs = duration / 3 if args.burst_start is None else args.burst_start
        bd = duration / 3 if args.burst_duration is None else args.burst_duration
        try:
            profile = burst_profile(args.rate, duration, bs, bd, args.burst_multiplier)
        except ValueError as exc:
            raise PlanError(f"--shape burst: {exc}") from exc
        windows.setdefault("burst", (bs, bs + bd))
    import numpy as np

    rng = np.random.default_rng(args.seed)
    return assign(arrival_times(profile, process, rng), mix, rng), windows


def _run(coro: Coroutine[Any, Any, T]) -> T:
    # uvloop roughly halves the client's per-request CPU; the box is small and shared.
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _unreachable(target: str, timeout_s: float = 5.0) -> str | None:
    """Why a TCP connection to the target's host and port fails, or None when it opens."""
    import socket
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(target)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def base_url(target: str) -> str:
    """`target` without a trailing /v1: the paths sent already start with /v1 (an OpenAI client's
    base_url ends in /v1, so users pass it; it used to send every request to /v1/v1/... -> 404)."""
    stripped = target.rstrip("/")
    return stripped[: -len("/v1")] if stripped.endswith("/v1") else target


def main(args: argparse.Namespace) -> int:
    from floodgate.sim.loadgen import run_load_detailed
    from floodgate.sim.report import (
        SLO,
        render_markdown,
        scrape_failure,
        summarize,
        summarize_window,
        write_report,
    )

    try:
        plan, windows = build_plan(args)
    except PlanError as exc:
        usage_error = getattr(args, "usage_error", None)
        if usage_error is not None:
            usage_error(str(exc))  # prints the usage and the message, exits 2
        print(f"floodgate load: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        import numpy as np

        n = len(plan)
        span = plan[-1].t_offset if plan else 0.0
        pr = np.bincount([r.priority for r in plan], minlength=3) if plan else np.zeros(3, int)
        print(f"{n} requests over {span:.1f} s ({n / span if span else 0:.2f} req/s); "
              f"priorities P0/P1/P2 = {pr[0]}/{pr[1]}/{pr[2]}; "
              f"mean prompt {np.mean([r.prompt_tokens for r in plan]) if plan else 0:.0f} tokens, "
              f"mean output {np.mean([r.output_tokens for r in plan]) if plan else 0:.0f} tokens")
        return 0
    if not plan:
        print("floodgate load: the plan is empty (rate, duration or trace window too small)", file=sys.stderr)
        return 2

    target = base_url(args.target)
    if target != args.target:
        print(f"floodgate load: --target is the base URL without /v1; sending to {target}/v1/...",
              file=sys.stderr)
        args.target = target
    unreachable = _unreachable(args.target)
    if unreachable:
        # Before the run, not after it: with nothing listening every request fails at once,
        # and the run used to go on for its whole duration before saying so.
        print(f"floodgate load: cannot reach {args.target}: {unreachable}", file=sys.stderr)
        return 1
    progress = not args.quiet and sys.stderr.isatty()
    result = _run(run_load_detailed(
        plan, args.target, model=args.model, api=args.api, request_timeout=args.timeout,
        retry=args.retry, retry_max_wait=args.retry_max_wait, metrics_url=args.metrics_url,
        metrics=[m.strip() for m in args.metrics.split(",") if m.strip()],
        sample_interval=args.sample_interval, extra_headers=dict(args.header), progress=progress,
        stop_on_cancel=True,
    ))
    interrupted = bool(result.meta.get("interrupted"))
    if interrupted:
        print(f"floodgate load: interrupted after {result.meta['wall_s']:.1f} s: the report covers the "
              f"{len(result.records)} requests sent (those in flight count as errors, kind "
              f"'interrupted')", file=sys.stderr)
    result.meta.update(shape=args.shape, seed=args.seed, windows={k: list(v) for k, v in windows.items()})
    slo = SLO(args.slo_ttft, args.slo_tpot)
    if args.out:
        paths = write_report(args.out, result, slo, plots=not args.no_plots, windows=windows)
        if not args.quiet:
            print(paths["summary"].read_text())
            print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    elif not args.quiet:
        summary = summarize(result.records, slo)
        md = render_markdown(summary, result.meta)
        for name, (t0, t1) in windows.items():
            md += "\n" + render_markdown(summarize_window(result.records, t0, t1, slo), {},
                                         title=f"Window: {name}", level=2)
        print(md)
    scrape_warning = scrape_failure(result.meta)
    if scrape_warning:
        print(f"floodgate load: warning: {scrape_warning}", file=sys.stderr)
    if interrupted:
        return 130
    if all(r.status is None for r in result.records):
        first = next((r.error for r in result.records if r.error), "no response")
        print(f"floodgate load: no request got a response from {args.target}: {first}", file=sys.stderr)
        return 1
    return 0
