"""Smoke test of `floodgate bench reject`: the stack starts, every P2 probe is answered 429 by the
processor and every local probe by Envoy, and the table prints. Not a performance test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_wrk = pytest.mark.skipif(shutil.which("wrk") is None,
                               reason="wrk is not installed (apt-get install -y wrk); the probes are paced wrk runs")


def test_a_variant_with_a_mistyped_key_is_named_before_anything_starts(tmp_path: Path) -> None:
    """docs/benchmarks.md shows `--variant before='{"server": {...}}'`: a mistyped key there was
    a RuntimeError traceback ("process exited with 2 before listening on ...") after Redis,
    the emulator and the shipped processor had started, the field named only in a log."""
    out = subprocess.run(
        [sys.executable, "-m", "floodgate", "bench", "reject", "--duration", "1", "--rounds", "1",
         "--variant", 'typo={"server": {"gc_freez": false}}', "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "--variant typo" in out.stderr and "server.gc_freez: Extra inputs are not permitted" in out.stderr, \
        out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "work").exists(), out.stderr


@pytest.mark.integration
@needs_wrk
def test_reject_bench_runs_and_prints_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "floodgate", "bench", "reject", "--duration", "2", "--rounds", "1", "--settle", "2",
         "--rate", "20", "--limit", "4", "--variant", 'frozen={"server": {"gc_freeze": true}}',
         "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "result.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=170, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert "| variant | phase | P2 reject p50 / p99 ms |" in out.stdout
    data = json.loads((tmp_path / "result.json").read_text())
    assert {s["variant"] for s in data["samples"]} == {"shipped", "frozen"}
    for s in data["samples"]:
        assert s["reject"]["requests"] > 0 and s["reject"]["n429"] == s["reject"]["requests"], s
        assert s["local"]["requests"] > 0 and s["local"]["n429"] == s["local"]["requests"], s
        assert s["proc"]["decision_p99_ms"] > 0  # the processor decided the P2 rejections
        assert s["background"].get("admitted_0", 0) + s["background"].get("admitted_1", 0) > 0
