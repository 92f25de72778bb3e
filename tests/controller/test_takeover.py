"""Two controllers of one deployment on one host (a leader and its standby, one `state_dir`),
and unrelated ones that must not touch each other's replicas. Real `floodgate sim` processes,
real Redis, the controllers in the test's loop."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from floodgate.controller.actuators.process import (
    ProcessActuator,
    TableOwnedElsewhere,
    pid_alive,
    read_table,
)
from floodgate.controller.config import (
    ConfigError,
    check_state_dirs,
    parse_config,
    process_state_dir,
)

from floodgate.stack import LocalStack
from tests.controller.live import (
    controller_config,
    count,
    process_actuator,
    registry_states,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration

NO_POOL = {"enabled": False, "min_size": 0, "max_size": 0}
# Long enough that a loaded box never lets the leader's lease lapse between renewals (which
# would make the standby the leader and its exit a leader's exit); a release hands it over at once.
LEASE = {"ttl_s": 15}


def _replica_procs(stack: LocalStack) -> dict[int, str]:
    """pid -> name of every replica process the stack's supervisor started that still runs."""
    return {c.proc.pid: c.name for c in stack.sup.children
            if c.name.startswith("replica-") and c.proc.poll() is None}


async def _active(url: str, n: int) -> bool:
    return count(await registry_states(url), "active") == n


async def test_a_standby_takes_over_the_replicas_the_leader_started_after_it_came_up(stack: LocalStack) -> None:
    # The standby's actuator exists before the leader replaces a crashed replica. Before, it
    # acted on the table it read at start-up: on taking over it removed the replacement's
    # registry entry while it served, cold-started another beside it, and left its process
    # running in no table (an orphan nothing ever stops; with vLLM, a GPU held for good).
    url = stack.start_redis()
    state_dir = stack.sup.workdir / "replicas"
    cfg = controller_config(url, policy={"min_replicas": 2, "max_replicas": 4}, warm_pool=NO_POOL, leader=LEASE)
    async with running(cfg, process_actuator(stack, state_dir), holder="a"):
        await wait_for(lambda: _active(url, 2), 40)
        standby = process_actuator(stack, state_dir)
        async with running(cfg, standby, holder="b", wait_ready=False) as b:
            (victim, *_) = sorted(read_table(state_dir)[1])
            os.killpg(int(read_table(state_dir)[1][victim]["pid"]), signal.SIGKILL)
            await wait_for(lambda: _replaced(url, victim), 40)
            assert not b.pools  # still standing by
            serving = await registry_states(url)
            pids = {int(e["pid"]) for e in read_table(state_dir)[1].values()}
            # ... the leader stops; the standby takes over.
        # (b stopped too: both gone, the replicas stay.)
    async with running(cfg, standby, holder="b") as b:
        await asyncio.sleep(1.0)  # a few ticks
        pc = b.pools["default"]
        assert await registry_states(url) == serving  # nothing taken out of routing
        assert not [e for e in pc.events if e["event"] == "forgotten"]
        assert not [e for e in pc.events if e["event"] == "transition" and e["frm"] == "cold"]  # no cold start
        assert set(_replica_procs(stack)) == pids  # every running replica is in the table
        assert {int(e["pid"]) for e in read_table(state_dir)[1].values()} == pids


async def _replaced(url: str, victim: str) -> bool:
    st = await registry_states(url)
    return victim not in st and count(st, "active") == 2


async def test_a_standby_with_stop_replicas_on_exit_stops_nothing(stack: LocalStack) -> None:
    # `--stop-replicas-on-exit` on a standby that never led stopped every replica of its leader
    # (in flight requests cut, the leader cold-starting replacements).
    url = stack.start_redis()
    state_dir = stack.sup.workdir / "replicas"
    cfg = controller_config(url, policy={"min_replicas": 2, "max_replicas": 4}, warm_pool=NO_POOL, leader=LEASE)
    async with running(cfg, process_actuator(stack, state_dir), holder="a") as a:
        await wait_for(lambda: _active(url, 2), 40)
        before = set(_replica_procs(stack))
        async with running(cfg, process_actuator(stack, state_dir), holder="b", wait_ready=False,
                           stop_replicas_on_exit=True):
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)
        assert set(_replica_procs(stack)) == before
        pc = a.pools["default"]
        assert not [e for e in pc.events if e["event"] == "failed"]
        assert await _active(url, 2)


async def test_the_leader_with_stop_replicas_on_exit_stops_them_before_the_standby_takes_over(
        stack: LocalStack) -> None:
    url = stack.start_redis()
    state_dir = stack.sup.workdir / "replicas"
    cfg = controller_config(url, policy={"min_replicas": 2, "max_replicas": 4}, warm_pool=NO_POOL, leader=LEASE)
    from floodgate.controller.app import Controller

    a = Controller(cfg, {"default": process_actuator(stack, state_dir)}, holder="a", stop_replicas_on_exit=True)
    stop_a = asyncio.Event()
    task_a = asyncio.create_task(a.run(stop_a))
    await asyncio.wait_for(a.ready.wait(), 15)  # a leads
    async with running(cfg, process_actuator(stack, state_dir), holder="b", wait_ready=False) as b:
        await wait_for(lambda: _active(url, 2), 40)
        theirs = set(_replica_procs(stack))
        their_ids = set(await registry_states(url))
        assert len(theirs) == 2 and len(their_ids) == 2
        stop_a.set()
        await asyncio.wait_for(task_a, 30)
        # The lease is released only after the replicas are stopped: the standby adopts none of
        # them (it would have adopted replicas being stopped), it starts its own.
        assert not any(pid_alive(p) for p in theirs)
        assert not set(await registry_states(url)) & their_ids  # out of routing too
        await asyncio.wait_for(b.ready.wait(), 15)
        await wait_for(lambda: _active(url, 2), 40)
        pc = b.pools["default"]
        assert not [e for e in pc.events if e["event"] == "adopt"]
        assert not set(_replica_procs(stack)) & theirs


def _cfg(url: str, state_dir: Path | None) -> object:
    actuator = {"kind": "process"} | ({"state_dir": str(state_dir)} if state_dir else {})
    return parse_config({"redis": {"url": url}, "pools": [{"name": "default", "actuator": actuator}]}, env={})


async def test_a_table_of_another_deployment_is_refused_while_its_replicas_run(stack: LocalStack) -> None:
    # Two stacks on one host (each its own Redis) with one state_dir: the second adopted the
    # first's replicas (registered them in its own Redis, then drained and stopped one).
    state_dir = stack.sup.workdir / "shared"
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", "{port}"]
    mine, theirs = _cfg("redis://10.0.0.1:6379/0", state_dir), _cfg("redis://10.0.0.2:6379/0", state_dir)
    from floodgate.controller.config import table_owner

    act = ProcessActuator(cmd, state_dir, supervisor=stack.sup,
                          owner=table_owner(mine, mine.pools[0]))  # type: ignore[attr-defined]
    h = await act.start("default-r0")
    assert h is not None and h.running
    with pytest.raises(ConfigError) as exc:
        check_state_dirs(theirs, create=True)  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "pools.0.actuator.state_dir: " in msg and "default-r0 (pid " in msg and "10.0.0.1" in msg, msg
    with pytest.raises(TableOwnedElsewhere):
        ProcessActuator(cmd, state_dir, owner=table_owner(theirs, theirs.pools[0]))  # type: ignore[attr-defined]
    check_state_dirs(mine, create=True)  # type: ignore[arg-type]  # its own: fine
    # Once its processes are gone, the table is taken over (nothing to lose).
    await act.stop("default-r0")
    check_state_dirs(theirs, create=True)  # type: ignore[arg-type]
    # Unset, the directory differs per deployment: unrelated stacks never meet.
    d1 = process_state_dir(mine, mine.pools[0])  # type: ignore[attr-defined, arg-type]
    d2 = process_state_dir(theirs, theirs.pools[0])  # type: ignore[attr-defined, arg-type]
    assert d1 == d2 == state_dir
    u1, u2 = _cfg("redis://10.0.0.1:6379/0", None), _cfg("redis://:secret@10.0.0.2:6379/0", None)
    p1 = process_state_dir(u1, u1.pools[0])  # type: ignore[attr-defined, arg-type]
    p2 = process_state_dir(u2, u2.pools[0])  # type: ignore[attr-defined, arg-type]
    assert p1 != p2 and p1.name.startswith("floodgate-controller-default-")
    assert "secret" not in table_owner(u2, u2.pools[0])  # type: ignore[arg-type, attr-defined]


async def test_credentials_and_options_of_the_same_redis_keep_the_table(
        stack: LocalStack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An operator review: a controller restarted with the password moved from its URL to
    FLOODGATE_REDIS_PASSWORD, or logging in as the shipped `floodgate-controller` ACL user, or
    with `?socket_timeout=2` added, is the same deployment. Its owner named the URL as written:
    with a state_dir set, start-up refused its own running replicas as "another deployment";
    with the default one it looked in another directory and left them running unmanaged."""
    state_dir = stack.sup.workdir / "table"
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", "{port}"]
    # The table as the version before wrote it (the user and a masked password in the URL).
    act = ProcessActuator(cmd, state_dir, supervisor=stack.sup,
                          owner="redis redis://:***@10.0.0.1:6379/0 leader fg:controller:leader pool default")
    h = await act.start("default-r0")
    assert h is not None and h.running
    same = ["redis://10.0.0.1:6379/0", "redis://floodgate-controller:pw@10.0.0.1:6379/0",
            "redis://:pw@10.0.0.1:6379/0?socket_timeout=2"]
    for url in same:
        check_state_dirs(_cfg(url, state_dir), create=True)  # type: ignore[arg-type]  # before: refused
    with pytest.raises(ConfigError):  # another Redis is another deployment, as before
        check_state_dirs(_cfg("redis://10.0.0.2:6379/0", state_dir), create=True)  # type: ignore[arg-type]
    await act.stop("default-r0")
    # The default directory: one for the three (before: three), and an earlier version's is
    # still found while it holds the table.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dirs = {process_state_dir(c, c.pools[0]) for c in map(lambda u: _cfg(u, None), same)}  # type: ignore[attr-defined]
    assert len(dirs) == 1
    legacy_url = "redis://:pw@10.0.0.1:6379/0"
    legacy = tmp_path / ("floodgate-controller-default-" + hashlib.sha256(
        b"redis redis://:***@10.0.0.1:6379/0 leader fg:controller:leader pool default").hexdigest()[:8])
    legacy.mkdir()
    (legacy / "replicas.json").write_text('{"owner": null, "replicas": {}}')
    c = _cfg(legacy_url, None)
    assert process_state_dir(c, c.pools[0]) == legacy  # type: ignore[attr-defined, arg-type]


async def test_the_table_survives_concurrent_writers(stack: LocalStack, tmp_path: Path) -> None:
    # Two actuators on one table (leader and standby) each write under the lock, reading the
    # table afresh: neither drops the other's entries.
    cmd = [sys.executable, "-c", "import time; time.sleep(60)", "{port}"]
    a = ProcessActuator(cmd, tmp_path, supervisor=stack.sup)
    b = ProcessActuator(cmd, tmp_path, supervisor=stack.sup)
    await asyncio.gather(*(x.start(f"r{i}") for i, x in enumerate([a, b] * 4)))
    assert sorted(read_table(tmp_path)[1]) == [f"r{i}" for i in range(8)]
    await asyncio.gather(a.set_role("r1", "active"), b.set_role("r2", "warm-pool"))
    t = read_table(tmp_path)[1]
    assert (t["r1"]["role"], t["r2"]["role"]) == ("active", "warm-pool")
    await b.stop_all()
    assert read_table(tmp_path)[1] == {}


async def test_a_restarted_controller_leaves_freed_static_endpoints_asleep(stack: LocalStack) -> None:
    # The static actuator keeps no roles across restarts: the endpoints the last controller
    # freed (asleep, no registry entry) were brought up again, woken, counted as arriving
    # capacity and promoted on an idle pool, then drained back one per scale-down interval.
    from floodgate.controller.actuators.static import StaticActuator

    from tests.controller.test_actuators import _static_sims

    url = stack.start_redis()
    eps = _static_sims(stack, 4)
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 4},
                            warm_pool={"min_size": 1, "max_size": 1, "warm_min_age_s": 0},
                            actuator={"kind": "static", "endpoints": eps})

    async def settled() -> bool:
        st = await registry_states(url)
        return sorted(st.values()) == ["active", "sleeping"]

    first = StaticActuator(eps)
    async with running(cfg, first, holder="a"):  # type: ignore[arg-type]
        await wait_for(settled, 60)
        await asyncio.sleep(0.5)
    await first.close()
    second = StaticActuator(eps)
    try:
        async with running(cfg, second, holder="b") as b:  # type: ignore[arg-type]
            for _ in range(12):  # 3 s of ticks: the pool stays as it was
                assert await settled(), await registry_states(url)
                await asyncio.sleep(0.25)
            pc = b.pools["default"]
            moves = [(e["frm"], e["to"]) for e in pc.events if e["event"] == "transition"]
            assert not [m for m in moves if m[1] in ("waking", "active", "loading", "warming")], moves
    finally:
        await second.close()


async def test_a_controller_restarted_during_cold_starts_starts_nothing_more(stack: LocalStack) -> None:
    # A review: min 2 and a warm pool of 1, the controller restarted while all three replicas
    # (2 to serve, 1 pool refill) were still loading. The new leader counted all three as wanted
    # serving capacity (desired 3), so the pool looked empty and it cold-started a fourth, which
    # sat in the pool for `warm_min_age_s`. It now starts from the last leader's desired count.
    url = stack.start_redis()
    act = process_actuator(stack, stack.sup.workdir / "replicas")
    act.command = [a if a != "0.5" else "4" for a in act.command]  # --cold-start 4 s: still loading at the restart
    cfg = controller_config(url, policy={"min_replicas": 2, "max_replicas": 4},
                            warm_pool={"min_size": 1, "max_size": 1, "max_total": 4}, leader=LEASE)
    async with running(cfg, act, holder="a") as ctl:
        pc = ctl.pools["default"]
        await wait_for(lambda: _loading(pc, 3), 10)
        await wait_for(lambda: _listed(act, 3), 10)  # their processes started (a start runs in a task)
    started = {h.replica_id for h in await act.list()}
    assert len(started) == 3, started
    async with running(cfg, act, holder="b") as ctl:
        pc = ctl.pools["default"]
        await wait_for(lambda: _serving_and_pooled(url), 30)
        await asyncio.sleep(2)  # a few more ticks: nothing more is started
        starts = [e for e in pc.events if e["event"] == "decision" and any(a.startswith("start:") for a in e["actions"])]
        assert not starts, starts
        assert {h.replica_id for h in await act.list()} == started
        assert next(e for e in pc.events if e["event"] == "resume")["desired"] == 2


async def _listed(act: ProcessActuator, n: int) -> bool:
    return len([h for h in await act.list() if h.running]) == n


async def _loading(pc: Any, n: int) -> bool:
    return sum(1 for r in pc.replicas.values() if r.view.state.value == "loading") == n


async def _serving_and_pooled(url: str) -> bool:
    st = await registry_states(url)
    return count(st, "active") == 2 and count(st, "warm") + count(st, "sleeping") == 1
