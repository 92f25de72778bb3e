"""Backtest smoke: short synthetic runs, consistency of the reported numbers, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from floodgate.controller import simulate as sm
from floodgate.controller.forecast import ForecastConfig
from floodgate.controller.lifecycle import WarmPoolConfig
from floodgate.controller.policy import PolicyConfig

from floodgate.cli import main

from .conftest import trace_or_skip

SIM = sm.SimConfig()


@pytest.fixture(scope="module")
def workload() -> sm.Workload:
    # 4 days so the forecaster (min_days=3) engages on the evaluated one; 40 minutes of it,
    # starting at 08:40 so the daily 09:00 peak is inside.
    w = sm.make_day_workload(days=4, peak_rps=3.0, sim=SIM, trace=None, tile=False, eval_hours=9.4, seed=3)
    keep = w.arrivals >= w.start + 8.67 * 3600
    return sm.Workload(w.name, w.arrivals[keep], w.service[keep], w.tokens[keep],
                       w.start + 8.67 * 3600, w.end, w.history, w.description)


@pytest.fixture(scope="module")
def results(workload: sm.Workload) -> list[sm.Result]:
    return sm.compare(workload, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig())


def test_every_policy_reported_with_consistent_numbers(results: list[sm.Result], workload: sm.Workload) -> None:
    assert [r.name for r in results] == list(sm.POLICY_NAMES)
    n = len(workload.arrivals)
    assert n > 1000
    for r in results:
        assert r.requests == n
        assert 0.0 <= r.slo <= 1.0
        assert r.slo_ok + r.rejected <= n
        assert r.cost == pytest.approx(r.replica_s + SIM.warm_cost_weight * r.warm_s)
        assert r.unweighted == pytest.approx(r.replica_s + r.warm_s)
        assert r.cost <= r.unweighted
        assert 0 < r.mean_active <= r.peak_active
        assert r.replica_s >= r.mean_active * (workload.end - workload.start) * 0.99
        assert len(r.timeline["t"]) == len(r.timeline["active"]) > 0
    oracle = results[-1]
    assert oracle.slo == 1.0 and oracle.rejected == 0
    by = {r.name: r for r in results}
    assert by["floodgate-reactive"].warm_s == 0 and by["hpa"].warm_s == 0
    assert by["floodgate"].warm_s > 0


def test_table_lists_all_policies(results: list[sm.Result]) -> None:
    table = sm.markdown_table(results, SIM)
    lines = table.splitlines()
    assert len(lines) == 2 + len(sm.POLICY_NAMES)
    for name in sm.POLICY_NAMES:
        assert any(line.startswith(f"| {name} |") for line in lines)
    assert "| oracle | 100.00% |" in table
    assert "1.000 | 1.000 |" in table  # oracle relative to itself


def test_forecast_engages_with_enough_history() -> None:
    w = sm.make_day_workload(days=4, peak_rps=2.0, sim=SIM, trace=None, tile=False, eval_hours=0.2, seed=5)
    assert w.history is not None and w.history.days_with_data() == 3
    ctl = sm.build_controllers(w, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate"])[0]
    sm.run_policy(w, ctl, SIM, sm.initial_replicas(w, SIM, PolicyConfig()))
    assert isinstance(ctl, sm.FloodgateController)
    assert ctl.forecast_engaged_ticks > 0
    assert sum(ctl.reasons.values()) == ctl.ticks


def test_run_is_deterministic(workload: sm.Workload) -> None:
    short = sm.Workload("s", workload.arrivals[:2000], workload.service[:2000], workload.tokens[:2000],
                        workload.start, float(workload.arrivals[1999]) + 1, workload.history, "")
    a = sm.compare(short, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "kpa"])
    b = sm.compare(short, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "kpa"])
    assert [(r.slo_ok, r.cost, r.cold_starts) for r in a] == [(r.slo_ok, r.cost, r.cold_starts) for r in b]


def test_sliding_max_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 20, 200)
    for w in (0, 1, 3, 7, 50):
        fwd = sm._sliding_max(a, w, True)
        bwd = sm._sliding_max(a, w, False)
        for k in range(len(a)):
            assert fwd[k] == a[k : k + w + 1].max()
            assert bwd[k] == a[max(0, k - w) : k + 1].max()


def test_oracle_schedule_covers_zero_wait_concurrency() -> None:
    arr = np.array([0.5, 0.6, 0.7, 10.0])
    svc = np.array([5.0, 5.0, 5.0, 1.0])
    w = sm.Workload("t", arr, svc, np.ones(4), 0.0, 20.0, None, "")
    sim = sm.SimConfig(slots_per_replica=2, cold_start_min_s=4.0, cold_start_max_s=4.0)
    sched = sm.oracle_schedule(w, sim)
    assert sched[0] == 2  # three requests in the first tick need two 2-slot replicas
    assert sched.max() == 2 and sched[-1] == 0


def test_cli_simulate_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([
        "controller", "simulate", "--mode", "synthetic", "--days", "2", "--eval-hours", "0.2",
        "--peak-rps", "2", "--policies", "floodgate,hpa,oracle", "--out", str(tmp_path),
    ])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| floodgate |" in out and "| hpa |" in out and "| oracle |" in out
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert [r["name"] for r in data["results"]] == ["floodgate", "hpa", "oracle"]
    assert (tmp_path / "replicas.png").stat().st_size > 1000


def test_cli_bare_controller_prints_help() -> None:
    assert main(["controller"]) == 2


def test_cli_rejects_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  kv_pressure_threshold: 3\n")
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert "kv_pressure_threshold" in capsys.readouterr().err
    cfg.write_text("polcy: {}\n")
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert main(["controller", "simulate", "--policies", "nope"]) == 2


def test_trace_tile_and_replay() -> None:
    path = trace_or_skip()
    trace = sm.load_trace(path)
    t, ctx, gen = trace
    assert len(t) == 19366 and t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert 1000 < ctx.mean() < 1300 and 150 < gen.mean() < 260
    w = sm.make_day_workload(days=2, peak_rps=4.0, sim=SIM, trace=trace, tile=True, eval_hours=0.25, seed=2)
    assert w.history is not None and len(w.arrivals) > 500
    rs = sm.compare(w, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "oracle"])
    assert rs[1].slo == 1.0
    rep = sm.make_replay_workload(trace, SIM, rate_scale=1.5)
    assert 1.45 < len(rep.arrivals) / len(t) < 1.55
    assert np.all(np.diff(rep.arrivals) >= 0)
