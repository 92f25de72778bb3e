"""Backtest: the yardstick (zero-wait reference, lower bound), the baselines, the numbers
reported, the CLI. Short synthetic runs only (the full runs are in docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from floodgate.controller.backtest import baselines, engine, oracle, report, workload
from floodgate.controller.forecast import ForecastConfig
from floodgate.controller.lifecycle import WarmPoolConfig
from floodgate.controller.policy import PolicyConfig
from floodgate.controller.signals import ReplicaState, ReplicaView

from floodgate.cli import main

from .conftest import trace_or_skip

SIM = engine.SimConfig()
S = ReplicaState


def _window(w: workload.Workload, start_h: float, hours: float) -> workload.Workload:
    start = w.scored_from + start_h * 3600
    end = start + hours * 3600
    keep = (w.arrivals >= start) & (w.arrivals < end)
    return workload.Workload(w.name, w.arrivals[keep], w.service[keep], w.tokens[keep], start, end,
                             w.history, w.description)


@pytest.fixture(scope="module")
def comparison() -> report.Comparison:
    # 4 days so the forecaster (min_days=3) engages on the evaluated one; 40 minutes of it
    # around the daily 09:00 peak.
    w = workload.make_day_workload(days=4, peak_rps=3.0, sim=SIM, trace=None, tile=False, eval_hours=9.4, seed=3)
    return report.compare(_window(w, 8.67, 0.73), SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig())


def test_every_policy_reported_with_consistent_numbers(comparison: report.Comparison) -> None:
    results = comparison.results
    w = comparison.workload
    assert [r.name for r in results] == list(report.POLICY_NAMES)
    n = len(w.arrivals)
    assert n > 1000
    for r in results:
        assert r.requests == n
        assert 0.0 <= r.slo <= 1.0
        assert r.slo_ok + r.rejected <= n
        # Unweighted by default: a sleeping replica costs what an active one does.
        assert r.cost == pytest.approx(r.unweighted) == pytest.approx(r.replica_s + r.warm_s)
        assert 0 < r.mean_active <= r.peak_active
        assert r.replica_s >= r.mean_active * (w.end - w.start) * 0.99
        assert len(r.timeline["t"]) == len(r.timeline["active"]) > 0
        # The all-served bound is below everything that served every request, the goal-level
        # bound below everything that met the goal.
        if r.rejected == 0 and r.killed == 0:
            assert r.unweighted >= comparison.lower_bound_s
        if r.slo >= comparison.slo_goal:
            assert r.unweighted >= comparison.goal_lower_bound_s
    assert comparison.goal_lower_bound_s <= comparison.lower_bound_s
    by = comparison.by_name()
    assert by["zero-wait"].slo == 1.0 and by["zero-wait"].max_wait == 0.0
    # Without a warm pool nothing is woken from one; a replica whose cold start ends after the
    # need has gone sleeps only until its anti-churn age (`warm_min_age_s`) has passed, then goes.
    reactive = by["floodgate-reactive"]
    assert reactive.wakes == 0
    assert reactive.warm_s <= reactive.cold_starts * (WarmPoolConfig().warm_min_age_s + 2 * SIM.tick_s)
    assert by["floodgate"].warm_s > 0
    # Baselines borrow nothing from the warm pool: nothing sleeps, nothing is woken.
    for name in ("hpa", "kpa", "zero-wait"):
        assert by[name].warm_s == 0 and by[name].wakes == 0


def test_table_prints_zero_wait_and_lower_bound_beside_every_policy(comparison: report.Comparison) -> None:
    table = report.markdown_table(comparison)
    lines = table.splitlines()
    assert len(lines) == 2 + len(report.POLICY_NAMES) + 2
    for name in report.POLICY_NAMES:
        assert any(line.startswith(f"| {name} |") for line in lines)
    assert "| zero-wait | 100.00% | 0.00 |" in table
    assert "cost / zero-wait" in lines[0] and "oracle" not in table
    assert lines[-2].startswith("| lower bound, all served") and "serve every request" in lines[-2]
    assert lines[-1].startswith("| lower bound, ≥ 99% SLO") and "cost / ≥ 99% SLO bound" in lines[0]
    assert "sleeping ×" not in table  # unweighted: no second cost column
    weighted = report.Comparison(comparison.workload, engine.SimConfig(warm_cost_weight=0.25),
                                 comparison.results, comparison.lower_bound_s, comparison.goal_lower_bound_s)
    assert "sleeping ×0.25" in report.markdown_table(weighted)


def test_peak_concurrency_is_exact_within_each_tick() -> None:
    rng = np.random.default_rng(4)
    arr = np.sort(rng.uniform(0, 60, 300))
    svc = rng.exponential(3.0, 300)
    edges = np.arange(0.0, 62.0, 2.0)
    got = oracle.peak_concurrency(arr, svc, edges)
    for k in range(len(edges) - 1):
        # Brute force on a fine grid plus every event time inside the tick.
        pts = np.concatenate([[edges[k]], arr[(arr >= edges[k]) & (arr < edges[k + 1])],
                              (arr + svc)[((arr + svc) >= edges[k]) & ((arr + svc) < edges[k + 1])]])
        conc = [int(np.count_nonzero((arr <= p) & (arr + svc > p))) for p in pts]
        assert got[k] == max(conc)


def test_zero_wait_reference_has_zero_wait_even_on_spiky_short_requests() -> None:
    # Bursts of simultaneous short requests: a tick-start count would miss them.
    rng = np.random.default_rng(1)
    bursts = np.repeat(np.arange(0.0, 1800.0, 37.0), 40) + rng.uniform(0, 0.5, 40 * 49)
    arr = np.sort(np.concatenate([bursts, rng.uniform(0, 1800, 3000)]))
    svc = rng.uniform(0.2, 3.0, len(arr))
    w = workload.Workload("spiky", arr, svc, np.ones(len(arr)), 0.0, 1800.0, None, "")
    c = report.compare(w, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["zero-wait", "hpa"])
    orc = c.by_name()["zero-wait"]
    assert orc.slo == 1.0 and orc.max_wait == 0.0
    assert orc.unweighted >= c.lower_bound_s


def test_zero_wait_schedule_bridges_short_gaps_only() -> None:
    arr = np.array([0.5, 0.6, 0.7, 10.0, 500.0])
    svc = np.array([5.0, 5.0, 5.0, 1.0, 1.0])
    w = workload.Workload("t", arr, svc, np.ones(5), 0.0, 600.0, None, "")
    sim = engine.SimConfig(slots_per_replica=2, cold_start_min_s=30.0, cold_start_max_s=40.0, warmup_s=0.0)
    sched = oracle.zero_wait_schedule(w, sim)
    assert sched[0] == 2  # three requests in the first tick need two 2-slot replicas
    assert sched[5] == 1  # 10 s later: one replica, kept through the 5 s gap (start costs 30 s)
    assert sched[100] == 0  # the 490 s gap is longer than a start: off
    assert sched[250] == 1


def test_replicaset_planner_has_no_warm_pool() -> None:
    now = 1000.0
    reps = (
        ReplicaView("a0", S.ACTIVE, 0.0, inflight=2, running=2),
        ReplicaView("a1", S.ACTIVE, 0.0),
        ReplicaView("w0", S.WARM, 990.0),  # finished loading: Ready, serves at once
        ReplicaView("l0", S.LOADING, 900.0),
    )
    p = baselines.plan_replicaset(4, reps, now, 300.0, 0)
    assert [(a.kind.value, a.replica_id) for a in p.actions] == [("promote", "w0")]
    p = baselines.plan_replicaset(2, reps, now, 300.0, 0)
    kinds = [(a.kind.value, a.replica_id) for a in p.actions]
    # Not-ready first, then the just-loaded one, never a sleep.
    assert ("terminate", "l0") in kinds and ("terminate", "w0") in kinds
    assert all(k != "sleep" for k, _ in kinds) and ("promote", "w0") not in kinds
    p = baselines.plan_replicaset(6, reps, now, 300.0, 7)
    assert [a.replica_id for a in p.actions if a.kind.value == "start"] == ["r7", "r8"]


def test_run_is_deterministic(comparison: report.Comparison) -> None:
    w = comparison.workload
    short = workload.Workload("s", w.arrivals[:2000], w.service[:2000], w.tokens[:2000],
                              w.start, float(w.arrivals[1999]) + 1, w.history, "")
    a = report.compare(short, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "kpa"])
    b = report.compare(short, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "kpa"])
    assert [(r.slo_ok, r.cost, r.cold_starts) for r in a.results] == [(r.slo_ok, r.cost, r.cold_starts) for r in b.results]


def test_sliding_max_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 20, 200)
    for w in (0, 1, 3, 7, 50):
        fwd = oracle.sliding_max(a, w, True)
        bwd = oracle.sliding_max(a, w, False)
        for k in range(len(a)):
            assert fwd[k] == a[k : k + w + 1].max()
            assert bwd[k] == a[max(0, k - w) : k + 1].max()


def test_cli_simulate_writes_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main([
        "controller", "simulate", "--mode", "synthetic", "--days", "2", "--eval-hours", "0.2",
        "--peak-rps", "2", "--policies", "floodgate,hpa,zero-wait", "--out", str(tmp_path),
    ])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| floodgate |" in out and "| hpa |" in out and "| zero-wait |" in out and "| lower bound" in out
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert [r["name"] for r in data["results"]] == ["floodgate", "hpa", "zero-wait"]
    assert (tmp_path / "replicas.png").stat().st_size > 1000


def test_oracle_is_an_old_alias_of_zero_wait(capsys: pytest.CaptureFixture[str]) -> None:
    # The policy was called "oracle" until the bench review (D3): the old name still runs, as zero-wait.
    assert report.canonical_policy("oracle") == "zero-wait" == report.canonical_policy("zero-wait")
    rc = main(["controller", "simulate", "--mode", "synthetic", "--days", "1", "--eval-hours", "0.1",
               "--warmup-hours", "0", "--peak-rps", "1", "--policies", "hpa,oracle"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| zero-wait | 100.00% | 0.00 |" in out and "| oracle |" not in out
    with pytest.raises(SystemExit):
        main(["controller", "simulate", "--help"])
    assert "`oracle` is accepted as an old alias of zero-wait" in " ".join(capsys.readouterr().out.split())


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
    capsys.readouterr()
    cfg.write_text("warm_pool: {min_size: 4}\nwarm_pool: {min_size: 1}\n")  # the same loader as the live config
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert "duplicate key warm_pool (line 2" in capsys.readouterr().err
    cfg.write_text("warm_pool: {min_size: 4, max_size: 2}\n")
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert "min_size (4) is above max_size (2)" in capsys.readouterr().err
    cfg.write_text("capacity: {max_factor: 0.5}\n")
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert "max_factor" in capsys.readouterr().err
    # The suite reads the same file and stops before running anything.
    assert main(["controller", "suite", "--out", str(tmp_path / "o"), "--config", str(cfg)]) == 2
    assert "max_factor" in capsys.readouterr().err and not (tmp_path / "o").exists()
    cfg.write_text("capacity: {max_factr: 4}\n")
    assert main(["controller", "suite", "--out", str(tmp_path / "o"), "--config", str(cfg)]) == 2
    assert "max_factr" in capsys.readouterr().err
    # A field is named by its path in the file, as the live controller's config names it.
    cfg.write_text("warm_pool: {min_size: -1}\n")
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert f"{cfg}: warm_pool.min_size: Input should be greater than or equal to 0" in capsys.readouterr().err
    cfg.write_text("policy: {min_replicas: 3, max_replicas: 1}\n")
    assert main(["controller", "simulate", "--config", str(cfg)]) == 2
    assert f"{cfg}: policy: Value error, min_replicas must be" in capsys.readouterr().err
    # A section that is not a mapping is an error naming it, not a traceback.
    for bad in ("capacity: 4\n", "policy: [1, 2]\n", "forecast: on\n"):
        cfg.write_text(bad)
        assert main(["controller", "simulate", "--config", str(cfg)]) == 2, bad
        assert f"{cfg}: {bad.split(':')[0]}: " in capsys.readouterr().err, bad


def test_config_capacity_reaches_every_floodgate_policy(tmp_path: Path) -> None:
    """`--config` with a `capacity:` section: what `simulate` and `suite` pass on reaches the
    floodgate policies' deciders (floodgate-served keeps learning off), and the suite's jobs."""
    from floodgate.controller.backtest import suite
    from floodgate.controller.cli import _load_overrides

    cfg = tmp_path / "c.yaml"
    cfg.write_text("capacity: {max_factor: 4}\npolicy: {target_concurrency: 6}\n")
    st = _load_overrides(cfg)
    assert st.capacity.max_factor == 4.0 and st.policy.target_concurrency == 6.0
    w = workload.make_day_workload(days=2, peak_rps=2.0, sim=SIM, trace=None, tile=False, eval_hours=0.2, seed=1,
                                   warmup_hours=0.1)
    ctls = report.build_controllers(w, SIM, st.policy, st.forecast, st.warm_pool,
                                    [*report.POLICY_NAMES, "floodgate-served"], st.capacity)
    caps = {c.name: c.cfg.capacity for c in ctls if isinstance(c, engine.FloodgateController)}
    assert caps["floodgate-served"].enabled is False
    assert {n: c.max_factor for n, c in caps.items() if n != "floodgate-served"} == {
        n: 4.0 for n in caps if n != "floodgate-served"} and len(caps) >= 4
    assert _load_overrides(None).capacity.max_factor == 1.0  # shipped
    # The suite's jobs run with them (seen here through the policy section: min_replicas 12).
    cfg.write_text("capacity: {max_factor: 4}\npolicy: {min_replicas: 12}\n")
    res = suite.run_suite(["smooth-long"], [1], None, SIM, 0.1, 1, None, settings=_load_overrides(cfg))
    active = {r["name"]: r["mean_active"] for r in res[0]["results"]}
    assert active["floodgate"] == active["hpa"] == 12.0
    res = suite.run_suite(["smooth-long"], [1], None, SIM, 0.1, 1, None)
    assert {r["name"]: r["mean_active"] for r in res[0]["results"]}["floodgate"] < 12.0


def test_trace_tile_and_replay() -> None:
    path = trace_or_skip()
    trace = workload.load_trace(path)
    t, ctx, gen = trace
    assert len(t) == 19366 and t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert 1000 < ctx.mean() < 1300 and 150 < gen.mean() < 260
    w = workload.make_day_workload(days=2, peak_rps=4.0, sim=SIM, trace=trace, tile=True, eval_hours=0.25, seed=2)
    assert w.history is not None and len(w.arrivals) > 500
    c = report.compare(w, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "zero-wait"])
    assert c.results[1].slo == 1.0
    rep = workload.make_replay_workload(trace, SIM, rate_scale=1.5)
    scored = rep.arrivals >= rep.scored_from
    assert 1.45 < scored.sum() / len(t) < 1.55
    assert np.all(np.diff(rep.arrivals) >= 0)
    # Nothing before the trace: its own last hour is looped in front, unscored.
    assert rep.start == pytest.approx(-(rep.end - rep.scored_from), abs=2) and (~scored).sum() == scored.sum()
    assert rep.history is None and "looped" in rep.description


def test_evaluated_day_starts_from_the_warm_up_state() -> None:
    w = workload.make_day_workload(days=2, peak_rps=2.0, sim=SIM, trace=None, tile=False, eval_hours=0.25,
                                   seed=1, warmup_hours=0.5)
    assert w.eval_start == workload.DAY_S and w.start == workload.DAY_S - 1800
    assert w.history is not None and w.history.end_minute == int(w.start // 60) - 1
    c = report.compare(w, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate", "zero-wait"])
    scored = int(np.count_nonzero(w.arrivals >= w.eval_start))
    assert 0 < scored < len(w.arrivals)
    assert all(r.requests == scored for r in c.results)
    # Only the evaluated window is charged (15 min of at least one replica, not 45).
    assert c.by_name()["zero-wait"].replica_s < 0.25 * 3600 * c.by_name()["zero-wait"].peak_active * 1.01 + SIM.start_cost_s * 20


def test_week_shape_weekend_trend_holidays() -> None:
    shape = workload.DayShape(bursts_per_day=0, weekend_factor=0.5, trend_per_day=0.1, holidays=(2,), day_noise=0.0)
    assert shape.day_factor(0) == 1.0 and shape.day_factor(1) == pytest.approx(1.1)
    assert shape.day_factor(2) == pytest.approx(1.21 * 0.4)
    assert shape.day_factor(5) == pytest.approx(1.1**5 * 0.5) and shape.day_factor(7) == pytest.approx(1.1**7)
    w = workload.make_day_workload(days=7, peak_rps=0.5, sim=SIM, trace=None, tile=False, shape=shape,
                                   eval_hours=1.0, seed=2)
    assert w.history is not None
    per_day = [np.nansum(w.history.get(np.arange(d * 1440, (d + 1) * 1440))) for d in range(5)]
    assert per_day[2] < 0.6 * per_day[1]  # the holiday
    assert per_day[1] > per_day[0] and per_day[4] > per_day[3]  # the trend


def test_multi_day_replay_feeds_the_forecaster_from_the_traces_own_days() -> None:
    # A 5-day "recorded" trace: the replay evaluates its last day; the 4 before are history.
    src = workload.make_day_workload(days=5, peak_rps=1.0, sim=SIM, trace=None, tile=False,
                                     shape=workload.DayShape(bursts_per_day=0), seed=4, warmup_hours=200)
    ctx = np.full(len(src.arrivals), 1000.0)
    gen = (src.service - 1000 * SIM.prefill_s_per_token) / SIM.tpot_s
    trace = (src.arrivals - src.arrivals[0], ctx, gen)
    w = workload.make_replay_workload(trace, SIM, eval_hours=2.0, warmup_hours=1.0)
    assert w.history is not None and w.history.days_with_data() >= 3
    assert w.eval_start is not None and w.end - w.eval_start == pytest.approx(2 * 3600, abs=1)
    assert "from the trace itself" in w.description
    c = report.compare(w, SIM, PolicyConfig(), ForecastConfig(), WarmPoolConfig(), ["floodgate"])
    assert "forecast engaged" in c.results[0].notes and "engaged 0%" not in c.results[0].notes


def test_a_warm_up_that_starts_within_the_traces_first_minute_has_no_history() -> None:
    # A review: a trace whose warm-up began 0.8 s after its first request (`--warmup-hours 1` on
    # a 3 h trace, 2 h evaluated) crashed the replay: less than a minute before the warm-up left
    # n_min = 0, and `vals[-0:]` is the whole array (ValueError: could not broadcast).
    t = np.array([10.0, 11.0, 70.0, 3600.0 + 12.0, 3700.0])
    svc, tok = np.full(len(t), 2.0), np.full(len(t), 10.0)
    w = workload._split("edge", t, svc, tok, eval_start=3610.8, eval_end=3800.0, warmup_s=3600.0, description="")
    assert w.start == pytest.approx(10.8) and w.history is None
    assert list(w.arrivals) == [11.0, 70.0, 3612.0, 3700.0]


def test_workloads_carry_their_prompt_tokens_for_ttft() -> None:
    """TTFT is the prompt's prefill: the engine read prompt + generated tokens, so long outputs
    looked like long prompts to learned capacity (a review: output x16 lowered it 7 -> 3.73 and
    cost 65.2 against 48.5 replica-hours)."""
    w = workload.make_day_workload(days=2, peak_rps=2.0, sim=SIM, trace=None, tile=False, eval_hours=0.25,
                                   seed=3, tokens="long")
    assert w.prompt is not None and len(w.prompt) == len(w.tokens)
    assert np.all(w.prompt > 0) and np.all(w.prompt < w.tokens)  # every request generates something
    gen = w.tokens - w.prompt
    np.testing.assert_allclose(w.service, w.prompt * SIM.prefill_s_per_token + gen * SIM.tpot_s)
    trace = (np.arange(50.0), np.full(50, 100.0), np.full(50, 3000.0))
    rep = workload.make_replay_workload(trace, SIM, eval_hours=0.01, warmup_hours=0.0)
    assert rep.prompt is not None and set(rep.prompt.tolist()) == {100.0} and set(rep.tokens.tolist()) == {3100.0}
