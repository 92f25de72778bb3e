"""Smoke test of `floodgate bench overhead`: every config starts, serves 2xx, and the table prints.

Not a performance test: one short round at one connection, to keep the command working.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("wrk") is None,
                       reason="wrk is not installed (apt-get install -y wrk); the overhead benchmark drives load with it"),
]


def test_overhead_runs_and_prints_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "floodgate", "bench", "overhead", "--duration", "1", "--rounds", "1",
         "--connections", "1", "--warmup", "0", "--workdir", str(tmp_path),
         "--json", str(tmp_path / "result.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=110, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    lines = out.stdout.splitlines()
    assert any(ln.startswith("| config | conns | req/s | p50 ms | p99 ms") for ln in lines), out.stdout
    for config in ("envoy", "noop", "floodgate", "floodgate-sampled"):
        row = next((ln for ln in lines if ln.startswith(f"| {config} | 1 |")), None)
        assert row is not None, f"no row for {config}:\n{out.stdout}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0, row  # req/s
        assert cells[8] == "0" and cells[9] == "0", f"errors in {row}"  # non-2xx, socket errors
    assert "added p50 at 1 conns" in out.stdout
    assert (tmp_path / "result.json").exists()
