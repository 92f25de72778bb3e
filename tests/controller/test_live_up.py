"""`floodgate up --no-demo`: the whole stack with the controller comes up, serves a request
through the gateway, and stops on SIGINT leaving no process behind (replicas included)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from floodgate.supervisor import free_port

pytestmark = pytest.mark.integration


def _descendants(root: int) -> set[int]:
    """Every live process whose parent chain reaches `root`."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (d / "stat").read_text()
                parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: set[int] = set()
    frontier = {root}
    while frontier:
        kids = {p for p, pp in parent.items() if pp in frontier and p not in out}
        out |= kids
        frontier = kids
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.2)


def _post(url: str) -> int:
    body = json.dumps({"model": "floodgate-sim-8b", "prompt": "hi", "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as r:
        return int(r.status)


def test_up_no_demo_starts_and_stops_cleanly(tmp_path: Path) -> None:
    port, admin = free_port(), free_port()
    err = (tmp_path / "up.err").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "floodgate", "up", "--no-demo", "--replicas", "1", "--warm-pool", "1", "--processors", "1",
         "--port", str(port), "--admin-port", str(admin), "--sim-cold-start", "0.3"],
        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    pids: set[int] = set()
    try:
        def status_line() -> bool:
            assert proc.poll() is None, (tmp_path / "up.err").read_text()
            return "replicas active 1/1" in (tmp_path / "up.err").read_text()

        _wait(status_line, 60)
        text = (tmp_path / "up.err").read_text()
        assert f"gateway http://127.0.0.1:{port}/v1" in text
        assert _post(f"http://127.0.0.1:{port}") == 200
        # The warm pool fills in the background: 1 active + 1 warm replica process.
        _wait(lambda: _pool_filled(tmp_path / "up.err"), 30)
        pids = _descendants(proc.pid)
        sims = [p for p in pids if b"sim" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(sims) >= 2  # the controller's replicas are its (grand)children
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(30)
        assert rc in (0, 130)
        time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        assert left == [], f"left behind: {left}"
        workdir = re.search(r"logs and configs in (\S+)", text)
        assert workdir is not None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in pids:
            if _alive(p):  # only after a failure: our own children are session leaders
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p, signal.SIGKILL)
        err.close()


def _pool_filled(path: Path) -> bool:
    lines = [ln for ln in path.read_text().splitlines() if "replicas active" in ln]
    return bool(lines) and "warm 1" in lines[-1]



def test_up_refuses_a_busy_port_unless_asked(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(port),
                            "--admin-port", str(free_port())], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2
        assert f"--port {port} is in use" in r.stderr and "--any-port" in r.stderr
        r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(free_port()),
                            "--admin-port", str(port)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and f"--admin-port {port} is in use" in r.stderr


def test_choose_port_takes_a_free_one_only_when_asked() -> None:
    import socket

    from floodgate.up import PortBusy, choose_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortBusy):
            choose_port(port, "--port", any_port=False)
        other = choose_port(port, "--port", any_port=True)
        assert other != port and other > 0
    free = free_port()
    assert choose_port(free, "--port", any_port=False) == free
