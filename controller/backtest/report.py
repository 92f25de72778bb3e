"""Run policies side by side on one workload and report them against the yardstick: the
zero-wait reference (the cheapest schedule with no wait at all on the engine's ticks; the SLO
allows some, so a real policy meeting it can be cheaper: a yardstick, not a bound) and the two
lower bounds (oracle.py) are printed beside every policy: the all-served bound, for policies
that serve every request, and the goal-level bound, for any policy that meets the SLO goal
(≥ `SLO_GOAL`)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from floodgate.controller import forecast as fc
from floodgate.controller.backtest.baselines import HPAController, KPAController
from floodgate.controller.backtest.engine import (
    FloodgateController,
    Result,
    SimConfig,
    SimController,
    initial_replicas,
    run_policy,
)
from floodgate.controller.backtest.oracle import (
    SLO_GOAL,
    ZeroWaitController,
    goal_lower_bound_s,
    lower_bound_s,
    zero_wait_schedule,
)
from floodgate.controller.backtest.workload import Workload
from floodgate.controller.capacity import CapacityConfig
from floodgate.controller.decider import DeciderConfig, DeciderState
from floodgate.controller.demand import DemandConfig
from floodgate.controller.lifecycle import WarmPoolConfig
from floodgate.controller.policy import PolicyConfig

ZERO_WAIT = "zero-wait"  # the zero-wait reference (oracle.py): a yardstick, not an oracle
# Old names still accepted: `--policies oracle` runs (and reports) "zero-wait".
POLICY_ALIASES: dict[str, str] = {"oracle": ZERO_WAIT}

POLICY_NAMES: tuple[str, ...] = (
    "floodgate",
    "floodgate-no-forecast",
    "floodgate-no-warm-pool",
    "floodgate-reactive",
    "hpa",
    "kpa",
    ZERO_WAIT,
)


# Not in the default run: Floodgate as it was before offered demand (issue 14) — no admission
# model in front, served demand only, the configured target_concurrency (no learning).
EXTRA_POLICY_NAMES: tuple[str, ...] = ("floodgate-served",)
KNOWN_POLICY_NAMES: tuple[str, ...] = POLICY_NAMES + EXTRA_POLICY_NAMES


def canonical_policy(name: str) -> str:
    """`name`, or the policy an old alias of it stands for ("oracle" → "zero-wait")."""
    return POLICY_ALIASES.get(name, name)


def floodgate_controller(
    name: str, w: Workload, policy: PolicyConfig, forecast: fc.ForecastConfig, pool: WarmPoolConfig,
    capacity: CapacityConfig | None = None,
) -> FloodgateController:
    cfg = DeciderConfig(policy, forecast, pool, capacity=capacity or CapacityConfig())
    if name == "floodgate-served":
        cfg = replace(cfg, demand=DemandConfig(enabled=False), capacity=CapacityConfig(enabled=False))
        return FloodgateController(name, cfg, DeciderState(history=w.history), admission=False)
    return FloodgateController(name, cfg, DeciderState(history=w.history))


def build_controllers(
    w: Workload,
    sim: SimConfig,
    policy: PolicyConfig,
    forecast: fc.ForecastConfig,
    pool: WarmPoolConfig,
    names: Sequence[str] = POLICY_NAMES,
    capacity: CapacityConfig | None = None,
) -> list[SimController]:
    no_pool = pool.model_copy(update={"enabled": False})
    no_fc = forecast.model_copy(update={"enabled": False})
    out: list[SimController] = []
    for name in map(canonical_policy, names):
        if name in ("floodgate", "floodgate-served"):
            out.append(floodgate_controller(name, w, policy, forecast, pool, capacity))
        elif name == "floodgate-no-forecast":
            out.append(floodgate_controller(name, w, policy, no_fc, pool, capacity))
        elif name == "floodgate-no-warm-pool":
            out.append(floodgate_controller(name, w, policy, forecast, no_pool, capacity))
        elif name == "floodgate-reactive":
            out.append(floodgate_controller(name, w, policy, no_fc, no_pool, capacity))
        elif name == "hpa":
            out.append(HPAController(name, policy.target_concurrency, policy.min_replicas, policy.max_replicas,
                                     pool.max_drain_s))
        elif name == "kpa":
            out.append(KPAController(name, policy.target_concurrency, policy.min_replicas, policy.max_replicas,
                                     pool.max_drain_s))
        elif name == ZERO_WAIT:
            out.append(ZeroWaitController(name, zero_wait_schedule(w, sim), w.start, sim.tick_s))
        else:
            raise ValueError(f"unknown policy {name!r} (known: {', '.join(KNOWN_POLICY_NAMES)}; "
                             f"aliases: {', '.join(f'{a} = {b}' for a, b in POLICY_ALIASES.items())})")
    return out


@dataclass
class Comparison:
    workload: Workload
    sim: SimConfig
    results: list[Result]
    lower_bound_s: float  # the all-served bound: for policies that serve every request
    goal_lower_bound_s: float  # the goal-level bound: for any policy at >= slo_goal attainment
    slo_goal: float = SLO_GOAL

    def by_name(self) -> dict[str, Result]:
        return {r.name: r for r in self.results}


def compare(
    w: Workload,
    sim: SimConfig,
    policy: PolicyConfig,
    forecast: fc.ForecastConfig,
    pool: WarmPoolConfig,
    names: Sequence[str] = POLICY_NAMES,
    progress: Callable[[str], None] | None = None,
    capacity: CapacityConfig | None = None,
) -> Comparison:
    results = []
    init = initial_replicas(w, policy.target_concurrency, policy.min_replicas, policy.max_replicas)
    for ctl in build_controllers(w, sim, policy, forecast, pool, names, capacity):
        t0 = time.perf_counter()
        r = run_policy(w, ctl, sim, init)
        if isinstance(ctl, FloodgateController) and ctl.cfg.forecast.enabled:
            fr = ctl.forecast_reasons
            tot = max(1, ctl.ticks)
            r.notes = (f"forecast engaged {fr.get('ok', 0) / tot:.0%} of ticks, switched off by its error "
                       f"guard {fr.get('high_error', 0) / tot:.0%}, short history {fr.get('short_history', 0) / tot:.0%}")
        if progress:
            progress(f"{ctl.name}: {time.perf_counter() - t0:.1f}s")
        results.append(r)
    return Comparison(w, sim, results, lower_bound_s(w, sim), goal_lower_bound_s(w, sim, SLO_GOAL), SLO_GOAL)


def _fmt_wait(x: float, sim: SimConfig) -> str:
    return f"{x:.2f}" if math.isfinite(x) else f"> {sim.queue_timeout_s:g} (429)"


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.3f}" if b else "–"


def markdown_table(c: Comparison) -> str:
    sim = c.sim
    results = c.results
    ref = next((r for r in results if r.name == ZERO_WAIT), None)
    lb, glb = c.lower_bound_s, c.goal_lower_bound_s
    goal = f"≥ {c.slo_goal:.0%} SLO"
    weighted = sim.warm_cost_weight != 1.0
    head = (
        f"| policy | SLO ≤{sim.slo_wait_s:g}s wait | p99 wait (s) | cost (replica-h) | cost / zero-wait | "
        f"cost / all-served bound | cost / {goal} bound | "
        + (f"cost, sleeping ×{sim.warm_cost_weight:g} (replica-h) | " if weighted else "")
        + "sleeping-h | rejected | mean active | cold starts | pool wakes |"
    )
    ncol = head.count("|") - 1
    lines = [head, "|" + "---|" * ncol]
    for r in results:
        lines.append(
            f"| {r.name} | {r.slo * 100:.2f}% | {_fmt_wait(r.p99_wait, sim)} | {r.unweighted / 3600:.1f} | "
            f"{_ratio(r.unweighted, ref.unweighted if ref else None)} | {_ratio(r.unweighted, lb)} | "
            f"{_ratio(r.unweighted, glb)} | "
            + (f"{r.cost / 3600:.1f} | " if weighted else "")
            + f"{r.warm_s / 3600:.1f} | {r.rejected / max(1, r.requests) * 100:.2f}% | {r.mean_active:.1f} | "
            f"{r.cold_starts} | {r.wakes} |"
        )
    rest = ("– | " if weighted else "") + "– | – | – | – | – |"
    lines.append(
        "| lower bound, all served (Σ service / slots; for policies that serve every request) | – | – | "
        f"{lb / 3600:.1f} | {_ratio(lb, ref.unweighted if ref else None)} | 1.000 | {_ratio(lb, glb)} | " + rest
    )
    lines.append(
        f"| lower bound, {goal} (Σ of the {c.slo_goal:.0%} least services / slots; for any policy meeting the goal) "
        f"| – | – | {glb / 3600:.1f} | {_ratio(glb, ref.unweighted if ref else None)} | {_ratio(glb, lb)} | 1.000 | "
        + rest
    )
    cut = [r for r in results if r.forced_stops or r.killed]
    if cut:
        lines.append("")
        lines.append("Forced stops (drains past max_drain_s; requests cut off count as SLO misses): "
                     + "; ".join(f"{r.name} {r.forced_stops} stops, {r.killed} requests cut" for r in cut) + ".")
    return "\n".join(lines)


def summary(c: Comparison) -> dict[str, Any]:
    return {
        "workload": c.workload.description,
        "requests": c.results[0].requests if c.results else 0,
        "lower_bound_s": c.lower_bound_s,  # all-served: for policies that serve every request
        "goal_lower_bound_s": c.goal_lower_bound_s,  # for any policy at >= slo_goal attainment
        "slo_goal": c.slo_goal,
        "results": [{k: v for k, v in asdict(r).items() if k != "timeline"} | {"slo": r.slo} for r in c.results],
    }


def write_outputs(out: Path, c: Comparison, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"sim": asdict(c.sim), **meta, **summary(c)}
    (out / "simulate.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "timeline.json").write_text(json.dumps({r.name: r.timeline for r in c.results}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    results = c.results
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.0 * len(results)), sharex=True)
    axes_list = list(np.atleast_1d(axes))
    for ax, r in zip(axes_list, results, strict=True):
        tl = r.timeline
        hours = np.asarray(tl["t"]) / 3600.0
        ax.plot(hours, tl["demand_slots"], color="0.6", lw=0.8, label="demand / slots")
        ax.plot(hours, tl["active"], color="C0", lw=1.0, label="active")
        ax.plot(hours, np.asarray(tl["active"]) + np.asarray(tl["warm"]), color="C2", lw=0.8, label="active + warm")
        ax.plot(hours, tl["loading"], color="C3", lw=0.8, label="loading")
        ax.set_ylabel(r.name, fontsize=8)
        ax.set_title(f"{r.name}: SLO {r.slo * 100:.2f}%, cost {r.unweighted / 3600:.0f} replica-h", fontsize=8)
    axes_list[0].legend(fontsize=7, ncol=4, loc="upper left")
    axes_list[-1].set_xlabel("hours into the evaluated window")
    fig.tight_layout()
    fig.savefig(out / "replicas.png", dpi=110)
    plt.close(fig)
