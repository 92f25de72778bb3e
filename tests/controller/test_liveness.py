"""A replica that runs but does not serve, and starts that keep failing (controller.liveness):
the pure rules, and the live controller with the process actuator and real emulators."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from floodgate.controller.actuators.process import ProcessActuator
from floodgate.controller.actuators.static import StaticActuator
from floodgate.controller.app import Controller
from floodgate.controller.config import ControllerConfig, parse_config
from floodgate.controller.liveness import StartBackoff, Unresponsive
from floodgate.controller.metrics import FAILURE_REASONS

from floodgate.stack import LocalStack
from tests.controller.live import (
    StreamStats,
    controller_config,
    count,
    process_actuator,
    registry_states,
    running,
    stream_once,
    wait_for,
)
from tests.helpers import serving


def test_a_run_of_failed_scrapes_starts_at_the_first_and_ends_at_a_good_one() -> None:
    u = Unresponsive().observe(10.0, False)
    assert u.since == 10.0
    u = u.observe(11.0, False).observe(12.0, None)  # not scraped this tick: the run goes on
    assert u.since == 10.0 and not u.due(39.9, 30.0) and u.due(40.0, 30.0)
    assert u.observe(41.0, True) == Unresponsive()
    assert not u.due(1e9, 0.0)  # 0: never
    assert not Unresponsive().due(1e9, 30.0)


def test_start_backoff_doubles_to_its_cap_and_resets_on_success() -> None:
    b = StartBackoff()
    assert not b.blocks(0.0)
    waits = []
    for now in (0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0):
        b = b.failed(now, 1.0, 60.0)
        waits.append(b.until - now)
    assert waits == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert b.blocks(80.0 + 59.9) and not b.blocks(80.0 + 60.0)
    assert b.succeeded() == StartBackoff()


def test_after_failed_starts_one_goes_at_a_time_until_a_replica_comes_up() -> None:
    b = StartBackoff()
    assert b.starts_allowed(0, 0.0, 60.0) is None and b.starts_allowed(3, 0.0, 60.0) is None  # no failure
    assert b.up() == b  # (coming up means nothing without a failure)
    b = b.failed(0.0, 1.0, 60.0)
    assert b.starts_allowed(0, 1.0, 60.0) == 1 and b.starts_allowed(1, 1.0, 60.0) == 0  # the probe only
    b = b.up()
    assert b.starts_allowed(1, 2.0, 60.0) is None  # it came up: the rest start together
    b = b.failed(10.0, 1.0, 60.0)  # then died young (or another failed): one at a time again
    assert b.failures == 2 and not b.came_up and b.starts_allowed(0, 11.0, 60.0) == 1
    # A failure long ago with nothing started since is forgotten (a review: one pod lost
    # mid-load held a burst six hours later to one start); a probe still loading keeps the cap.
    assert b.starts_allowed(0, 6 * 3600.0, 60.0) is None
    assert b.starts_allowed(0, 69.9, 60.0) == 1 and b.starts_allowed(1, 6 * 3600.0, 60.0) == 0


def test_a_start_the_platform_refused_for_now_pauses_starts_without_a_failure() -> None:
    b = StartBackoff().paused(10.0, 1.0)
    assert b.blocks(10.5) and not b.blocks(11.0)
    assert b.failures == 0 and b.starts_allowed(0, 11.0, 60.0) is None  # no one-at-a-time after it
    assert b.paused(10.2, 0.5).until == 11.0  # never shortens a wait under way
    f = StartBackoff().failed(0.0, 4.0, 60.0).paused(1.0, 1.0)
    assert f.until == 4.0 and f.failures == 1


@pytest.mark.integration
async def test_a_hung_active_replica_is_failed_and_replaced(stack: LocalStack) -> None:
    # SIGSTOP: the process runs (the actuator lists it running) but answers nothing. It used to
    # stay active for good, every tick stale; now after `unresponsive_s` of failed scrapes and
    # a /health that does not answer, it is failed, leaves the registry, and the warm one serves.
    url = stack.start_redis()
    act = process_actuator(stack, stack.sup.workdir / "replicas")
    cfg = _one_and_a_spare(url, unresponsive_s=2, scrape_s=0.5)
    async with running(cfg, act) as ctl:
        pc = ctl.pools["default"]
        await wait_for(lambda: _pool_is(url, active=1, spare=1), 40)
        # The counters of a first failure exist at 0 before it (rate() needs two samples), and
        # the boot's starts are no warm-pool misses (there was no pool to hit).
        m = ctl.metrics.render().decode()
        assert 'floodgate_replica_failures_total{pool="default",reason="unresponsive"} 0.0' in m
        assert 'floodgate_warm_pool_misses_total{pool="default"} 0.0' in m
        (hung,) = [rid for rid, r in pc.replicas.items() if r.view.state.value == "active"]
        pid = await _pid(act, hung)
        os.kill(pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: _active_is_not(url, hung), 30)
            failed = [e for e in pc.events if e["event"] == "failed" and e["replica"] == hung]
            assert failed and failed[0]["why"].startswith("unresponsive"), failed
            assert ctl.metrics.unresponsive.labels(pool="default")._value.get() == 1
            assert ctl.metrics.failures.labels(pool="default", reason="unresponsive")._value.get() == 1
        finally:
            os.kill(pid, signal.SIGCONT)


@pytest.mark.integration
async def test_a_hung_warm_pool_replica_is_failed_and_replaced_before_any_burst(stack: LocalStack) -> None:
    # A warm-pool replica is not scraped: a hung one (SIGSTOP) was found only when a burst
    # promoted it, and the burst waited for its wake. Its /health checks (`pool_probe_s`) now
    # find it while it waits: it is failed and stopped, and the plan cold-starts a refill.
    url = stack.start_redis()
    act = process_actuator(stack, stack.sup.workdir / "replicas")
    cfg = _one_and_a_spare(url, unresponsive_s=2, pool_probe_s=0.5, liveness_probe_s=0.5)
    async with running(cfg, act) as ctl:
        pc = ctl.pools["default"]
        await wait_for(lambda: _pool_is(url, active=1, spare=1), 40)
        (hung,) = [rid for rid, r in pc.replicas.items() if r.view.state.value == "warm"]
        await wait_for(lambda: _is(url, hung, "sleeping"), 30)  # put to sleep: nothing talks to it now
        pid = await _pid(act, hung)
        os.kill(pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: _spare_is_not(url, hung), 40)
            failed = [e for e in pc.events if e["event"] == "failed" and e["replica"] == hung]
            assert failed and failed[0]["why"].startswith("unresponsive in the warm pool"), failed
            assert [e for e in pc.events if e["event"] == "pool_probe_failed" and e["replica"] == hung]
            assert ctl.metrics.failures.labels(pool="default", reason="pool_unresponsive")._value.get() == 1
            await wait_for(lambda: _stopped(act, hung), 15)  # stopped (SIGTERM, then SIGKILL), not left hanging
            assert not any(e["event"] == "failed" and e["replica"] != hung for e in pc.events)  # the others pass their checks
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.integration
async def test_a_hung_draining_replica_is_failed_not_held_until_max_drain(stack: LocalStack) -> None:
    # A replica that hangs (SIGSTOP: a deadlock, a wedged GPU) after its drain began: its
    # scrapes fail, and a failed scrape reads as busy, so the drain never finished and only
    # `max_drain_s` (300 s) ended it. Meanwhile it held the pool's one concurrent drain and
    # counted as the pool's refill (no other scale-down, no refill for five minutes). The
    # liveness checks of active replicas now cover draining ones too.
    url = stack.start_redis()
    state_dir = stack.sup.workdir / "replicas"
    timeouts = {"unresponsive_s": 2, "scrape_s": 0.5, "liveness_probe_s": 0.5}
    pool = {"enabled": False, "min_size": 0, "max_size": 0, "max_drain_s": 300}
    two = controller_config(url, policy={"min_replicas": 2, "max_replicas": 2}, warm_pool=pool, timeouts=timeouts)
    one = controller_config(url, policy={"min_replicas": 1, "max_replicas": 2}, warm_pool=pool, timeouts=timeouts)
    async with running(two, process_actuator(stack, state_dir), holder="a"):
        await wait_for(lambda: _pool_is(url, active=2, spare=0), 40)
    act = process_actuator(stack, state_dir)
    endpoints = {h.replica_id: h.endpoint for h in await act.list()}
    stats = StreamStats()
    async with aiohttp.ClientSession() as s:
        # A long stream straight to each replica: neither drain can end while it runs.
        streams = [asyncio.create_task(stream_once(s, f"http://{ep}", 3000, stats)) for ep in endpoints.values()]
        try:
            await wait_for(lambda: _each_runs(s, endpoints), 10)
            async with running(one, act, holder="b") as ctl:
                pc = ctl.pools["default"]
                hung = await wait_for(lambda: _draining(url), 20)
                pid = await _pid(act, hung)
                os.kill(pid, signal.SIGSTOP)
                try:
                    await wait_for(lambda: _stopped(act, hung), 40)
                    failed = [e for e in pc.events if e["event"] == "failed" and e["replica"] == hung]
                    assert failed and failed[0]["why"].startswith("unresponsive"), failed
                    assert not [e for e in pc.events if e["event"] == "transition" and e["on"] == "drain_timeout"]
                    assert ctl.metrics.failures.labels(pool="default", reason="unresponsive")._value.get() == 1
                    assert hung not in await registry_states(url)
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)


async def _each_runs(s: aiohttp.ClientSession, endpoints: dict[str, str]) -> bool:
    for ep in endpoints.values():
        async with s.get(f"http://{ep}/metrics") as r:
            text = await r.text()
        if not any(line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1
                   for line in text.splitlines()):
            return False
    return True


async def _draining(url: str) -> str | None:
    return next((rid for rid, st in (await registry_states(url)).items() if st == "draining"), None)


def _one_and_a_spare(url: str, **timeouts: float) -> ControllerConfig:
    """One active replica and one in the warm pool (room for a replacement), with `timeouts`."""
    return controller_config(url, policy={"min_replicas": 1, "max_replicas": 2},
                             warm_pool={"min_size": 1, "max_size": 1, "max_total": 3}, timeouts=timeouts)


async def _pid(act: ProcessActuator, rid: str) -> int:
    return int(next(h for h in await act.list() if h.replica_id == rid).labels["pid"])


async def _stopped(act: ProcessActuator, rid: str) -> bool:
    return rid not in {h.replica_id for h in await act.list() if h.running}


async def _is(url: str, rid: str, state: str) -> bool:
    return (await registry_states(url)).get(rid) == state


async def _spare_is_not(url: str, rid: str) -> bool:
    st = await registry_states(url)
    return count(st, "active") == 1 and count(st, "warm") + count(st, "sleeping") >= 1 and rid not in st


async def _pool_is(url: str, *, active: int, spare: int) -> bool:
    st = await registry_states(url)
    return count(st, "active") == active and count(st, "warm") + count(st, "sleeping") >= spare


async def _active_is_not(url: str, rid: str) -> bool:
    st = await registry_states(url)
    return count(st, "active") == 1 and rid not in st


@pytest.mark.integration
async def test_failing_starts_back_off(stack: LocalStack, tmp_path: Path) -> None:
    # A command that exits at once: each start fails within a second (reconcile sees it gone).
    # Without the backoff the plan started another at every tick (372 in 8 s in a review).
    url = stack.start_redis()
    act = ProcessActuator([sys.executable, "-c", "import sys; sys.exit(3)", "{port}"], tmp_path / "replicas",
                          supervisor=stack.sup)
    cfg = controller_config(url, policy={"min_replicas": 1}, warm_pool={"enabled": False}, tick=0.05,
                            timeouts={"start_backoff_s": 1, "start_backoff_max_s": 60, "adopt_grace_s": 0})
    async with running(cfg, act) as ctl:
        held = 0.0  # the longest start backoff the metrics showed
        for _ in range(60):
            await asyncio.sleep(0.1)
            held = max(held, ctl.metrics.start_backoff.labels(pool="default")._value.get())
        pc = ctl.pools["default"]
        starts = [e for e in pc.events if e["event"] == "decision" and any(a.startswith("start:") for a in e["actions"])]
        backoffs = [e for e in pc.events if e["event"] == "start_backoff"]
        failed = [e for e in pc.events if e["event"] == "failed"]
        counted = sum(ctl.metrics.failures.labels(pool="default", reason=r)._value.get() for r in FAILURE_REASONS)
    # a crash loop shows in the metrics: every failure counted, the backoff as a gauge
    assert failed and counted == len(failed), (counted, failed)
    assert held >= 0.5, held
    # waits of 1, 2, 4 s: starts at ~0, 1, 3 (and the next at 7, after the window)
    assert 2 <= len(starts) <= 4, [(e["ts"], e["actions"]) for e in starts]
    assert backoffs and backoffs[-1]["failures"] in (len(starts) - 1, len(starts)), backoffs


@pytest.mark.integration
async def test_a_replica_that_dies_soon_after_coming_up_backs_off_too(stack: LocalStack, tmp_path: Path) -> None:
    # A real emulator that comes up (cold start 0.3 s), passes /health and its warm-up, is
    # promoted, and is killed 1.5 s after spawn: an engine that dies on its first batches. Its
    # deaths did not count toward the backoff (only failures before coming up did), so it was
    # restarted as fast as it died: 16 cold starts in 40 s in a review (8 in this test's 12 s).
    # Now each death within `crash_loop_s` of coming up counts: waits of 1, 2, 4 s.
    url = stack.start_redis()
    sim = f"{sys.executable} -m floodgate sim --port $0 --cold-start 0.3 --log-level warning"
    act = ProcessActuator(["sh", "-c", f"{sim} & p=$!; sleep 1.5; kill -9 $p; exit 1", "{port}"],
                          tmp_path / "replicas", supervisor=stack.sup)
    cfg = controller_config(url, policy={"min_replicas": 1}, warm_pool={"enabled": False}, tick=0.1,
                            timeouts={"start_backoff_s": 1, "start_backoff_max_s": 60, "adopt_grace_s": 0,
                                      "crash_loop_s": 30})
    async with running(cfg, act) as ctl:
        pc = ctl.pools["default"]
        await asyncio.sleep(12)
        starts = [e for e in pc.events if e["event"] == "decision" and any(a.startswith("start:") for a in e["actions"])]
        backoffs = [e for e in pc.events if e["event"] == "start_backoff"]
        came_up = [e for e in pc.events if e["event"] == "promoted"]
    assert came_up, "the replica never came up: this is the early-crash case, not this test's"
    # each round ~2 s (spawn to death) plus its wait (1, 2, 4 s): 3-4 starts in 12 s, not ~8
    assert 2 <= len(starts) <= 4, [(e["ts"], e["actions"]) for e in starts]
    assert backoffs and [e["failures"] for e in backoffs] == list(range(1, len(backoffs) + 1)), backoffs


@pytest.mark.integration
async def test_after_failed_starts_the_pool_starts_one_replica_until_one_comes_up(stack: LocalStack,
                                                                                  tmp_path: Path) -> None:
    # The first three starts fail (the command exits); a real emulator comes up from the fourth
    # on. Three are wanted: when the backoff ended, every planned start went at once (three
    # more failures a round with a command that keeps failing). Now one start goes alone, and
    # once it is up the other two start together.
    url = stack.start_redis()
    calls = tmp_path / "calls"
    sim = f"{sys.executable} -m floodgate sim --port $0 --cold-start 0.3 --log-level warning"
    act = ProcessActuator(["sh", "-c", f"echo x >> {calls}; [ $(wc -l < {calls}) -le 3 ] && exit 1; exec {sim}",
                           "{port}"], tmp_path / "replicas", supervisor=stack.sup)
    cfg = controller_config(url, policy={"min_replicas": 3}, warm_pool={"enabled": False}, tick=0.1,
                            timeouts={"start_backoff_s": 1, "start_backoff_max_s": 60, "adopt_grace_s": 0})
    async with running(cfg, act) as ctl:
        pc = ctl.pools["default"]
        await wait_for(lambda: _pool_is(url, active=3, spare=0), 40)
        rounds = [sum(a.startswith("start:") for a in e["actions"]) for e in pc.events
                  if e["event"] == "decision" and any(a.startswith("start:") for a in e["actions"])]
    assert rounds[0] == 3, rounds  # the first round: no failure yet
    # After the failures: the probe alone, then the rest ([1, 2]; on a loaded box a failure of
    # the first round noticed after the probe came up puts starts back to one at a time: [1, 1, 1]).
    assert rounds[1] == 1 and sum(rounds[1:]) == 3, rounds


PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
"""


class FakeVllm:
    def __init__(self) -> None:
        self.slow = 0.0
        self.n_completions = 0
        self.n_sleeps = 0

    async def health(self, _: web.Request) -> web.Response:
        await asyncio.sleep(self.slow)
        return web.Response(text="")

    async def metrics(self, _: web.Request) -> web.Response:
        await asyncio.sleep(self.slow)
        return web.Response(text=PAGE)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(self, _: web.Request) -> web.Response:
        self.n_completions += 1
        return web.json_response({"choices": [{"text": "x"}]})

    async def is_sleeping(self, _: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    async def sleep(self, _: web.Request) -> web.Response:
        self.n_sleeps += 1
        return web.Response(text="")

    async def wake(self, _: web.Request) -> web.Response:
        return web.Response(text="")


@pytest.mark.integration
async def test_a_slow_but_serving_replica_is_not_failed(stack: LocalStack) -> None:
    # An API server whose loop is loaded answers /metrics and /health in 1.5 s, past the 1 s
    # scrape timeout, while it serves. Its scrapes fail, but the liveness check has its own
    # timeout (`liveness_probe_s`), so it is kept (a review had it failed and put to sleep).
    # A stand-in server: the emulator cannot be made to answer its /metrics late.
    url = stack.start_redis()
    fake = FakeVllm()
    app = web.Application()
    app.add_routes([web.get("/health", fake.health), web.get("/metrics", fake.metrics),
                    web.get("/v1/models", fake.models), web.post("/v1/completions", fake.completions),
                    web.get("/is_sleeping", fake.is_sleeping), web.post("/sleep", fake.sleep),
                    web.post("/wake_up", fake.wake)])
    async with serving(app) as port:
        await _slow_replica_kept(url, fake, f"127.0.0.1:{port}")


async def _slow_replica_kept(url: str, fake: FakeVllm, ep: str) -> None:
    cfg = parse_config({
        "redis": {"url": url}, "tick_interval_s": 0.25, "metrics_listen": None, "leader": {"ttl_s": 3},
        "pools": [{"name": "default",
                   "policy": {"min_replicas": 1, "max_replicas": 1, "stabilization_window_s": 0,
                              "scale_down_interval_s": 0, "panic_window_s": 0},
                   "forecast": {"enabled": False}, "warm_pool": {"enabled": False},
                   "timeouts": {"health_s": 30, "warmup_s": 10, "unresponsive_s": 3},  # scrape_s: default 1 s
                   "actuator": {"kind": "static", "endpoints": {"r1": ep}}}]}, env={})
    ctl = Controller(cfg, {"default": StaticActuator({"r1": ep})}, holder="t")
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    try:
        await wait_for(lambda: _r1_active(url), 20)
        fake.slow = 1.5
        pc = ctl.pools["default"]
        await asyncio.sleep(8)
        failed = [e for e in pc.events if e["event"] == "failed"]
        assert not failed, failed
        assert (await registry_states(url)).get("r1") == "active" and fake.n_sleeps == 0
        assert any(e["event"] == "decision" and e.get("stale") for e in pc.events)  # its scrapes did fail
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def _r1_active(url: str) -> bool:
    return (await registry_states(url)).get("r1") == "active"


async def test_a_replica_failed_by_its_check_while_the_tick_acts_is_not_acted_on(stack: LocalStack) -> None:
    # The liveness checks run beside the ticks and fail a replica whenever their /health call
    # ends: a hung pool replica's check can end between the tick's plan and its actions (during
    # the leader check or the persist, both Redis round trips). The plan had promoted it (a
    # burst needs it): PROMOTE on a FAILED replica raised InvalidTransition out of the tick,
    # which stops the controller (and, with --stop-replicas-on-exit, every replica with it).
    from floodgate.controller.app import PoolController, Replica
    from floodgate.controller.metrics import ControllerMetrics
    from floodgate.controller.signals import ReplicaState, ReplicaView
    from floodgate.extproc.state import redis_client

    from floodgate.supervisor import free_port
    from tests.controller.test_registry_sync import Fixed

    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 1, "max_replicas": 1},
                            warm_pool={"min_size": 0, "max_size": 0, "max_total": 1})
    rc = redis_client(url)
    ep = f"127.0.0.1:{free_port()}"  # nothing answers: a hung pool replica
    async with aiohttp.ClientSession() as s:
        pc = PoolController(cfg.pools[0], Fixed({"r0": ep}), rc, s, ControllerMetrics())  # type: ignore[arg-type]
        rep = Replica(ReplicaView("r0", ReplicaState.WARM, pc.clock() - 600, asleep=True), ep)
        pc.replicas = {"r0": rep}

        async def check_ends_now() -> bool:  # the pool check's failure lands during the leader check
            await pc._fail(rep, "unresponsive in the warm pool", kind="pool_unresponsive")
            return True

        pc.confirm = check_ends_now
        await pc.tick()  # raised InvalidTransition
        assert any(a.kind.value == "promote" for a in pc.logged_actions), pc.logged_actions
        assert rep.view.state is ReplicaState.FAILED and not rep.busy
        await pc.shutdown()
    await rc.aclose()


async def test_a_replica_failed_by_its_check_during_an_earlier_action_is_not_acted_on(
        stack: LocalStack, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same race one step later: the tick carries out its actions one after the other, and
    # an action's registry write (a Redis round trip) lets a check fail the replica of an action
    # after it. Two pool replicas promoted for a burst; the second one's check ends during the
    # first one's registry write.
    from floodgate.controller.app import PoolController, Replica
    from floodgate.controller.metrics import ControllerMetrics
    from floodgate.controller.signals import ReplicaState, ReplicaView
    from floodgate.extproc.registry import Registry
    from floodgate.extproc.state import redis_client

    from floodgate.supervisor import free_port
    from tests.controller.test_registry_sync import Fixed

    url = stack.start_redis()
    cfg = controller_config(url, policy={"min_replicas": 2, "max_replicas": 2},
                            warm_pool={"min_size": 0, "max_size": 0, "max_total": 2})
    rc = redis_client(url)
    eps = {"r0": f"127.0.0.1:{free_port()}", "r1": f"127.0.0.1:{free_port()}"}  # nothing answers
    real_set = Registry.set
    async with aiohttp.ClientSession() as s:
        pc = PoolController(cfg.pools[0], Fixed(eps), rc, s, ControllerMetrics())  # type: ignore[arg-type]
        reps = {rid: Replica(ReplicaView(rid, ReplicaState.WARM, pc.clock() - 600, asleep=True), ep)
                for rid, ep in eps.items()}
        pc.replicas = dict(reps)

        async def write_then_check_ends(self: Registry, endpoint: str, state: str, replica_id: str,
                                        meta: object = None) -> None:
            await real_set(self, endpoint, state, replica_id)
            other = reps["r1" if replica_id == "r0" else "r0"]
            if other.view.state is ReplicaState.WARM:
                await pc._fail(other, "unresponsive in the warm pool", kind="pool_unresponsive")

        monkeypatch.setattr(Registry, "set", write_then_check_ends)
        await pc.tick()  # raised InvalidTransition
        assert sorted(a.kind.value for a in pc.logged_actions) == ["promote", "promote"], pc.logged_actions
        promoted = [e["replica"] for e in pc.events if e["event"] == "transition" and e["on"] == "promote"]
        failed = [e["replica"] for e in pc.events if e["event"] == "failed"]
        assert len(promoted) == 1 and failed[0] != promoted[0], (promoted, failed)  # the other one: failed, not promoted
        await pc.shutdown()
    await rc.aclose()
