"""`floodgate bench scrape` at tiny scale: both variants measured, the one without `*_created`
samples shorter (tests/test_metrics_first_event.py checks a real processor serves none)."""

from __future__ import annotations

import argparse
import re

import pytest
from floodgate.bench import scrape_cost


def test_bench_prints_both_variants_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert scrape_cost.run(argparse.Namespace(rounds=2, scrapes=2)) == 0
    rows = {m[0]: m for m in re.findall(r"^\| (with _created|without) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| ([\d.]+)x \|$",
                                        capsys.readouterr().out, re.M)}
    assert set(rows) == {"with _created", "without"}
    assert rows["with _created"][4] == "1.00"
    lines = {k: int(v[2].replace(",", "")) for k, v in rows.items()}
    assert 0 < lines["without"] < lines["with _created"]
