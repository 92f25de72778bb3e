"""`floodgate bench scrape` at tiny scale: both variants measured, the one without `*_created`
samples shorter (tests/test_metrics_first_event.py checks a real processor serves none)."""

from __future__ import annotations

import argparse
import re

import pytest
from floodgate.bench import scrape_cost


def test_bench_prints_both_variants_of_both_formats_and_gives_the_setting_back(
        capsys: pytest.CaptureFixture[str]) -> None:
    from prometheus_client import metrics

    was = metrics._use_created
    assert scrape_cost.run(argparse.Namespace(rounds=2, scrapes=2)) == 0
    assert metrics._use_created == was
    rows = re.findall(r"^\| (text|OpenMetrics) \| (with _created|without) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+)x \|$",
                      capsys.readouterr().out, re.M)
    assert {(r[0], r[1]) for r in rows} == {(f, v) for f in ("text", "OpenMetrics") for v in ("with _created", "without")}
    for fmt in ("text", "OpenMetrics"):
        lines = {r[1]: int(r[3].replace(",", "")) for r in rows if r[0] == fmt}
        assert 0 < lines["without"] < lines["with _created"], (fmt, lines)
        assert next(r[5] for r in rows if r[0] == fmt and r[1] == "with _created") == "1.00"
