"""`floodgate bench script-instr` at tiny scale: a real server under valgrind.

Instruction counts are the benchmark's point: the same leases.lua loaded twice (base = this
checkout's HEAD), counted inside FCALL (`--count script`, the count that does not follow the
box's timing), must count the same to within a few percent, and a decision must
cost something: with a batch's ops grouped (admits, then the release) and in turn on the shipped
settings (the onset ramp on).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from floodgate.bench import script_instr

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shutil.which("valgrind"), reason="valgrind is not installed")]

ROOT = Path(script_instr.__file__).resolve().parent.parent


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workload", [[], ["--order", "mixed", "--settings", "shipped"]], ids=["grouped", "mixed-shipped"])
def test_script_instr_counts_the_same_library_the_same(workload: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "extproc/leases.lua"]).returncode:
        pytest.skip("leases.lua differs from HEAD in this checkout")
    parser = argparse.ArgumentParser()
    script_instr.add_arguments(parser)
    args = parser.parse_args(["--base", "HEAD", "--gateways", "2", "--batch", "1,2", "--decisions", "240", "--count", "script",
                              *workload])
    assert script_instr.run(args) == 0
    text = capsys.readouterr().out
    rows = re.findall(r"^\s+(\d+)\s+([\d,]+)\s+([\d,]+)\s+([\d.]+)$", text, re.M)
    assert [int(b) for b, *_ in rows] == [1, 2]
    for _, base, _here, ratio in rows:
        assert int(base.replace(",", "")) > 10_000  # a decision runs the script path
        assert 0.97 < float(ratio) < 1.03  # the same code: only skiplist levels and hash seeds differ
    assert "instructions per call" in text
