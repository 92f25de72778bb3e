"""Smoke tests of `floodgate bench overhead`: every config starts, serves 2xx, and the table prints;
the `floodgate-picking` row really routes by endpoint picking (the shipped gateway path).

Not performance tests: one short round at one connection, to keep the command working.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None,
    reason="wrk is not installed (apt-get install -y wrk); the overhead benchmark drives load with it")


@pytest.mark.integration
@needs_wrk
def test_overhead_runs_and_prints_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "floodgate", "bench", "overhead", "--duration", "1", "--rounds", "1",
         "--connections", "1", "--warmup", "0", "--workdir", str(tmp_path),
         "--json", str(tmp_path / "result.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert any(ln.startswith("| config | conns | req/s | p50 ms | p99 ms") for ln in lines), out.stdout
    for config in ("envoy", "noop", "floodgate", "floodgate-sampled", "floodgate-picking"):
        row = next((ln for ln in lines if ln.startswith(f"| {config} | 1 |")), None)
        assert row is not None, f"no row for {config}:\n{out.stdout}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0, row  # req/s
        assert cells[8] == "0" and cells[9] == "0", f"errors in {row}"  # non-2xx, socket errors
    assert "added p50 at 1 conns" in out.stdout
    assert (tmp_path / "result.json").exists()


@pytest.mark.integration
@needs_wrk
def test_picking_row_takes_the_per_request_path(tmp_path: Path) -> None:
    """`floodgate-picking` runs as the shipped compose / Kubernetes / `floodgate up` processors do:
    every request is sent by Envoy's `model_picked` (ORIGINAL_DST) cluster to the endpoint the
    processor picked, and each one costs its own acquire + release script call in Redis. The
    credits row (`floodgate-sampled`, no picking) beside it shows the count tells the paths apart:
    with picking silently off, the picked count and the script calls would both fall to ~0."""
    result = tmp_path / "result.json"
    out = subprocess.run(
        [sys.executable, "-m", "floodgate", "bench", "overhead", "--duration", "2", "--rounds", "1",
         "--connections", "1", "--warmup", "0", "--configs", "noop", "floodgate-sampled", "floodgate-picking",
         "--workdir", str(tmp_path / "work"), "--json", str(result)],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    # The headline says which row is the shipped path and which the credits path.
    assert "- floodgate-picking: the shipped gateway deployments" in out.stdout, out.stdout
    assert "- floodgate-sampled: no endpoint picking" in out.stdout, out.stdout
    assert "floodgate-picking: PASS added p50" in out.stdout or "floodgate-picking: FAIL added p50" in out.stdout

    proc_cfg = (tmp_path / "work" / "extproc-floodgate-picking.yaml").read_text()
    assert "endpoint_picking: true" in proc_cfg, proc_cfg

    data = json.loads(result.read_text())
    runs = {r["config"]: r for r in data["runs"]}
    pick, credits = runs["floodgate-picking"], runs["floodgate-sampled"]
    assert pick["requests"] > 0 and pick["non_2xx"] == 0 and pick["socket_errors"] == 0, pick
    # Every request the front Envoy completed went to the endpoint the processor picked (give or
    # take the one in flight when the counters were read).
    assert pick["completed"] >= pick["requests"], pick
    assert abs(pick["picked"] - pick["completed"]) <= 1, pick
    assert pick["ext_proc_streams"] >= pick["requests"], pick
    # One acquire + one release per request (at one connection releases are not batched).
    assert pick["redis_calls_per_req"] >= 1.5, pick
    # Without picking the same processor admits from local credits: almost no script calls.
    assert credits["picked"] is None, credits
    assert credits["redis_calls_per_req"] < 0.5, credits
    rows = {r["config"]: r for r in data["rows"]}
    assert rows["floodgate-picking"]["picked_share"] >= 0.99, rows["floodgate-picking"]
    assert rows["floodgate-picking"]["unpicked"] == 0, rows["floodgate-picking"]
    assert set(data["targets_met"]) == {"floodgate-picking", "floodgate-sampled"}, data["targets_met"]


def test_summary_reports_the_share_routed_by_picking() -> None:
    """A picking row with requests that bypassed `model_picked` counts them as `unpicked` (`run`
    prints an ERROR and exits 1), allowing one per connection and run in flight at the counters'
    read; rows without picking have no share."""
    from floodgate.bench.overhead import Run, summarize

    def run(config: str, picked: int | None, completed: int) -> Run:
        return Run(config=config, connections=1, round=1, requests=completed, seconds=1.0, rps=completed,
                   p50_ms=1.0, p90_ms=1.0, p99_ms=1.0, non_2xx=0, socket_errors=0, ext_proc_streams=completed,
                   cpu_us_per_req={}, picked=picked, completed=completed,
                   redis_calls_per_req=None if picked is None else 2.0)

    rows = {r.config: r for r in summarize(
        [run("noop", None, 100), run("floodgate-sampled", None, 80), run("floodgate-picking", 30, 60)],
        ["noop", "floodgate-sampled", "floodgate-picking"], [1])}
    assert rows["floodgate-picking"].picked_share == 0.5
    assert rows["floodgate-picking"].unpicked == 29  # 60 served, 30 picked, 1 in flight allowed
    assert rows["floodgate-picking"].redis_calls_per_req == 2.0
    assert rows["floodgate-sampled"].picked_share is None
    assert rows["floodgate-picking"].throughput_ratio == 0.6
    edge = {r.config: r for r in summarize([run("floodgate-picking", 60, 61), run("floodgate-picking", 41, 40)],
                                           ["floodgate-picking"], [1])}["floodgate-picking"]
    assert edge.unpicked == 0 and edge.picked_share == 1.0  # requests straddling a run's edges
