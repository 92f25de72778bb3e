"""Backtest workloads: request arrivals, service times and the demand history before them.

* `load_trace`: an Azure LLM trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens).
* `make_day_workload`: days of diurnal traffic (Poisson or the trace tiled and thinned), with
  a repeating daily event and random bursts; optional week shape (weekday/weekend), trend and
  holidays. The last day is evaluated; the earlier days become the forecaster's history.
* `make_replay_workload`: a trace as recorded; when it spans several days, its own earlier
  days are the forecaster's history and the last day is evaluated.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from floodgate.controller import forecast as fc

if TYPE_CHECKING:
    from floodgate.controller.backtest.engine import SimConfig

DAY_S = 86400.0


@dataclass(frozen=True)
class Workload:
    """Requests to simulate plus the per-minute demand history of the days before them.

    The engine simulates from `start` (so the evaluated window begins from the state the
    warm-up left, not from an empty pool) and scores requests and cost from `eval_start` on.
    """

    name: str
    arrivals: np.ndarray  # absolute seconds, sorted
    service: np.ndarray  # slot-seconds per request
    tokens: np.ndarray  # prompt + generated tokens (KV footprint)
    start: float
    end: float
    history: fc.DemandHistory | None
    description: str
    eval_start: float | None = None  # None: == start

    @property
    def scored_from(self) -> float:
        return self.start if self.eval_start is None else self.eval_start

def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from first request, context tokens, generated tokens) of an Azure LLM trace CSV."""
    from datetime import datetime

    ts: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            # Timestamps carry 7 fractional digits; fromisoformat takes 6.
            raw = row["TIMESTAMP"].strip()
            if "." in raw:
                head, frac = raw.split(".", 1)
                raw = f"{head}.{frac[:6]}"
            ts.append(datetime.fromisoformat(raw).timestamp())
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    t = np.asarray(ts, dtype=float)
    order = np.argsort(t, kind="stable")
    t = t[order] - t[order][0]
    return t, np.asarray(ctx, dtype=float)[order], np.asarray(gen, dtype=float)[order]


def _synthetic_tokens(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    # Lognormals matched to the Azure conversation trace (means ≈ 1155 and 211 tokens).
    ctx = np.clip(rng.lognormal(6.8, 0.75, n), 8, 8192)
    gen = np.clip(rng.lognormal(5.05, 0.7, n), 1, 2048)
    return ctx, gen


@dataclass(frozen=True)
class DayShape:
    """Diurnal demand shape with a recurring morning peak and random bursts."""

    trough: float = 0.3  # rate at 03:00 relative to the 15:00 peak
    event_hour: float = 9.0  # a daily job that repeats every day (forecastable)
    event_minutes: float = 40.0
    event_mult: float = 1.6
    bursts_per_day: float = 6.0  # Poisson count of unforecastable bursts per day
    burst_mult: tuple[float, float] = (1.5, 2.5)
    burst_s: tuple[float, float] = (120.0, 600.0)
    ramp_s: float = 30.0
    day_noise: float = 0.05  # day-to-day amplitude noise (std, relative)


def _ramp_window(t: np.ndarray, start: float, dur: float, ramp: float) -> np.ndarray:
    up = np.clip((t - start) / ramp, 0, 1)
    down = np.clip((start + dur - t) / ramp, 0, 1)
    return np.minimum(up, down)


def day_shape(t_in_day: np.ndarray, shape: DayShape, rng: np.random.Generator) -> np.ndarray:
    """Rate multiplier (peak = 1, without events) at seconds-of-day `t_in_day` for one day."""
    h = t_in_day / 3600.0
    s = shape.trough + (1 - shape.trough) * 0.5 * (1 - np.cos(2 * np.pi * (h - 3.0) / 24.0))
    s = s * max(0.5, rng.normal(1.0, shape.day_noise))
    ev = _ramp_window(t_in_day, shape.event_hour * 3600, shape.event_minutes * 60, 60.0)
    mult = 1 + (shape.event_mult - 1) * ev
    for _ in range(rng.poisson(shape.bursts_per_day)):
        start = rng.uniform(0, DAY_S)
        dur = rng.uniform(*shape.burst_s)
        m = rng.uniform(*shape.burst_mult)
        mult = np.maximum(mult, 1 + (m - 1) * _ramp_window(t_in_day, start, dur, shape.ramp_s))
    return np.asarray(s * mult)


def make_day_workload(
    *,
    days: int,
    peak_rps: float,
    sim: SimConfig,
    trace: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    tile: bool,
    shape: DayShape = DayShape(),
    eval_hours: float = 24.0,
    seed: int = 1,
) -> Workload:
    """`days` days of diurnal + burst traffic; the last day (first `eval_hours` of it) is
    evaluated, the earlier ones become per-minute demand history for the forecaster.

    `tile=True` takes arrivals from the trace (time-compressed and tiled, so its own
    minute-scale burstiness survives) and thins them to the day shape; otherwise arrivals are
    Poisson. Tokens come from the trace when given (resampled), else from matched lognormals.
    """
    rng = np.random.default_rng(seed)
    grid = np.arange(0.0, DAY_S, 1.0)
    all_t: list[np.ndarray] = []
    all_c: list[np.ndarray] = []
    all_g: list[np.ndarray] = []
    for d in range(days):
        shp = day_shape(grid, shape, rng)
        smax = float(shp.max())
        lam_max = peak_rps * smax
        if tile and trace is not None:
            tt, _, _ = trace
            span = float(tt[-1]) + 1.0
            k = (len(tt) / span) / lam_max  # compress the trace so its mean rate is lam_max
            period = span * k
            reps = math.ceil(DAY_S / period) + 1
            off = rng.uniform(0, period)
            cand = (tt[None, :] * k + (np.arange(reps)[:, None] * period) - off).ravel()
            cand = np.sort(cand[(cand >= 0) & (cand < DAY_S)])
        else:
            n = rng.poisson(lam_max * DAY_S)
            cand = np.sort(rng.uniform(0, DAY_S, n))
        keep = rng.random(len(cand)) < shp[cand.astype(np.int64)] / smax
        t = cand[keep]
        if trace is not None:
            idx = rng.integers(0, len(trace[1]), len(t))
            c, g = trace[1][idx], trace[2][idx]
        else:
            c, g = _synthetic_tokens(rng, len(t))
        all_t.append(t + d * DAY_S)
        all_c.append(c)
        all_g.append(g)
    service_all = [c * sim.prefill_s_per_token + g * sim.tpot_s for c, g in zip(all_c, all_g, strict=True)]
    # History: offered concurrency per minute (Little: Σ service of the minute's arrivals / 60).
    hist: fc.DemandHistory | None = None
    if days > 1:
        ht = np.concatenate(all_t[:-1])
        hs = np.concatenate(service_all[:-1])
        n_min = int((days - 1) * DAY_S // 60)
        per_min = np.bincount((ht // 60).astype(np.int64), weights=hs, minlength=n_min)[:n_min] / 60.0
        hist = fc.DemandHistory.empty(max(n_min, 8 * 1440), end_minute=n_min - 1)
        vals = np.array(hist.values)
        vals[-n_min:] = per_min
        vals.flags.writeable = False
        hist = fc.DemandHistory(n_min - 1, vals)
    start = (days - 1) * DAY_S
    end = start + eval_hours * 3600.0
    t = all_t[-1]
    sel = t < end
    kind = "tiled Azure trace" if (tile and trace is not None) else "Poisson"
    return Workload(
        name=f"{'tile' if tile and trace is not None else 'synthetic'}-{days}d",
        arrivals=t[sel],
        service=service_all[-1][sel],
        tokens=(all_c[-1] + all_g[-1])[sel],
        start=start,
        end=end,
        history=hist,
        description=(
            f"{days} days of diurnal traffic ({kind} arrivals, peak {peak_rps:g} req/s, "
            f"daily {shape.event_hour:g}:00 peak ×{shape.event_mult:g}, "
            f"~{shape.bursts_per_day:g} random bursts/day ×{shape.burst_mult[0]:g}–{shape.burst_mult[1]:g}); "
            f"day {days} evaluated ({eval_hours:g} h, {int(sel.sum())} requests)"
        ),
    )


def make_replay_workload(
    trace: tuple[np.ndarray, np.ndarray, np.ndarray], sim: SimConfig, rate_scale: float = 1.0, seed: int = 1
) -> Workload:
    """The trace as recorded; `rate_scale` > 1 superposes jittered copies (rate × k, same shape)."""
    rng = np.random.default_rng(seed)
    t, c, g = trace
    copies = [np.arange(len(t))] * int(rate_scale)
    frac = rate_scale - int(rate_scale)
    if frac > 0:
        copies.append(np.flatnonzero(rng.random(len(t)) < frac))
    idx = np.concatenate(copies) if copies else np.arange(len(t))
    jitter = np.where(np.arange(len(idx)) < len(t), 0.0, rng.uniform(0, 1.0, len(idx)))
    tt = t[idx] + jitter
    order = np.argsort(tt, kind="stable")
    tt, idx = tt[order], idx[order]
    svc = c[idx] * sim.prefill_s_per_token + g[idx] * sim.tpot_s
    return Workload(
        name="replay",
        arrivals=tt,
        service=svc,
        tokens=c[idx] + g[idx],
        start=0.0,
        end=float(tt[-1]) + 1.0,
        history=None,
        description=f"Azure trace replayed as recorded (rate ×{rate_scale:g}, {len(tt)} requests, no history)",
    )

