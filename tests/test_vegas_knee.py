"""Vegas holds the knee: 8 simulated hours of saturation on the pure engine (fake time).

The same simulation as `floodgate bench vegas-knee` (bench/vegas_knee.py): the knee is the
concurrency with the highest goodput on the engine, measured here; the shipped limit must stay
within ±25 % of it, and above 80 % of it with 5 % upstream 5xx. Netflix's flavor with the
same tolerance ratchets away (the defect this guards against).
"""

from __future__ import annotations

import pytest
from floodgate.bench.vegas_knee import Setup, _pool, find_knee, saturate, summarize
from floodgate.extproc.config import PoolConfig

SETUP = Setup()
SHIPPED = PoolConfig()


@pytest.fixture(scope="module")
def knee() -> int:
    c1 = SHIPPED.classes[1]
    k, curve = find_knee(SETUP, c1.slo_ttft_s * SETUP.time_scale, c1.slo_tpot_s * SETUP.time_scale,
                         200 * SETUP.time_scale, list(range(10, 161, 10)))
    assert 30 <= k <= 120, curve  # a knee, not the edge of the grid
    assert curve[k] > 1.2 * curve[160] and curve[k] > 1.2 * curve[10]
    return k


def test_shipped_vegas_holds_the_knee_for_eight_hours(knee: int) -> None:
    s = summarize(saturate(SETUP, _pool({}, SETUP), 8.0), knee, 600)
    assert s["windows"] > 3000
    assert s["within_25pct"] >= 0.99, s
    assert 0.75 * knee <= s["mean"] <= 1.25 * knee, s


def test_five_percent_5xx_keep_it_above_80_percent(knee: int) -> None:
    s = summarize(saturate(SETUP, _pool({}, SETUP), 8.0, error_rate=0.05), knee, 600)
    assert s["above_80pct"] >= 0.99, s


def test_netflix_flavor_with_tolerance_ratchets_under_load(knee: int) -> None:
    s = summarize(saturate(SETUP, _pool({"flavor": "netflix"}, SETUP), 8.0), knee, 600)
    assert s["max"] > 3 * knee, s  # the probe re-baselines at loaded latency
