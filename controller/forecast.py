"""The predictive floor: same minute-of-day on each of the last days, exponentially decayed.

Demand history is one number per wall-clock minute (the mean concurrent demand, running +
waiting, over that minute; the live controller records it with `MinuteAccumulator` and persists
`DemandHistory.to_dict()` in Redis so a restart keeps it). For a target minute m the forecast is

    f(m) = Σ_d w_d · h'(p_d(m)) / Σ_d w_d,   w_d = exp(−decay·(d−1)),  d = 1..days

over the days that have data for that minute, where p_d(m) is the same minute d days earlier
(m − d·1440, or the same local wall-clock minute with a `timezone`: `past_minutes`) and h' is
the history with one-off outliers clipped against the other days (`clip_outliers`). The floor is the max of f over
[now + lead_min, now + lead_max] (pre-scaling 5–10 min ahead, enough to cover a cold start),
divided by the per-replica target concurrency. It is withheld (`engaged=False`, reactive only)
when fewer than `min_days` days have data, or when the forecast's weighted absolute percentage
error over the last hour (WAPE, recomputed from history itself: what the same formula would
have said for those minutes) is above `max_error`.

Pure: no I/O, no clock; minutes are absolute (`floor(t / 60)`), so "same minute of day" is
`m − d·1440` in the controller's clock (UTC epoch seconds in the live controller) unless a
`timezone` aligns the days on local time (the zone is loaded when the config is validated).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from functools import lru_cache
from typing import Any
from zoneinfo import ZoneInfo, available_timezones

import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from floodgate.yamlconfig import STRICT

MINUTES_PER_DAY = 1440


class ForecastConfig(BaseModel):
    """Forecaster settings. Defaults: docs/controller.md (forecast) and the backtest."""

    model_config = STRICT

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
    retention_days: int = Field(default=8, ge=1, le=366, description="Days of minutes the history keeps (at most a "
                                "year: the history is stored as one value, ~12 KB a day, under the shipped Redis's "
                                "16 MB value cap).")
    outlier_ratio: float | None = Field(
        default=2.0, ge=1, description="Robustness to one-off spikes: a past day's minute above this multiple "
        "of the largest value any *other* day had within `outlier_window_min` of the same minute of day "
        "(at least `error_floor`) is clipped to that multiple before it votes, so a single spike yesterday "
        "does not set today's floor, while a peak that recurs on other days is kept. A new level is forecast "
        "from its second day (from a quiet history, at most this multiple of `error_floor` before). With "
        "`days: 1` there is no other day and nothing is clipped. null: no clipping.")
    outlier_window_min: int = Field(
        default=30, ge=0, le=720, description="Minutes either side of the same minute of day in which the other "
        "days' largest value is looked for (a daily peak that drifts by up to this much is still a peak).")

    timezone: str = Field(
        default="UTC", min_length=1, description="IANA time zone (e.g. Europe/Berlin) whose wall clock the "
        "days are aligned on: a minute is compared with the same local time on each past day, so a daily "
        "09:00 local peak stays at 09:00 across a DST change. UTC: days are 1440 minutes apart in the "
        "controller's clock (a DST change then shifts every past day by the offset change, e.g. a 09:00 "
        "event is pre-scaled an hour late or early for a week).")

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, v: str) -> str:
        # Only names of the IANA database: `localtime` (the host's zone, so the days would depend
        # on where the controller runs) and folder names are not zones; the error never shows a
        # path of the installation.
        if v != "UTC" and (v in ("localtime", "posixrules", "Factory") or v not in available_timezones()):
            raise ValueError(f"unknown IANA time zone {v!r} (e.g. UTC, Europe/Berlin, America/New_York)")
        try:
            zone(v)  # loads it now (config load), so the forecaster reads it from the cache
        except (ValueError, OSError, KeyError):  # ZoneInfoNotFoundError is a KeyError
            raise ValueError(f"unknown IANA time zone {v!r} (e.g. UTC, Europe/Berlin, America/New_York)") from None
        return v

    @model_validator(mode="after")
    def _leads(self) -> ForecastConfig:
        if self.lead_min_s > self.lead_max_s:
            raise ValueError("lead_min_s must be ≤ lead_max_s")
        if self.retention_days < self.days:
            raise ValueError("retention_days must be ≥ days")
        return self


@lru_cache(maxsize=16)
def zone(name: str) -> tzinfo:
    """The tzinfo of an IANA name (UTC without a lookup). Loaded and cached when the config is
    validated (`ForecastConfig.timezone`), so the forecast itself reads no file."""
    return UTC if name == "UTC" else ZoneInfo(name)


def past_minutes(minutes: np.ndarray, days: int, tz: str) -> np.ndarray:
    """(len(minutes), days): for each absolute minute, the same wall-clock minute 1..days
    days before it in `tz` (UTC: m - d·1440). Across a DST change the local day is 1380 or
    1500 minutes long; a wall-clock time that did not exist that day (the hour skipped in
    spring) maps to the instant an hour later, one that happened twice to its first time."""
    lags = np.arange(1, days + 1) * MINUTES_PER_DAY
    if tz == "UTC":
        return minutes[:, None] - lags[None, :]
    z = zone(tz)
    out = np.empty((len(minutes), days), dtype=np.int64)
    for i, m in enumerate(minutes.tolist()):
        local = datetime.fromtimestamp(m * 60, z)
        wall = local.replace(tzinfo=None)
        for d in range(days):
            past = (wall - timedelta(days=d + 1)).replace(tzinfo=z)
            out[i, d] = math.floor(past.timestamp() / 60.0)
    return out


def minute_of(t: float) -> int:
    return math.floor(t / 60.0)


def _clean(value: float) -> float:
    """A demand sample as the history keeps it: NaN unless finite and ≥ 0."""
    v = float(value)
    return v if math.isfinite(v) and v >= 0 else math.nan


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
        """A new history with `value` at `minute`; a non-finite or negative value is recorded as
        NaN (no data), never as a number the forecast would divide by or scale on."""
        value = _clean(value)
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
        # Redis JSON may hold Infinity / NaN / negatives (a bad write, a hand edit): no data.
        vals = np.array([np.nan if x is None else _clean(float(x)) for x in d["values"]], dtype=float)
        end = d["end_minute"]
        if not isinstance(end, (int, float)) or not math.isfinite(end) or not 0 <= end < 2**40:
            # (an infinite end raised OverflowError, 1e300 an IndexError deep in numpy)
            raise ValueError(f"end_minute {end!r} is no minute a clock reaches")
        h = DemandHistory(int(end), vals)
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

    Forecast is NaN where no past day has data. Past values that are outliers against the
    other days (`outlier_ratio`) are clipped first (`clip_outliers`).
    """
    w = weights(cfg)
    at = past_minutes(minutes, cfg.days, cfg.timezone)  # (len(minutes), days): same wall-clock minute
    past = history.get(at)
    past = np.where(np.isfinite(past) & (past >= 0), past, np.nan)  # a history built by hand may hold inf
    if cfg.outlier_ratio is not None:
        past = clip_outliers(history, at, past, cfg)
    have = ~np.isnan(past)
    wsum = (have * w).sum(axis=1)
    num = (np.where(have, past, 0.0) * w).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        f = np.where(wsum > 0, num / wsum, np.nan)
    return f, have.sum(axis=1)


def clip_outliers(history: DemandHistory, at: np.ndarray, past: np.ndarray, cfg: ForecastConfig) -> np.ndarray:
    """`past` (minutes x days, read at the absolute minutes `at`) with each value clipped to `outlier_ratio` x the largest value
    the *other* days had within ±`outlier_window_min` of the same minute of day (that largest
    value taken as at least `error_floor`). A value with no other day to compare is kept.

    A one-minute spike on one day is an outlier against every other day and votes at most as a
    double of their largest value; a peak that recurs (on any other day, within the window)
    is compared with itself and kept whole."""
    ratio = cfg.outlier_ratio
    assert ratio is not None
    k = cfg.outlier_window_min
    offs = np.arange(-k, k + 1)
    near = history.get(at[:, :, None] + offs[None, None, :])
    near = np.where(np.isfinite(near) & (near >= 0), near, -np.inf)
    day_max = near.max(axis=2)  # (minutes, days): -inf where the day has no data near
    top = day_max.argmax(axis=1)
    first = day_max.max(axis=1)
    rest = day_max.copy()
    rest[np.arange(len(at)), top] = -np.inf
    second = rest.max(axis=1)
    others = np.where(np.arange(day_max.shape[1])[None, :] == top[:, None], second[:, None], first[:, None])
    cap = ratio * np.maximum(others, cfg.error_floor)
    return np.where(np.isfinite(others) & (past > cap), cap, past)


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
    """The forecast as a replica floor (None when the forecaster is not engaged). Total: a
    peak, target or headroom that is not a finite number (or a target ≤ 0) gives None (no
    floor, reactive only), never an exception."""
    if not forecast.engaged or forecast.peak is None:
        return None
    need = forecast.peak * headroom / target_concurrency if target_concurrency > 0 else math.nan
    if not math.isfinite(need):
        return None
    return max(0, math.ceil(need - 1e-9))
