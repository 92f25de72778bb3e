"""The burst's onset on a virtual clock: Floodgate's grant loop in front of the pool's engines.

The overload bench's worst P0 TTFTs are P0s that arrive in the burst's first seconds, wait
nothing in Floodgate's queue, and then wait in the engine's FIFO queue behind the dozens of
lower-class prompts admitted at once when in-flight jumps from the steady level to the limit.
This model replays the bench's own plan (`bench.overload.build_plan`) through the reference
grant loop (`PermitTable` + `queue_decision`, the code the Lua script is checked against) and
the replicas' own engine model (`sim/engine.py`), Envoy's LEAST_REQUEST in between, with a
static limit (96: static-96; 115: about Vegas's burst limit), to test remedies before building:

* `shipped-ramp`: the onset ramp as shipped (`PermitTable`'s token bucket, policy.ramp_refill);
  `ramp-bucket-4` / `ramp-bucket-2` the same with a smaller bucket (0.03 x L, at least 4 /
  2 at once: tried with `--vegas-steps` and not kept, docs/benchmarks.md Overload notes);
* `ramp-B+R/s`  : an absolute bucket, B at once and R per second beyond what releases free,
                  applied whether or not a P0 is in flight (variants: `by_release_rate` scales
                  both with the pool's release rate, `grace` lets a paced waiter go near its
                  deadline, `above_half` paces only above half the limit);
* `prefill-K`   : at most K lower-class requests admitted and still without a first token (an
                  oracle: the processor does not see first tokens of unsampled requests);
* `p0first`     : P0 goes first in its engine's queue (engine-side priority: the engines run
                  vLLM's `--scheduling-policy priority` and P0 carries `priority: -1`, as the
                  pool setting `engine_priority: {0: -1}` sends it); `ramp+p0first` with the ramp;
* `p0pick`      : P0 goes to the replica with the least prefill work queued (oracle).
* `backlog-K`, `max-backlog-K`, `est-K@R`, `max-est-K@R`: prefill pacing with Envoy choosing
                  the replica: while P0 is in flight a lower class is granted only while the
                  prefill work in the engines is at most K prompt tokens — the engines' true
                  backlog summed (`backlog`, an oracle) or that of the most loaded replica
                  (`max-`), or an estimate from the admissions alone (`est`: each admitted
                  prompt's tokens on its replica, draining at R tokens/s per replica; what a
                  processor could know, given each request's prompt size and endpoint);
* `pick-backlog-K`, `pick-est-K@R`: the same with endpoint picking: every request goes to the
                  replica with the least (true or estimated) prefill backlog and a lower class is
                  granted while that least backlog is at most K (bench/p0_bound.py's FIFO oracle
                  live; `pick-backlog-inf`: the picking without the pacing).
* `estn-…`, `pick-estn-…`: the estimate counts every request as the mean prompt (MEAN_PROMPT)
                  instead of its own size; `pool-est…`: one estimate for the whole pool draining at
                  R x replicas (a processor that does not know each request's replica); `…+ramp`:
                  the shipped onset ramp as well. `pick-estn-512@6k+ramp` is what shipped before
                  each request's size was read; `pick-cl4-512@6k+ramp` is what ships
                  (`prefill_tokens_per_s`, `prefill_bytes_per_token` 4: the size from the request's
                  content-length, extproc/prefill.py) with endpoint picking; `pick-cl6-…` the same
                  at 6 bytes per token (about the bench's own prompts' ratio).

With `--vegas` the limit is no longer fixed: the shipped Vegas (`limit_for`, from `limit.initial`)
is fed every finished request as the processor feeds it (`sample_rate` of them with their latency
from admission, at most `max_sampled` measured at once, the in-flight at the finish), so its
climb, its burst and sparse-phase levels and their effect on P0 can be explored across seeds
(`--trace` prints every limit change); JSON overrides LimitConfig fields, e.g.
`--vegas '{"decrease_gain": 0}'` for Netflix's lg step instead of the proportional decrease.

    python -m floodgate.bench.p0_onset --limit 96 115 --seeds 1 2 3
    python -m floodgate.bench.p0_onset --vegas --only shipped-ramp --seeds 1 2 3 4
    python -m floodgate.bench.p0_onset --limit 72 96 --seeds 1 2 3 4 5 6 --vegas-steps \
        --only shipped-ramp ramp-bucket-4 ramp-bucket-2     # the limit climbing in the burst
    python -m floodgate.bench.p0_onset --limit 96 115 --seeds 1 2 3 4 5 \
        --only shipped-ramp max-est-1024@6k pick-est-512@6k  # prefill pacing, without / with picking
    python -m floodgate.bench.p0_onset --limit 96 --seeds 1 2 3 4 \
        --only shipped-ramp pick-est-512@6k pick-estn-512@6k pick-estn-512@6k+ramp
    python -m floodgate.bench.p0_onset --limit 96 --seeds 1 2 3 4 \
        --only pick-estn-512@6k+ramp pick-est-512@6k+ramp pick-cl4-512@6k+ramp  # what ships
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from floodgate.extproc.config import AdmissionConfig, PoolConfig
from floodgate.extproc.limit import Latency, limit_for, sample_request
from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import (
    ARRIVAL_FAST_TAU_S,
    ARRIVAL_TAU_S,
    CLASSES,
    RAMP_MIN_BURST,
    RAMP_MIN_RATE_S,
    DecayingMean,
    DecayingRate,
    Reject,
    queue_decision,
)


@dataclass(frozen=True)
class Remedy:
    name: str = "none"
    ramp_burst: float | None = None  # token bucket: growth allowed at once
    ramp_rate: float = 0.0  # growth tokens per second
    prefill_cap: int | None = None  # lower-class requests admitted without a first token (oracle)
    p0_first: bool = False
    p0_pick: bool = False
    # ramp scaled by the pool's completion rate R (permits freed per second, decayed as
    # leases.lua keeps it): burst = ramp_burst x R (seconds of completions), rate = ramp_rate x R
    by_release_rate: bool = False
    grace: float | None = None  # a paced waiter this close to its deadline goes anyway
    above_half: bool = False  # pace only grants made with in-flight at or above half the limit
    # the shipped rule itself: PermitTable's onset ramp (burst share, rate share of L per second)
    shipped: tuple[float, float] | None = None
    ramp_min_burst: float = RAMP_MIN_BURST  # with `shipped`: the bucket's floor (policy.RAMP_MIN_BURST)
    # prefill pacing: while P0 is in flight a lower class is granted only while the prefill work
    # admitted and not yet done is at most `prefill_k` prompt tokens. `prefill_rate` (tokens/s
    # per replica) > 0: that work is an estimate from the admissions alone (every admitted prompt's
    # tokens in, draining at the rate: what a processor can know); 0: the engines' true backlog
    # (an oracle)
    prefill_k: float | None = None
    prefill_rate: float = 0.0
    # with `prefill_k` (oracle mode): every request goes to the replica with the least prefill
    # backlog and a lower class is granted while that least backlog is at most K (endpoint
    # picking that knows each engine's prefill queue: bench/p0_bound.py's FIFO policy, live)
    per_replica: bool = False
    # without picking (Envoy routes): the pool's level is the most loaded replica's backlog
    # instead of the sum (the processor learns each request's endpoint from its response headers)
    pool_max: bool = False
    # with `prefill_rate`: the estimate counts every admitted request as the mean prompt
    # (MEAN_PROMPT) instead of its own size (a processor that does not read the request's size)
    unit_size: bool = False
    # with `prefill_rate`: one estimate for the pool, draining at the rate x replicas (what a
    # processor that does not know each request's replica can keep) instead of one per replica
    pooled: bool = False
    # the shipped onset ramp as well as the remedy's pacing (both must let a grant through)
    ramp_too: bool = False
    # with `prefill_rate`: each request's size as the processor estimates it from the request's
    # `content-length` (extproc.prefill.prompt_tokens: body bytes / this, clamped to [1,
    # MAX_REQUEST_TOKENS]; the body the load generator sends, sim.loadgen.request_body) instead of
    # its true prompt tokens (an oracle of the engine's tokenizer)
    body_bytes_per_token: float = 0.0


MEAN_PROMPT = 512.0


@dataclass
class Gate:
    """The remedies' pacing rules, as a `PermitTable` pacer (extproc.permits.Pacer)."""

    remedy: Remedy
    tokens: float = 0.0
    ts: float = 0.0
    prefilling: int = 0  # lower-class admitted, no first token yet
    release_rate: Any = None  # () -> permits freed per second (0 = unknown)
    backlog: float = 0.0  # prefill pacing: estimated prompt tokens admitted, not yet prefilled
    backlog_ts: float = 0.0
    replicas: int = 1
    engine_backlog: Any = None  # () -> the engines' true prefill backlog (oracle)
    est: list[float] = field(default_factory=list)  # per-replica estimates (per_replica, rate > 0)

    def prefill_level(self, now: float) -> float:
        r = self.remedy
        if r.prefill_rate <= 0:
            return float(self.engine_backlog(r.per_replica)) + self.backlog  # + granted in this loop
        n = 1 if r.pooled else self.replicas
        if len(self.est) != n:
            self.est = [0.0] * n
        drain = r.prefill_rate * (self.replicas if r.pooled else 1)
        self.est = [max(0.0, x - drain * (now - self.backlog_ts)) for x in self.est]
        self.backlog_ts = now
        # with picking the next request goes to the least; without, Envoy may send it to any
        return (min(self.est) if r.per_replica else self._pool(self.est)) + self.backlog

    def _pool(self, backlogs: list[float]) -> float:
        return max(backlogs) if self.remedy.pool_max else sum(backlogs)

    def admitted(self, tokens: float, now: float, replica: int = 0) -> None:
        """A request's prompt reached the engines (estimate mode: its tokens join the backlog)."""
        if self.remedy.prefill_k is not None and self.remedy.prefill_rate > 0:
            self.prefill_level(now)
            self.est[0 if self.remedy.pooled else replica] += MEAN_PROMPT if self.remedy.unit_size else tokens
            self.backlog = max(0.0, self.backlog - MEAN_PROMPT)

    def params(self) -> tuple[float, float]:
        r = self.remedy
        assert r.ramp_burst is not None
        if not r.by_release_rate:
            return r.ramp_burst, r.ramp_rate
        rate = self.release_rate()
        if rate <= 0:
            return math.inf, math.inf
        return r.ramp_burst * rate, r.ramp_rate * rate

    def refill(self, now: float) -> None:
        r = self.remedy
        if r.ramp_burst is None:
            return
        burst, rate = self.params()
        self.tokens = min(burst, self.tokens + rate * max(0.0, now - self.ts))
        self.ts = now

    def free_pass(self, inflight: Sequence[int], limit: int) -> bool:
        return self.remedy.above_half and 2 * sum(inflight) < limit

    def open(self, cls: int, now: float, inflight: Sequence[int], limit: int,
             head_deadline: float | None) -> bool:
        if cls == 0 or self.free_pass(inflight, limit):
            return True
        r = self.remedy
        ok = True
        if r.prefill_cap is not None and self.prefilling >= r.prefill_cap:
            ok = False
        elif r.prefill_k is not None:
            ok = inflight[0] == 0 or self.prefill_level(now) <= r.prefill_k
        elif r.ramp_burst is not None:
            self.refill(now)
            ok = self.tokens >= 1
        # a paced waiter this close to its deadline goes anyway
        return ok or (head_deadline is not None and r.grace is not None and head_deadline - now <= r.grace)

    def granted(self, cls: int, now: float, inflight: Sequence[int], limit: int) -> None:
        if self.remedy.prefill_k is not None:
            self.backlog += MEAN_PROMPT  # until routed (the grant loop may grant several at once)
        if self.free_pass(inflight, limit):
            return
        if self.remedy.ramp_burst is not None:
            self.tokens -= 1
        if cls > 0:
            self.prefilling += 1

    def released(self, now: float) -> None:
        if self.remedy.ramp_burst is not None:
            self.refill(now)
            self.tokens = min(self.params()[0], self.tokens + 1)


@dataclass
class Result:
    remedy: str
    limit: int
    p0_ttft_p99_burst_s: float
    p0_ttft_p99_after2_s: float
    p0_queue_p99_burst_s: float
    goodput_burst_tok_s: float
    rejected_burst: dict[int, int] = field(default_factory=dict)
    timeouts_burst: dict[int, int] = field(default_factory=dict)
    p0_sparse_p99_s: float = 0.0
    p0_burst_ttft: list[float] = field(default_factory=list)
    p1_burst_ok: int = 0
    limit_burst: float = 0.0  # time-weighted mean limit in the burst (static: the limit)
    limit_sparse: float = 0.0  # ... in the sparse-P0 phase
    limit_trace: list[tuple[float, int, int]] = field(default_factory=list)  # (t, limit, in-flight)
    limit_recovery: float = 0.0  # ... in the recovery phase
    sparse_goodput_tok_s: float = 0.0  # output tokens/s of sparse-phase arrivals within the SLO
    sparse_over_tpot: int = 0  # sparse-phase arrivals admitted whose TPOT was over the SLO
    sparse_admitted: int = 0


def run(w: Any, capacity_rps: float, limit: int, remedy: Remedy, *, seed: int = 0,
        slo_ttft: float = 2.0, slo_tpot: float = 0.1,
        limit_steps: Sequence[tuple[float, int]] = (), vegas: PoolConfig | None = None) -> Result:
    """`limit_steps`: (time, new limit) — the limit set at those times (a Vegas-like climb).
    `vegas`: the limit is that pool's (`limit_for`, shipped `LimitConfig` unless told otherwise),
    starting at its `initial` (not `limit`), fed as the processor feeds it: every finished
    request in a window, `sample_rate` of them with their latency from admission (at most
    `max_sampled` measured at once), the peak in-flight the processor last saw."""
    import numpy as np
    from floodgate.bench.overload import build_plan
    from floodgate.sim.engine import Engine

    rng = random.Random(seed)
    vrng = random.Random(seed * 31 + 7)
    plan = build_plan(w, capacity_rps)
    lim = limit_for(vegas) if vegas is not None else None
    vstate = lim.initial(vegas.limit.initial) if lim is not None and vegas is not None else None
    if vegas is not None:
        limit = vegas.limit.initial
    sampled: set[int] = set()
    limit_trace: list[tuple[float, int, int]] = []
    pool = PoolConfig()
    classes = pool.classes
    adm = AdmissionConfig()
    gate = Gate(remedy, tokens=math.inf)
    shares = tuple(classes[k].share for k in CLASSES)
    headroom = tuple(classes[k].headroom for k in CLASSES)
    if remedy.shipped is not None:
        table = PermitTable(limit=limit, shares=shares, headroom=headroom,  # type: ignore[arg-type]
                            ramp_burst=remedy.shipped[0], ramp_rate=remedy.shipped[1],
                            ramp_min_rate=RAMP_MIN_RATE_S, ramp_min_burst=remedy.ramp_min_burst)
    else:
        ramp: dict[str, Any] = dict(ramp_burst=_SHIPPED[0], ramp_rate=_SHIPPED[1], ramp_min_rate=RAMP_MIN_RATE_S,
                                    ramp_min_burst=remedy.ramp_min_burst) if remedy.ramp_too else {}
        table = PermitTable(limit=limit, shares=shares, headroom=headroom, pacer=gate, **ramp)  # type: ignore[arg-type]
    ecfg = w.engine_config()
    if remedy.p0_first:  # vLLM's --scheduling-policy priority, P0 sent with priority -1
        ecfg = replace(ecfg, scheduling_policy="priority")
    engines = [Engine(ecfg) for _ in range(w.replicas)]
    from floodgate.bench.p0_bound import prefill_backlog
    gate.replicas = len(engines)
    gate.engine_backlog = lambda least: (min(prefill_backlog(e) for e in engines) if least
                                         else gate._pool([prefill_backlog(e) for e in engines]))
    active = [0] * len(engines)
    where: dict[int, int] = {}
    released = DecayingRate()
    level = DecayingMean()
    now = 0.0
    gate.release_rate = lambda: released.read(now)
    arrivals = [DecayingRate(tau=ARRIVAL_TAU_S) for _ in CLASSES]
    arrivals_fast = [DecayingRate(tau=ARRIVAL_FAST_TAU_S) for _ in CLASSES]
    grants = [DecayingRate(), DecayingRate(), DecayingRate()]
    admitted_at: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    count: dict[int, int] = {}
    outcome: dict[int, str] = {}
    deadline: dict[int, float] = {}
    events: list[tuple[float, int, int]] = []  # (time, kind, index): kind 1 deadline, 2 arrival
    for i, r in enumerate(plan):
        heapq.heappush(events, (r.t_offset, 2, i))
    sizes: list[float] = []
    if remedy.body_bytes_per_token > 0:
        import json

        from floodgate.extproc.prefill import MAX_REQUEST_TOKENS, prompt_tokens
        from floodgate.sim.loadgen import request_body

        # the bench's requests: completions API, the emulator's model name, ids in arrival order
        sizes = [prompt_tokens([str(len(json.dumps(request_body(r, i, "floodgate-sim-8b", "completions")[1])))],
                               None, bytes_per_token=remedy.body_bytes_per_token, default=MEAN_PROMPT,
                               max_tokens=MAX_REQUEST_TOKENS) for i, r in enumerate(plan)]

    def route(i: int, now: float) -> None:
        r = plan[i]
        if remedy.per_replica and remedy.prefill_rate > 0:
            gate.prefill_level(now)
            k = min(range(len(engines)), key=lambda j: (gate.est[j], active[j]))
        elif remedy.per_replica:
            k = min(range(len(engines)), key=lambda j: (prefill_backlog(engines[j]), active[j]))
        elif remedy.p0_pick and r.priority == 0:
            def work(e: Engine) -> int:
                return sum(s.num_tokens - s.num_computed for s in e.waiting) + sum(
                    max(0, s.prompt_tokens - s.num_computed) for s in e.running)
            k = min(range(len(engines)), key=lambda j: work(engines[j]))
        else:  # Envoy LEAST_REQUEST: two random choices (with replacement), fewer active wins
            a, b = rng.randrange(len(engines)), rng.randrange(len(engines))
            k = a if active[a] <= active[b] else b
        e = engines[k]
        e.add_request(str(i), r.prompt_tokens, r.output_tokens, now,
                      priority=-1 if remedy.p0_first and r.priority == 0 else 0)
        gate.admitted(sizes[i] if sizes else r.prompt_tokens, now, k)
        if remedy.prefill_k is not None and remedy.prefill_rate <= 0:
            gate.backlog = max(0.0, gate.backlog - MEAN_PROMPT)  # now in the engines' own backlog
        active[k] += 1
        where[i] = k

    def granted(tickets: list[str], now: float) -> None:
        for t in tickets:
            i = int(t)
            admitted_at[i] = now
            outcome[i] = "admitted"
            grants[plan[i].priority].bump(now)
            if vegas is not None and sample_request(vrng.random(), vegas.limit.sample_rate, len(sampled),
                                                    vegas.limit.max_sampled):
                sampled.add(i)
            route(i, now)

    def feed(i: int, now: float) -> list[str]:
        """A finished request's outcome to the Vegas limit (as Admitter.finish); the grants a
        new limit makes."""
        nonlocal vstate
        if lim is None or vstate is None:
            return []
        rtt = None
        if i in sampled:
            sampled.discard(i)
            n = count[i]
            tpot = (last[i] - first[i]) / (n - 1) if n > 1 else None
            assert vegas is not None
            rtt = Latency(first[i] - admitted_at[i], tpot).signal(vegas.limit.signal)
        sample = lim.record(now, "success", rtt, sum(table.inflight()), admitted_at[i])
        if sample is None:
            return []
        new = lim.update(vstate, sample, vrng.random())
        old, vstate = int(vstate.limit), new
        if max(1, int(new.limit)) == max(1, old):
            return []
        lim.limit_changed(now)
        limit_trace.append((now, int(new.limit), sum(table.inflight())))
        return table.set_limit(max(1, int(new.limit)), now)

    steps = sorted(limit_steps)
    while True:
        nexts = [t for t in (e.next_event_time() for e in engines) if t is not None]
        cand = nexts + ([events[0][0]] if events else []) + ([steps[0][0]] if steps else [])
        if not cand:
            break
        now = max(now, min(cand))
        while steps and steps[0][0] <= now:
            granted(table.set_limit(steps.pop(0)[1], now), now)
        for k, e in enumerate(engines):
            for ev in e.advance(now):
                i = int(ev.seq.request_id)
                if i not in first:
                    first[i] = ev.time
                    if plan[i].priority > 0:
                        gate.prefilling -= 1
                last[i] = ev.time
                count[i] = ev.index + 1
                if ev.finished:
                    active[k] -= 1
                    level.add(now, sum(table.inflight()))
                    released.bump(now)
                    gate.released(now)
                    granted(table.release_many([str(i)], now)[1], now)
                    granted(feed(i, now), now)
        while events and events[0][0] <= now:
            _, kind, i = heapq.heappop(events)
            r = plan[i]
            if kind == 1:
                if str(i) not in table.leases and outcome.get(i) == "queued":
                    table.cancel(str(i))
                    outcome[i] = "queue_timeout"
                continue
            arrivals[r.priority].bump(now)
            arrivals_fast[r.priority].bump(now)
            ok, _, woken = table.acquire(str(i), r.priority, now)
            granted(woken, now)
            if ok:
                granted([str(i)], now)
                continue
            snap = table.snapshot(
                r.priority, r.tenant, released.read(now), now=now, release_n=released.n, inflight_avg=level.value,
                arrival_rates=(arrivals[0].read(now), arrivals[1].read(now), arrivals[2].read(now)),
                arrival_rates_fast=(arrivals_fast[0].read(now), arrivals_fast[1].read(now),
                                    arrivals_fast[2].read(now)),
                class_rates=(grants[0].read(now), grants[1].read(now), grants[2].read(now)))
            d = queue_decision(r.priority, snap, classes, adm, rand=rng.random())
            if isinstance(d, Reject):
                outcome[i] = d.reason
                continue
            outcome[i] = "queued"
            deadline[i] = now + classes[r.priority].queue_timeout_s
            heapq.heappush(events, (deadline[i], 1, i))
            _, got = table.enqueue(str(i), r.priority, r.tenant, deadline[i], now)
            granted(got, now)
        # tokens accrue with time: let a paced waiter go when the bucket allows (the real
        # grant loop runs on every arrival, release and poll)
        granted(table.mine([], now)[1], now)
    win = w.windows()
    a, b = win["burst"]
    p0_ttft, p0_after, p0_q = [], [], []
    good = 0
    rej: dict[int, int] = {0: 0, 1: 0, 2: 0}
    tmo: dict[int, int] = {0: 0, 1: 0, 2: 0}

    def tpot_of(i: int) -> float:  # seconds per output token after the first
        n = count[i]
        return (last[i] - first[i]) / (n - 1) if n > 1 else 0.0

    for i, r in enumerate(plan):
        if not a <= r.t_offset < b:
            continue
        if outcome.get(i) != "admitted":
            rej[r.priority] += 1
            if outcome.get(i) == "queue_timeout":
                tmo[r.priority] += 1
            continue
        ttft = first[i] - r.t_offset
        if r.priority == 0:
            p0_ttft.append(ttft)
            p0_q.append(admitted_at[i] - r.t_offset)
            if r.t_offset >= a + 2:
                p0_after.append(ttft)
        if ttft <= slo_ttft and tpot_of(i) <= slo_tpot:
            good += count[i]
    sa, sb = win["sparse-p0"]
    sparse_good = sparse_over = sparse_adm = 0
    for i, r in enumerate(plan):
        if sa <= r.t_offset < sb and outcome.get(i) == "admitted" and i in first:
            sparse_adm += 1
            tpot = tpot_of(i)
            sparse_over += tpot > slo_tpot
            if first[i] - r.t_offset <= slo_ttft and tpot <= slo_tpot:
                sparse_good += count[i]
    sparse = [first[i] - r.t_offset for i, r in enumerate(plan)
              if r.priority == 0 and sa <= r.t_offset < sb and i in first]
    pct = lambda v: float(np.percentile(v, 99)) if v else math.nan  # noqa: E731
    p1_ok = sum(1 for i, r in enumerate(plan) if a <= r.t_offset < b and r.priority == 1
                and outcome.get(i) == "admitted")
    def mean_limit(lo: float, hi: float) -> float:
        """Time-weighted mean of the limit over [lo, hi)."""
        if not limit_trace:
            return float(limit)
        pts = [(0.0, vegas.limit.initial if vegas is not None else limit)] + [(t, v) for t, v, _ in limit_trace]
        total = 0.0
        for k, (t0, v) in enumerate(pts):
            t1 = pts[k + 1][0] if k + 1 < len(pts) else math.inf
            total += v * max(0.0, min(hi, t1) - max(lo, t0))
        return total / (hi - lo)

    return Result(remedy.name, limit, pct(p0_ttft), pct(p0_after), pct(p0_q), good / (b - a), rej, tmo,
                  pct(sparse), p0_ttft, p1_ok, mean_limit(a, b), mean_limit(sa, sb), limit_trace,
                  mean_limit(*win["recovery"]), sparse_good / (sb - sa), sparse_over, sparse_adm)


_SHIPPED = (PoolConfig().onset_ramp_burst, PoolConfig().onset_ramp_rate)
REMEDIES = (
    Remedy(),
    Remedy("shipped-ramp", shipped=_SHIPPED),
    Remedy("ramp-bucket-4", shipped=(0.03, _SHIPPED[1]), ramp_min_burst=4.0),
    Remedy("ramp-bucket-2", shipped=(0.0, _SHIPPED[1]), ramp_min_burst=2.0),
    Remedy("p0first", p0_first=True),
    Remedy("ramp+p0first", shipped=_SHIPPED, p0_first=True),
    Remedy("p0pick", p0_pick=True),
    Remedy("prefill-4", prefill_cap=4),
    Remedy("prefill-8", prefill_cap=8),
    Remedy("prefill-16", prefill_cap=16),
    Remedy("backlog-0", prefill_k=0),
    Remedy("backlog-1024", prefill_k=1024),
    Remedy("backlog-2048", prefill_k=2048),
    Remedy("backlog-4096", prefill_k=4096),
    Remedy("pick-backlog-0", prefill_k=0, per_replica=True),
    Remedy("pick-backlog-512", prefill_k=512, per_replica=True),
    Remedy("pick-backlog-1024", prefill_k=1024, per_replica=True),
    Remedy("pick-backlog-inf", prefill_k=math.inf, per_replica=True),
    Remedy("pick-est-0@6k", prefill_k=0, prefill_rate=6000, per_replica=True),
    Remedy("pick-est-512@6k", prefill_k=512, prefill_rate=6000, per_replica=True),
    Remedy("pick-est-512@7k", prefill_k=512, prefill_rate=7000, per_replica=True),
    Remedy("pick-est-512@5k", prefill_k=512, prefill_rate=5000, per_replica=True),
    Remedy("pick-est-1024@6k", prefill_k=1024, prefill_rate=6000, per_replica=True),
    Remedy("pick-estn-512@6k", prefill_k=512, prefill_rate=6000, per_replica=True, unit_size=True),
    Remedy("pick-estn-512@6k+ramp", prefill_k=512, prefill_rate=6000, per_replica=True, unit_size=True,
           ramp_too=True),
    Remedy("pick-est-512@6k+ramp", prefill_k=512, prefill_rate=6000, per_replica=True, ramp_too=True),
    # what ships: each request's content-length / 4 (extproc.prefill.prompt_tokens), with the ramp
    Remedy("pick-cl4-512@6k+ramp", prefill_k=512, prefill_rate=6000, per_replica=True, ramp_too=True,
           body_bytes_per_token=4.0),
    Remedy("pick-cl6-512@6k+ramp", prefill_k=512, prefill_rate=6000, per_replica=True, ramp_too=True,
           body_bytes_per_token=6.0),
    Remedy("pick-cl5-512@6k+ramp", prefill_k=512, prefill_rate=6000, per_replica=True, ramp_too=True,
           body_bytes_per_token=5.0),
    Remedy("pick-cl8-512@6k+ramp", prefill_k=512, prefill_rate=6000, per_replica=True, ramp_too=True,
           body_bytes_per_token=8.0),
    Remedy("pick-estn-512@7.5k+ramp", prefill_k=512, prefill_rate=7500, per_replica=True, unit_size=True,
           ramp_too=True),
    Remedy("max-backlog-512", prefill_k=512, pool_max=True),
    Remedy("max-backlog-1024", prefill_k=1024, pool_max=True),
    Remedy("max-est-512@6k", prefill_k=512, prefill_rate=6000, pool_max=True),
    Remedy("max-est-1024@6k", prefill_k=1024, prefill_rate=6000, pool_max=True),
    Remedy("est-1024@6k", prefill_k=1024, prefill_rate=6000),
    Remedy("est-2048@6k", prefill_k=2048, prefill_rate=6000),
    Remedy("est-2048@7k", prefill_k=2048, prefill_rate=7000),
    Remedy("est-4096@6k", prefill_k=4096, prefill_rate=6000),
    Remedy("estn-1024@6k", prefill_k=1024, prefill_rate=6000, unit_size=True),
    Remedy("estn-2048@6k", prefill_k=2048, prefill_rate=6000, unit_size=True),
    Remedy("pool-est-1024@6k", prefill_k=1024, prefill_rate=6000, pooled=True),
    Remedy("pool-est-2048@6k", prefill_k=2048, prefill_rate=6000, pooled=True),
    Remedy("pool-estn-1024@6k", prefill_k=1024, prefill_rate=6000, pooled=True, unit_size=True),
    Remedy("pool-estn-2048@6k", prefill_k=2048, prefill_rate=6000, pooled=True, unit_size=True),
    Remedy("ramp-8+10/s", ramp_burst=8, ramp_rate=10),
    Remedy("ramp-8+20/s", ramp_burst=8, ramp_rate=20),
    Remedy("ramp-16+20/s", ramp_burst=16, ramp_rate=20),
    Remedy("ramp-16+40/s", ramp_burst=16, ramp_rate=40),
)


def main(argv: list[str] | None = None) -> None:
    from floodgate.bench.overload import Workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, nargs="+", default=[96, 115])
    ap.add_argument("--capacity", type=float, default=19.1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--mix", type=float, nargs=3, default=None)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--vegas-steps", action="store_true",
                    help="the limit climbs as Vegas did in the overload bench's burst: +12 (6 lg at a "
                         "limit of 100+) every 2 s from 1 s into the burst, 4 times, from each --limit")
    ap.add_argument("--vegas", nargs="?", const="{}", default=None, metavar="JSON",
                    help="the limit is the shipped Vegas (from limit.initial), fed as the processor feeds it; "
                         "JSON: LimitConfig fields to override, e.g. '{\"slo_target\": 0.5}' (--limit is ignored)")
    ap.add_argument("--trace", action="store_true", help="with --vegas: print each limit change")
    args = ap.parse_args(argv)
    vegas = None
    if args.vegas is not None:
        import json

        from floodgate.extproc.config import LimitConfig
        from pydantic import ValidationError

        from floodgate.yamlconfig import format_errors

        # Validated, as the processor would: model_copy(update=...) took a mistyped field
        # ('{"slo_targt": 0.5}') silently and ran the shipped value (a docs review).
        base = PoolConfig()
        try:
            update = json.loads(args.vegas)
        except ValueError as exc:
            ap.error(f"--vegas: not JSON: {exc}")
        if not isinstance(update, dict):
            ap.error("--vegas: expected a JSON object of LimitConfig fields")
        try:
            limit = LimitConfig.model_validate({**base.limit.model_dump(), **update})
        except ValidationError as exc:
            ap.error(f"--vegas: {format_errors(exc, 'invalid LimitConfig')}")
        vegas = base.model_copy(update={"limit": limit})
        args.limit = [vegas.limit.initial]
    print("| remedy | limit | seed | P0 TTFT p99 burst ms | after 2 s | P0 queue p99 ms | burst goodput tok/s | "
          "rejected P0/P1/P2 (timeouts) | sparse P0 p99 ms | limit burst / recovery / sparse | "
          "sparse goodput tok/s | sparse TPOT > SLO (of admitted) |")
    for seed in args.seeds:
        w = Workload(seed=seed) if args.mix is None else Workload(seed=seed, priority_shares=tuple(args.mix))
        for limit in args.limit:
            for rem in REMEDIES:
                if args.only and rem.name not in args.only:
                    continue
                steps: list[tuple[float, int]] = []
                if args.vegas_steps:
                    start = w.windows()["burst"][0]
                    steps = [(start + 1.0 + 2.0 * k, limit + 12 * (k + 1)) for k in range(4)]
                r = run(w, args.capacity, limit, rem, seed=seed, limit_steps=steps, vegas=vegas)
                if args.trace:
                    for t, v, n in r.limit_trace:
                        print(f"  t={t:6.1f} limit {v:4d} in flight {n:4d}")
                print(f"| {r.remedy} | {limit} | {seed} | {r.p0_ttft_p99_burst_s * 1000:.0f} | "
                      f"{r.p0_ttft_p99_after2_s * 1000:.0f} | {r.p0_queue_p99_burst_s * 1000:.0f} | "
                      f"{r.goodput_burst_tok_s:.0f} | "
                      + "/".join(f"{r.rejected_burst[k]}({r.timeouts_burst[k]})" for k in CLASSES)
                      + f" | {r.p0_sparse_p99_s * 1000:.0f} | {r.limit_burst:.0f} / {r.limit_recovery:.0f} / "
                      f"{r.limit_sparse:.0f} | {r.sparse_goodput_tok_s:.0f} | {r.sparse_over_tpot} ({r.sparse_admitted}) |",
                      flush=True)


if __name__ == "__main__":
    main()
