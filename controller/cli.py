"""`floodgate controller …`: the scaling controller's command line.

Layout: `register()` adds the `controller` command with its own sub-commands. Without a
sub-command, `floodgate controller --config FILE` runs the live controller (`controller.app`);
`simulate` is the trace backtest (pure, no services needed). A bare `floodgate controller`
prints help and exits 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from floodgate.validators import out_dir

if TYPE_CHECKING:
    from floodgate.controller.backtest.suite import Settings

# The trace shipped with the package (floodgate/sim/data); a light import.
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "sim" / "data" / "AzureLLMInferenceTrace_conv.csv.gz"


def trace_path(value: str) -> Path:
    """`--trace`: a CSV path, or `azure` for the Azure trace shipped with the package."""
    return DEFAULT_TRACE if value == "azure" else Path(value)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where it says something: not when the help already names its
    default, nor for a default of None or "" (an absent value), nor for a required option."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or "default:" in text or action.required or action.default in (None, ""):
            return action.help
        return super()._get_help_string(action)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "controller",
        help="scaling controller (and its backtest: `controller simulate`)",
        description="The Floodgate scaling controller. `simulate` backtests the policy on a trace. "
                    "FLOODGATE_REDIS_URL, FLOODGATE_REDIS_PASSWORD, FLOODGATE_CONTROLLER_METRICS_LISTEN and "
                    "FLOODGATE_ENVOY_ADMIN_URL override the config file.",
    )
    parser.add_argument("--config", "-c", type=Path,
                        help="controller YAML (docs/configuration.md, docs/controller.md); runs the live controller")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="log verbosity on stderr (default: info; the decision log is info)")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the config (and that its actuator's client is installed), print it, and exit")
    parser.add_argument("--stop-replicas-on-exit", action="store_true",
                        help="process actuator: when the controller exits as the leader, stop the pools' "
                        "replicas before it releases the lease (`floodgate up`); a standby stops nothing. "
                        "By default replicas outlive the controller so a restart or a standby adopts them")
    parser.set_defaults(handler=lambda args: _main(parser, args))
    sub = parser.add_subparsers(dest="controller_command", metavar="<subcommand>")
    _add_simulate(sub)
    _add_suite(sub)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    # Sub-commands set their own handler; reaching here means none was given.
    if args.config is None:
        parser.print_help()
        print("\nfloodgate controller: --config is required (a controller YAML; deploy/compose/controller.yaml "
              "is an example)", file=sys.stderr)
        return 2
    return _run_live(args)


def _run_live(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from floodgate.controller.config import (
        ConfigError,
        check_commands,
        check_state_dirs,
        load_config,
    )

    from floodgate.yamlconfig import dump_redacted

    try:
        cfg = load_config(args.config)
        # --check-config only tries (and removes what it made); start-up keeps the directories.
        check_state_dirs(cfg, create=not args.check_config)
        check_commands(cfg)
    except ConfigError as exc:
        print(f"floodgate controller: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(dump_redacted(cfg))
        return 0
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # The decision log is one JSON object per line on stdout (machine-readable).
    dl = logging.getLogger("floodgate.controller.decisions")
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(message)s"))
    dl.addHandler(h)
    dl.propagate = False

    async def main(stop: asyncio.Event) -> int:
        from floodgate.controller.app import Controller

        try:
            ctl = Controller(cfg, stop_replicas_on_exit=args.stop_replicas_on_exit)
        except (ImportError, ValueError) as exc:
            print(f"floodgate controller: {exc}", file=sys.stderr)
            return 2
        await ctl.run(stop)
        return 0

    from floodgate.runtime import run_until_signalled

    return run_until_signalled(main, use_uvloop=False)


def _add_simulate(sub: Any) -> None:
    from floodgate.controller.backtest.engine import SHIPPED_QUEUE_TIMEOUT_S
    from floodgate.controller.backtest.oracle import SLO_GOAL
    from floodgate.controller.backtest.report import POLICY_NAMES

    p = sub.add_parser(
        "simulate",
        help="backtest scaling policies on a request trace",
        description=(
            "Replay a request trace through a discrete-event model of replicas (cold starts, "
            "warm-pool wakes, drains) under Floodgate's policy and the HPA/KPA baselines beside the zero-wait "
            "reference (the cheapest schedule that never makes a request wait, knowing the future: a yardstick, not "
            "a bound; real policies meeting the SLO can cost less) and two lower bounds: all-served (for policies "
            f"that serve every request) and at the ≥ {SLO_GOAL:.0%} SLO goal (for any policy meeting it); print SLO attainment "
            "and replica-seconds side by side."
        ),
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--trace", type=trace_path, default=None, help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens; plain or .gz), or `azure` for the one shipped with Floodgate (default: none, synthetic tokens)")
    p.add_argument(
        "--mode",
        choices=("tile", "synthetic", "replay"),
        default=None,
        help="tile: the trace tiled into diurnal+burst days; synthetic: Poisson diurnal+burst days; "
        "replay: the trace as recorded, its last --eval-hours evaluated and its earlier days the forecast history "
        "(default: tile with --trace, else synthetic)",
    )
    p.add_argument("--days", type=int, default=8, help="days generated; the last is evaluated, the others are forecast history")
    p.add_argument("--eval-hours", type=float, default=24.0, help="hours of the last day that are simulated")
    p.add_argument("--peak-rps", type=float, default=10.0, help="request rate at the diurnal peak, before events and bursts")
    p.add_argument("--bursts-per-day", type=float, default=6.0, help="mean number of random (unforecastable) bursts per day")
    p.add_argument("--spikes-per-hour", type=float, default=0.0, help="short (10-60 s) unforecastable spikes ×2-4 per hour")
    p.add_argument("--weekend-factor", type=float, default=1.0, help="rate on Saturdays and Sundays relative to a weekday (day 1 is a Monday)")
    p.add_argument("--trend", type=float, default=0.0, help="compound rate growth per day (0.01 = +1%%/day)")
    p.add_argument("--holidays", default="", help="comma-separated day numbers (1-based) at 0.4× the rate (default: none)")
    p.add_argument("--tokens", choices=("conv", "short", "long"), default="conv",
                   help="synthetic mode: token lengths (conv: like the Azure conversation trace; short: chat; long: long generations)")
    p.add_argument("--warmup-hours", type=float, default=2.0,
                   help="hours simulated before the evaluated window, unscored, so it starts from the state the day before left")
    p.add_argument("--rate-scale", type=float, default=1.0, help="replay mode: multiply the trace's rate")
    p.add_argument("--seed", type=int, default=1, help="seed of the generated traffic and the replicas' start times")
    p.add_argument("--slo-wait", type=float, default=2.0, help="SLO: queueing delay budget in seconds")
    p.add_argument("--queue-timeout", type=float, default=SHIPPED_QUEUE_TIMEOUT_S,
                   help=f"queued requests are rejected (429) after this long (default {SHIPPED_QUEUE_TIMEOUT_S:g}: "
                        "the shipped queue_timeout_s of P1, the class of a request without a priority header)")
    p.add_argument("--warm-weight", type=float, default=1.0,
                   help="cost of a sleeping warm-pool replica-second relative to an active one; 1 unless the "
                   "sleeping replica's GPU is really given to something else (docs/controller.md, Backtest)")
    p.add_argument("--slots", type=int, default=8, help="concurrent sequences per replica")
    p.add_argument("--cold-start", type=float, nargs=2, default=(120.0, 300.0), metavar=("MIN", "MAX"),
                   help="a replica's cold start, s: uniform in [MIN, MAX] (default: 120 300)")
    p.add_argument("--wake", type=float, nargs=2, default=(5.0, 15.0), metavar=("MIN", "MAX"),
                   help="waking a sleeping warm-pool replica, s: uniform in [MIN, MAX] (default: 5 15)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help="comma-separated subset; also floodgate-served (the loop before offered demand: "
                        "no admission model, served demand only, no learned capacity); `oracle` is accepted as "
                        "an old alias of zero-wait and reported as zero-wait")
    p.add_argument("--config", type=Path, default=None, help="YAML with `policy:`, `forecast:`, `warm_pool:`, `capacity:` sections overriding the defaults")
    p.add_argument("--out", type=out_dir, default=None, help="write simulate.json, timeline.json and replicas.png here (default: print only)")
    p.set_defaults(handler=_simulate)


def _load_overrides(path: Path | None) -> Settings:
    """The `--config` YAML of `simulate` and `suite` as `suite.Settings` (sections `policy`,
    `forecast`, `warm_pool`, `capacity`, each as in the live controller's pool config)."""
    from floodgate.controller.backtest.suite import Settings
    from floodgate.controller.capacity import CapacityConfig
    from floodgate.controller.forecast import ForecastConfig
    from floodgate.controller.lifecycle import WarmPoolConfig
    from floodgate.controller.policy import PolicyConfig
    from pydantic import ValidationError

    from floodgate.yamlconfig import read_mapping

    raw: dict[str, Any] = {}
    if path is not None:
        loaded = read_mapping(path)  # a ConfigError (ValueError) names a duplicate key
        unknown = set(loaded) - {"policy", "forecast", "warm_pool", "capacity"}
        if unknown:
            raise ValueError(f"{path}: unknown section(s) {', '.join(sorted(unknown))}")
        raw = loaded
    models: dict[str, type[Any]] = {"policy": PolicyConfig, "forecast": ForecastConfig,
                                    "warm_pool": WarmPoolConfig, "capacity": CapacityConfig}
    built: dict[str, Any] = {}
    for section, model in models.items():
        given = raw.get(section) or {}
        if not isinstance(given, dict):
            raise ValueError(f"{path}: {section}: expected a mapping of settings, got {type(given).__name__} {given!r}")
        try:
            built[section] = model(**given)
        except ValidationError as exc:  # named by its path in the file, as the live config's errors are
            err = exc.errors()[0]
            loc = ".".join(str(x) for x in (section, *err["loc"]))
            raise ValueError(f"{path}: {loc}: {err['msg']}") from None
    return Settings(built["policy"], built["forecast"], built["warm_pool"], built["capacity"])


def _bad_simulate_args(args: argparse.Namespace) -> str | None:
    """The first out-of-range `simulate` option, named, or None: checked before anything runs."""
    checks: list[tuple[str, float, bool, str]] = [
        # (flag, value, ok, what it must be)
        ("--days", args.days, args.days >= 1, ">= 1"),
        ("--eval-hours", args.eval_hours, args.eval_hours > 0, "> 0"),
        ("--peak-rps", args.peak_rps, args.peak_rps > 0, "> 0"),
        ("--bursts-per-day", args.bursts_per_day, args.bursts_per_day >= 0, ">= 0"),
        ("--spikes-per-hour", args.spikes_per_hour, args.spikes_per_hour >= 0, ">= 0"),
        ("--weekend-factor", args.weekend_factor, args.weekend_factor >= 0, ">= 0"),
        ("--trend", args.trend, args.trend > -1, "> -1"),
        ("--warmup-hours", args.warmup_hours, args.warmup_hours >= 0, ">= 0"),
        ("--rate-scale", args.rate_scale, args.rate_scale > 0, "> 0"),
        ("--slo-wait", args.slo_wait, args.slo_wait >= 0, ">= 0"),
        ("--queue-timeout", args.queue_timeout, args.queue_timeout > 0, "> 0"),
        ("--warm-weight", args.warm_weight, args.warm_weight >= 0, ">= 0"),
        ("--slots", args.slots, args.slots >= 1, ">= 1"),
    ]
    for flag, value, ok, want in checks:
        if not ok or not math.isfinite(value):
            return f"{flag} must be {want} (got {value:g})"
    for flag, (lo, hi) in (("--cold-start", args.cold_start), ("--wake", args.wake)):
        if not (0 <= lo <= hi and math.isfinite(hi)):
            return f"{flag} MIN MAX must satisfy 0 <= MIN <= MAX (got {lo:g} {hi:g})"
    return None


def _simulate(args: argparse.Namespace) -> int:
    import time

    from floodgate.controller.backtest import engine, report, workload

    bad = _bad_simulate_args(args)
    if bad is not None:
        print(f"floodgate controller simulate: {bad}", file=sys.stderr)
        return 2
    try:
        settings = _load_overrides(args.config)
        policy, forecast, pool = settings.policy, settings.forecast, settings.warm_pool
    except (OSError, ValueError) as exc:
        print(f"floodgate controller simulate: {exc}", file=sys.stderr)
        return 2
    sim = engine.SimConfig(
        slots_per_replica=args.slots,
        cold_start_min_s=args.cold_start[0],
        cold_start_max_s=args.cold_start[1],
        wake_min_s=args.wake[0],
        wake_max_s=args.wake[1],
        slo_wait_s=args.slo_wait,
        queue_timeout_s=args.queue_timeout,
        warm_cost_weight=args.warm_weight,
        seed=args.seed,
    )
    trace = None
    if args.trace is not None:
        if not args.trace.is_file():
            print(f"floodgate controller simulate: no such trace file: {args.trace}", file=sys.stderr)
            return 2
        trace = workload.load_trace(args.trace)
    mode = args.mode or ("tile" if trace is not None else "synthetic")
    names = [report.canonical_policy(n.strip()) for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in report.KNOWN_POLICY_NAMES]
    if unknown:
        print(f"floodgate controller simulate: unknown policies {unknown}; known: {', '.join(report.KNOWN_POLICY_NAMES)} "
              f"(and {', '.join(report.POLICY_ALIASES)}, an old alias of {report.ZERO_WAIT})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if mode == "replay":
        if trace is None:
            print("floodgate controller simulate: --mode replay needs --trace", file=sys.stderr)
            return 2
        w = workload.make_replay_workload(trace, sim, args.rate_scale, args.seed, args.eval_hours, args.warmup_hours)
    else:
        try:
            holidays = tuple(int(x) - 1 for x in args.holidays.split(",") if x.strip())
        except ValueError:
            print(f"floodgate controller simulate: --holidays: not a list of day numbers: {args.holidays!r}", file=sys.stderr)
            return 2
        shape = workload.DayShape(bursts_per_day=args.bursts_per_day, spikes_per_hour=args.spikes_per_hour,
                                  weekend_factor=args.weekend_factor, trend_per_day=args.trend, holidays=holidays)
        w = workload.make_day_workload(
            days=args.days,
            peak_rps=args.peak_rps,
            sim=sim,
            trace=trace,
            tile=mode == "tile",
            shape=shape,
            eval_hours=args.eval_hours,
            seed=args.seed,
            warmup_hours=args.warmup_hours,
            tokens=args.tokens,
        )
    print(f"workload: {w.description}", flush=True)
    c = report.compare(
        w, sim, policy, forecast, pool, names, progress=lambda m: print(f"  ran {m}", file=sys.stderr, flush=True),
        capacity=settings.capacity,
    )
    print()
    print(report.markdown_table(c))
    print()
    for r in c.results:
        if r.notes:
            print(f"{r.name}: {r.notes}")
    print(
        f"SLO: queueing delay ≤ {sim.slo_wait_s:g} s (rejections after {sim.queue_timeout_s:g} s count as misses); "
        f"cost = replica-seconds of every replica holding a GPU, sleeping warm-pool replicas × "
        f"{sim.warm_cost_weight:g}; zero-wait = the cheapest zero-wait schedule (a yardstick, not a bound), "
        f"each start charged {sim.start_cost_s:g} s, only its part inside the scored window. "
        f"Lower bounds: all served = Σ every request's least service inside the scored window / slots, a bound "
        f"only for policies that serve every request; ≥ {c.slo_goal:.0%} SLO = the same over the {c.slo_goal:.0%} "
        f"of scored requests with the least, a bound for any policy meeting the goal (a missed request may hold "
        f"nothing). "
        f"Simulated in {time.perf_counter() - t0:.0f} s."
    )
    if args.out is not None:
        report.write_outputs(args.out, c, {"policy": policy.model_dump(), "forecast": forecast.model_dump(),
                                           "warm_pool": pool.model_dump()})
        print(f"wrote {args.out}/simulate.json, timeline.json, replicas.png")
    return 0


def _add_suite(sub: Any) -> None:
    from floodgate.controller.backtest.suite import SCENARIOS, SLO_GOAL

    p = sub.add_parser(
        "suite",
        help="backtest every policy on several kinds of traffic and seeds, with the Pareto curve",
        description=(
            "Run the backtest scenarios (controller/backtest/suite.py) for each seed: every policy beside the "
            "zero-wait reference (a yardstick, not a bound) and the two lower bounds (all-served, for policies that serve "
            f"every request; at the ≥ {SLO_GOAL:.0%} SLO goal, for any policy meeting it; unweighted cost), the goal verdict, and floodgate at "
            "fixed warm-pool sizes (Pareto curve of SLO against cost). Writes suite.md, suite.json, pareto.png."
        ),
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--trace", type=trace_path, default=DEFAULT_TRACE, help="Azure conversation trace CSV (scenarios azure-*; default: the one shipped with Floodgate, floodgate/sim/data)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    p.add_argument("--eval-hours", type=float, default=24.0, help="hours of the evaluated day")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--no-pareto", action="store_true", help="skip the warm-pool sweep")
    p.add_argument("--config", type=Path, default=None, help="YAML with `policy:`, `forecast:`, `warm_pool:`, `capacity:` sections overriding the shipped defaults of the floodgate policies")
    p.add_argument("--out", type=out_dir, required=True, help="output directory")
    p.set_defaults(handler=_suite)


def _suite(args: argparse.Namespace) -> int:
    import time

    from floodgate.controller.backtest import suite
    from floodgate.controller.backtest.engine import SimConfig

    for flag, value, ok, want in (("--eval-hours", args.eval_hours, args.eval_hours > 0, "> 0"),
                                  ("--jobs", args.jobs, args.jobs >= 1, ">= 1")):
        if not ok:
            print(f"floodgate controller suite: {flag} must be {want} (got {value:g})", file=sys.stderr)
            return 2
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in suite.SCENARIOS]
    if unknown:
        print(f"floodgate controller suite: unknown scenarios {unknown}; known: {', '.join(suite.SCENARIOS)}",
              file=sys.stderr)
        return 2
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        print(f"floodgate controller suite: --seeds: not a list of integers: {args.seeds!r}", file=sys.stderr)
        return 2
    try:
        settings = _load_overrides(args.config)
    except (OSError, ValueError) as exc:
        print(f"floodgate controller suite: {exc}", file=sys.stderr)
        return 2
    trace = args.trace if args.trace is not None and args.trace.is_file() else None
    if trace is None:
        print(f"floodgate controller suite: no trace at {args.trace}: skipping the azure-* scenarios", file=sys.stderr)
    t0 = time.perf_counter()
    res = suite.run_suite(names, seeds, trace, SimConfig(), args.eval_hours, args.jobs,
                          None if args.no_pareto else seeds[0],
                          progress=lambda m: print(f"  done {m} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                                                   flush=True),
                          settings=settings)
    suite.write(res, args.out)
    print((args.out / "suite.md").read_text())
    print(f"wrote {args.out}/suite.md, suite.json, pareto.png ({time.perf_counter() - t0:.0f} s)")
    return 0
