"""Backtest engine fidelity: the admission model decides as the processor's early drop does
(a request waits when the release rate is unknown or rests on too few releases; an arrival on
a tick edge is not queued ahead of itself), a request cut off by a forced stop misses its SLO,
and `floodgate controller simulate` / `suite` reject out-of-range options before running.
Real modules only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from floodgate.controller.backtest import baselines, engine, oracle
from floodgate.controller.backtest.workload import Workload
from floodgate.controller.decider import Signals
from floodgate.controller.lifecycle import Action, ActionKind
from floodgate.controller.signals import ReplicaState
from floodgate.extproc.policy import MIN_RELEASES

from floodgate.cli import main

SIM = engine.SimConfig()


class Static:
    """A plain ReplicaSet of n replicas, with or without Floodgate's admission in front."""

    instant_start = False

    def __init__(self, n: int, admission: bool, max_drain_s: float = math.inf) -> None:
        self.n, self.admission, self.max_drain_s, self.seq = n, admission, max_drain_s, 0
        self.name = f"static-{n}"

    def size(self, now: float) -> int:
        return self.n

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        p = baselines.plan_replicaset(self.size(now), signals.replicas, now, self.max_drain_s, self.seq)
        self.seq = p.next_seq
        return p.actions


@pytest.mark.parametrize("offset", [0.5, 0.0])
def test_admission_lets_requests_wait_after_an_idle_spell(offset: float) -> None:
    # Idle 100 s, then 16 requests of 0.5 s at once on one replica of 8 slots: 8 start, 8 wait
    # 0.5 s. The start rate is 0 after the idle spell; the processor lets a standard-class
    # request wait when unsure about the rate. The engine turned away 7/16 of them (every one
    # at a tick edge, free slots or not).
    arr = np.repeat(np.arange(100.0, 3700.0, 100.0) + offset, 16)
    w = Workload("idle-then-burst", arr, np.full(len(arr), 0.5), np.full(len(arr), 300.0), 0.0, 3700.0, None, "")
    for admission in (False, True):
        r = engine.run_policy(w, Static(1, admission), SIM, 1)
        assert r.rejected == 0 and r.slo == 1.0, (admission, r.rejected)
        assert r.max_wait == pytest.approx(0.5)


def test_an_arrival_on_a_tick_edge_is_not_queued_ahead_of_itself() -> None:
    # A known release rate (3/s background of 20 s requests on 20 replicas: ~60 of 160 slots
    # busy), then 100 one-second requests exactly at a tick time: 100 slots are free, so all
    # start at once. Counting them in the queue as well put the last ~40 behind 100 waiters
    # the rate could not serve in 15 s: turned away.
    rng = np.random.default_rng(2)
    bg = np.sort(rng.uniform(0.0, 1200.0, 3600))
    t_edge = 900.0
    assert (t_edge / SIM.tick_s).is_integer()
    arr = np.concatenate([bg, np.full(100, t_edge)])
    svc = np.concatenate([np.full(len(bg), 20.0), np.full(100, 1.0)])
    o = np.argsort(arr, kind="stable")
    w = Workload("edge", arr[o], svc[o], np.full(len(arr), 300.0), 0.0, 1200.0, None, "")
    r = engine.run_policy(w, Static(20, True), SIM, 20)
    assert r.rejected == 0 and r.slo == 1.0


def test_early_drop_is_the_processors_rule() -> None:
    # Unknown rate or too few releases: the request waits, however long the line.
    assert not engine.early_drop(1000.0, 0.0, 0.0, 15.0)
    assert not engine.early_drop(1000.0, 5.0, MIN_RELEASES - 1, 15.0)
    # A known rate: turned away only when enough releases are unlikely before the timeout
    # (10/s for 15 s: ~150 expected, read at the rate's upper bound).
    assert not engine.early_drop(100.0, 10.0, 100.0, 15.0)
    assert not engine.early_drop(150.0, 10.0, 100.0, 15.0)
    assert engine.early_drop(300.0, 10.0, 100.0, 15.0)


def test_requests_cut_off_by_a_forced_stop_miss_their_slo() -> None:
    # 16 requests of 1000 s on 2 replicas; at 100 s the ReplicaSet shrinks to 1 with a 10 s
    # drain limit: the drained replica is force-stopped with its 8 streams mid-response.
    class Shrink(Static):
        def size(self, now: float) -> int:
            return 2 if now < 100 else 1

    w = Workload("cut", np.full(16, 10.0), np.full(16, 1000.0), np.full(16, 500.0), 0.0, 600.0, None, "")
    r = engine.run_policy(w, Shrink(2, False, max_drain_s=10.0), SIM, 2)
    assert r.forced_stops == 1 and r.killed == 8
    assert r.slo_ok == 8 and r.requests == 16 and r.slo == 0.5


@pytest.mark.parametrize("finish", [ActionKind.TERMINATE, ActionKind.RECYCLE])
def test_requests_on_a_replica_ended_mid_drain_are_cut_off(finish: ActionKind) -> None:
    # A controller that ends a drain at once (the shipped planners wait for it): the 8 streams
    # still running are cut off and miss, as with a forced stop; otherwise they would count as
    # served by a replica no longer charged (and a policy could beat the goal-level bound).
    class EndsDrainsEarly:
        name, instant_start, admission = "ends-drains-early", False, False

        def step(self, signals: Signals, now: float) -> Sequence[Action]:
            if now < 100:
                return ()
            return [Action(ActionKind.DRAIN if v.state is ReplicaState.ACTIVE else finish, v.replica_id, "test")
                    for v in signals.replicas if v.state in (ReplicaState.ACTIVE, ReplicaState.DRAINING)]

    w = Workload("cut", np.full(8, 10.0), np.full(8, 1000.0), np.full(8, 500.0), 0.0, 600.0, None, "")
    r = engine.run_policy(w, EndsDrainsEarly(), SIM, 1)
    assert r.killed == 8 and r.slo_ok == 0 and r.forced_stops == 0
    assert r.cost >= oracle.goal_lower_bound_s(w, SIM, r.slo)


BAD_SIMULATE = [
    (["--peak-rps", "0"], "--peak-rps"),
    (["--peak-rps", "-3"], "--peak-rps"),
    (["--eval-hours", "0"], "--eval-hours"),
    (["--eval-hours", "nan"], "--eval-hours"),
    (["--slots", "0"], "--slots"),
    (["--cold-start", "300", "120"], "--cold-start"),
    (["--wake", "-1", "5"], "--wake"),
    (["--warm-weight", "-1"], "--warm-weight"),
    (["--queue-timeout", "0"], "--queue-timeout"),
    (["--slo-wait", "-1"], "--slo-wait"),
    (["--days", "0"], "--days"),
    (["--warmup-hours", "-1"], "--warmup-hours"),
    (["--rate-scale", "0"], "--rate-scale"),
    (["--bursts-per-day", "-1"], "--bursts-per-day"),
    (["--spikes-per-hour", "-1"], "--spikes-per-hour"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD_SIMULATE, ids=[" ".join(a) for a, _ in BAD_SIMULATE])
def test_cli_simulate_rejects_out_of_range_options_before_running(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["controller", "simulate", "--days", "1", "--eval-hours", "0.2", "--warmup-hours", "0",
               "--policies", "hpa,zero-wait", *argv])
    out, err = capsys.readouterr()
    assert rc != 0
    assert flag in err and "Traceback" not in err
    assert "workload:" not in out  # nothing ran


@pytest.mark.parametrize("argv", [["--jobs", "0"], ["--eval-hours", "0"]])
def test_cli_suite_rejects_out_of_range_options(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["controller", "suite", "--out", str(tmp_path / "o"), *argv])
    assert rc != 0 and argv[0] in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
