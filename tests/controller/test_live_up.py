"""`floodgate up --no-demo`: the whole stack with the controller comes up, serves a request
through the gateway, and stops on SIGINT leaving no process behind (replicas included)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from itertools import pairwise
from pathlib import Path

import psutil
import pytest
import yaml

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port

pytestmark = pytest.mark.integration


def _descendants(root: int) -> set[int]:
    """Every live process whose parent chain reaches `root`."""
    try:
        return {c.pid for c in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.2)


def _post(url: str) -> int:
    body = json.dumps({"model": "floodgate-sim-8b", "prompt": "hi", "max_tokens": 4}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:  # the body says who answered (processor, Envoy, replica)
        raise AssertionError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from exc


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_up_no_demo_starts_and_stops_cleanly(tmp_path: Path, stop: signal.Signals) -> None:
    """SIGINT (Ctrl-C) and SIGHUP (a closed terminal) take the cleanup path; after SIGKILL, which
    nothing can catch, the kernel sends each child SIGTERM (`Supervisor.die_with_parent`) and the
    controller stops its replicas. Before: SIGHUP and SIGKILL left Redis, the processors, the
    controller and its replicas running (8 processes). A clean stop removes the work directory
    (a review found hundreds left under /tmp); --keep-logs (given with SIGHUP here) keeps it."""
    port, admin = free_port(), free_port()
    err = (tmp_path / "up.err").open("wb")
    keep = ["--keep-logs"] if stop == signal.SIGHUP else []
    if stop == signal.SIGINT:
        # A user's config with picking off (what the README says for a fixed pool) still serves:
        # up's replicas reach Envoy only by picking (a review's never did: an empty cluster).
        (tmp_path / "own.yaml").write_text("pools: [{name: default, endpoint_picking: false}]\n")
        keep = ["--config", str(tmp_path / "own.yaml")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "floodgate", "up", "--no-demo", "--replicas", "1", "--warm-pool", "1", "--processors", "1",
         "--port", str(port), "--admin-port", str(admin), "--sim-cold-start", "0.3", *keep],
        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    pids: set[int] = set()
    workdir: Path | None = None
    try:
        def status_line() -> bool:
            assert proc.poll() is None, (tmp_path / "up.err").read_text()
            return "replicas active 1/1" in (tmp_path / "up.err").read_text()

        _wait(status_line, 60)
        text = (tmp_path / "up.err").read_text()
        assert f"gateway http://127.0.0.1:{port}/v1" in text
        assert _post(f"http://127.0.0.1:{port}") == 200
        if stop == signal.SIGINT:
            assert "endpoint_picking: false is overridden" in text
            # The status command the banner prints finds the stack's controller (a review: the
            # quickstart's `status --redis-url` alone said no controller runs).
            cmd = re.search(r"status +floodgate (status .*)", text)
            assert cmd is not None, text
            r = subprocess.run([sys.executable, "-m", "floodgate", *cmd.group(1).split()],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and "controller: leader " in r.stdout, (r.stdout, r.stderr)
        found = re.search(r"logs and configs in (\S+)", text)
        assert found is not None
        workdir = Path(found.group(1))
        # Picks stay on loopback whatever the (passwordless) demo Valkey's registry says; the
        # request above was picked and served under that allowlist.
        import yaml
        cfg = yaml.safe_load((workdir / "extproc0.yaml").read_text())
        assert [p["allowed_endpoints"] for p in cfg["pools"]] == [["127.0.0.1/32"]]
        # the controller says at start what it runs (the processor always did)
        banner = (workdir / "controller.log").read_text()
        assert "floodgate controller started (metrics 127.0.0.1:" in banner and "['default: process']" in banner
        # The warm pool fills in the background: 1 active + 1 warm replica process.
        _wait(lambda: _pool_filled(tmp_path / "up.err"), 30)
        pids = _descendants(proc.pid)
        sims = [p for p in pids if "sim" in " ".join(psutil.Process(p).cmdline())]
        assert len(sims) >= 2  # the controller's replicas are its (grand)children
        proc.send_signal(stop)
        rc = proc.wait(30)
        assert rc in ((0, 130) if stop == signal.SIGINT else (130,) if stop == signal.SIGHUP else (-9,)), rc
        with contextlib.suppress(AssertionError):
            _wait(lambda: not any(_alive(p) for p in pids), 20)
        left = [(p, psutil.Process(p).cmdline()[:3]) for p in pids if _alive(p)]
        assert left == [], f"left behind: {left}"
        # SIGKILL: nothing could clean up; SIGHUP: kept as asked; SIGINT: a clean stop, removed
        assert workdir.exists() == (stop != signal.SIGINT), (stop, workdir)
        if stop == signal.SIGHUP:
            assert f"logs and configs kept in {workdir}" in (tmp_path / "up.err").read_text()
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in pids:
            if _alive(p):  # only after a failure: our own children are session leaders
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p, signal.SIGKILL)
        err.close()


@pytest.mark.parametrize("mode", [["--no-demo"], ["--demo-duration", "120", "--out", "{tmp}/report"]])
def test_up_stops_once_no_processor_is_left(tmp_path: Path, mode: list[str]) -> None:
    """A review: after its processors exited `up` went on printing `limit 0` while every request
    got 503 (and a demo ran its load on to the end); now it says why and stops the stack (exit
    1), leaving nothing behind."""
    port, admin = free_port(), free_port()
    err = (tmp_path / "up.err").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "floodgate", "up", *(m.format(tmp=tmp_path) for m in mode), "--replicas", "1",
         "--warm-pool", "0", "--processors", "1",
         "--port", str(port), "--admin-port", str(admin), "--sim-cold-start", "0.3"],
        stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    pids: set[int] = set()
    try:
        _wait(lambda: "replicas active 1/1" in (tmp_path / "up.err").read_text(), 60)
        pids = _descendants(proc.pid)
        (extproc,) = [p for p in pids if "extproc" in psutil.Process(p).cmdline()]
        os.kill(extproc, signal.SIGKILL)
        assert proc.wait(30) == 1
        text = (tmp_path / "up.err").read_text()
        assert "floodgate up: extproc0 exited: the stack cannot serve; stopping it" in text, text[-2000:]
        with contextlib.suppress(AssertionError):
            _wait(lambda: not any(_alive(p) for p in pids), 20)
        assert [p for p in pids if _alive(p)] == []
        kept = re.search(r"logs and configs kept in (\S+)", text)  # a failure: its logs are wanted
        assert kept is not None and (Path(kept.group(1)) / "extproc0.log").exists(), text[-2000:]
        shutil.rmtree(kept.group(1), ignore_errors=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in pids:
            if _alive(p):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p, signal.SIGKILL)
        err.close()


def _pool_filled(path: Path) -> bool:
    lines = [ln for ln in path.read_text().splitlines() if "replicas active" in ln]
    return bool(lines) and "warm pool 1" in lines[-1]



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


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_up_against_a_dead_redis_says_so_without_a_traceback(tmp_path: Path, scheme: str) -> None:
    """`--redis-url` pointing at nothing: one line naming the URL (password redacted) and the
    error, exit 1, before any processor starts (before: a 74-line redis-py traceback after
    starting the processors, Envoy and the controller). A Cluster none of whose seed nodes
    answers too: redis-py raises RedisClusterUnreachableError there, which is no RedisError,
    and `up` ended in its traceback (a Redis HA review)."""
    dead = f"{scheme}://:hunter2@127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "")
    r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(free_port()),
                        "--admin-port", str(free_port()), "--redis-url", dead], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"cannot use Redis at {scheme}://:***@127.0.0.1" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "hunter2" not in r.stderr and "extproc0" not in r.stderr


def test_up_config_that_is_not_utf8_is_an_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"redis: \xff\xfe\x00bad\n")
    for argv in (["up", "--no-demo", "--port", str(free_port()), "--admin-port", str(free_port())],
                 ["extproc", "--check-config"], ["status"]):
        r = subprocess.run([sys.executable, "-m", "floodgate", *argv, "--config", str(bad)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (argv, r.returncode, r.stderr[-2000:])
        assert f"config {bad} is not UTF-8 text: byte 0xff at offset 7" in r.stderr, (argv, r.stderr[-2000:])
        assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("argv", "words"), [
    (["--replicas", "3", "--max-replicas", "2"], "--max-replicas (2) is below --replicas (3)"),
    (["--replicas", "1", "--max-replicas", "2", "--warm-pool", "5"],
     "warm_pool.min_size (5) is above policy.max_replicas (2)"),
    (["--warm-pool", "-1"], "--warm-pool must be 0 or more"),
    (["--processors", "0"], "--processors must be 1 or more"),
    (["--replicas", "0"], "--replicas 0 needs --max-replicas"),
    (["--redis-url", "http://x:1"], "redis.url"),
    (["--port", "70000"], "70000 is not a TCP port"),  # was an OverflowError traceback
    (["--admin-port", "-1"], "-1 is not a TCP port"),
    # inf and nan parse as floats and passed the range checks; --demo-rate inf started the stack
    # and died building the demo plan (a review)
    (["--demo-rate", "inf"], "--demo-rate: must be a finite number, got 'inf'"),
    (["--demo-duration", "nan"], "--demo-duration: must be a finite number, got 'nan'"),
    (["--sim-cold-start", "inf"], "--sim-cold-start: must be a finite number, got 'inf'"),
])
def test_up_rejects_bad_arguments_before_starting_anything(argv: list[str], words: str) -> None:
    """The arguments and the controller config they make are checked first: exit 2 with the reason,
    no Redis, processor, Envoy or controller started (no work directory announced), no traceback."""
    r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(free_port()),
                        "--admin-port", str(free_port()), *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "logs and configs in" not in r.stderr


def test_up_check_args_accepts_the_defaults_and_the_documented_ones() -> None:
    from floodgate.cli import build_parser
    from floodgate.up import check_args

    parser = build_parser("up")
    for argv in ([], ["--replicas", "1", "--warm-pool", "1"], ["--replicas", "2", "--max-replicas", "2"],
                 ["--replicas", "0", "--max-replicas", "2", "--no-demo"]):
        assert check_args(parser.parse_args(["up", *argv])) is None, argv
    assert check_args(parser.parse_args(["up", "--replicas", "0", "--max-replicas", "2"])) is not None  # no demo load
    # --demo-rate 0 ran the default-rate demo (0 read as unset: review user); no load is --no-demo
    said = check_args(parser.parse_args(["up", "--demo-rate", "0"]))
    assert said is not None and "--demo-rate above 0" in said
    assert check_args(parser.parse_args(["up", "--demo-rate", "3"])) is None


def _up_serves(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run `floodgate up --no-demo` (1 replica, no warm pool) with `argv` and `env`, check that its
    gateway serves a request, stop it with SIGINT; its stderr."""
    port, admin = free_port(), free_port()
    log = tmp_path / "up.err"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "floodgate", "up", "--no-demo", "--replicas", "1", "--warm-pool", "0",
             "--port", str(port), "--admin-port", str(admin), "--sim-cold-start", "0.3", *argv],
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env={**os.environ, **(env or {})})
        try:
            def serving() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                return "replicas active 1/1" in log.read_text()

            _wait(serving, 90)
            assert _post(f"http://127.0.0.1:{port}") == 200
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) in (0, 130)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return log.read_text()


def test_up_ignores_the_components_env_overrides(tmp_path: Path) -> None:
    """The processors' and the controller's env overrides win over their config files, through
    which `up` configures them: an operator's FLOODGATE_REDIS_URL (the default of `floodgate
    status`) sent the local stack's processors and controller to that Redis (pool settings and a
    replica registry written there) while `up` waited on its own Redis for replicas that never
    came; FLOODGATE_GATEWAY_ID gave both processors one id (the second exited 2). Now they are
    dropped, with a note each, before the configs are read (a bad FLOODGATE_LISTEN is no error)."""
    from floodgate.supervisor import Supervisor

    (tmp_path / "other").mkdir()
    with Supervisor(workdir=tmp_path / "other") as sup:
        _, other = sup.start_redis()
        text = _up_serves(tmp_path, ["--processors", "2"], env={
            "FLOODGATE_REDIS_URL": other, "FLOODGATE_GATEWAY_ID": "gw-1",
            "FLOODGATE_ENVOY_ADMIN_URL": "http://127.0.0.1:1", "FLOODGATE_CONTROLLER_METRICS_LISTEN": "127.0.0.1:1",
            "FLOODGATE_LISTEN": "not-an-address"})
        for name in ("FLOODGATE_REDIS_URL", "FLOODGATE_GATEWAY_ID", "FLOODGATE_ENVOY_ADMIN_URL",
                     "FLOODGATE_CONTROLLER_METRICS_LISTEN", "FLOODGATE_LISTEN"):
            assert f"{name} is set: ignored" in text, text[-3000:]
        import redis

        c = redis.Redis.from_url(other)
        try:
            assert c.keys("*") == [], "the stack wrote into the Redis of FLOODGATE_REDIS_URL"
        finally:
            c.close()


def test_up_says_which_process_did_not_start_without_a_traceback(tmp_path: Path) -> None:
    """A child of the stack that exits at start (here an Envoy binary that fails) was a Python
    traceback (`RuntimeError: process exited with 1 before listening on N`); now one line names
    it and its log, exit 1. The same port given twice is refused before anything starts (Envoy
    could not bind its second listener: the same traceback, after Redis and the processors)."""
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(port),
                        "--admin-port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"--port and --admin-port are both {port}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "logs and configs in" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(free_port()),
                        "--admin-port", str(free_port())], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "FLOODGATE_ENVOY_BIN": "/bin/false"})
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "floodgate up: envoy did not start: process exited with 1" in r.stderr, r.stderr[-2000:]
    assert "envoy.log" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    found = re.search(r"logs and configs kept in (\S+)", r.stderr)
    assert found is not None, r.stderr
    shutil.rmtree(found.group(1), ignore_errors=True)


def test_up_serves_with_a_config_for_tls_and_a_health_port(tmp_path: Path) -> None:
    """A production processor config (TLS on the ext_proc port, a plaintext health port) given
    to `up --config`: the stack's Envoy speaks plaintext to its processors, each on ports of
    its own, so Envoy found no healthy processor (a traceback after 20 s) and a second
    processor could not bind the one health port. Both are left out here, with a note; so is
    `max_requests` (a processor would exit after its first request and stay down)."""
    from tests.certs import make_pki

    server = make_pki(tmp_path / "pki").issue("processor", ips=("127.0.0.1",))
    cfg = tmp_path / "prod.yaml"
    cfg.write_text(yaml.safe_dump({"server": {
        "tls": {"cert_file": str(server.cert), "key_file": str(server.key)},
        "health_listen": f"127.0.0.1:{free_port()}", "max_requests": 1}}))
    text = _up_serves(tmp_path, ["--processors", "2", "--config", str(cfg)])
    assert "server.tls, server.health_listen left out" in text, text[-3000:]
    # A recycling processor exits for its platform to restart it; nothing here would.
    assert "server.max_requests left out" in text, text[-3000:]


def test_up_refuses_a_config_of_several_pools(tmp_path: Path) -> None:
    """The local stack's controller scales one pool: a second pool's requests got `503
    no_endpoints` for as long as the stack ran, without a word (an operator review)."""
    cfg = tmp_path / "two.yaml"
    cfg.write_text(yaml.safe_dump({"pools": [{"name": "default"}, {"name": "second"}]}))
    r = subprocess.run([sys.executable, "-m", "floodgate", "up", "--no-demo", "--port", str(free_port()),
                        "--admin-port", str(free_port()), "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "pools: the local stack runs one pool, this config has 2 (default, second)" in r.stderr, r.stderr
    assert "logs and configs in" not in r.stderr and "Traceback" not in r.stderr


def test_up_gives_engine_priority_pools_engines_that_schedule_by_priority(tmp_path: Path) -> None:
    """A pool with `engine_priority` writes vLLM priorities into the request bodies; the stack's
    emulated engines ran fcfs and answered 400 to the documented {0: -1, 1: 0, 2: 1} (an operator
    review): they now start with `--scheduling-policy priority`, only then."""
    from floodgate.cli import build_parser
    from floodgate.up import controller_config

    args = build_parser("up").parse_args(["up"])
    for on in (True, False):
        cmd = controller_config(args, "redis://127.0.0.1:1/0", 1, 2, tmp_path, engine_priority=on)[
            "pools"][0]["actuator"]["command"]
        sim_args = build_parser("sim").parse_args(["sim", *(a.replace("{port}", "1") for a in cmd[cmd.index("sim") + 1:])])
        assert sim_args.scheduling_policy == ("priority" if on else "fcfs"), cmd


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


def test_demo_controller_config_shows_promote_drain_and_recycle() -> None:
    """The controller config `floodgate up` runs, driven through the live controller's pure
    decider with the demo's load shape (in-flight per the measured ~10 per replica at the steady
    rate, ~110 in the burst): the steady load stays on --replicas, the burst promotes from the
    warm pool and cold-starts up to --max-replicas, and the recovery drains and recycles into the
    pool. Replica transitions are applied at once (wake, warm-up) as if instantaneous."""
    import argparse
    from dataclasses import replace as dc_replace

    from floodgate.controller.config import parse_config
    from floodgate.controller.decider import DeciderConfig, DeciderState, Signals, decide
    from floodgate.controller.lifecycle import ActionKind, Event, apply_action, apply_event
    from floodgate.controller.signals import ReplicaState as S
    from floodgate.controller.signals import ReplicaView

    from floodgate.up import controller_config
    from tests.controller.conftest import signals

    args = argparse.Namespace(replicas=2, max_replicas=0, warm_pool=2, sim_cold_start=1.0)
    raw = controller_config(args, "redis://127.0.0.1:6379/0", 9901, 9464, Path("/tmp/x"))
    pool = parse_config(raw, env={}).pools[0]
    cfg = DeciderConfig(pool.policy, pool.forecast, pool.warm_pool, "r")
    t = 1_000_000.0
    reps: dict[str, ReplicaView] = {f"r{i}": ReplicaView(f"r{i}", S.ACTIVE if i < 2 else S.WARM, t - 100,
                                                         asleep=i >= 2) for i in range(4)}
    state = DeciderState(next_seq=4)
    seen: dict[str, list[float]] = {}
    max_active = 0
    for step in range(90):  # one tick a second, the demo's 90 s
        t += 1.0
        phase_inflight = 110.0 if 22 <= step < 45 else 20.0
        active = [r for r in reps.values() if r.state is S.ACTIVE]
        max_active = max(max_active, len(active))
        sig = Signals(signals(t, tuple(reps.values()), running=phase_inflight), tuple(reps.values()))
        state, d = decide(cfg, state, sig, t)
        for a in d.actions:
            seen.setdefault(a.kind.value, []).append(step)
            if a.kind is ActionKind.START:
                v = apply_action(ReplicaView(a.replica_id, S.COLD, t), a.kind, t)
                v = apply_event(apply_event(v, Event.LOADED, t), Event.WARMUP_OK, t, asleep=False)
                reps[a.replica_id] = v
                continue
            v = apply_action(reps[a.replica_id], a.kind, t)
            if v.state is S.WAKING:
                v = apply_event(v, Event.WAKE_OK, t)
            if v.state is S.TERMINATED:
                reps.pop(a.replica_id)
                continue
            reps[a.replica_id] = dc_replace(v, inflight=0, running=0)
        if step == 21:
            assert [r.state for r in reps.values()].count(S.ACTIVE) == 2, "steady load must stay on --replicas"
    assert max_active == 6
    assert all(22 <= s < 45 for s in seen["promote"]), seen["promote"]  # promotions in the burst only
    assert seen["drain"] and min(seen["drain"]) >= 45 and max(seen["drain"]) < 90
    assert seen.get("recycle"), "a drained replica goes back into the warm pool"
    final = [r.state for r in reps.values()]
    assert final.count(S.ACTIVE) == 2 and final.count(S.WARM) == 2


class _DecisionLog:
    """A controller decision log for the scaling report's tests: decisions and replica
    transitions at seconds from `t0`, as the controller writes them."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.recs: list[dict[str, object]] = []

    def decision(self, t: float, direction: str, *actions: str) -> None:
        self.recs.append({"ts": self.t0 + t, "pool": "default", "event": "decision", "direction": direction,
                          "actions": list(actions)})

    def moves(self, t: float, rid: str, *states: str) -> None:
        self.recs.extend({"ts": self.t0 + t, "pool": "default", "event": "transition", "replica": rid,
                          "frm": a, "to": b} for a, b in pairwise(states))


def test_the_scaling_report_tells_pool_promotions_from_cold_starts(tmp_path: Path) -> None:
    """The "Scaling" section of `floodgate up`'s report, from a decision log shaped as a demo
    run's (the controller logs a start only as a `start:` action, never as a transition). The
    burst promotes the 2 pool replicas and cold-starts 2 more to refill the pool; the next steps up
    promote those as soon as they are warm (one after a moment asleep). They are the burst's 2
    cold starts, not promotions from the pool (the report said "promoted from the warm pool: 4"
    and showed no cold start). After the burst, a replica drained back into the pool and promoted
    again is a pool promotion. What happened before the demo is not shown."""

    from floodgate.up import render_timeline, scaling_timeline

    t0 = 1_000_000.0
    log_ = _DecisionLog(t0)
    recs, decision, moves = log_.recs, log_.decision, log_.moves

    # Before the demo: 2 started for min_replicas and promoted, 2 pool refills put to sleep.
    decision(-30, "none", "start:default-r0:scale_up", "start:default-r1:scale_up",
             "start:default-r2:pool_refill", "start:default-r3:pool_refill")
    for rid in ("default-r0", "default-r1", "default-r2", "default-r3"):
        moves(-28, rid, "loading", "warming", "warm")
    decision(-28, "none", "promote:default-r0:scale_up", "promote:default-r1:scale_up",
             "sleep:default-r2:pool", "sleep:default-r3:pool")
    moves(-28, "default-r0", "warm", "waking", "active")
    moves(-28, "default-r1", "warm", "waking", "active")
    # The burst: the pool promoted, and refilled with 2 cold starts ...
    decision(23.3, "up", "promote:default-r2:scale_up", "promote:default-r3:scale_up",
             "start:default-r4:pool_refill", "start:default-r5:pool_refill")
    moves(23.3, "default-r2", "warm", "waking")
    moves(23.3, "default-r3", "warm", "waking")
    decision(24.3, "up")
    moves(24.3, "default-r2", "waking", "active")
    moves(24.3, "default-r3", "waking", "active")
    # ... which the next steps up take as soon as they are warm.
    moves(24.4, "default-r4", "loading", "warming", "warm")
    decision(24.5, "none", "promote:default-r4:scale_up")
    moves(24.5, "default-r4", "warm", "waking", "active")
    moves(24.9, "default-r5", "loading", "warming", "warm")
    decision(25.0, "none", "sleep:default-r5:pool")
    decision(25.6, "up", "promote:default-r5:scale_up")
    moves(25.6, "default-r5", "warm", "waking", "active")
    # After the burst: r5 drained into the pool, then promoted from it.
    decision(55, "down", "drain:default-r5:scale_down")
    moves(55, "default-r5", "active", "draining")
    decision(57, "none", "recycle:default-r5:pool_refill")
    moves(57, "default-r5", "draining", "warm")
    decision(70, "up", "promote:default-r5:scale_up")
    moves(70, "default-r5", "warm", "waking")
    log = tmp_path / "controller.log"
    log.write_text("controller: starting\n" + "".join(json.dumps(r) + "\n" for r in recs))

    timeline = scaling_timeline(log, t0)
    in_burst: dict[str, list[str]] = {}
    for t, rid, what in timeline:
        if 22.5 <= t < 45:
            in_burst.setdefault(what, []).append(rid)
    assert in_burst == {
        "cold start": ["default-r4", "default-r5"],
        "promoted from the warm pool": ["default-r2", "default-r3"],
        "cold start ready (warm)": ["default-r4", "default-r5"],
        "promoted after its cold start": ["default-r4", "default-r5"],
    }
    assert (70.0, "default-r5", "promoted from the warm pool") in timeline
    report = render_timeline([row for row in timeline if row[0] < 45], 22.5, 45)
    assert "cold start: 2, promoted from the warm pool: 2, cold start ready (warm): 2, " \
           "promoted after its cold start: 2." in report, report
    assert "| 25.6 | default-r5 | promoted after its cold start |" in report, report


def test_a_replica_started_for_demand_but_put_to_sleep_at_bring_up_is_a_pool_promotion(tmp_path: Path) -> None:
    """At bring-up the controller starts 2 replicas for demand and 2 for the pool, then promotes
    the first 2 that are warm, not necessarily the 2 started for demand: here r1 and r2, and r0
    (started `scale_up`) goes to sleep in the pool with r3. The burst's promotions of r0 and r3
    are both from the warm pool. Before, r0 was still counted as a cold start waiting for its
    promotion, and the report said "promoted after its cold start: 3" against 2 cold starts
    (two `floodgate up` demo runs of a review, decision logs of this shape)."""

    from floodgate.up import render_timeline, scaling_timeline

    t0 = 1_000_000.0
    log_ = _DecisionLog(t0)
    recs, decision, moves = log_.recs, log_.decision, log_.moves

    decision(-30, "none", "start:default-r0:scale_up", "start:default-r1:scale_up",
             "start:default-r2:pool_refill", "start:default-r3:pool_refill")
    moves(-29.5, "default-r1", "loading", "warming", "warm")
    decision(-29.4, "none", "promote:default-r1:scale_up")
    moves(-29.4, "default-r1", "warm", "waking", "active")
    moves(-29.2, "default-r2", "loading", "warming", "warm")
    decision(-29.1, "none", "promote:default-r2:scale_up")
    moves(-29.1, "default-r2", "warm", "waking", "active")
    moves(-29.0, "default-r3", "loading", "warming", "warm")
    moves(-29.0, "default-r0", "loading", "warming", "warm")
    decision(-28.9, "none", "sleep:default-r3:pool")
    decision(-28.8, "none", "sleep:default-r0:pool")
    # The burst: both pool replicas promoted, the pool refilled with 2 cold starts, which the
    # next steps take once warm (r4 after a moment asleep).
    decision(23.4, "up", "promote:default-r0:scale_up", "start:default-r4:pool_refill")
    moves(23.4, "default-r0", "warm", "waking")
    decision(24.4, "up", "promote:default-r3:scale_up", "start:default-r5:pool_refill")
    moves(24.4, "default-r3", "warm", "waking")
    moves(24.6, "default-r4", "loading", "warming", "warm")
    decision(24.7, "none", "sleep:default-r4:pool")
    decision(25.2, "none", "promote:default-r4:scale_up")
    moves(25.2, "default-r4", "warm", "waking", "active")
    moves(26.0, "default-r5", "loading", "warming", "warm")
    decision(26.1, "none", "promote:default-r5:scale_up")
    moves(26.1, "default-r5", "warm", "waking", "active")
    log = tmp_path / "controller.log"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))

    timeline = scaling_timeline(log, t0)
    promotions = {rid: what for _, rid, what in timeline if what.startswith("promoted")}
    assert promotions == {"default-r0": "promoted from the warm pool", "default-r3": "promoted from the warm pool",
                          "default-r4": "promoted after its cold start",
                          "default-r5": "promoted after its cold start"}, promotions
    report = render_timeline(timeline, 22.5, 45)
    assert "promoted from the warm pool: 2" in report and "promoted after its cold start: 2" in report, report


def test_status_line_reports_a_stack_process_that_exited_once() -> None:
    import subprocess as sp
    import sys as _sys

    from floodgate.supervisor import Supervisor
    from floodgate.up import StatusLine

    with Supervisor() as sup:
        dead = sup.start("extproc0", [_sys.executable, "-c", "import sys; sys.exit(3)"])
        alive = sup.start("envoy", [_sys.executable, "-c", "import time; time.sleep(30)"])
        dead.proc.wait(20)
        status = StatusLine([], None, [dead, alive])
        (line,) = status.deaths()
        assert "extproc0 exited (code 3)" in line and str(dead.log_path) in line
        assert status.deaths() == []  # said once
        assert isinstance(alive.proc, sp.Popen) and alive.proc.poll() is None
        # The stack serves while one processor of a group is left; not once none is.
        assert StatusLine([], None, [dead, alive], [[alive], [dead, alive]]).fatal() is None
        assert StatusLine([], None, [dead], [[alive], [dead]]).fatal() == "extproc0 exited"
        alive.proc.kill()
        alive.proc.wait(20)
        assert StatusLine([], None, [], [[dead, alive]]).fatal() == "every one of extproc0, envoy exited"


@pytest.mark.parametrize(("rules", "kept"), [
    (None, False), ([], False), (["127.0.0.1/32"], True), (["127.0.0.0/8"], True),
    (["10.0.0.0/8", "127.0.0.1"], True),
    (["172.28.0.0/24:8000"], False),  # deploy/compose/processor.yaml: every request was 503 no_endpoints
    (["127.0.0.1:8000"], False), (["::1/128"], False),  # up's replicas: 127.0.0.1, ports chosen at start
])
def test_up_keeps_a_pools_picks_on_loopback(rules: list[str] | None, kept: bool) -> None:
    from floodgate.up import _loopback_allowlist

    pool: dict[str, object] = {"name": "p"} if rules is None else {"name": "p", "allowed_endpoints": rules}
    note = _loopback_allowlist(pool)
    assert pool["allowed_endpoints"] == (rules if kept else ["127.0.0.1/32"])
    assert (note is not None) == (bool(rules) and not kept), note
    if note:
        assert str(rules) in note and "127.0.0.1/32" in note


async def test_the_status_line_to_a_log_prints_changes_only(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a terminal (a service's log, a pipe): a line when it changes and every `quiet_s`, not
    one a second forever."""
    import asyncio

    from floodgate.up import _status_loop

    lines = iter(["idle", "idle", "idle", "busy", "busy", "idle", "idle", "idle", "idle"])
    stop = asyncio.Event()

    class Fake:
        def deaths(self) -> list[str]:
            return []

        def fatal(self) -> str | None:
            return None

        async def line(self, _session: object) -> str:
            text = next(lines, None)
            if text is None:
                stop.set()
                return "end"
            return text

    await _status_loop(Fake(), stop, 0.0, quiet_s=3600, every_s=0.001)  # type: ignore[arg-type]
    shown = [ln.split("] ", 1)[1] for ln in capsys.readouterr().err.splitlines()]
    assert shown == ["idle", "busy", "idle", "end"], shown


async def test_the_first_status_line_shows_no_rate() -> None:
    # The first line has no interval behind it: the start-up probes' admissions, divided by the
    # milliseconds since the line was made, read "admit 2000.0/s" on an idle stack.
    from floodgate.up import StatusLine

    status = StatusLine([])
    samples = iter([{"admitted@a": 2.0, "rejected@a": 0.0, "limit": 8.0},
                    {"admitted@a": 12.0, "rejected@a": 1.0, "limit": 8.0}])

    async def sample(session: object) -> dict[str, float]:
        return next(samples)

    status.sample = sample  # type: ignore[method-assign]
    first = await status.line(None)  # type: ignore[arg-type]
    assert "admit    0.0/s reject    0.0/s" in first, first
    status.last_t -= 2.0  # two seconds later: 10 admitted, 1 rejected
    second = await status.line(None)  # type: ignore[arg-type]
    assert "admit    5.0/s reject    0.5/s" in second, second


async def test_a_processor_that_drops_out_of_the_status_line_is_no_negative_rate() -> None:
    """A review: with one of two processors SIGKILLed the line read `admit -59.7/s`, the sum of
    the counters falling with the processor gone. Rates are per processor read both times, and
    a counter that went down (a restart) counts from 0."""
    from floodgate.up import StatusLine

    status = StatusLine([])
    samples = iter([{"admitted@a": 100.0, "admitted@b": 120.0, "rejected@a": 5.0, "rejected@b": 7.0, "limit": 8.0},
                    {"admitted@a": 110.0, "admitted@b": 130.0, "rejected@a": 5.0, "rejected@b": 7.0, "limit": 8.0},
                    {"admitted@a": 120.0, "rejected@a": 6.0, "limit": 8.0},  # b died
                    {"admitted@a": 4.0, "admitted@b": 10.0, "rejected@a": 0.0, "rejected@b": 0.0, "limit": 8.0}])

    async def sample(session: object) -> dict[str, float]:
        return next(samples)

    status.sample = sample  # type: ignore[method-assign]
    await status.line(None)  # type: ignore[arg-type]
    lines = []
    for _ in range(3):
        status.last_t -= 1.0
        lines.append(await status.line(None))  # type: ignore[arg-type]
    assert "admit   20.0/s reject    0.0/s" in lines[0], lines[0]
    assert "admit   10.0/s reject    1.0/s" in lines[1], lines[1]  # a alone, not -120
    assert "admit    4.0/s reject    0.0/s" in lines[2], lines[2]  # a restarted (4 since); b not in the last read


def test_the_banner_names_the_configured_priority_header_and_whether_it_is_trusted() -> None:
    from floodgate.up import DEMO_CONFIG, _priority_hint

    assert _priority_hint(DEMO_CONFIG) == "x-request-priority: 0|1|2"
    assert _priority_hint({"admission": {"priority_header": "x-prio", "trust": {"cidrs": ["127.0.0.0/8"]}}}) \
        == "x-prio: 0|1|2"
    assert "not trusted" in _priority_hint({"admission": {"priority_header": "x-prio", "trust": {"cidrs": []}}})


def test_up_says_when_redis_holds_another_configs_pool_settings(stack: LocalStack) -> None:
    """An operator review: `up --redis-url` against a Redis an earlier run had used kept that
    run's stored pool settings (every grant uses them: a config's `fair_order: false` ran as
    true), and the processors' ERROR went only to their logs, which a clean stop deletes. `up`
    prints it (and its status line says SETTINGS MISMATCH)."""
    from floodgate.up import _settings_mismatch

    stack.start_redis()
    first = stack.start_processor({"pools": [{"name": "default"}]})  # stores the pool's settings
    assert _settings_mismatch([first]) is None
    other = stack.start_processor({"pools": [{"name": "default", "fair_order": False}]})
    _wait(lambda: _settings_mismatch([other]) is not None, 20)
    line = _settings_mismatch([first, other])
    assert line is not None
    assert line.startswith("pool default: this processor's settings differ") and "fair" in line, line
    assert "settings_epoch" in line and "empty Redis database" in line
