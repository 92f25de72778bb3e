"""What the decider records into the forecast history while the pool is capped and admission
sheds: the offered concurrency (running + turned away, Little's law), not running + the queue
that admission holds (docs/controller.md, "Offered demand")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from floodgate.controller.backtest import engine, report, workload
from floodgate.controller.backtest.workload import Workload
from floodgate.controller.decider import Signals, decide
from floodgate.controller.forecast import ForecastConfig
from floodgate.controller.lifecycle import Action, WarmPoolConfig
from floodgate.controller.policy import PolicyConfig

# A long queue timeout (the shipped P1's is 1.5 s): the pool holds a queue while it sheds, so
# the history must tell the offered concurrency from running + that queue.
SIM = engine.SimConfig(queue_timeout_s=15.0)


@dataclass
class Recording(engine.FloodgateController):
    recorded: list[tuple[float, float]] = field(default_factory=list)  # (t, minute's mean)
    queued: list[float] = field(default_factory=list)  # waiting at the ticks after the step

    def step(self, signals: Signals, now: float) -> Sequence[Action]:
        self.state, d = decide(self.cfg, self.state, signals, now)
        if d.recorded is not None:
            self.recorded.append((now, d.recorded[1]))
        if now >= 1500:
            self.queued.append(d.plan.waiting)
        return d.actions


def test_history_holds_offered_concurrency_while_capped_and_shedding() -> None:
    rng = np.random.default_rng(3)
    end = 2400.0
    cand = np.sort(rng.uniform(0, end, rng.poisson(8 * end)))
    arr = cand[rng.random(len(cand)) < np.where(cand >= 1200, 1.0, 0.25)]  # 2 -> 8 req/s at 20 min
    c, g = workload._synthetic_tokens(rng, len(arr), "conv")
    svc = c * SIM.prefill_s_per_token + g * SIM.tpot_s
    w = Workload("step-capped", arr, svc, c + g, 0.0, end, None, "", eval_start=600.0)
    inner = report.floodgate_controller("floodgate", w, PolicyConfig(max_replicas=3), ForecastConfig(),
                                        WarmPoolConfig())
    ctl = Recording(inner.name, inner.cfg, inner.state)
    r = engine.run_policy(w, ctl, SIM, 2)
    assert r.rejected > 1000  # 3 replicas x 8 slots carry 24 of ~50: admission sheds
    assert np.mean(ctl.queued) > 10  # ... and holds a queue meanwhile
    offered = 8.0 * float(svc.mean())  # Little's law: rate x slot time
    late = [v for t, v in ctl.recorded if t >= 1500]
    assert len(late) >= 10
    # Before: running + queue, 1.9x the offered concurrency (94 where ~50 was offered).
    assert 0.9 * offered <= float(np.mean(late)) <= 1.3 * offered
