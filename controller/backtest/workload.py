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
    # Prompt tokens alone (what prefill, and so TTFT, takes time for); None: `tokens` stands in.
    prompt: np.ndarray | None = None

    @property
    def scored_from(self) -> float:
        return self.start if self.eval_start is None else self.eval_start

def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from first request, context tokens, generated tokens) of an Azure LLM trace CSV."""
    from datetime import datetime

    ts: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    from floodgate.sim.arrivals import open_trace

    with open_trace(path) as fh:
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


# Lognormal token models (context, generated): (mu, sigma, max) each.
TOKEN_MODELS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    # Matched to the Azure conversation trace (means ≈ 1155 and 211 tokens).
    "conv": ((6.8, 0.75, 8192.0), (5.05, 0.7, 2048.0)),
    # Chat completions / autocomplete: short prompts, a few dozen tokens out (~1–2 s each).
    "short": ((5.5, 0.6, 2048.0), (3.5, 0.6, 256.0)),
    # Long generations (summaries, code): ~700 tokens out on average, up to 4096 (~2 min).
    "long": ((7.2, 0.6, 16384.0), (6.4, 0.6, 4096.0)),
}


def _synthetic_tokens(rng: np.random.Generator, n: int, model: str = "conv") -> tuple[np.ndarray, np.ndarray]:
    (cm, cs, cx), (gm, gs, gx) = TOKEN_MODELS[model]
    ctx = np.clip(rng.lognormal(cm, cs, n), 8, cx)
    gen = np.clip(rng.lognormal(gm, gs, n), 1, gx)
    return ctx, gen


@dataclass(frozen=True)
class DayShape:
    """Diurnal demand shape with a recurring morning peak, random bursts and spikes, and a
    week around it (day 0 is a Monday)."""

    trough: float = 0.3  # rate at 03:00 relative to the 15:00 peak
    event_hour: float = 9.0  # a daily job that repeats every day (forecastable)
    event_minutes: float = 40.0
    event_mult: float = 1.6
    bursts_per_day: float = 6.0  # Poisson count of unforecastable bursts per day
    burst_mult: tuple[float, float] = (1.5, 2.5)
    burst_s: tuple[float, float] = (120.0, 600.0)
    ramp_s: float = 30.0
    spikes_per_hour: float = 0.0  # short unforecastable spikes (seconds to a minute)
    spike_mult: tuple[float, float] = (2.0, 4.0)
    spike_s: tuple[float, float] = (10.0, 60.0)
    day_noise: float = 0.05  # day-to-day amplitude noise (std, relative)
    weekend_factor: float = 1.0  # rate on Saturday and Sunday relative to a weekday
    trend_per_day: float = 0.0  # compound growth of the rate per day (0.01 = +1 %/day)
    holidays: tuple[int, ...] = ()  # day indices (0-based) at `holiday_factor`
    holiday_factor: float = 0.4

    def day_factor(self, d: int) -> float:
        f = (1.0 + self.trend_per_day) ** d
        if d % 7 in (5, 6):
            f *= self.weekend_factor
        if d in self.holidays:
            f *= self.holiday_factor
        return f


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
    for _ in range(rng.poisson(shape.spikes_per_hour * 24)):
        start = rng.uniform(0, DAY_S)
        dur = rng.uniform(*shape.spike_s)
        m = rng.uniform(*shape.spike_mult)
        lo, hi = int(start), min(int(start + dur) + 1, len(mult))
        mult[lo:hi] = np.maximum(mult[lo:hi], m)  # a step: no ramp
    return np.asarray(s * mult)


def per_minute_demand(arrivals: np.ndarray, service: np.ndarray, first_minute: int, n_min: int) -> np.ndarray:
    """Offered concurrency per minute (Little: Σ service of the minute's arrivals / 60)."""
    idx = (arrivals // 60).astype(np.int64) - first_minute
    ok = (idx >= 0) & (idx < n_min)
    return np.bincount(idx[ok], weights=service[ok], minlength=n_min)[:n_min] / 60.0


def _split(
    name: str, t: np.ndarray, svc: np.ndarray, tok: np.ndarray, eval_start: float, eval_end: float,
    warmup_s: float, description: str, retention_days: int = 8, prompt: np.ndarray | None = None,
) -> Workload:
    """The window [eval_start - warmup, eval_end) to simulate (scored from eval_start) and the
    per-minute history of everything before it (the forecaster's memory of earlier days)."""
    sim_start = max(float(t[0]) if len(t) else eval_start, eval_start - warmup_s)
    sim_start = min(sim_start, eval_start)
    hist: fc.DemandHistory | None = None
    before = t < sim_start
    first = int(t[before][0] // 60) if before.any() else 0
    end_minute = int(sim_start // 60) - 1
    n_min = end_minute - first + 1
    if before.any() and n_min > 0:  # (arrivals only in sim_start's own minute: no whole minute to remember)
        vals = np.full(max(n_min, retention_days * fc.MINUTES_PER_DAY), np.nan)
        vals[-n_min:] = per_minute_demand(t[before], svc[before], first, n_min)[-len(vals):]
        vals.flags.writeable = False
        hist = fc.DemandHistory(end_minute, vals)
    sel = (t >= sim_start) & (t < eval_end)
    return Workload(name, t[sel], svc[sel], tok[sel], sim_start, eval_end, hist, description,
                    eval_start=eval_start, prompt=None if prompt is None else prompt[sel])


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
    warmup_hours: float = 2.0,
    tokens: str = "conv",
    name: str | None = None,
) -> Workload:
    """`days` days of diurnal + burst traffic; the last day (first `eval_hours` of it) is
    evaluated, the earlier ones become per-minute demand history for the forecaster. The
    simulation starts `warmup_hours` before the evaluated day (from an active pool sized for
    that minute), so the evaluated day starts from the state the previous day left — the
    warm-up is longer than every memory of the decider (burst memory 90 min, stabilization
    window 5 min).

    `tile=True` takes arrivals from the trace (time-compressed and tiled, so its own
    minute-scale burstiness survives) and thins them to the day shape; otherwise arrivals are
    Poisson. Tokens come from the trace when given (resampled), else from the `tokens` model.
    """
    rng = np.random.default_rng(seed)
    grid = np.arange(0.0, DAY_S, 1.0)
    all_t: list[np.ndarray] = []
    all_c: list[np.ndarray] = []
    all_g: list[np.ndarray] = []
    for d in range(days):
        shp = day_shape(grid, shape, rng) * shape.day_factor(d)
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
            c, g = _synthetic_tokens(rng, len(t), tokens)
        all_t.append(t + d * DAY_S)
        all_c.append(c)
        all_g.append(g)
    t = np.concatenate(all_t)
    c = np.concatenate(all_c)
    g = np.concatenate(all_g)
    svc = c * sim.prefill_s_per_token + g * sim.tpot_s
    eval_start = (days - 1) * DAY_S
    eval_end = eval_start + eval_hours * 3600.0
    kind = "tiled Azure trace" if (tile and trace is not None) else f"Poisson, {tokens} tokens"
    week = ""
    if shape.weekend_factor != 1.0 or shape.trend_per_day or shape.holidays:
        week = (f", weekend ×{shape.weekend_factor:g}, trend {shape.trend_per_day * 100:+g}%/day, "
                f"holidays {list(shape.holidays)}")
    n_eval = int(np.count_nonzero((t >= eval_start) & (t < eval_end)))
    desc = (
        f"{days} days of diurnal traffic ({kind} arrivals, peak {peak_rps:g} req/s, "
        f"daily {shape.event_hour:g}:00 peak ×{shape.event_mult:g}, "
        f"~{shape.bursts_per_day:g} random bursts/day ×{shape.burst_mult[0]:g}–{shape.burst_mult[1]:g}"
        + (f", ~{shape.spikes_per_hour:g} spikes/h ×{shape.spike_mult[0]:g}–{shape.spike_mult[1]:g}"
           if shape.spikes_per_hour else "")
        + f"{week}); day {days} evaluated ({eval_hours:g} h, {n_eval} requests, {warmup_hours:g} h warm-up)"
    )
    default = f"{'tile' if tile and trace is not None else 'synthetic'}-{days}d"
    return _split(name or default, t, svc, c + g, eval_start, eval_end, warmup_hours * 3600.0, desc, prompt=c)


def make_replay_workload(
    trace: tuple[np.ndarray, np.ndarray, np.ndarray],
    sim: SimConfig,
    rate_scale: float = 1.0,
    seed: int = 1,
    eval_hours: float = 24.0,
    warmup_hours: float = 2.0,
) -> Workload:
    """The trace as recorded; `rate_scale` > 1 superposes jittered copies (rate × k, same
    shape). A trace longer than `eval_hours` is split: its last `eval_hours` are evaluated,
    everything before is the forecaster's history (the trace's own earlier days), the
    `warmup_hours` just before are simulated unscored. A trace with nothing before its
    evaluated window gets its own tail looped in front as the warm-up."""
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
    tok = c[idx] + g[idx]
    pr = c[idx]
    end = float(tt[-1]) + 1.0
    eval_start = max(float(tt[0]), end - eval_hours * 3600.0)
    span_h = (end - float(tt[0])) / 3600.0
    looped = ""
    if eval_start <= float(tt[0]) and warmup_hours > 0:
        # Nothing recorded before the evaluated window: the state before it is unknown, and
        # starting from an empty pool would score only the cold start. Prepend the trace's own
        # tail (at most `warmup_hours` of it), looped, as the unscored warm-up.
        span = end - float(tt[0])
        tail = tt >= end - min(warmup_hours * 3600.0, span)
        shift = end - float(tt[0])
        tt = np.concatenate([tt[tail] - shift, tt])
        svc = np.concatenate([svc[tail], svc])
        tok = np.concatenate([tok[tail], tok])
        pr = np.concatenate([pr[tail], pr])
        looped = f", warm-up: its last {min(warmup_hours * 3600.0, span) / 3600:.1f} h looped before it"
    w = _split("replay", tt, svc, tok, eval_start, end, warmup_hours * 3600.0, "", prompt=pr)
    n_eval = int(np.count_nonzero(w.arrivals >= eval_start))
    hist = (f"history {w.history.days_with_data()} day(s) from the trace itself" if w.history is not None
            else "no history") + looped
    desc = (f"trace replayed as recorded (rate ×{rate_scale:g}, {span_h:.1f} h; last "
            f"{(end - eval_start) / 3600:.1f} h evaluated, {n_eval} requests; {hist})")
    return Workload(w.name, w.arrivals, w.service, w.tokens, w.start, w.end, w.history, desc, w.eval_start,
                    prompt=w.prompt)
