"""Offered demand: what clients asked for, including what admission turned away (pure).

vLLM's `running + waiting` plus Floodgate's queue only shows the demand admission let in. A
request that is early-dropped, rejected for a full queue or a tenant cap, or times out in the
queue never reaches a replica, so a pool that sheds a 3x burst can read as merely full. This
module turns two independent counter sources into offered rates, reconciles them and marks
them stale like every other signal:

* **Floodgate's counters in Redis** (per pool, per class, cumulative; `extproc.state.read_demand`):
  `admitted`, `queued`, and the turned-away outcomes `early_drop`, `queue_full`, `tenant_cap`,
  `queue_timeout`, `no_endpoints` (503) and `abandoned` (the client left while queued).
  Arrivals = admitted + turned away + growth of the queue (a queued request is counted once:
  when it is admitted or when it leaves the queue without a permit).
* **Envoy's gateway listener** (the HTTP connection manager's stat prefix, `gateway` in the
  shipped config): `ext_proc.streams_started` (every request that reached the processor; not
  the ones Envoy answers itself, a 404 path or the routes around the filter, which
  `downstream_rq_total` counts too: a client's flood of those read as arrivals) and
  `ext_proc_immediate_responses_sent` (every request the processor answered itself: 429s and
  503s). Envoy keeps no per-status downstream counter (only `downstream_rq_xx` per class), so
  the ext_proc counter is the exact "turned away by admission" count. It also covers what the
  processors could not record in Redis (a Redis outage degrades them to local limits).

Rates are counter deltas over a sliding window (`window_s`), never across a counter reset
(a restarted Envoy or a flushed Redis), and only from samples no older than `stale_after_s`.
Reconciliation, per tick:

* both fresh: per-class rates from Floodgate; if Envoy saw more turned away than Floodgate
  recorded (for a listener that serves this pool only), the excess is spread over the classes
  in proportion to Floodgate's own turned-away mix (to `default_class` when it has none);
* one fresh: that one (Envoy alone is unclassed: everything goes to `default_class`);
* neither: `stale=True` and no rates: the policy falls back to served demand and, as with any
  stale signal, never scales down on it.

The policy converts a turned-away rate into concurrency with Little's law: each turned-away
request would have held a slot for W = running / admitted rate seconds (W measured, bounded by
`max_service_s`). The classes in `exclude_classes` (e.g. `[2]`: sheddable traffic the pool
chooses to shed under load) are left out of `lacking` but stay in `offered_rate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any, Literal

from floodgate.extproc.schema import DEMAND_OUTCOMES as COUNTERS
from floodgate.extproc.schema import TURNED_AWAY
from pydantic import BaseModel, Field

from floodgate.yamlconfig import STRICT


class DemandConfig(BaseModel):
    """Offered-demand settings of one pool."""

    model_config = STRICT

    enabled: bool = Field(default=True, description="Count demand admission turned away (false: served demand only).")
    window_s: float = Field(default=5.0, gt=0, description="Counter deltas are taken over this many seconds.")
    up_window_s: float = Field(default=2.0, ge=0, description="Scale-up also reads the turned-away rate over "
                               "this many seconds (Knative's panic window: up on the short window, down only on "
                               "`window_s`, through the policy's stabilization); 0 = off. At least two counter "
                               "reads must fall in it.")
    up_sigma: float = Field(default=1.0, ge=0, description="The short window's turned-away rate is read at its "
                            "lower confidence bound at this many standard deviations (a count of a few seconds "
                            "is noisy, and the policy keeps the largest size it was asked for).")
    stale_after_s: float = Field(default=10.0, gt=0, description="A counter sample older than this is stale.")
    exclude_classes: tuple[Literal[0, 1, 2], ...] = Field(
        default=(), description="Classes whose turned-away demand does not drive scale-up "
        "(e.g. [2]: P2 the pool chooses to shed under load). They stay in the offered rate the decision "
        "log reports, and are left out of the demand the forecaster records.")
    default_class: int = Field(default=1, ge=0, le=2, description="Class of unclassed (Envoy-only) demand.")
    use_envoy: bool = Field(default=True, description="Reconcile with Envoy's gateway listener counters "
                            "(only correct when the listener serves this pool alone and `envoy.admin_url` is the "
                            "one Envoy every request of the pool passes: with several gateway Envoys set false, "
                            "or their counts read as the pool's and hold Floodgate's turned-away to one Envoy's).")
    max_service_s: float = Field(default=600.0, gt=0, description="Upper bound on the measured seconds a request holds a slot.")
    burst: bool = Field(default=True, description="Also size scale-up from the offered rate since a step "
                        "(the burst estimate; `burst_concurrency`). Never used for scale-down.")
    burst_ticks: int = Field(default=2, ge=1, description="The burst estimate needs a step that has lasted "
                             "this many ticks, each bringing more arrivals than the rate before it (a step that "
                             "persists, not a clump of arrivals).")
    burst_sigma: float = Field(default=2.0, ge=0, description="A split of the rate window is a step when the "
                               "arrivals since it exceed what the rate before it predicts by this many standard "
                               "deviations; the policy acts on the burst estimate only when the rate's lower "
                               "confidence bound at this many deviations is beyond the current size.")
    burst_size_sigma: float = Field(default=1.0, ge=0, description="The burst estimate sizes the pool on the "
                                    "rate's lower confidence bound at this many standard deviations (never below "
                                    "the `burst_sigma` bound).")
    burst_react: bool = Field(default=True, description="Also give the policy the step's point estimate and "
                              "upper confidence bound, so that its first reaction to a confirmed step is sized "
                              "for the whole step (docs/controller.md, \"First reaction\").")
    burst_react_sigma: float = Field(default=2.0, ge=0, description="The first reaction to a confirmed step sizes "
                                     "the pool on the step rate's upper confidence bound at this many standard "
                                     "deviations.")
    burst_react_max_ratio: float = Field(default=1.5, ge=1, description="...but on at most this multiple of the "
                                         "step rate's point estimate (a step of few arrivals has a wide bound).")
    slot_smoothing_s: float = Field(default=10.0, gt=0, description="Time constant over which running and "
                                    "the admitted rate are averaged before their ratio (Little's law) gives "
                                    "the slot time the burst estimate sizes with.")


@dataclass(frozen=True, slots=True)
class ClassCounters:
    """Cumulative counters of one class (one pool), as read from Redis."""

    admitted: float = 0.0
    queued: float = 0.0
    early_drop: float = 0.0
    queue_full: float = 0.0
    tenant_cap: float = 0.0
    queue_timeout: float = 0.0
    no_endpoints: float = 0.0  # 503: the pool had no active endpoint
    abandoned: float = 0.0  # the client gave up while queued
    refused: float = 0.0  # answered by the processor as malformed (400/431): no demand
    unadmitted: float = 0.0  # passed without a permit (a body-less GET, ...): no demand
    degraded: float = 0.0  # turned away on a processor's local limits (no shared state): no demand
    retried: float = 0.0  # turned away, a client's retry of a request counted before: no demand
    # admitted (in `admitted` too), a retry whose first attempt was counted turned away: taken
    # off the turned-away count (`net_of_retries`)
    retried_admitted: float = 0.0

    @property
    def turned_away(self) -> float:
        return sum(getattr(self, n) for n in TURNED_AWAY)

    @staticmethod
    def from_mapping(m: dict[str, int] | dict[str, float]) -> ClassCounters:
        """From `extproc.state.read_demand`'s per-class {outcome: count} (unknown keys ignored)."""
        return ClassCounters(**{n: float(m.get(n, 0)) for n in COUNTERS})


@dataclass(frozen=True, slots=True)
class FloodgateCounters:
    """One read of a pool's counters (per class) and queue depth (per class)."""

    taken_at: float
    ok: bool = True
    classes: dict[int, ClassCounters] = field(default_factory=dict)
    queued_now: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GatewayCounters:
    """One read of Envoy's gateway listener counters."""

    taken_at: float
    ok: bool = True
    rq_total: float = 0.0  # arrivals: http.<prefix>.ext_proc.streams_started (else downstream_rq_total)
    rejected: float = 0.0  # http.<prefix>.ext_proc_immediate_responses_sent
    # http.<prefix>.downstream_rq_total, when `rq_total` is the streams counter: arrivals never
    # grow more than it does (`gateway_arrivals`). Every ext_proc filter on the listener counts
    # its streams in that one counter, so with a second one (an operator's own processor, an AI
    # gateway's) each request counted twice.
    downstream: float | None = None


def gateway_arrivals(a: GatewayCounters, b: GatewayCounters) -> float:
    """Requests that reached admission between two reads: the ext_proc streams started, held
    to what `downstream_rq_total` grew by (a review: a second ext_proc filter on the gateway,
    5 requests read as 10 arrivals)."""
    n = b.rq_total - a.rq_total
    if a.downstream is not None and b.downstream is not None:
        n = min(n, b.downstream - a.downstream)
    return max(0.0, n)


@dataclass(frozen=True, slots=True)
class RunningRead:
    """vLLM `num_requests_running` summed over the pool's fresh replicas at one tick."""

    taken_at: float
    running: float


@dataclass(frozen=True, slots=True)
class DemandWindow:
    """Recent counter samples of both sources (oldest first), pruned to `window_s`, and the
    running counts of the same ticks (`observe_running`), so that Little's law divides the
    admitted rate over the window by the mean running over the same span."""

    floodgate: tuple[FloodgateCounters, ...] = ()
    gateway: tuple[GatewayCounters, ...] = ()
    running: tuple[RunningRead, ...] = ()


@dataclass(frozen=True, slots=True)
class OfferedDemand:
    """Reconciled rates (requests/s) at one tick."""

    stale: bool
    source: str  # "floodgate+envoy" | "floodgate" | "envoy" | "none"
    offered_rate: dict[int, float]  # per class: arrivals
    admitted_rate: dict[int, float]
    turned_away_rate: dict[int, float]
    envoy_excess_rate: float = 0.0  # turned away per Envoy but missing from Floodgate's counters
    unanswered_rate: float = 0.0  # turned away per Floodgate beyond what Envoy answered: not counted

    @property
    def offered_total(self) -> float:
        return sum(self.offered_rate.values())

    @property
    def admitted_total(self) -> float:
        return sum(self.admitted_rate.values())

    def lacking_rate(self, exclude: tuple[int, ...] = ()) -> float:
        """Turned-away requests/s that count as capacity the pool lacks."""
        return sum(v for c, v in self.turned_away_rate.items() if c not in exclude)


STALE = OfferedDemand(True, "none", {}, {}, {})


def _prune(samples: tuple, sample: object, now: float, keep_s: float) -> tuple:
    # Keep one sample at or before the window start so the delta spans the whole window.
    out = (*samples, sample)
    while len(out) > 2 and now - out[1].taken_at >= keep_s:
        out = out[1:]
    return out


def observe(w: DemandWindow, now: float, cfg: DemandConfig, fg: FloodgateCounters | None = None,
            gw: GatewayCounters | None = None) -> DemandWindow:
    """Add this tick's reads (failed reads are dropped: a gap, never a zero; so is a gateway
    read that is no number: an infinite rate raised in the policy and stopped the controller)."""
    f, g = w.floodgate, w.gateway
    if fg is not None and fg.ok:
        if f and _fg_reset(f[-1], fg):
            f = ()  # counters went backwards (Redis flushed / failed over): restart the window
        f = _prune(f, fg, now, cfg.window_s)
    if gw is not None and gw.ok and math.isfinite(gw.rq_total) and math.isfinite(gw.rejected) and \
            (gw.downstream is None or math.isfinite(gw.downstream)):
        if g and (gw.rq_total < g[-1].rq_total or gw.rejected < g[-1].rejected
                  or (gw.downstream is not None and g[-1].downstream is not None
                      and gw.downstream < g[-1].downstream)):
            g = ()  # Envoy restarted
        g = _prune(g, gw, now, cfg.window_s)
    return DemandWindow(f, g, w.running)


def observe_running(w: DemandWindow, now: float, running: float, cfg: DemandConfig) -> DemandWindow:
    """Add this tick's running count (kept over the rate window plus one read before it)."""
    return replace(w, running=_prune(w.running, RunningRead(now, running), now, cfg.window_s))


def mean_running(w: DemandWindow, start: float, end: float) -> float | None:
    """Time-weighted mean of the running reads over [start, end] (linear between reads, the
    nearest read beyond them); None without reads or with an empty span."""
    reads = w.running
    if not reads or end <= start:
        return None
    pts = [(r.taken_at, r.running) for r in reads]

    def at(t: float) -> float:
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, v0), (t1, v1) in pairwise(pts):
            if t <= t1:
                return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
        return pts[-1][1]

    knots = [start, *(t for t, _ in pts if start < t < end), end]
    area = sum((b - a) * (at(a) + at(b)) / 2 for a, b in pairwise(knots))
    return area / (end - start)


def rate_span(w: DemandWindow, now: float, cfg: DemandConfig) -> tuple[float, float] | None:
    """The span the admitted rate of `offered` is measured over (Floodgate's reads when fresh,
    else Envoy's); None when stale."""
    if _fresh(w.floodgate, now, cfg):
        return w.floodgate[0].taken_at, w.floodgate[-1].taken_at
    if cfg.use_envoy and _fresh(w.gateway, now, cfg):
        return w.gateway[0].taken_at, w.gateway[-1].taken_at
    return None


def _fg_reset(a: FloodgateCounters, b: FloodgateCounters) -> bool:
    for c, ca in a.classes.items():
        cb = b.classes.get(c)
        if cb is None:
            return True
        if any(getattr(cb, n) < getattr(ca, n) for n in COUNTERS):
            return True
    return False


def _fresh(samples: tuple, now: float, cfg: DemandConfig) -> bool:
    return len(samples) >= 2 and now - samples[-1].taken_at <= cfg.stale_after_s \
        and samples[-1].taken_at > samples[0].taken_at


def floodgate_rates(a: FloodgateCounters, b: FloodgateCounters) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """(offered, admitted, turned away) per class, requests/s, between two reads."""
    dt = b.taken_at - a.taken_at
    off: dict[int, float] = {}
    adm: dict[int, float] = {}
    away: dict[int, float] = {}
    for c in sorted(set(a.classes) | set(b.classes)):
        ca, cb = a.classes.get(c, ClassCounters()), b.classes.get(c, ClassCounters())
        d_adm = cb.admitted - ca.admitted
        d_away = cb.turned_away - ca.turned_away
        d_q = b.queued_now.get(c, 0.0) - a.queued_now.get(c, 0.0)
        adm[c] = max(0.0, d_adm) / dt
        away[c] = max(0.0, d_away) / dt
        off[c] = max(0.0, d_adm + d_away + d_q) / dt
    return off, adm, away


def net_of_retries(a: FloodgateCounters, b: FloodgateCounters, off: dict[int, float], adm: dict[int, float],
                   away: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """(offered, turned away) per class without the first attempts that a retry admitted
    between the two reads took back (`retried_admitted`, extproc/retry_match.py): a request
    turned away once and then served is one request, counted among the admitted. At most
    what the class turned away in the window (a retry admitted now may take back a first
    attempt of an earlier window: that one was counted there)."""
    dt = b.taken_at - a.taken_at
    if dt <= 0:
        return off, away
    off, away = dict(off), dict(away)
    for c, cb in b.classes.items():
        back = max(0.0, cb.retried_admitted - a.classes.get(c, ClassCounters()).retried_admitted) / dt
        m = min(back, away.get(c, 0.0))
        if m > 0:
            away[c] -= m
            off[c] = max(adm.get(c, 0.0), off.get(c, 0.0) - m)
    return off, away


def not_demand_rate(w: DemandWindow, now: float, cfg: DemandConfig) -> tuple[float, float]:
    """(refused + degraded + retried, those + unadmitted + retried_admitted) per second over
    Floodgate's window (0, 0 when stale): requests Envoy's gateway counters count (as arrivals;
    the refused also as the processor's immediate responses) that are no new demand
    (`schema.NOT_DEMAND`, and the admitted retries whose first attempts were counted,
    `schema.RETRIED_ADMITTED`: arrivals for Envoy, not immediate responses)."""
    if not _fresh(w.floodgate, now, cfg):
        return 0.0, 0.0
    a, b = w.floodgate[0], w.floodgate[-1]
    dt = b.taken_at - a.taken_at
    if dt <= 0:
        return 0.0, 0.0
    # (turned away on local limits, or a retry turned away again: answered by the processor
    # like the refused, no demand)
    refused = counted_between(a, b, "refused", "degraded", "retried")
    passed = counted_between(a, b, "unadmitted", "retried_admitted")  # arrivals Envoy counts, no new demand
    return refused / dt, (refused + passed) / dt


def counted_between(a: FloodgateCounters, b: FloodgateCounters, *outcomes: str) -> float:
    """How many requests these outcomes counted between two reads, all classes (never below 0)."""
    return sum(max(0.0, getattr(cb, n) - getattr(a.classes.get(c, ClassCounters()), n))
               for c, cb in b.classes.items() for n in outcomes)


# Floodgate's counters may claim more turned away than Envoy answered by this much (the two are
# read at different moments over the same window) before the excess is taken for forged.
ANSWERED_TOLERANCE = 0.25
ANSWERED_SLACK_RPS = 1.0


def answered_bound(claimed: float, answered: float) -> float:
    """What Floodgate's turned-away rate (abandoned left out) may count, given the immediate
    responses Envoy sent for them: every request a processor turns away gets one (a 429/503
    the processor answers through Envoy), so a counter above that is written by someone else.
    The processors' Redis user can write the demand counters; a review wrote them and the
    controller read the forged rates (a pool pushed to `max_replicas` is the harm)."""
    return min(claimed, answered * (1 + ANSWERED_TOLERANCE) + ANSWERED_SLACK_RPS)


def abandoned_bound(unanswered_arrivals: float, admitted: float) -> float:
    """What Floodgate's `abandoned` rate may count: a client that left while queued got no
    immediate response, so it is one of the arrivals Envoy counted that the processors did
    not answer (Envoy's arrivals less the immediate responses) or of the requests already
    queued when the window began, and not one of those they admitted; with the same room for
    the reads' misalignment as `answered_bound`."""
    return max(0.0, unanswered_arrivals * (1 + ANSWERED_TOLERANCE) + ANSWERED_SLACK_RPS - admitted)


def offered(w: DemandWindow, now: float, cfg: DemandConfig) -> OfferedDemand:
    """Reconciled offered demand at `now` (see the module doc)."""
    fg_ok = _fresh(w.floodgate, now, cfg)
    gw_ok = cfg.use_envoy and _fresh(w.gateway, now, cfg)
    if not fg_ok and not gw_ok:
        return STALE
    g_off = g_away = 0.0
    if gw_ok:
        a, b = w.gateway[0], w.gateway[-1]
        dt = b.taken_at - a.taken_at
        g_off = gateway_arrivals(a, b) / dt
        g_away = max(0.0, b.rejected - a.rejected) / dt
    dc = cfg.default_class
    if not fg_ok:
        return OfferedDemand(False, "envoy", {dc: g_off}, {dc: max(0.0, g_off - g_away)}, {dc: g_away})
    fa, fb = w.floodgate[0], w.floodgate[-1]
    off, adm, away = floodgate_rates(fa, fb)
    if not gw_ok:
        off, away = net_of_retries(fa, fb, off, adm, away)
        return OfferedDemand(False, "floodgate", off, adm, away)
    # Envoy's immediate responses beyond what the processors counted as turned away: requests
    # a processor turned away without counting them (it could not reach Redis) — but not the
    # ones it refused as malformed (a review: 30 req/s of `x-tenant-id: a,b`, each a 400,
    # scaled a pool for one replica's load 1 -> 8, its max, in 28 s).
    refused, _ = not_demand_rate(w, now, cfg)
    dt_fg = fb.taken_at - fa.taken_at
    left_c = {c: max(0.0, cb.abandoned - fa.classes.get(c, ClassCounters()).abandoned) / dt_fg
              for c, cb in fb.classes.items()}
    left = sum(left_c.values())
    # A client that left while queued got no reply, so `abandoned` is not held to Envoy's
    # immediate responses; it is held to the arrivals Envoy saw that got none, less what the
    # processors admitted (a review forged 20,000/s of it, and the controller read that as
    # offered and turned-away demand).
    # (requests queued when the window began may leave or be admitted in it: room for them)
    left_max = abandoned_bound(g_off - g_away + sum(fa.queued_now.values()) / dt_fg, sum(adm.values()))
    forged_left = max(0.0, left - left_max)
    if forged_left > 0:
        keep_left = left_max / left
        for c, v in left_c.items():
            cut = v * (1 - keep_left)
            away[c] = max(0.0, away.get(c, 0.0) - cut)
            off[c] = max(adm.get(c, 0.0), off.get(c, 0.0) - cut)
        left = left_max
    claimed = max(0.0, sum(away.values()) - left)
    answered = max(0.0, g_away - refused)
    unanswered = claimed - answered_bound(claimed, answered)
    if unanswered > 0:
        keep = (claimed - unanswered + left) / (claimed + left)
        away = {c: v * keep for c, v in away.items()}
        off = {c: max(adm.get(c, 0.0), off.get(c, 0.0) - (v / keep - v)) for c, v in away.items()}
    excess = max(0.0, g_away - sum(away.values()) - refused)
    if excess > 0:
        total = sum(away.values())
        shares = {c: v / total for c, v in away.items()} if total > 0 else {dc: 1.0}
        for c, s in shares.items():
            away[c] = away.get(c, 0.0) + excess * s
            off[c] = off.get(c, 0.0) + excess * s
    # Envoy answered every attempt, so the two sources are compared on what Floodgate turned
    # away, before the retries admitted since take their first attempts back.
    off, away = net_of_retries(fa, fb, off, adm, away)
    return OfferedDemand(False, "floodgate+envoy", off, adm, away, excess, max(0.0, unanswered) + forged_left)


def recent(w: DemandWindow, now: float, span_s: float) -> DemandWindow:
    """The reads of the last `span_s` seconds, plus the last one at or before its start (so
    the deltas span the whole short window, as `_prune` keeps them for the long one)."""
    def cut(samples: tuple) -> tuple:
        out = samples
        while len(out) > 2 and now - out[1].taken_at >= span_s:
            out = out[1:]
        return out
    return DemandWindow(cut(w.floodgate), cut(w.gateway), cut(w.running))


def since(w: DemandWindow, start: float) -> DemandWindow:
    """The reads taken at or after `start` (`start`: when the pool's active set last grew)."""
    def cut(samples: tuple) -> tuple:
        return tuple(s for s in samples if s.taken_at >= start)
    return DemandWindow(cut(w.floodgate), cut(w.gateway), cut(w.running))


def scale_up_lacking(w: DemandWindow, now: float, cfg: DemandConfig, service_s: float | None) -> float:
    """Turned-away demand as concurrency over the short window (`up_window_s`), for scale-up.

    The 5 s rate window reads a step in turned-away requests as a ramp across the window: one
    second into a 6x burst it holds a fifth of the step (the elastic bench, seed 1: the offered
    demand read 22.6 concurrent 1.1 s into the first burst and 45.2, about what the burst
    needed, 2.3 s later). Over a 2 s window the same second reads half the step, and the whole
    of it 2 s in. Noisier, so it only ever raises the reading (the caller takes the larger
    of the two) and never lowers a size: scale-down stays on the long window through the
    policy's stabilization, as Knative's panic window does. Sized with the slot time measured
    over the long window (`service_s`), not the short window's own ratio (a step's admissions
    run before the running count follows them). The count is read at its lower confidence
    bound (`up_sigma`), like the burst estimate's size: the policy keeps the largest size it
    was asked for, so an overestimate sticks while an underestimate is raised a tick later.
    0 when off, stale or without a slot time."""
    if not cfg.enabled or cfg.up_window_s <= 0 or service_s is None:
        return 0.0
    short = recent(w, now, cfg.up_window_s)
    d = offered(short, now, cfg)
    span = rate_span(short, now, cfg)
    if d.stale or span is None:
        return 0.0
    dt = span[1] - span[0]
    n = d.lacking_rate(cfg.exclude_classes) * dt
    return max(0.0, n - cfg.up_sigma * math.sqrt(n)) / dt * service_s


def service_time(d: OfferedDemand, running: float, cfg: DemandConfig) -> float | None:
    """Seconds an admitted request holds a slot, by Little's law (running / admitted rate);
    None without admissions in the window."""
    adm = d.admitted_total
    if d.stale or adm <= 0 or running <= 0:
        return None
    return min(running / adm, cfg.max_service_s)


def lacking_concurrency(d: OfferedDemand, running: float, cfg: DemandConfig,
                        service_s_hint: float | None = None, slot_s: float | None = None) -> float:
    """Turned-away demand as concurrency (Little's law): turned-away rate x the time a request
    holds a slot: the averaged slot time (`SlotTime`, `slot_s`) where there is one, else this
    window's running / admitted rate, else the last one measured (`service_s_hint`); without
    any, 0 (served demand and queue pressure then carry the signal). 0 when stale.

    The window's own ratio is the fallback, not the first choice: a full pool admits only as
    requests finish, and with long requests a 5 s window holds a few admissions, so the ratio
    scatters; read high, it multiplies every request turned away (the backtest's smooth-long
    day, ~20 s generations at ~1.3 req/s: 24 running over one admission in 3 s read 72 s, and
    1.3 turned away per second asked for 96 more concurrent, 9 -> 18 replicas, where the slot
    time read 28 s)."""
    if d.stale or not cfg.enabled:
        return 0.0
    service_s = slot_s or service_time(d, running, cfg) or service_s_hint
    if service_s is None:
        return 0.0
    return d.lacking_rate(cfg.exclude_classes) * service_s


@dataclass(frozen=True, slots=True)
class SlotTime:
    """Little's law averaged over time: exponentially weighted running and admitted rate, and
    the seconds a request holds a slot as their ratio. The ratio of one tick (an instantaneous
    running count over a 5 s admitted rate) scatters +-33 % (5th-95th percentile) at the
    elastic bench's load; averaged over `slot_smoothing_s` (10 s) first, +-7 %. The burst
    estimate multiplies its rate by it, so that scatter was the size's scatter."""

    at: float
    running: float
    admitted: float  # requests/s

    @property
    def seconds(self) -> float:
        return self.running / self.admitted


def update_slot(prev: SlotTime | None, now: float, running: float, admitted_rate: float,
                cfg: DemandConfig) -> SlotTime:
    """Fold one tick's running and admitted rate in (the caller passes only ticks where
    admitted = started: nothing waited inside the replicas)."""
    if prev is None or now <= prev.at:
        return SlotTime(now, running, admitted_rate) if prev is None else prev
    a = 1.0 - math.exp(-(now - prev.at) / cfg.slot_smoothing_s)
    return SlotTime(now, prev.running + a * (running - prev.running), prev.admitted + a * (admitted_rate - prev.admitted))


@dataclass(frozen=True, slots=True)
class BurstEstimate:
    """Offered concurrency since a step: `size` (the rate's lower bound at `burst_size_sigma`,
    what the pool is sized for) and `low` (at `burst_sigma`: the policy acts only when this
    one is beyond the current size). 0 / 0: no step, or the pool is not behind."""

    size: float = 0.0
    low: float = 0.0
    # For the policy's first reaction (`burst_react`; 0 when off): the concurrency at the step
    # rate's point estimate (`mid`) and at its upper bound (`high`: `burst_react_sigma`, at most
    # `burst_react_max_ratio` x mid), and whether requests were turned away since the step
    # (`shed`: admission is already refusing part of it).
    mid: float = 0.0
    high: float = 0.0
    shed: bool = False


NO_BURST = BurstEstimate()


def burst_concurrency(w: DemandWindow, now: float, cfg: DemandConfig, service_s: float | None,
                      replica_waiting: float = 0.0) -> BurstEstimate:
    """The burst estimate: offered concurrency at the rate arrivals have had since a step in
    the last seconds (Little's law: that rate x the measured service time).

    Knative's panic window: the rate window (`window_s`) dilutes a step at its start (0.5 s of
    a 6x burst in a 5 s window reads as 1.5x), so the first decision after the step adds one
    replica; the rate since the step reads it at its height. Arrivals come from Envoy's
    `ext_proc.streams_started` (the requests that reached admission) when it is read (live:
    the processors flush their Redis counters about once a second, so a short span of those
    is lumpy), else from Floodgate's counters.

    The step is a change point in the window's reads: every read k splits the window into
    the arrivals before it (rate r0 over span s0) and since it (n over the last dt seconds, at
    least `burst_ticks` ticks: a step that persists, not one clump). A split is a step when n
    exceeds what r0 predicts by `burst_sigma` standard deviations of the difference (both
    sides are Poisson counts: the earlier rate is an estimate too) and every tick since the
    split brought more than r0 predicts (a clump in one tick is no step). Of the splits that
    are steps, the one with the largest *lower confidence bound* of the rate since it,
    (n - burst_sigma x sqrt(n)) / dt, is the step: that bound is `low` (the policy acts only
    when it is beyond the current size), and the bound at `burst_size_sigma` (1: the rate is
    at least this with ~84 % confidence) is `size`, what the pool is sized for:

    * the baseline is the rate before the step, not the whole window: a window that already
      holds the step's first seconds no longer hides it (the elastic bench's seed 1 sized its
      first burst 2 s after the controller saw it, on the one pair of ticks that passed);
    * lower bounds, because the policy keeps the largest size it was asked for: an
      overestimate sticks through the burst, an underestimate is raised on the next tick as
      the step's arrivals add up (the bound tightens as 1/sqrt(n)). Sizing on single ticks'
      rates, selected for being steps, read the elastic bench's 4x burst as 43-81 concurrent
      where ~32 were needed, and a clump on a ramp as a burst. Acting on the 2-sigma bound
      keeps clumps out (a fake-clock run of the elastic plan: no false detection in 200
      seeds, against 52 of 200 before); sizing on it too left the first decision at ~4
      replicas where 7 were needed (the 1-sigma bound: ~6, largest asked ~8);
    * it only counts when the pool is behind: requests wait in Floodgate's queue or inside
      the replicas (`replica_waiting`: vLLM `num_requests_waiting` of this tick), or some
      were turned away since the step (arrivals served as they come say nothing about
      missing capacity).

    The policy uses it for scale-up only (never in the stabilization window). Demand of
    `exclude_classes` that was turned away is left out. 0 when stale, disabled, without a
    measured service time or without enough reads in the window (it needs `burst_ticks` + 2).
    """
    full = offered(w, now, cfg)
    if not (cfg.enabled and cfg.burst) or service_s is None or full.stale:
        return NO_BURST
    use_gw = cfg.use_envoy and _fresh(w.gateway, now, cfg)
    fg_ok = _fresh(w.floodgate, now, cfg)
    src: tuple = w.gateway if use_gw else w.floodgate

    # Envoy counts requests that are no demand (refused as malformed, passed without a permit):
    # taken out at their rate over Floodgate's window (the two sources read at other moments).
    refused_rate, bypass_rate = not_demand_rate(w, now, cfg) if use_gw else (0.0, 0.0)

    def arrivals(a: Any, b: Any) -> float:
        if use_gw:
            return max(0.0, gateway_arrivals(a, b) - bypass_rate * (b.taken_at - a.taken_at))
        return sum(net_of_retries(a, b, *floodgate_rates(a, b))[0].values()) * (b.taken_at - a.taken_at)

    def turned_away(a: Any, b: Any) -> float:
        if use_gw:
            return max(0.0, b.rejected - a.rejected - refused_rate * (b.taken_at - a.taken_at))
        return sum(net_of_retries(a, b, *floodgate_rates(a, b))[1].values()) * (b.taken_at - a.taken_at)

    z = cfg.burst_sigma
    first, last = src[0], src[-1]
    rate, since, size_n, size_dt = 0.0, None, 0.0, 1.0
    for k in range(1, len(src) - cfg.burst_ticks):
        split = src[k]
        s0, dt = split.taken_at - first.taken_at, last.taken_at - split.taken_at
        if s0 <= 0 or dt <= 0:
            continue
        n0, n = arrivals(first, split), arrivals(split, last)
        r = dt / s0
        excess = n - n0 * r  # above what the rate before the split predicts
        if excess <= 0 or excess < z * math.sqrt(max(n + n0 * r * r, 1.0)):
            continue
        # Persistence: every tick since the split brought more than the rate before it (one
        # clump spread over the ticks after it is not a step).
        r0 = n0 / s0
        if any(arrivals(a, b) <= r0 * (b.taken_at - a.taken_at) for a, b in zip(src[k:-1], src[k + 1:], strict=True)):
            continue
        lcb = max(0.0, n - z * math.sqrt(n)) / dt
        if lcb > rate:
            rate, since, size_n, size_dt = lcb, split, n, dt
    if since is None:
        return NO_BURST
    # Behind: requests wait somewhere. Admission with a limit above what the replicas run
    # (it follows the endpoint count) queues a burst inside vLLM rather than in Floodgate's
    # queue (the elastic bench's first burst: Floodgate's queue 0, vLLM waiting 15 -> 101), so
    # that queue counts as much as Floodgate's own.
    behind = replica_waiting > 0 or (fg_ok and sum(w.floodgate[-1].queued_now.values()) > 0) \
        or turned_away(since, last) > 0
    if not behind:
        return NO_BURST
    # Share of excluded turned-away demand: over the last tick with Floodgate's per-class
    # counters as the source, over the rate window with Envoy's (unclassed) ones.
    mix = full if use_gw else offered(DemandWindow(w.floodgate[-2:], ()), now, cfg)
    excluded = sum(v for c, v in mix.turned_away_rate.items() if c in cfg.exclude_classes)
    share = excluded / mix.offered_total if not mix.stale and mix.offered_total > 0 else 0.0
    size_rate = max(0.0, size_n - cfg.burst_size_sigma * math.sqrt(size_n)) / size_dt
    keep = (1.0 - min(1.0, share)) * service_s
    mid = high = 0.0
    if cfg.burst_react:
        mid = size_n / size_dt
        high = min(size_n + cfg.burst_react_sigma * math.sqrt(size_n), cfg.burst_react_max_ratio * size_n) / size_dt
    return BurstEstimate(max(rate, size_rate) * keep, rate * keep, mid * keep, high * keep,
                         turned_away(since, last) > 0)
