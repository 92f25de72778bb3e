"""Per-replica capacity, learned from measured latency instead of assumed (pure).

The policy sizes the pool as demand / capacity, where capacity is the concurrency (running +
waiting at vLLM) one replica carries while meeting the pool's latency SLO. A configured
constant (`PolicyConfig.target_concurrency`) is only a prior: a model, GPU or prompt mix that
is slower than assumed makes every sizing short by the same factor. Like NVIDIA Dynamo's SLA
planner, which corrects its offline profile with the latency it measures, this module corrects
the prior from the replicas' TTFT/ITL histogram deltas:

    c  = mean concurrency per active replica over the window
    r  = max(TTFT_q / slo_ttft, mean ITL / slo_itl)          (latency as a share of the SLO)
    raw estimate = c * aim / r                               (aim: target share of the SLO, < 1)

Near the operating point latency grows about linearly with concurrency (decode step time with
batch size, queueing once the batch is full); with a fixed latency floor the raw estimate lies
between the observed c and the true capacity, so repeated windows converge on it from either
side. Every estimate is bounded by what the window proves, assuming latency does not fall as
concurrency rises:

* SLO met at c (r <= 1): capacity >= c * aim, and we never extrapolate beyond
  `max_extrapolation` x c (a light load with flat latency says little about the limit); such a
  window lowers the estimate only when its latency is above the aimed share of the SLO;
* SLO missed at c (r > 1): capacity < c, so the estimate is at most c * aim / r — unless the
  SLO cannot be met at any load. With a recent window at a clearly different concurrency (by
  `LOAD_STEP`), the line through the two (latency against concurrency, its slope at least 0)
  gives the latency at no load: at or above the SLO, it is a floor the load does not move
  (long prompts: prefill alone took 2-8 s at any load, a review) and more replicas cannot meet
  the SLO: the window does not lower the estimate, the lowering such windows made is undone,
  and the floor is remembered. Before, every window "missed", each lowered the estimate, the
  pool grew, the concurrency per replica fell, and the next window missed again: the estimate
  sat at `min_factor` and the pool ran 4x the replicas at the same SLO. (A first version read
  any latency within 10 % over a 25 % change of load as a floor, and so kept a pool whose
  latency rises slowly with load, meeting the SLO below some concurrency, at the prior: SLO
  missed for good where lowering met it. The intercept tells the two apart.);

* admission held requests back (a queue at the gateway, or requests turned away) on most
  ticks of a window: the replicas ran at what admission judged they sustain (a concurrency
  limit, or `max_num_seqs` behind it), so the estimate is at most `saturated_share` x the
  concurrency of those ticks. This is what reveals a hard cap that latency does not show
  (flat latency up to a fixed batch size);

* past the prior (only with `max_factor` > 1), a move *up* is judged on the tail: the same
  estimate from TTFT at `up_quantile` (p99) must lie above the current one, and bounds the move;
  a window whose tail misses lowers it towards the prior; nothing else raises it there (a p90
  miss, a floor's restore). Below a full batch the p90 stays flat while the requests that
  queue inside the engine make the tail; sizing on the p90 alone climbed past the concurrency
  at which 99 % of requests meet the SLO;

and by `[min_factor, max_factor]` x the prior. By default `max_factor` is 1: learning corrects a
prior that is too optimistic (the costly direction: SLO misses) and never sizes above it. Raised,
a rise past the prior goes in steps of at most `max_step_up` (10 %) per window and only while
the tail meets the SLO; a window whose tail misses sends the estimate back towards the prior.
Measured both ways in docs/controller.md ("Learned capacity"). A window is used only when it is fresh (no
stale tick, no failed scrape of an active replica inside it), has at least `min_ttft` and
`min_itl` observations, and, to move the estimate *up*, carried at least `min_load_fraction`
of the current estimate. Accepted estimates are smoothed (EWMA) and a single window moves the
estimate by at most `max_step` (relative). `update` never reads a missing value as zero:
an empty or stale window leaves the estimate as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from floodgate.controller.vllm import Histogram, merge_histograms
from pydantic import BaseModel, Field, model_validator

from floodgate.yamlconfig import STRICT


class CapacityConfig(BaseModel):
    """Learned per-replica capacity. Off (`enabled: false`) the prior is used as is."""

    model_config = STRICT

    enabled: bool = Field(default=True, description="Learn capacity from measured TTFT/ITL (false: use target_concurrency).")
    slo_ttft_s: float = Field(default=2.0, gt=0, description="The pool's TTFT SLO (seconds).")
    slo_itl_s: float = Field(default=0.1, gt=0, description="The pool's inter-token latency (TPOT) SLO (seconds).")
    ttft_quantile: float = Field(default=0.9, gt=0, lt=1, description="TTFT quantile compared with the SLO.")
    aim: float = Field(default=0.8, gt=0, le=1, description="Share of the SLO the estimate sizes for (headroom).")
    window_s: float = Field(default=20.0, gt=0, description="Seconds of histogram deltas per estimate.")
    min_ttft: int = Field(default=20, ge=1, description="TTFT observations a window needs.")
    min_itl: int = Field(default=100, ge=1, description="ITL observations a window needs.")
    min_load_fraction: float = Field(default=0.5, ge=0, le=1, description="A window moves the estimate up only if its concurrency was at least this share of the estimate.")
    max_extrapolation: float = Field(default=1.5, ge=1, description="A window meeting the SLO at concurrency c proves at most this x c.")
    smoothing: float = Field(default=0.5, gt=0, le=1, description="EWMA weight of a new window.")
    max_step: float = Field(default=0.5, gt=0, description="Largest relative change of the estimate per window.")
    max_step_up: float = Field(default=0.1, gt=0, description="Largest relative rise of the estimate per window "
                               "above the prior (`max_step` bounds a fall, and a rise up to the prior): an overshoot "
                               "is paid in SLO misses, a shortfall only in replicas.")
    min_factor: float = Field(default=0.25, gt=0, le=1, description="Lowest estimate as a share of the prior.")
    max_factor: float = Field(default=1.0, ge=1, description="Highest estimate as a multiple of the prior (1: "
                              "learning only corrects a prior that is too high; raise it to also learn upwards, in steps "
                              "of `max_step_up`, judged on the TTFT tail at `up_quantile`).")
    up_quantile: float = Field(default=0.99, gt=0, lt=1, description="TTFT quantile a rise past the prior is judged "
                               "on (with max_factor > 1): the estimate from it bounds the rise, and a window where it misses "
                               "the SLO sends an estimate above the prior back towards it (a p90 stays flat below a full "
                               "batch while the requests that queue inside the engine make the tail).")
    saturated_share: float = Field(default=0.875, gt=0, le=1, description="A window in which admission held requests "
                                   "back sizes for this share of the concurrency the replicas ran at (7 of 8).")

    @model_validator(mode="after")
    def _fractions(self) -> CapacityConfig:
        if self.min_factor > self.max_factor:
            raise ValueError("min_factor must be ≤ max_factor")
        return self


@dataclass(frozen=True, slots=True)
class Window:
    """Histogram deltas and concurrency samples accumulated since `started`."""

    started: float
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    conc_sum: float = 0.0  # Σ per-tick concurrency per active replica
    ticks: int = 0
    saturated_ticks: int = 0  # ticks on which admission held requests back (queue or turned away)
    sat_conc_sum: float = 0.0  # Σ concurrency per replica over those ticks
    tainted: bool = False  # a stale tick fell inside: the window proves nothing


# Two windows show a latency floor when their concurrencies differ by LOAD_STEP or more and the
# line through them puts the latency at no load at or above the SLO (`floor_bound`).
LOAD_STEP = 1.25
RECENT_WINDOWS = 8  # closed windows remembered for that comparison (with the window's length: minutes)
# A floor once shown is remembered this long after two windows last showed it: meanwhile no miss
# lowers the estimate (the SLO cannot be met at any load; latency says nothing of capacity), and
# the estimate goes back to where it was before the floor's windows lowered it. Without it the
# comparison forgot the lighter windows after RECENT_WINDOWS, and a noisy window (p90 of a few
# long prefills: 3.3-4.2 x the SLO in one review trace) lowered the estimate step by step.
FLOOR_MEMORY_S = 600.0


@dataclass(frozen=True, slots=True)
class Seen:
    """A closed window that measured something: its concurrency per replica, its latency as a
    share of the SLO, and the estimate before it was folded in."""

    concurrency: float
    ratio: float
    before: float


def no_load_ratio(a: tuple[float, float], b: tuple[float, float]) -> float | None:
    """The latency ratio at no load on the line through two (concurrency, ratio) windows whose
    concurrencies differ by LOAD_STEP or more (the slope taken as at least 0: latency that fell
    with load is noise, read as flat); None for windows too alike in load to say (pure)."""
    lo, hi = sorted((a, b))
    if lo[0] <= 0 or hi[0] < lo[0] * LOAD_STEP:
        return None
    slope = max(0.0, (hi[1] - lo[1]) / (hi[0] - lo[0]))
    return lo[1] - slope * lo[0]


def no_load_ratios(c: float, r: float, recent: tuple[Seen, ...]) -> list[tuple[Seen, float]]:
    """The recent windows far enough in load from this one (concurrency `c`, ratio `r`) to
    give a latency at no load (`no_load_ratio`), each with it (pure)."""
    out = []
    for s in recent:
        f = no_load_ratio((c, r), (s.concurrency, s.ratio))
        if f is not None:
            out.append((s, f))
    return out


def floor_bound(c: float, r: float, recent: tuple[Seen, ...]) -> list[tuple[Seen, float]]:
    """The recent windows that, with this one (concurrency `c`, ratio `r`), put the latency at
    no load at or above the SLO, each with that no-load ratio (pure)."""
    return [(s, f) for s, f in no_load_ratios(c, r, recent) if f >= 1.0]


@dataclass(frozen=True, slots=True)
class CapacityState:
    """The estimate (None: still the prior) and the window being filled."""

    estimate: float | None = None
    window: Window | None = None
    updated_at: float | None = None
    accepted: int = 0  # windows that moved (or confirmed) the estimate
    rejected: int = 0  # windows closed without an update (empty, stale, too light)
    last_raw: float | None = None  # the last window's bounded raw estimate (for the log)
    last_ratio: float | None = None  # its latency as a share of the SLO
    recent: tuple[Seen, ...] = ()  # the last RECENT_WINDOWS closed windows that measured something
    floor_windows: int = 0  # windows whose SLO miss was a latency floor, not the load (`floor_bound`)
    floor_ratio: float | None = None  # that floor: the latency at no load as a share of the SLO ...
    floor_until: float = 0.0  # ... remembered until then
    floor_restore: float = 0.0  # the estimate before the floor's windows lowered it
    # A latency between the aim and the SLO shown flat in load (`flat_above_aim`): windows in that
    # band lower nothing until this time, which every such window moves on.
    band_until: float = 0.0


@dataclass(frozen=True, slots=True)
class TickLatency:
    """One tick's inputs: deltas since the previous scrape, summed over fresh active replicas."""

    ttft: Histogram
    itl: Histogram
    concurrency: float  # Σ (running + waiting) over the fresh active replicas
    replicas: int  # fresh active replicas contributing
    stale: bool  # an active replica's scrape failed or is old: the window is tainted
    # Admission held requests back this tick (Floodgate queue > 0 or requests turned away):
    # the replicas ran at what admission judged they sustain.
    saturated: bool = False


def tick_latency(samples: list[tuple[Histogram, Histogram, float]], active: int,
                 saturated: bool = False) -> TickLatency:
    """From (ttft_delta, itl_delta, running+waiting) of each fresh active replica."""
    return TickLatency(
        merge_histograms(s[0] for s in samples),
        merge_histograms(s[1] for s in samples),
        sum(s[2] for s in samples),
        len(samples),
        len(samples) < active,
        saturated,
    )


def capacity(state: CapacityState, prior: float, cfg: CapacityConfig) -> float:
    """The per-replica capacity to size with: the learned estimate, else the prior."""
    if not cfg.enabled or state.estimate is None:
        return prior
    return state.estimate


def latency_ratio(ttft: Histogram, itl: Histogram, cfg: CapacityConfig, quantile: float | None = None) -> float | None:
    """Measured latency as a share of the SLO (max over the TTFT quantile, `ttft_quantile`
    unless given, and mean ITL)."""
    q = ttft.interpolated(cfg.ttft_quantile if quantile is None else quantile)
    m = itl.mean
    if q is None or m is None:
        return None
    return max(q / cfg.slo_ttft_s, m / cfg.slo_itl_s)


def window_point(w: Window, cfg: CapacityConfig) -> tuple[float, float] | None:
    """(concurrency per replica, latency ratio) of a closed window that measured enough
    (untainted, with `min_ttft`/`min_itl` observations); None otherwise."""
    if w.tainted or w.ticks == 0 or w.ttft.count < cfg.min_ttft or w.itl.count < cfg.min_itl:
        return None
    r = latency_ratio(w.ttft, w.itl, cfg)
    return None if r is None else (w.conc_sum / w.ticks, r)


def flat_above_aim(c: float, r: float, recent: tuple[Seen, ...], aim: float) -> list[Seen]:
    """The recent windows that, with this one (ratio `r` between the aim and the SLO at
    concurrency `c`), show its latency as a floor above the aimed share: every window at least
    `LOAD_STEP` apart in load puts the latency at no load at or above `aim` (none of them shows
    less load bringing it under). Empty when no window is that far apart, or one shows it (pure)."""
    ratios = no_load_ratios(c, r, recent)
    return [] if any(f < aim for _, f in ratios) else [s for s, _ in ratios]


def estimate_window(w: Window, point: tuple[float, float] | None, current: float, prior: float,
                    cfg: CapacityConfig) -> tuple[float | None, float | None]:
    """(bounded raw estimate, latency ratio) of a closed window whose `window_point` is
    `point`, or (None, ratio) when the window proves nothing. (A miss whose latency is a
    floor: `update`, `floor_bound`.)"""
    if point is None:
        return None, None
    c, r = point
    if c <= 0:
        return None, r
    if r <= 1.0:
        saturated = 2 * w.saturated_ticks >= w.ticks
        if c < cfg.min_load_fraction * current and not saturated:
            return None, r  # too light to say anything about the limit
        raw = min(c * cfg.aim / max(r, 1e-9), c * cfg.max_extrapolation)
        raw = max(raw, c * cfg.aim)  # the SLO was met at c
        # Above the prior (the operator's word) a rise needs the tail too, and keeps it.
        bar = max(current, prior)
        # The same ratio with TTFT at `up_quantile`: what a rise past `bar` is judged on.
        tail = latency_ratio(w.ttft, w.itl, cfg, cfg.up_quantile) if raw > bar or current > prior else None
        if current > prior and tail is not None and tail > 1.0:
            raw = max(prior, min(current, c * cfg.aim / tail))  # the tail missed: back towards the prior
        elif raw > bar:
            # The same estimate from `up_quantile`, up to which a rise past `bar` may go.
            up = None if tail is None else min(c * cfg.aim / max(tail, 1e-9), c * cfg.max_extrapolation)
            raw = bar if up is None else max(bar, min(raw, up))
            if raw <= current and not saturated:
                return None, r
        elif raw < current and r <= cfg.aim and not saturated:
            # Latency within the aimed share proves a lower bound only: it never lowers the
            # estimate (a pool sized generously runs light, and reading that as its limit
            # would spiral down). Between the aim and the SLO, it lowers towards the aim.
            return None, r
        if saturated:
            # Requests were waiting at the gateway while the replicas ran at c_sat: admission
            # (a concurrency limit, or max_num_seqs behind it) found no more room, and flat
            # latency below a hard cap says nothing about what lies beyond it.
            raw = min(raw, cfg.saturated_share * w.sat_conc_sum / w.saturated_ticks)
    else:
        # The SLO was missed at c: capacity is below c. (A miss never raises the estimate past
        # the prior, or past where it is when above: a rise there needs the tail.)
        raw = min(c * cfg.aim / r, max(current, prior))
    return min(max(raw, cfg.min_factor * prior), cfg.max_factor * prior), r


def update(state: CapacityState, tick: TickLatency | None, now: float, prior: float,
           cfg: CapacityConfig) -> CapacityState:
    """Feed one tick (None: nothing measured this tick, e.g. the scrape of every replica
    failed: taints the window). Closes the window after `window_s` and folds it in."""
    if not cfg.enabled:
        return state
    w = state.window or Window(now)
    if tick is None or tick.stale:
        w = replace(w, tainted=True)
    elif tick.replicas > 0:
        w = replace(w,
                    ttft=merge_histograms((w.ttft, tick.ttft)),
                    itl=merge_histograms((w.itl, tick.itl)),
                    conc_sum=w.conc_sum + tick.concurrency / tick.replicas,
                    ticks=w.ticks + 1,
                    saturated_ticks=w.saturated_ticks + (1 if tick.saturated else 0),
                    sat_conc_sum=w.sat_conc_sum + (tick.concurrency / tick.replicas if tick.saturated else 0.0))
    if now - w.started < cfg.window_s:
        return replace(state, window=w)
    current = capacity(state, prior, cfg)
    point = window_point(w, cfg)
    loaded = point if point is not None and point[0] > 0 else None
    recent = state.recent if loaded is None else (*state.recent, Seen(*loaded, current))[-RECENT_WINDOWS:]
    if loaded is not None and loaded[1] > 1.0:
        miss = loaded[1]
        floor = floor_bound(*loaded, state.recent)
        remembered = state.floor_ratio is not None and now < state.floor_until
        if floor or remembered:
            # The SLO missed at a latency the load does not move: undo the lowering the
            # windows of that floor made (the estimate before the first of them), lower nothing.
            undo = max([state.floor_restore if remembered else 0.0, *(s.before for s, _ in floor)])
            restored = min(max(current, undo), max(current, prior))  # never a rise past the prior
            return replace(state, estimate=restored if state.estimate is not None else None, window=Window(now),
                           rejected=state.rejected + 1, last_ratio=miss, recent=recent,
                           floor_windows=state.floor_windows + 1,
                           floor_ratio=min(f for _, f in floor) if floor else state.floor_ratio,
                           floor_until=now + FLOOR_MEMORY_S if floor else state.floor_until,
                           floor_restore=undo)
    if loaded is not None and cfg.aim < loaded[1] <= 1.0 and 2 * w.saturated_ticks < w.ticks:
        flat = flat_above_aim(*loaded, state.recent, cfg.aim)
        if flat or now < state.band_until:
            # The SLO met with a latency between the aim and the SLO that load does not move
            # (TTFT is mostly prefill): a lowering towards the aim cannot buy the headroom, it
            # only grows the pool, which lowers the concurrency per replica, and the next window
            # lowered the estimate again (a review's half-speed Azure replay: 7 -> 1.75, i.e.
            # `min_factor`, at 3.2x the replica-hours of the zero-wait reference where the prior
            # alone cost 1.4x). Lower nothing, and remember the band while every window stays in
            # it: the windows after it sit at one load (none lowered the estimate), so none can
            # show it again, and forgetting it restarted the descent until a window at a load
            # 25 % away showed it again.
            estimate = state.estimate
            if flat and estimate is not None:
                # Undo what the windows of that flat latency lowered, no higher than a
                # concurrency at which a window met the SLO (a latency that does rise, slowly,
                # meets the SLO only below some load: a review's 0.9 + 0.01 c).
                undo = max(s.before for s in flat)
                proved = max([loaded[0], *(s.concurrency for s in state.recent if s.ratio <= 1.0)])
                estimate = min(max(current, undo), max(current, prior), max(current, proved))
            return replace(state, estimate=estimate, window=Window(now), rejected=state.rejected + 1,
                           last_ratio=loaded[1], recent=recent, band_until=now + FLOOR_MEMORY_S)
    raw, r = estimate_window(w, point, current, prior, cfg)
    if raw is None:
        return replace(state, window=Window(now), rejected=state.rejected + 1, last_ratio=r, recent=recent)
    blended = current + cfg.smoothing * (raw - current)
    lo, hi = current * (1 - cfg.max_step), current * (1 + cfg.max_step)
    hi = min(hi, max(prior, current * (1 + cfg.max_step_up)))  # past the prior: small steps
    new = min(max(blended, lo), hi)
    new = min(max(new, cfg.min_factor * prior), cfg.max_factor * prior)
    return CapacityState(estimate=new, window=Window(now), updated_at=now, accepted=state.accepted + 1,
                         rejected=state.rejected, last_raw=raw, last_ratio=r, recent=recent,
                         floor_windows=state.floor_windows, floor_ratio=state.floor_ratio,
                         floor_until=state.floor_until, floor_restore=state.floor_restore,
                         band_until=state.band_until)


def replicas_for(demand: float, per_replica: float) -> int:
    """Replicas needed for `demand` concurrent requests at `per_replica` each."""
    return max(0, math.ceil(demand / per_replica - 1e-9))
