"""The predictive floor: same minute-of-day on each of the last days, exponentially decayed.

Demand history is one number per wall-clock minute (the mean concurrent demand, running +
waiting, over that minute; the live controller records it with `MinuteAccumulator` and persists
`DemandHistory.to_dict()` in Redis so a restart keeps it). For a target minute m the forecast is

    f(m) = Σ_d w_d · h(m − d·1440) / Σ_d w_d,   w_d = exp(−decay·(d−1)),  d = 1..days

over the days that have data for that minute. The floor is the max of f over
[now + lead_min, now + lead_max] (pre-scaling 5–10 min ahead, enough to cover a cold start),
divided by the per-replica target concurrency. It is withheld (`engaged=False`, reactive only)
when fewer than `min_days` days have data, or when the forecast's weighted absolute percentage
error over the last hour (WAPE, recomputed from history itself: what the same formula would
have said for those minutes) is above `max_error`.

Pure: no I/O, no clock; minutes are absolute (`floor(t / 60)`), so "same minute of day" is
`m − d·1440` in the controller's clock (UTC epoch seconds in the live controller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

MINUTES_PER_DAY = 1440


class ForecastConfig(BaseModel):
    """Forecaster settings. Defaults: docs/controller.md (forecast) and the backtest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="False: reactive only, no floor.")
    days: int = Field(default=7, ge=1, le=28, description="Past days that vote for a minute.")
    decay: float = Field(default=0.3, ge=0, description="Weight of day d is exp(-decay·(d-1)).")
    min_days: int = Field(default=3, ge=1, description="Days with data needed before the floor engages.")
    lead_min_s: float = Field(default=300.0, ge=0, description="Start of the pre-scale window (≥ a cold start).")
    lead_max_s: float = Field(default=600.0, gt=0, description="End of the pre-scale window.")
    error_window_s: float = Field(default=3600.0, gt=0, description="Window of the recent-error check.")
    max_error: float = Field(default=0.35, gt=0, description="WAPE over the error window above which the floor is withheld.")
    min_error_minutes: int = Field(default=15, ge=1, description="Actual minutes needed to judge the error (fewer: not judged).")
    error_floor: float = Field(default=1.0, gt=0, description="Per-minute demand added to the WAPE denominator so idle hours do not read as huge errors.")
    headroom: float = Field(default=1.0, gt=0, description="Multiplier on the forecast before it becomes replicas.")
    retention_days: int = Field(default=8, ge=1, description="Days of minutes the history keeps.")

    @model_validator(mode="after")
    def _leads(self) -> ForecastConfig:
        if self.lead_min_s > self.lead_max_s:
            raise ValueError("lead_min_s must be ≤ lead_max_s")
        if self.retention_days < self.days:
            raise ValueError("retention_days must be ≥ days")
        return self


def minute_of(t: float) -> int:
    return math.floor(t / 60.0)


@dataclass(frozen=True)
class DemandHistory:
    """Per-minute demand over the last `len(values)` minutes ending at `end_minute`.

    Immutable: `record` returns a new history. NaN marks a minute without data (controller
    down, scrape outage): such minutes are skipped, never read as zero demand.
    """

    end_minute: int
    values: np.ndarray  # float64, values[-1] is end_minute

    @staticmethod
    def empty(retention_minutes: int, end_minute: int = 0) -> DemandHistory:
        v = np.full(retention_minutes, np.nan)
        v.flags.writeable = False
        return DemandHistory(end_minute, v)

    @property
    def start_minute(self) -> int:
        return self.end_minute - len(self.values) + 1

    def record(self, minute: int, value: float) -> DemandHistory:
        n = len(self.values)
        if minute <= self.end_minute - n:
            return self  # older than retention
        if minute > self.end_minute:
            shift = minute - self.end_minute
            v = np.full(n, np.nan)
            if shift < n:
                v[: n - shift] = self.values[shift:]
            end = minute
        else:
            v = self.values.copy()
            end = self.end_minute
        v[n - 1 - (end - minute)] = value
        v.flags.writeable = False
        return DemandHistory(end, v)

    def get(self, minutes: np.ndarray) -> np.ndarray:
        """Values at absolute minutes (NaN outside the retained range or without data)."""
        idx = minutes - self.start_minute
        ok = (idx >= 0) & (idx < len(self.values))
        out = np.full(minutes.shape, np.nan)
        out[ok] = self.values[idx[ok]]
        return out

    def days_with_data(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.values))) // MINUTES_PER_DAY

    # Compact encoding for Redis (JSON): NaN becomes None.
    def to_dict(self) -> dict[str, Any]:
        return {
            "end_minute": self.end_minute,
            "values": [None if math.isnan(x) else round(float(x), 4) for x in self.values],
        }

    @staticmethod
    def from_dict(d: dict[str, Any], retention_minutes: int | None = None) -> DemandHistory:
        vals = np.array([np.nan if x is None else float(x) for x in d["values"]], dtype=float)
        h = DemandHistory(int(d["end_minute"]), vals)
        if retention_minutes is not None and retention_minutes != len(vals):
            # Re-size (retention changed in config): keep the newest minutes.
            out = DemandHistory.empty(retention_minutes, h.end_minute)
            mins = np.arange(out.start_minute, out.end_minute + 1)
            v = h.get(mins)
            v.flags.writeable = False
            return DemandHistory(out.end_minute, v)
        vals.flags.writeable = False
        return h


@dataclass(frozen=True, slots=True)
class MinuteAccumulator:
    """Running mean of demand samples within the current minute."""

    minute: int | None = None
    total: float = 0.0
    count: int = 0


def accumulate(
    acc: MinuteAccumulator, now: float, value: float
) -> tuple[MinuteAccumulator, tuple[int, float] | None]:
    """Add one sample; returns the new accumulator and (minute, mean) when a minute closed."""
    m = minute_of(now)
    if acc.minute is None or m == acc.minute:
        return MinuteAccumulator(m, acc.total + value, acc.count + 1), None
    done = (acc.minute, acc.total / acc.count) if acc.count else None
    return MinuteAccumulator(m, value, 1), done


def weights(cfg: ForecastConfig) -> np.ndarray:
    """w_d = exp(-decay·(d-1)) for d = 1..days (not normalised)."""
    return np.exp(-cfg.decay * np.arange(cfg.days, dtype=float))


def forecast_minutes(
    history: DemandHistory, minutes: np.ndarray, cfg: ForecastConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(forecast, days_with_data) for each absolute minute in `minutes`.

    Forecast is NaN where no past day has data.
    """
    w = weights(cfg)
    lags = np.arange(1, cfg.days + 1) * MINUTES_PER_DAY
    past = history.get(minutes[:, None] - lags[None, :])  # (len(minutes), days)
    have = ~np.isnan(past)
    wsum = (have * w).sum(axis=1)
    num = (np.where(have, past, 0.0) * w).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        f = np.where(wsum > 0, num / wsum, np.nan)
    return f, have.sum(axis=1)


@dataclass(frozen=True, slots=True)
class Forecast:
    """The forecaster's answer at one instant."""

    engaged: bool
    reason: str  # "ok" | "disabled" | "short_history" | "high_error"
    peak: float | None  # max forecast demand over the lead window
    days: int  # fewest days with data over the lead window
    error: float | None  # WAPE over the recent error window (None: not judged)


def recent_error(history: DemandHistory, now: float, cfg: ForecastConfig) -> float | None:
    """WAPE of the forecast against actual demand over the last `error_window_s`."""
    end = minute_of(now)
    n = max(1, int(cfg.error_window_s // 60))
    mins = np.arange(end - n, end)
    actual = history.get(mins)
    f, _ = forecast_minutes(history, mins, cfg)
    ok = ~np.isnan(actual) & ~np.isnan(f)
    k = int(ok.sum())
    if k < cfg.min_error_minutes:
        return None
    return float(np.abs(f[ok] - actual[ok]).sum() / (actual[ok].sum() + cfg.error_floor * k))


def predict(
    history: DemandHistory,
    now: float,
    cfg: ForecastConfig,
    lead_min_s: float | None = None,
    lead_max_s: float | None = None,
) -> Forecast:
    """Peak forecast demand over [now + lead_min, now + lead_max], or why there is none."""
    if not cfg.enabled:
        return Forecast(False, "disabled", None, 0, None)
    lo = minute_of(now + (cfg.lead_min_s if lead_min_s is None else lead_min_s))
    hi = minute_of(now + (cfg.lead_max_s if lead_max_s is None else lead_max_s))
    mins = np.arange(lo, hi + 1)
    f, days = forecast_minutes(history, mins, cfg)
    dmin = int(days.min()) if len(days) else 0
    peak = float(np.nanmax(f)) if np.any(~np.isnan(f)) else None
    if dmin < cfg.min_days or peak is None:
        return Forecast(False, "short_history", peak, dmin, None)
    err = recent_error(history, now, cfg)
    if err is not None and err > cfg.max_error:
        return Forecast(False, "high_error", peak, dmin, err)
    return Forecast(True, "ok", peak, dmin, err)


def floor_replicas(forecast: Forecast, target_concurrency: float, headroom: float = 1.0) -> int | None:
    """The forecast as a replica floor (None when the forecaster is not engaged)."""
    if not forecast.engaged or forecast.peak is None:
        return None
    return max(0, math.ceil(forecast.peak * headroom / target_concurrency - 1e-9))
