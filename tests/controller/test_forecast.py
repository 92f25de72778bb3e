"""Forecaster: weights, lead window, fallbacks, history encoding."""

from __future__ import annotations

import json
import math
from datetime import datetime
from zoneinfo import ZoneInfo

import numpy as np
import pytest
from floodgate.controller import forecast as fc
from floodgate.controller.config import ConfigError, parse_config
from pydantic import ValidationError

DAY = 1440
CFG = fc.ForecastConfig()


def hist_from(fn, days: int, end_minute: int) -> fc.DemandHistory:  # type: ignore[no-untyped-def]
    """History of `days` full days ending at `end_minute`, value fn(absolute minute)."""
    h = fc.DemandHistory.empty(8 * DAY, end_minute)
    mins = np.arange(end_minute - days * DAY + 1, end_minute + 1)
    v = np.array(h.values)
    v[-len(mins):] = [fn(int(m)) for m in mins]
    v.flags.writeable = False
    return fc.DemandHistory(end_minute, v)


def test_weights_decay_by_day() -> None:
    w = fc.weights(CFG)
    assert len(w) == 7
    assert w[0] == 1.0
    assert w[1] == pytest.approx(math.exp(-0.3))
    assert w[6] == pytest.approx(math.exp(-1.8))


def test_same_minute_weighted_average() -> None:
    m = 10 * DAY + 600
    h = fc.DemandHistory.empty(8 * DAY, m)
    h = h.record(m - DAY, 10.0).record(m - 2 * DAY, 20.0)
    f, days = fc.forecast_minutes(h, np.array([m]), CFG)
    w2 = math.exp(-0.3)
    assert f[0] == pytest.approx((10 + 20 * w2) / (1 + w2))
    assert days[0] == 2


def test_constant_history_forecasts_the_constant() -> None:
    now_min = 20 * DAY + 300
    h = hist_from(lambda m: 40.0, 7, now_min)
    f = fc.predict(h, now_min * 60.0, CFG)
    assert f.engaged and f.reason == "ok"
    assert f.peak == pytest.approx(40.0)
    assert f.days == 7
    assert f.error == pytest.approx(0.0)
    assert fc.floor_replicas(f, 10.0) == 4


def test_lead_window_is_five_to_ten_minutes_ahead() -> None:
    now_min = 20 * DAY + 300

    def spike_at(offset: int):  # type: ignore[no-untyped-def]
        return lambda m: 100.0 if (m % DAY) == ((now_min + offset) % DAY) else 10.0

    for offset, expected in ((4, 10.0), (5, 100.0), (7, 100.0), (10, 100.0), (11, 10.0)):
        h = hist_from(spike_at(offset), 7, now_min - 1)
        f = fc.predict(h, now_min * 60.0, CFG.model_copy(update={"max_error": 100.0}))
        assert f.engaged
        assert f.peak == pytest.approx(expected), offset


def test_short_history_falls_back_to_reactive() -> None:
    now_min = 20 * DAY
    h = hist_from(lambda m: 40.0, 2, now_min)
    f = fc.predict(h, now_min * 60.0, CFG)
    assert (f.engaged, f.reason, f.days) == (False, "short_history", 2)
    assert fc.floor_replicas(f, 10.0) is None
    h3 = hist_from(lambda m: 40.0, 3, now_min)
    assert fc.predict(h3, now_min * 60.0, CFG).engaged


def test_missing_minutes_are_skipped_not_zero() -> None:
    now_min = 20 * DAY
    h = hist_from(lambda m: 40.0, 7, now_min)
    target = now_min + 6
    h = h.record(target - DAY, float("nan"))  # yesterday's minute lost (controller down)
    f, days = fc.forecast_minutes(h, np.array([target]), CFG)
    assert f[0] == pytest.approx(40.0)
    assert days[0] == 6


def test_high_recent_error_falls_back() -> None:
    now_min = 20 * DAY
    # Past days said 40, the last hour actually ran at 100.
    h = hist_from(lambda m: 100.0 if m > now_min - 60 else 40.0, 7, now_min)
    f = fc.predict(h, now_min * 60.0 + 30, CFG)
    assert (f.engaged, f.reason) == (False, "high_error")
    assert f.error is not None and f.error > CFG.max_error
    # A modest error keeps it engaged.
    h = hist_from(lambda m: 44.0 if m > now_min - 60 else 40.0, 7, now_min)
    assert fc.predict(h, now_min * 60.0 + 30, CFG).engaged


def test_error_not_judged_without_recent_actuals() -> None:
    now_min = 20 * DAY
    h = hist_from(lambda m: 40.0, 7, now_min - 120)  # two-hour gap (restart)
    f = fc.predict(h, now_min * 60.0, CFG)
    assert f.engaged and f.error is None


def test_disabled() -> None:
    h = hist_from(lambda m: 40.0, 7, 20 * DAY)
    f = fc.predict(h, 20 * DAY * 60.0, CFG.model_copy(update={"enabled": False}))
    assert (f.engaged, f.reason) == (False, "disabled")


def test_floor_replicas_rounding_and_headroom() -> None:
    f = fc.Forecast(True, "ok", 25.0, 7, 0.1)
    assert fc.floor_replicas(f, 10.0) == 3
    assert fc.floor_replicas(f, 12.5) == 2
    assert fc.floor_replicas(f, 10.0, headroom=1.2) == 3
    assert fc.floor_replicas(f, 10.0, headroom=1.3) == 4


def test_history_record_shift_and_retention() -> None:
    h = fc.DemandHistory.empty(10, end_minute=100)
    h2 = h.record(100, 1.0)
    assert h.values[-1] != h.values[-1]  # original untouched (NaN)
    h3 = h2.record(103, 4.0)
    assert h3.end_minute == 103
    assert list(h3.get(np.array([100, 101, 103]))) == pytest.approx([1.0, np.nan, 4.0], nan_ok=True)
    assert h3.record(90, 9.0) is h3  # older than retention
    h4 = h3.record(102, 3.0)  # inside the window
    assert h4.get(np.array([102]))[0] == 3.0
    h5 = h4.record(500, 5.0)  # jump beyond the whole window
    assert np.isnan(h5.values[:-1]).all() and h5.values[-1] == 5.0
    with pytest.raises(ValueError):
        h5.values[0] = 1.0  # immutable


def test_history_dict_round_trip() -> None:
    h = fc.DemandHistory.empty(5, end_minute=10).record(9, 2.5).record(10, 3.0)
    d = h.to_dict()
    assert d == {"end_minute": 10, "values": [None, None, None, 2.5, 3.0]}
    back = fc.DemandHistory.from_dict(d)
    assert back.end_minute == 10
    assert np.array_equal(back.values, h.values, equal_nan=True)
    # Re-sized on load when retention changed: newest minutes kept.
    small = fc.DemandHistory.from_dict(d, retention_minutes=2)
    assert list(small.values) == [2.5, 3.0]
    big = fc.DemandHistory.from_dict(d, retention_minutes=8)
    assert len(big.values) == 8 and big.values[-1] == 3.0


def test_days_with_data() -> None:
    assert hist_from(lambda m: 1.0, 3, 20 * DAY).days_with_data() == 3


def test_minute_accumulator() -> None:
    acc = fc.MinuteAccumulator()
    out = []
    for t, v in ((60.0, 2.0), (70.0, 4.0), (119.0, 6.0), (120.0, 10.0), (185.0, 1.0)):
        acc, done = fc.accumulate(acc, t, v)
        if done:
            out.append(done)
    assert out == [(1, 4.0), (2, 10.0)]
    assert acc.minute == 3


def test_config_validation() -> None:
    with pytest.raises(ValidationError, match="lead_min_s"):
        fc.ForecastConfig(lead_min_s=700, lead_max_s=600)
    with pytest.raises(ValidationError, match="retention_days"):
        fc.ForecastConfig(days=7, retention_days=3)
    c = fc.ForecastConfig()
    assert (c.days, c.decay, c.lead_min_s, c.lead_max_s) == (7, 0.3, 300.0, 600.0)


def test_one_spike_yesterday_does_not_set_todays_floor() -> None:
    """A single one-minute 35x spike yesterday inside today's lead window: before, the floor
    read 32 replicas for the 6 minutes it was in the window (the weighted mean of 700 and 20s)."""
    now_min = 20 * DAY + 500
    spike = now_min + 7 - DAY
    h = hist_from(lambda m: 700.0 if m == spike else 20.0, 7, now_min - 1)
    f = fc.predict(h, now_min * 60.0 + 1, CFG)
    w = fc.weights(CFG)
    # Clipped to 2 x the other days' 20 before it votes: (40·w1 + 20·(w2..w7)) / Σw.
    assert f.engaged and f.peak == pytest.approx((40.0 * w[0] + 20.0 * w[1:].sum()) / w.sum())
    assert fc.floor_replicas(f, 7.0) == 4  # 3 without the spike, 32 before
    raw = fc.predict(h, now_min * 60.0 + 1, CFG.model_copy(update={"outlier_ratio": None}))
    assert fc.floor_replicas(raw, 7.0) == 32  # the setting off: the plain weighted mean


def test_a_peak_that_recurs_every_day_is_still_prescaled() -> None:
    """The 09:00 peak (7x the base) on each of the last 7 days, drifting by up to 12 minutes
    from day to day, is pre-scaled in full: each day's peak is compared with the others'."""
    nine = 9 * 60
    drift = {d: (d * 5) % 25 - 12 for d in range(1, 8)}  # -12 .. +12 minutes

    def day_shape(m: int) -> float:
        d = (20 * DAY + nine - m) // DAY + 1  # days back from today's 09:00
        start = nine + drift.get(d, 0)
        return 140.0 if start <= m % DAY < start + 20 else 20.0

    now_min = 20 * DAY + nine - 7  # 08:53: the lead window 08:58-09:03
    h = hist_from(day_shape, 7, now_min - 1)
    f = fc.predict(h, now_min * 60.0, CFG)
    raw = fc.predict(h, now_min * 60.0, CFG.model_copy(update={"outlier_ratio": None}))
    assert f.engaged and f.peak == pytest.approx(raw.peak)
    assert fc.floor_replicas(f, 7.0) == fc.floor_replicas(raw, 7.0) >= 15
    # A peak on yesterday only, below 2x the other days: a real change, kept.
    h1 = hist_from(lambda m: 36.0 if m % DAY == (now_min + 7) % DAY and m > now_min - DAY else 20.0, 7, now_min - 1)
    assert fc.predict(h1, now_min * 60.0, CFG).peak == pytest.approx(
        fc.predict(h1, now_min * 60.0, CFG.model_copy(update={"outlier_ratio": None})).peak)


def test_non_finite_demand_is_no_data_and_the_floor_is_total() -> None:
    m = 10 * DAY + 600
    h = fc.DemandHistory.empty(8 * DAY, m)
    for bad in (math.inf, -math.inf, math.nan, -3.0):
        assert math.isnan(h.record(m, bad).values[-1])
    assert h.record(m, 5.0).values[-1] == 5.0
    # Redis JSON with Infinity / NaN / a negative (json.loads accepts the first two).
    d = json.loads(f'{{"end_minute": {m}, "values": [1.5, Infinity, NaN, -Infinity, -2, null]}}')
    got = fc.DemandHistory.from_dict(d)
    assert got.values[0] == 1.5 and np.isnan(got.values[1:]).all()
    # A history built by hand with inf (the backtest builds its own) votes as no data.
    now_min = 20 * DAY + 500
    v = np.array(hist_from(lambda _: 20.0, 7, now_min - 1).values)
    v[-1 - (now_min - 1 - (now_min + 7 - DAY))] = math.inf
    v.flags.writeable = False
    f = fc.predict(fc.DemandHistory(now_min - 1, v), now_min * 60.0, CFG)
    assert fc.floor_replicas(f, 7.0) == 3
    # floor_replicas never raises: a peak or a target that is not a finite number is no floor.
    for peak, target, headroom in ((math.inf, 7.0, 1.0), (math.nan, 7.0, 1.0), (1e308, 1e-308, 1.0),
                                   (10.0, 0.0, 1.0), (10.0, math.nan, 1.0), (10.0, 7.0, math.inf)):
        assert fc.floor_replicas(fc.Forecast(True, "ok", peak, 7, None), target, headroom) is None


def _berlin_days(now: datetime, days: int) -> fc.DemandHistory:
    """`days` days before `now` of a 20-concurrent base with a 09:00-09:40 local event at 140."""
    z = ZoneInfo("Europe/Berlin")
    end = fc.minute_of(now.timestamp()) - 1

    def local_event(m: int) -> float:
        t = datetime.fromtimestamp(m * 60, z)
        return 140.0 if t.hour == 9 and t.minute < 40 else 20.0

    return hist_from(local_event, days, end)


def test_timezone_keeps_a_local_event_aligned_across_dst() -> None:
    """The day of the spring change (2026-03-29 02:00, Berlin UTC+1 -> +2): the 09:00 local
    event of the past week was at 08:00 UTC, today's is at 07:00 UTC. Days 1440 minutes apart
    forecast it an hour late (the UTC default); aligned on Berlin's wall clock, on time."""
    z = ZoneInfo("Europe/Berlin")
    now = datetime(2026, 3, 29, 8, 53, tzinfo=z)  # lead window 08:58-09:03 local
    h = _berlin_days(now, 7)
    berlin = CFG.model_copy(update={"timezone": "Europe/Berlin"})
    assert fc.floor_replicas(fc.predict(h, now.timestamp(), berlin), 7.0) == 20
    assert fc.floor_replicas(fc.predict(h, now.timestamp(), CFG), 7.0) == 3  # UTC: the hour before it
    later = datetime(2026, 3, 29, 9, 53, tzinfo=z)  # UTC alignment sees it an hour late
    assert fc.floor_replicas(fc.predict(h, later.timestamp(), CFG), 7.0) == 20
    # Before the change both agree (Berlin's days are 1440 minutes there).
    before = datetime(2026, 3, 27, 8, 53, tzinfo=z)
    hb = _berlin_days(before, 7)
    assert fc.floor_replicas(fc.predict(hb, before.timestamp(), berlin), 7.0) == 20
    assert fc.floor_replicas(fc.predict(hb, before.timestamp(), CFG), 7.0) == 20


def test_past_minutes_is_the_same_wall_clock_minute() -> None:
    z = ZoneInfo("Europe/Berlin")
    m = fc.minute_of(datetime(2026, 3, 30, 12, 0, tzinfo=z).timestamp())  # the day after the change
    at = fc.past_minutes(np.array([m]), 2, "Europe/Berlin")[0]
    assert [datetime.fromtimestamp(int(x) * 60, z).strftime("%d %H:%M") for x in at] == ["29 12:00", "28 12:00"]
    assert list(m - at) == [1440, 1440 + 1380]  # 29 March had 23 hours
    assert list(fc.past_minutes(np.array([m]), 2, "UTC")[0]) == [m - 1440, m - 2880]


def test_unknown_timezone_fails_config_load_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        fc.ForecastConfig(timezone="Mars/Olympus_Mons")
    # Not zones: the host's own (days would depend on where the controller runs), a folder of
    # the database (its error showed the installation's path).
    for name in ("localtime", "America", "../zoneinfo"):
        with pytest.raises(ValidationError, match="unknown IANA time zone") as err:
            fc.ForecastConfig(timezone=name)
        assert "/site-packages/" not in str(err.value) and "tzdata" not in str(err.value), err.value
    raw = {"pools": [{"name": "p", "forecast": {"timezone": "Europe/Berlinn"},
                      "actuator": {"kind": "static", "endpoints": ["127.0.0.1:8000"]}}]}
    with pytest.raises(ConfigError, match=r"pools\.0\.forecast\.timezone.*Europe/Berlinn"):
        parse_config(raw, env={})
    assert parse_config({**raw, "pools": [{**raw["pools"][0], "forecast": {"timezone": "Asia/Tokyo"}}]},
                        env={}).pools[0].forecast.timezone == "Asia/Tokyo"


def test_a_spike_over_idle_days_is_clipped_idle_minutes_are_data() -> None:
    """Mutation review: a minute of 0 demand on the other days is data (an idle pool), not a gap.
    A one-minute spike of 700 yesterday over six idle days is clipped to 2 × max(0, error_floor
    1) = 2 before it votes; read as "no other day to compare", it was kept whole and the floor
    pre-scaled ~30 replicas for an idle pool (the spike test above has 20s, not 0s, around it)."""
    now_min = 20 * DAY + 500
    spike = now_min + 7 - DAY
    h = hist_from(lambda m: 700.0 if m == spike else 0.0, 7, now_min - 1)
    f = fc.predict(h, now_min * 60.0 + 1, CFG)
    w = fc.weights(CFG)
    assert f.engaged and f.peak == pytest.approx(2.0 * w[0] / w.sum())
    assert fc.floor_replicas(f, 7.0) == 1


def test_recent_error_adds_error_floor_per_minute_to_the_denominator() -> None:
    """Mutation review: WAPE = Σ|forecast − actual| / (Σ actual + error_floor × minutes), so an
    idle hour does not read as an infinite error: forecast 1, actual 0 for the last hour is
    60 / (0 + 60) = 1.0, and a halved demand (10 -> 5) 300 / (300 + 60) = 0.83. (With the
    floor divided by the minutes instead, the idle hour read 60 / (1 / 60) = 3,600.)"""
    now_min = 20 * DAY + 600
    idle = hist_from(lambda m: 0.0 if m > now_min - 61 else 1.0, 7, now_min - 1)
    assert fc.recent_error(idle, now_min * 60.0, CFG) == pytest.approx(1.0)
    halved = hist_from(lambda m: 5.0 if m > now_min - 61 else 10.0, 7, now_min - 1)
    assert fc.recent_error(halved, now_min * 60.0, CFG) == pytest.approx(300 / 360)
