"""The Vegas concurrency limit (pure), Netflix concurrency-limits semantics plus five fixes.

Per sample (docs/admission.md, Vegas): queue = ceil(L * (1 - ref / rtt)) with ref = rtt_noload in Netflix's
formula; lg = log10 of the truncated integer limit (at least 1); alpha = 3 lg, beta = 6 lg,
threshold = lg. Drop: L -= lg. App-limited (inflight * 2 < L): no change. queue <= threshold:
L += beta; queue < alpha: L += lg; queue > beta: L -= lg. Clamp, then smooth. rtt_noload is a
running minimum, re-estimated every jitter[0.5, 1) * probe_multiplier * L samples.

`flavor="netflix"` is VegasLimit.java as written (tests/test_vegas.py checks it against a
transcription). The default `floodgate` flavor differs where Netflix's choices hurt an LLM
pool under sustained load:

* Baseline. Netflix's probe sets rtt_noload to the current rtt, even when the pool is
  saturated; with a tolerance that accepts latency up to k x rtt_noload, every probe under
  load raises the accepted latency k-fold and the limit ratchets to its maximum. Here the
  probe re-estimates rtt_noload from the lowest rtt of the windows since the last probe that
  ran at low in-flight (at most twice the in-flight of the current baseline, or 4); under
  sustained saturation there are none and the baseline stays.
* Drops. Netflix counts any drop in a window as a drop of the window; here a window whose
  requests failed with share s moves the limit s of the way to the drop decrease and 1 - s of
  the way to the latency decision, so a few percent of upstream 5xx barely move it.
* Round trips (opt-in, `limit.rise_once_per_rtt`). A window whose latency comes (in part) from requests admitted before the
  limit last changed (`Sample.fresh` False, limit.WindowedLimit) may lower or hold the limit
  but not raise it: increases at most once per round trip, as TCP Vegas. LLM requests report
  seconds after admission while windows close every second; without this a burst raised the
  limit window after window before any request admitted at the raised limit had reported.
* Decrease. Netflix lowers the limit by lg (2 from 100 to 999) per window however far the
  queue estimate is above beta, so a limit that rose while the pool was app-limited (in flight
  at least half of it, no latency) comes back down at ~2 per second while every window reads
  a queue of 20-40: in the overload bench the sparse phase began at 150-170 and held ~140 in
  flight against a goodput plateau of 112-136. Here (`decrease_gain` g > 0) it comes down by
  max(lg, g x (queue - beta)) (`limit.decrease_gain`, 0.25): in proportion to how far past
  the target the pool is, and still by lg near it, so at the knee it moves as before (0.5
  came down faster but let noisy windows dip it below 80 % of the knee with 5 % 5xx).
* Reference. ref = `target`, the latency the pool's SLO allows for the signal (config
  `limit.slo_target`), when the no-load latency is below it; tolerance x rtt_noload
  otherwise. An LLM engine's TPOT grows with batch size long before anything queues, and
  the SLO, not the latency at whatever load the baseline happened to be measured, says how
  much growth is fine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from floodgate.extproc.limit import LimitState, Sample, SampleWindow

__all__ = ["Sample", "SampleWindow", "VegasLimit", "VegasState", "log10_root"]

VegasState = LimitState
LOW_INFLIGHT_FLOOR = 4


def log10_root(limit: float) -> int:
    """Netflix Log10RootFunction on the truncated integer limit (max(1, floor(log10 L)))."""
    n = int(limit)
    return max(1, int(math.log10(n))) if n >= 1 else 1


def _netflix_log10_root(n: int) -> int:
    # Log10RootFunction.java: a lookup of max(1, (int) log10(i)) below 1000, sqrt above.
    return max(1, int(math.log10(n))) if 0 < n < 1000 else (1 if n <= 0 else int(math.sqrt(n)))


@dataclass(frozen=True)
class VegasLimit:
    min_limit: int = 1
    max_limit: int = 512
    smoothing: float = 1.0
    probe_multiplier: int = 30
    # Latency up to tolerance x rtt_noload counts as no queue. 1.0 is Netflix's Vegas.
    tolerance: float = 1.0
    flavor: Literal["floodgate", "netflix"] = "floodgate"
    target: float = 0.0  # SLO latency of the signal that counts as no queue (0 = none)
    # floodgate flavor: a window whose queue estimate is above beta lowers the limit by
    # max(lg, decrease_gain x (queue - beta)) instead of lg (0 = Netflix's lg step).
    decrease_gain: float = 0.0

    @property
    def adaptive(self) -> bool:
        return True

    def initial(self, limit: int) -> VegasState:
        return VegasState(limit=float(max(self.min_limit, min(self.max_limit, limit))))

    def _lg(self, limit: float) -> int:
        return _netflix_log10_root(int(limit)) if self.flavor == "netflix" else log10_root(limit)

    def update(self, state: VegasState, sample: Sample, rand: float) -> VegasState:
        """`rand` in [0, 1) picks the next probe jitter (passed in to keep this pure)."""
        if sample.rtt <= 0:
            # A window of drops only (every measured request failed): no latency to learn from.
            if sample.dropped:
                return replace(state, limit=self._next_limit(state, sample))
            return state
        if state.probe_jitter >= 1.0:
            # A state that never drew its probe jitter (a fresh pool): draw it now, uniform in
            # [0.5, 1) as Netflix does at construction.
            state = replace(state, probe_jitter=0.5 + rand * 0.5)
        probe_count = state.probe_count + 1
        if state.probe_jitter * self.probe_multiplier * state.limit <= probe_count:
            return self._probe(state, sample, rand)
        if state.rtt_noload == 0 or sample.rtt < state.rtt_noload:
            return replace(state, rtt_noload=sample.rtt, probe_count=probe_count,
                           noload_inflight=sample.inflight)
        state = replace(state, probe_count=probe_count)
        if self.flavor == "floodgate" and self._low(state, sample.inflight) and (
                state.epoch_rtt == 0 or sample.rtt < state.epoch_rtt):
            state = replace(state, epoch_rtt=sample.rtt, epoch_inflight=sample.inflight)
        return replace(state, limit=self._next_limit(state, sample))

    def _low(self, state: VegasState, inflight: int) -> bool:
        return inflight <= max(LOW_INFLIGHT_FLOOR, 2 * state.noload_inflight)

    def _probe(self, state: VegasState, sample: Sample, rand: float) -> VegasState:
        jitter = 0.5 + rand * 0.5
        if self.flavor == "netflix":
            # Forget the minimum: a permanently slower model is re-learnt (and, under load,
            # the loaded latency becomes the baseline).
            return replace(state, rtt_noload=sample.rtt, probe_count=0, probe_jitter=jitter,
                           noload_inflight=sample.inflight)
        rtt, inflight = state.epoch_rtt, state.epoch_inflight
        if self._low(state, sample.inflight) and (rtt == 0 or sample.rtt < rtt):
            rtt, inflight = sample.rtt, sample.inflight
        if rtt == 0:  # no window at low in-flight since the last probe: keep the baseline
            rtt, inflight = state.rtt_noload, state.noload_inflight
        return replace(state, rtt_noload=rtt, noload_inflight=inflight, probe_count=0,
                       probe_jitter=jitter, epoch_rtt=0.0, epoch_inflight=0)

    def _next_limit(self, state: VegasState, sample: Sample) -> float:
        limit = state.limit
        lg = self._lg(limit)
        decreased = limit - lg
        if self.flavor == "netflix" or sample.rtt <= 0:
            share = 1.0 if sample.dropped else 0.0
        else:
            share = sample.drops
        if share >= 1.0:
            target = decreased
        else:
            target = self._latency_target(state, sample, lg)
            target = (1 - share) * target + share * decreased
        if target == limit:
            return limit  # no change: Netflix returns before smoothing (no float drift)
        lo = 1.0 if self.flavor == "netflix" else float(self.min_limit)
        target = max(lo, min(float(self.max_limit), target))
        return (1 - self.smoothing) * limit + self.smoothing * target

    def _latency_target(self, state: VegasState, sample: Sample, lg: int) -> float:
        limit = state.limit
        if sample.inflight * 2 < limit:
            return limit  # app-limited: the latency says nothing about the limit
        ref = self.tolerance * state.rtt_noload
        if self.flavor == "floodgate" and self.target >= state.rtt_noload:
            # The SLO says how much latency growth is fine; the tolerance is only the fallback
            # for a pool whose no-load latency already misses it.
            ref = self.target
        queue = max(0, math.ceil(limit * (1 - ref / sample.rtt)))
        alpha, beta, threshold = 3 * lg, 6 * lg, lg
        if queue < alpha and not sample.fresh:
            return limit  # the latency of requests admitted under a lower limit cannot justify this one
        if queue <= threshold:
            return limit + beta
        if queue < alpha:
            return limit + lg
        if queue > beta:
            if self.flavor == "floodgate" and self.decrease_gain > 0:
                # The queue estimate says how far past the target the pool is: come down in
                # proportion, not by lg = 2 per window from 170 to a knee near 120.
                return limit - max(lg, self.decrease_gain * (queue - beta))
            return limit - lg
        return limit
