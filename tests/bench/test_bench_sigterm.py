"""`floodgate bench ...` stopped by SIGTERM (a CI cancel, `timeout`, `kill`) stops what it started,
as Ctrl-C does: with Python's default SIGTERM it died at once and left Redis, the processors and
the no-op processor running (a review: five processes reparented to init). A second SIGTERM while
it cleans up is ignored (a review: one 20 ms after the first left processes behind)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_sigterm_stops_every_process_the_bench_started(tmp_path: Path) -> None:
    err = (tmp_path / "bench.err").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "floodgate", "bench", "scale", "--processors", "2",
                             "--modes", "contended", "--duration", "60", "--json", str(tmp_path / "s.json")],
                            stdout=err, stderr=err)
    me = psutil.Process(proc.pid)
    started: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        for c in me.children(recursive=True):
            started.setdefault(c.pid, c)
        names = " ".join(" ".join(c.cmdline()) for c in started.values() if c.is_running())
        if "valkey" in names and names.count("extproc") >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, (tmp_path / "bench.err").read_text()
    time.sleep(1.0)
    for c in me.children(recursive=True):
        started.setdefault(c.pid, c)
    assert len(started) >= 3
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # a second one during the cleanup does not cut it short
    assert proc.wait(30) != 0
    _, alive = psutil.wait_procs(list(started.values()), timeout=15)
    left = [" ".join(p.cmdline()[:4]) for p in alive]
    for p in alive:
        p.kill()
    assert left == [], f"left behind after SIGTERM: {left}"
