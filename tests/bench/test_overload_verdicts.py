"""The overload bench's static reference: the best static limit run beside each Vegas row, of
its own deployment variant (pure: rows built by hand)."""

from __future__ import annotations

import dataclasses

from floodgate.bench.overload import STATIC_SWEEP, Row, best_static, default_configs, verdicts


def row(config: str, goodput: float) -> Row:
    fields = {f.name: None for f in dataclasses.fields(Row)}
    fields.update(config=config, goodput_burst_tok_s=goodput, sparse_p0_early_drops=0, sparse_p0_offered=0)
    return Row(**fields)  # type: ignore[arg-type]


def test_every_default_run_sweeps_the_static_limits() -> None:
    assert all(f"static-{n}" in default_configs() for n in STATIC_SWEEP) and len(STATIC_SWEEP) >= 3
    # the shipped deployments pick endpoints: that variant is swept too
    assert all(f"static-{n}@picking" in default_configs() for n in STATIC_SWEEP)


def test_vegas_is_judged_against_the_best_static_limit_of_its_variant() -> None:
    rows = [row("static-64", 1160), row("static-96", 1308), row("static-128", 1402), row("static-160", 892),
            row("vegas-combined", 1380), row("vegas-combined@tuned", 1300),
            row("static-96@picking", 1296), row("vegas-combined@picking", 1338)]
    assert best_static(rows, "vegas-combined").config == "static-128"  # not the static-96 of old
    assert best_static(rows, "vegas-combined@tuned").config == "static-128"  # (class settings only)
    assert best_static(rows, "vegas-combined@picking").config == "static-96@picking"
    assert best_static(rows, "vegas-combined@engine-priority") is None  # no static of that variant ran
    lines = {ln.split(":")[0]: ln for ln in verdicts(rows)}
    assert "vs best static (static-128, of static-64, static-96, static-128, static-160 in this run) PASS (98%)" \
        in lines["vegas-combined"]
    # One hand-picked limit of a variant is no best static: reported, not judged (a review).
    pick = lines["vegas-combined@picking"]
    assert "vs static-96@picking (not judged: fewer than 3 static limits of this deployment ran" in pick
    assert "PASS (103%)" not in pick and "FAIL" not in pick.split("vs static-96@picking")[1]
    swept = verdicts([*rows, row("static-64@picking", 1200), row("static-128@picking", 1400)])
    line = next(ln for ln in swept if ln.startswith("vegas-combined@picking:"))
    assert "vs best static (static-128@picking, of static-64@picking, static-96@picking, static-128@picking in this " \
        "run) PASS (96%)" in line
