"""The decider is the one step the live controller and the backtest both run: fed the same
signal sequence, the live shell and the backtest take identical actions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from floodgate.controller.actuators.static import StaticActuator
from floodgate.controller.app import PoolController
from floodgate.controller.backtest import engine, report, workload
from floodgate.controller.config import ActuatorConfig, PoolConfig
from floodgate.controller.decider import DeciderConfig, DeciderState, Signals, decide
from floodgate.controller.forecast import DemandHistory, ForecastConfig
from floodgate.controller.lifecycle import Action, ActionKind, WarmPoolConfig
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.policy import PolicyConfig
from floodgate.extproc.state import redis_client

from .conftest import FakeClock, signals, views

SIM = engine.SimConfig()


@dataclass
class Recording:
    """Wraps the backtest's Floodgate controller and keeps what it saw and did."""

    inner: engine.FloodgateController
    log: list[tuple[Signals, float, tuple[Action, ...]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def instant_start(self) -> bool:
        return False

    @property
    def admission(self) -> bool:
        return self.inner.admission

    def step(self, sig: Signals, now: float) -> Sequence[Action]:
        acts = tuple(self.inner.step(sig, now))
        self.log.append((sig, now, acts))
        return acts


async def test_live_shell_and_backtest_take_identical_actions() -> None:
    # A burst around the daily peak with forecast history: scale-up by promotion and cold
    # start, pool refill, sleep, drain and recycle all happen.
    w = workload.make_day_workload(days=4, peak_rps=3.0, sim=SIM, trace=None, tile=False, eval_hours=9.3, seed=3)
    keep = w.arrivals >= w.scored_from + 8.5 * 3600
    w = workload.Workload(w.name, w.arrivals[keep], w.service[keep], w.tokens[keep], w.scored_from + 8.5 * 3600,
                          w.end, w.history, w.description)
    pol, fc_cfg, pool = PolicyConfig(), ForecastConfig(), WarmPoolConfig()
    rec = Recording(report.floodgate_controller("floodgate", w, pol, fc_cfg, pool))
    engine.run_policy(w, rec, SIM, engine.initial_replicas(w, pol.target_concurrency, 1, 64))
    kinds = {a.kind for _, _, acts in rec.log for a in acts}
    assert {ActionKind.START, ActionKind.PROMOTE, ActionKind.DRAIN, ActionKind.SLEEP} <= kinds
    assert rec.inner.forecast_reasons.get("ok", 0) > 0  # the forecast floor took part

    cfg = PoolConfig(name="p", id_prefix="r", policy=pol, forecast=fc_cfg, warm_pool=pool,
                     actuator=ActuatorConfig(kind="process"))
    client = redis_client("redis://127.0.0.1:1/0")  # never contacted: step() does no I/O
    async with aiohttp.ClientSession() as session:
        # The backtest's platform has room for every start (`max_total`): so must this one's.
        pc = PoolController(cfg, _Unbounded(["127.0.0.1:1"]), client, session, ControllerMetrics())
        pc.state = DeciderState(history=w.history)
        for sig, now, acts in rec.log:
            d = pc.step(sig, now)
            assert d.actions == acts, f"live and backtest diverged at t={now}"
    await client.aclose()
    # Same final memory (policy window, bursts, history, ids).
    a, b = pc.state, rec.inner.state
    assert (a.policy, a.bursts, a.acc, a.next_seq, a.forecast) == (b.policy, b.bursts, b.acc, b.next_seq, b.forecast)
    # ... including what offered demand and learned capacity remember.
    assert (a.demand, a.service_s, a.capacity) == (b.demand, b.service_s, b.capacity)
    assert any(sig.pool.counters is not None and sig.pool.latency is not None for sig, _, _ in rec.log)
    assert a.history is not None and b.history is not None
    assert np.array_equal(a.history.values, b.history.values, equal_nan=True)


class _Unbounded(StaticActuator):
    """Never contacted (step() does no I/O), and of no fixed size, as the backtest's platform."""

    @property
    def capacity(self) -> None:  # type: ignore[override]
        return None


def test_decider_records_history_and_skips_stale_ticks(clock: FakeClock) -> None:
    cfg = DeciderConfig(forecast=ForecastConfig(min_days=1))
    st = DeciderState()
    now = clock.now
    reps = views(now, active=2)
    recorded = []
    for i in range(70):
        now = clock.advance(1.0) if i else now
        st, d = decide(cfg, st, Signals(signals(now, reps, running=10.0), reps), now)
        if d.recorded is not None:
            recorded.append(d.recorded)
    assert st.history is not None
    assert len(recorded) == 1 and recorded[0][1] == 10.0
    assert st.history.get(np.array([recorded[0][0]]))[0] == 10.0
    # A stale tick is not a demand sample.
    stale = signals(now + 70, reps, running=0.0, stale_ids=frozenset({"a0"}))
    st2, d2 = decide(cfg, st, Signals(stale, reps), now + 70)
    assert d2.plan.stale and d2.recorded is None and st2.acc == st.acc


def test_the_decider_floors_the_pool_at_the_forecast_of_its_history() -> None:
    """Mutation review: the decider caches its forecasts per (minute, history end) and must
    compute them on a tick whose key it has not seen. With the cache test inverted the forecast
    was never made and no floor applied, and no test noticed (the live/backtest comparison
    only checks the two agree). A week of 40 concurrent at a target of 10: floor 4, so a light
    tick on 4 replicas keeps them."""
    day = 1440
    now_min = 20 * day + 300
    fcfg = ForecastConfig()
    h = DemandHistory.empty(fcfg.retention_days * day, now_min)
    v = np.array(h.values)
    v[-7 * day:] = 40.0
    v.flags.writeable = False
    cfg = DeciderConfig(policy=PolicyConfig(target_concurrency=10.0), forecast=fcfg)
    now = now_min * 60.0
    reps = views(now, active=4)
    _, d = decide(cfg, DeciderState(history=DemandHistory(now_min, v)), Signals(signals(now, reps, running=8), reps),
                  now)
    assert d.forecast.engaged and d.floor == 4
    assert d.plan.desired == 4
