"""The processor's counters exist at 0 before their first event.

Prometheus's rate() and increase() need two samples of a series: a counter series that first
appears at 1 adds nothing, so a processor's first degraded spell, first Redis error or first
queue_full never showed on the dashboard (an observability review). Every closed label set is
created at start-up (`Metrics.prepare`), and the first event is then an increase from 0."""

from __future__ import annotations

import ast
import asyncio
import signal
from pathlib import Path

import aiohttp
import pytest
from floodgate.extproc.metrics import REDIS_OPS

from floodgate.stack import LocalStack
from tests.helpers import metrics, wait_until
from tests.test_admission_e2e import TRUST_LOCAL

EXTPROC = Path(__file__).resolve().parents[1] / "extproc"


def test_every_redis_op_the_admitter_names_is_prepared() -> None:
    """`Admitter.call(rt, "op", ...)` and `_quietly(rt, "op", ...)` name the op that labels
    floodgate_redis_errors_total: each must be in REDIS_OPS, or its first error is lost."""
    named: set[str] = set()
    for path in EXTPROC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("call", "_quietly") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                named.add(node.args[1].value)
    assert named, "found no op names: the scan no longer matches the code"
    assert named <= set(REDIS_OPS), named - set(REDIS_OPS)


@pytest.mark.integration
async def test_a_first_degraded_spell_is_an_increase_from_zero(stack: LocalStack) -> None:
    stack.start_redis()
    cfg = {"redis": {"op_timeout_s": 0.3}, **TRUST_LOCAL,
           "pools": [{"name": "default", "limit": {"mode": "static", "initial": 4}}]}
    proc = stack.start_processor(cfg)
    async with aiohttp.ClientSession() as s:
        m = await metrics(s, proc.metrics_url)
        for series in ('floodgate_degraded_transitions_total{pool="default"}',
                       'floodgate_redis_errors_total{op="sync"}',
                       'floodgate_lost_leases_total{pool="default"}',
                       'floodgate_decisions_total{outcome="rejected",pool="default",priority="2",reason="queue_full"}',
                       'floodgate_releases_total{pool="default",reason="no_endpoints"}',
                       'floodgate_background_loop_restarts_total{loop="fg-sync-default"}'):
            assert m.get(series) == 0, (series, {k: v for k, v in m.items() if k.startswith(series.split("{")[0])})
        # ... and no `*_created` samples beside them (unused lines a scrape formats while it
        # holds the interpreter: `floodgate bench scrape`).
        assert m and not [k for k in m if k.split("{")[0].endswith("_created")]
        assert stack.redis_child is not None
        stack.redis_child.kill(signal.SIGSTOP)  # frozen: calls time out, the pool degrades
        try:
            async def degraded() -> bool:
                return (await metrics(s, proc.metrics_url)).get('floodgate_pool_degraded{pool="default"}') == 1
            assert await wait_until(degraded, 15)
        finally:
            stack.redis_child.kill(signal.SIGCONT)
        await asyncio.sleep(0.1)
        m = await metrics(s, proc.metrics_url)
        assert m['floodgate_degraded_transitions_total{pool="default"}'] == 1
        assert sum(v for k, v in m.items() if k.startswith("floodgate_redis_errors_total")) >= 1


def test_budget_waits_and_scale_events_start_at_zero() -> None:
    """Two counters an operator review found absent until their first event: the processor's
    floodgate_budget_waits_total (P2 ships with a time-to-429 target) and the controller's
    floodgate_scale_events_total (the first scale-up was no increase)."""
    from floodgate.controller.metrics import SCALE_REASONS, ControllerMetrics
    from floodgate.extproc.metrics import Metrics

    m = Metrics()
    m.prepare("p")
    for prio in ("0", "1", "2"):
        for outcome in ("served", "timed_out", "gone"):
            assert m.registry.get_sample_value("floodgate_budget_waits_total",
                                               {"pool": "p", "priority": prio, "outcome": outcome}) == 0
    c = ControllerMetrics()
    c.prepare("p")
    assert SCALE_REASONS["up"] and SCALE_REASONS["down"]
    for direction, reasons in SCALE_REASONS.items():
        for reason in reasons:
            assert c.registry.get_sample_value("floodgate_scale_events_total",
                                               {"pool": "p", "direction": direction, "reason": reason}) == 0


def test_a_pools_background_loops_are_counted_from_zero_before_they_start() -> None:
    """A scrape between the metrics listener's start and the loops' (the admitter's start-up
    calls to Redis come first) found no `floodgate_background_loop_restarts_total` series for
    the pool's sync loop (a loaded fresh-clone CI run); `prepare` creates them."""
    from floodgate.extproc.metrics import Metrics

    m = Metrics()
    m.prepare("p")
    for loop in ("fg-sync-p", "fg-poll-p"):
        assert m.registry.get_sample_value("floodgate_background_loop_restarts_total", {"loop": loop}) == 0
