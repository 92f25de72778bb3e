"""The backtest suite on a short window: the tables, the verdict, the Pareto sweep and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from floodgate.controller.backtest import engine, suite

from floodgate.cli import main


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    sim = engine.SimConfig()
    return [suite.run_job(suite.Job("smooth-long", 1, kind, None, 0.3, sim, warmup_hours=0.2)) for kind in ("compare", "pareto")]


def test_suite_tables_verdict_and_pareto(results: list[dict[str, object]], tmp_path: Path) -> None:
    comp, par = results
    by = {r["name"]: r for r in comp["results"]}  # type: ignore[index]
    assert set(by) == set(suite.SUITE_POLICIES)
    v = suite.verdict(comp)  # type: ignore[arg-type]
    f, o = by["floodgate"], by["zero-wait"]
    assert v["ratio"] == pytest.approx(f["unweighted"] / o["unweighted"])
    assert v["met"] == (f["slo"] >= 0.99 and v["ratio"] <= 1.25 and all(v["ahead"].values())
                        and all(v["cheaper"].values()))
    assert [p["pool"] for p in par["points"]] == list(suite.POOL_SIZES)  # type: ignore[index]
    costs = [p["cost_s"] for p in par["points"]]  # type: ignore[index]
    assert costs[-1] > costs[0]  # a bigger fixed pool costs more
    md = suite.markdown(results)  # type: ignore[arg-type]
    assert "**smooth-long**" in md and "| 1 |" in md and ("met" in md or "missed" in md)
    suite.write(results, tmp_path)  # type: ignore[arg-type]
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    written = (tmp_path / "suite.md").read_text()
    assert "pool 16" in written
    assert "1.25× the zero-wait reference" in written and "not a bound" in written and "oracle" not in written
    assert len(json.loads((tmp_path / "suite.json").read_text())) == 2
    # Both bounds, each named for what it bounds (the review's S2-3: the all-served one is no
    # bound for the 99 % goal).
    assert "| lower bound, all served | lower bound, ≥ 99% SLO | goal |" in written
    assert "holds only for policies that serve every request" in written and "only bound" not in written
    saved = json.loads((tmp_path / "suite.json").read_text())[0]
    assert 0 < saved["goal_lower_bound_s"] <= saved["lower_bound_s"] and saved["slo_goal"] == 0.99


def test_fixed_pool_is_exactly_k() -> None:
    from floodgate.controller.lifecycle import WarmPoolConfig, warm_pool_target

    cfg = suite.fixed_pool(WarmPoolConfig(), 4)
    assert warm_pool_target(30, 60, cfg, largest_burst=40) == 4
    assert warm_pool_target(30, 60, suite.fixed_pool(WarmPoolConfig(), 0)) == 0


def test_cli_suite_rejects_unknown_scenario(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["controller", "suite", "--scenarios", "nope", "--out", str(tmp_path)]) == 2
    assert "nope" in capsys.readouterr().err
