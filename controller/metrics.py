"""The controller's Prometheus metrics (own registry per controller, so tests can run several)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal, get_args

from floodgate.controller import policy
from floodgate.controller.lifecycle import ActionKind
from floodgate.controller.signals import ReplicaState
from floodgate.extproc.metrics import serve_metrics
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from floodgate.runtime import ListenError

FAILURE_REASONS = ("not_running", "vanished", "action_failed", "unresponsive", "pool_unresponsive")
# The replica operations the controller runs in the background (app.py `_guard`), each counted
# in floodgate_controller_actions_total with outcome ok or error.
BackgroundOp = Literal["start", "bring_up", "promote", "sleep", "stop"]
SCRAPE_SOURCES = ("vllm", "envoy", "redis", "registry", "floodgate", "actuator")
# The (direction, reason) pairs a change of the desired count can carry (`floodgate_scale_events_total`).
SCALE_REASONS = {
    "up": (policy.REASON_QUEUE, policy.REASON_KV, policy.REASON_DEMAND, policy.REASON_BURST, policy.REASON_REACTION,
           policy.REASON_FLOOR, policy.REASON_BOUNDS),
    "down": (policy.REASON_DOWN, policy.REASON_BOUNDS),
}


class ControllerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.replicas = Gauge("floodgate_replicas", "Replicas per lifecycle state.", ["pool", "state"], registry=r)
        self.desired = Gauge("floodgate_desired_replicas", "Desired active replicas (policy output).", ["pool"], registry=r)
        self.actual = Gauge("floodgate_actual_replicas", "Active replicas (serving, in the registry).", ["pool"], registry=r)
        self.warm_target = Gauge("floodgate_warm_pool_target", "Warm-pool target size.", ["pool"], registry=r)
        self.warm_reserve = Gauge("floodgate_warm_pool_reserve_share", "Share of the warm pool's constant reserve "
                                  "(burst_fraction) held: the turned-away (or served-late) share over warm_pool.reserve_window_s, "
                                  "over warm_pool.reserve_shed_share, at most 1 (1 until half the window is measured).",
                                  ["pool"], registry=r)
        self.scale_events = Counter("floodgate_scale_events_total", "Changes of the desired count.",
                                    ["pool", "direction", "reason"], registry=r)
        self.actions = Counter("floodgate_replica_actions_total", "Lifecycle actions: outcome `issued` once per "
                               "action the controller takes (every kind: start, promote, sleep, drain, undrain, "
                               "recycle, terminate, force_stop); the operations that run on beside the ticks "
                               "(start, bring_up: a replica found loading brought to warm, promote, sleep, stop) also "
                               "count how they ended, `ok` or `error` (a stop that failed is tried again, "
                               "each try counted). Count actions by `issued`.",
                               ["pool", "action", "outcome"], registry=r)
        self.failures = Counter("floodgate_replica_failures_total", "Replicas the controller marked failed (then "
                                "terminated), by why: not_running (its process or pod ended), vanished (gone from "
                                "the actuator's list), action_failed (a start, wake, sleep or stop failed), "
                                "unresponsive (an active one: scrapes failing, /health not answering), "
                                "pool_unresponsive (a warm-pool one's /health checks failing).",
                                ["pool", "reason"], registry=r)
        self.start_backoff = Gauge("floodgate_start_backoff_seconds", "Seconds until the next replica start is "
                                   "allowed after failed starts in a row (0: none held back): a crash-looping "
                                   "model server shows here.", ["pool"], registry=r)
        self.drain = Histogram("floodgate_drain_duration_seconds", "Drain start to its end, by outcome: recycled or terminated (idle), forced (max_drain_s), undrained (taken back by a scale-up).",
                               ["pool", "outcome"], registry=r,
                               buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.warm_hits = Counter("floodgate_warm_pool_hits_total", "Scale-ups served by promoting a warm replica.",
                                 ["pool"], registry=r)
        self.warm_misses = Counter("floodgate_warm_pool_misses_total", "Scale-ups that needed a cold start.",
                                   ["pool"], registry=r)
        self.forecast = Gauge("floodgate_forecast_replicas", "Forecast floor (replicas); NaN when not engaged.",
                              ["pool"], registry=r)
        self.forecast_demand = Gauge("floodgate_forecast_demand", "Forecast peak demand over the lead window.",
                                     ["pool"], registry=r)
        self.demand = Gauge("floodgate_demand", "Offered demand the policy sized for (running + waiting + Floodgate "
                            "queue + turned-away demand as concurrency).", ["pool"], registry=r)
        self.lacking = Gauge("floodgate_demand_turned_away", "Turned-away demand counted as concurrency the pool "
                             "lacks (excluded classes left out).", ["pool"], registry=r)
        self.offered_rate = Gauge("floodgate_offered_requests_per_second", "Offered requests/s per class "
                                  "(Floodgate's counters reconciled with Envoy); NaN when stale.",
                                  ["pool", "priority"], registry=r)
        self.turned_away_rate = Gauge("floodgate_turned_away_requests_per_second", "Requests/s admission turned "
                                      "away per class; NaN when stale.", ["pool", "priority"], registry=r)
        self.per_replica = Gauge("floodgate_replica_capacity", "Per-replica capacity the pool is sized with "
                                 "(learned from TTFT/ITL, else target_concurrency).", ["pool"], registry=r)
        self.scrape_failures = Counter("floodgate_scrape_failures_total", "Failed scrapes (marked, never read as zero).",
                                       ["source"], registry=r)
        self.unresponsive = Counter("floodgate_replicas_unresponsive_total", "Replicas failed because they stopped "
                                    "answering: active ones whose scrapes failed for timeouts.unresponsive_s and "
                                    "whose /health did not answer, warm-pool ones whose /health checks failed that long.",
                                    ["pool"], registry=r)
        self.ceiling = Gauge("floodgate_admission_ceiling", "Admission ceiling published for the processors, per "
                             "active endpoint, while cold starts are awaited; NaN when none is published.",
                             ["pool"], registry=r)
        self.leader = Gauge("floodgate_controller_leader", "1 while this controller holds the leader lease.", registry=r)
        self.ticks = Counter("floodgate_controller_ticks_total", "Pool ticks run while leader (all pools).",
                             registry=r)
        self.tick_seconds = Histogram("floodgate_controller_tick_seconds", "One pool's tick: reconcile, scrapes, "
                                      "decision and actions (each pool ticks in its own loop).", ["pool"],
                                      buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
                                      registry=r)

    def prepare(self, pool: str) -> None:
        """Create the pool's label sets of the counters at 0, so that the first event of a kind
        is an increase: Prometheus's rate() and increase() need two samples of a series, and a
        series first seen at 1 adds nothing (a first failure or cold start never showed)."""
        for kind in ActionKind:
            self.actions.labels(pool=pool, action=kind.value, outcome="issued")
        for what in get_args(BackgroundOp):
            for outcome in ("ok", "error"):
                self.actions.labels(pool=pool, action=what, outcome=outcome)
        for reason in FAILURE_REASONS:
            self.failures.labels(pool=pool, reason=reason)
        for c in (self.warm_hits, self.warm_misses, self.unresponsive):
            c.labels(pool=pool)
        self.start_backoff.labels(pool=pool).set(0)
        for direction, reasons in SCALE_REASONS.items():
            for reason in reasons:
                self.scale_events.labels(pool=pool, direction=direction, reason=reason)
        for source in SCRAPE_SOURCES:
            self.scrape_failures.labels(source=source)

    def forget_pools(self) -> None:
        """Drop every per-pool gauge (a controller that steps down decides nothing any more). Kept,
        a standby's last decisions read as current: KEDA's `max(floodgate_desired_replicas)` took
        the old leader's 3 over the new one's 1, and Grafana's `sum by (state)` counted the
        replicas twice (an operator review). Counters stay: they only count what happened."""
        for g in (self.replicas, self.desired, self.actual, self.warm_target, self.warm_reserve, self.start_backoff,
                  self.forecast,
                  self.forecast_demand, self.demand, self.lacking, self.offered_rate, self.turned_away_rate,
                  self.per_replica, self.ceiling):
            g.clear()

    def set_states(self, pool: str, counts: dict[ReplicaState, int]) -> None:
        for st, n in counts.items():
            self.replicas.labels(pool=pool, state=st.value).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def serve(self, listen: str) -> MetricsListener:
        """Serve /metrics on `listen` (HOST:PORT) until the returned listener's `cleanup()`.
        The processor's listener (extproc.metrics.serve_metrics): threads off the event loop,
        a deadline on each connection's whole exchange and a bound on connections at once.
        aiohttp's server, used before, kept every connection that sent nothing (or trickled a
        request line) for good: an attacker review's 1,100 idle connections held a controller
        at its 1,024 file descriptors, its /metrics timed out, and any connection it then had
        to open (Redis after a reconnect, a new replica's scrape) failed with EMFILE."""
        host, _, port = listen.rpartition(":")
        disable_created_metrics()  # as the processor (extproc/app.py): no `*_created` samples
        try:
            httpd = serve_metrics(host.strip("[]") or "127.0.0.1", int(port), self.registry)
        except OSError as exc:
            raise ListenError(f"metrics_listen {listen}: cannot listen: {exc.strerror or exc}") from None
        return MetricsListener(httpd)


class MetricsListener:
    """A running metrics listener (`ControllerMetrics.serve`)."""

    def __init__(self, httpd: Any) -> None:
        self._httpd = httpd

    async def cleanup(self) -> None:
        """Stop serving and close the listening socket (the serving loop polls every 0.5 s:
        waited for in a thread, not on the event loop)."""
        await asyncio.to_thread(self._httpd.shutdown)
        self._httpd.server_close()
