"""`floodgate bench elastic` at tiny scale: the whole loop runs (Envoy, processor, Redis, the
controller with the process actuator, emulated replicas), the report adds up, the plot and the
doc section are written, and no replica outlives the run."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import psutil
import pytest
from floodgate.bench import elastic

pytestmark = pytest.mark.integration


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    elastic.add_arguments(parser)
    return parser.parse_args(["--out", str(tmp_path / "out"), "--doc", str(tmp_path / "benchmarks.md"),
                              "--quiet", *extra])


@pytest.mark.timeout(240)
def test_elastic_smoke(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Overload\n\nsomeone else's section\n")
    args = _args(tmp_path, "--configs", "admission", "floodgate", "--scale", "0.15", "--cold-start", "20",
                 "--per-replica-rps", "8", "--max-replicas", "4", "--timeout", "15")
    assert elastic.run(args) == 0

    out = tmp_path / "out"
    report = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"admission", "floodgate"}
    for r in rows.values():
        assert r["consistent"] and r["offered"] == report["plan_requests"]
        assert r["offered"] == r["admitted"] + r["rejected"] + r["errors"]
        assert r["errors"] == 0
        assert r["active_replica_s"] > 0
    # The fixed pool costs exactly its size; the controller's pool was sampled while it ran.
    assert rows["admission"]["active_replica_s"] == pytest.approx(2 * sum(
        p["duration_s"] for p in report["workload"]["phases"]))
    with gzip.open(out / "floodgate.json.gz", "rt") as f:
        raw = json.load(f)
    assert raw["replicas"] and all(s["states"].get("active", 0) >= 2 for s in raw["replicas"])
    assert any(e.get("event") == "decision" for e in raw["controller"])
    # The first cold start after the burst, as measured from the decision log, lies after it.
    m = rows["floodgate"]["measured_cold_start_s"]
    assert m is None or m > 0
    # Both bursts are scored; detection (decision log) precedes the window it opens, and the
    # "outside the first cold start" window is detection (at most two ticks) + the configured
    # cold start.
    fg = rows["floodgate"]
    assert [b["name"] for b in fg["bursts"]] == ["burst", "burst2"]
    assert fg["detection_s"] is None or 0 <= fg["detection_s"] < fg["cold_window_s"]
    cold = report["workload"]["cold_start_s"] * report["workload"]["ops_scale"]
    assert fg["cold_window_s"] == pytest.approx(elastic.allowed_detection(fg["detection_s"]) + cold)
    assert all("slo_settle_s" in b for b in fg["bursts"]) and fg["met_slo"] > 0
    b2 = fg["bursts"][1]
    assert b2["active_at_start"] is not None and b2["active_at_start"] >= 2
    assert (out / "timeline.png").stat().st_size > 10_000
    text = doc.read_text()
    assert "someone else's section" in text and elastic.SECTION_START in text and "## Elastic" in text
    # Replicas the controller started are gone with it (it stops them on exit).
    pids = raw["meta"]["replica_pids"]
    assert len(pids) >= 3  # 2 active + the warm pool
    for pid in pids:
        assert not _alive(pid), pid


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_scaling_only_processor_admits_everything_without_pacing() -> None:
    """The `scaling` configuration is the no-admission baseline: a limit nothing reaches and no
    prefill pacing (which would hold P1/P2 in Floodgate's queue while a P0 runs); `floodgate`
    keeps the shipped picking with its pacing. Both load as the processor loads them."""
    from floodgate.extproc.config import Config

    w = elastic.Workload()
    scaling = Config.model_validate(elastic.processor_config("scaling", w, 2.0)).pools[0]
    assert scaling.endpoint_picking and scaling.prefill_tokens_per_s == 0
    assert scaling.limit.mode == "static" and scaling.limit.initial >= 100000
    floodgate = Config.model_validate(elastic.processor_config("floodgate", w, 2.0)).pools[0]
    assert floodgate.endpoint_picking and floodgate.prefill_tokens_per_s > 0


def test_replica_seconds_count_every_state_that_holds_a_replica() -> None:
    from floodgate.bench.elastic import ReplicaSample, replica_seconds

    samples = [ReplicaSample(0.0, {"active": 2.0, "warm": 1.0}),
               ReplicaSample(10.0, {"active": 1.0, "draining": 1.0, "waking": 1.0, "loading": 1.0, "failed": 1.0}),
               ReplicaSample(20.0, {"active": 3.0})]
    act, pooled, starting, peak = replica_seconds(samples, 30.0)
    assert (act, pooled, starting, peak) == (20 + 30 + 30, 10.0, 20.0, 3.0)  # a failed one costs until stopped


def test_capacity_max_factor_reaches_the_floodgate_controller_as_it_loads(tmp_path: Path) -> None:
    """`--capacity-max-factor` sets the floodgate controller's learning bound (validated as the
    controller loads its config); scaling only keeps learning off."""
    from floodgate.controller.config import ControllerConfig

    w = elastic._workload(_args(tmp_path, "--capacity-max-factor", "4"))
    assert w.capacity_max_factor == 4.0
    cfg = {name: ControllerConfig.model_validate(elastic.controller_config(
        name, w, "redis://127.0.0.1:6379", "http://127.0.0.1:9901", 9999, tmp_path)).pools[0]
        for name in ("floodgate", "scaling")}
    assert cfg["floodgate"].capacity.max_factor == 4.0 and cfg["floodgate"].capacity.enabled
    assert not cfg["scaling"].capacity.enabled
    shipped = ControllerConfig.model_validate(elastic.controller_config(
        "floodgate", elastic.Workload(), "redis://127.0.0.1:6379", "http://127.0.0.1:9901", 9999, tmp_path)).pools[0]
    assert shipped.capacity.max_factor == 1.0


@pytest.mark.parametrize(("flags", "field"), [
    (("--capacity-max-factor", "0.5"), "capacity.max_factor"),
    (("--replicas", "12"), "min_replicas must be ≤ max_replicas"),
    (("--target-concurrency", "0"), "policy.target_concurrency"),
])
def test_a_bad_flag_stops_the_bench_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           flags: tuple[str, ...], field: str) -> None:
    """A flag that makes a controller config invalid is refused up front, naming the field, with
    nothing started and nothing written (the run used to fail minutes in, when the controller it
    spawned refused its config)."""
    args = _args(tmp_path, "--configs", "scaling", "floodgate", *flags)
    assert elastic.run(args) == 2
    err = capsys.readouterr().err
    assert field in err and "invalid" in err
    assert not (tmp_path / "out").exists()
    assert elastic.check_workload(elastic._workload(_args(tmp_path)), elastic.CONFIGS) is None


def test_from_raw_evaluates_the_recorded_workload_not_this_commands_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--from-raw` re-evaluates a recorded run: its deadlines come from the workload that ran.
    Before, they came from the command's flags (a review: `--from-raw --cold-start 300` turned
    the committed run's burst-1 FAIL at 16.1 s against 16.0 into a PASS against 31.0, and wrote
    300 into results.json). A flag that disagrees with the record is refused; the committed
    run re-evaluates to its committed verdicts."""
    import shutil

    src = Path(elastic.DEFAULT_OUT)
    out = tmp_path / "out"
    shutil.copytree(src, out)
    committed = json.loads((out / "results.json").read_text())
    assert elastic.run(_args(tmp_path, "--from-raw", "--no-plots", "--no-doc", "--cold-start", "300")) == 2
    err = capsys.readouterr().err
    assert "cold_start_s 150.0 recorded, 300.0 given" in err
    assert json.loads((out / "results.json").read_text()) == committed  # nothing rewritten
    assert elastic.run(_args(tmp_path, "--from-raw", "--no-plots", "--no-doc")) in (0, 1)
    again = json.loads((out / "results.json").read_text())
    assert again["verdicts"] == committed["verdicts"] and again["workload"] == committed["workload"]
    # The recorded run's own flags are no clash (its command, re-run with --from-raw).
    assert elastic.run(_args(tmp_path, "--from-raw", "--no-plots", "--no-doc", "--seed", "1")) in (0, 1)
