"""Concurrency limits (pure), in the shape of Netflix concurrency-limits.

A `Limit` maps the shared limiter state and one `Sample` to the next state; it does no I/O
and reads no clock, so the same function runs against the state held in Redis (read,
update, compare-and-set) and in the local fallback. `FixedLimit` holds a configured value;
`VegasLimit` (vegas.py) adapts to latency. `WindowedLimit` is the decorator that aggregates
per-request outcomes into window samples (Netflix `WindowedLimit`), and `limit_for` builds
the pool's limit from its configuration — the one place that reads `limit.mode`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from floodgate.extproc.config import PoolConfig

Outcome = Literal["success", "dropped", "ignored"]


COMBINED_TOKENS = 32  # the `combined` signal: time to the 32nd token (TTFT + 31 x TPOT)


@dataclass(frozen=True)
class Latency:
    """What was measured of one request: time to first token after admission and the request
    body's end (`LatencyMeter.uploaded`), and mean time per output token (None with fewer than
    two tokens) — of a streamed (SSE) response.

    A whole (non-streamed JSON) response has no first token to time: `ttft` and `tpot` are None,
    and `whole` (admission to the body's end) and `tokens` (its `usage.completion_tokens`) say
    what there is. Its time per token, `whole / tokens`, stands in for TPOT, and 32 of them for
    the time to the 32nd token (`combined`): TTFT + (n - 1) TPOT spread over n tokens, which
    for n >= 32 weighs TTFT at 32/n of its share (a few percent at the bench's TTFT/TPOT); a
    shorter answer is not used, since its time is mostly TTFT and 32 x TTFT would read as
    congestion. No TTFT signal comes from a whole response."""

    ttft: float | None
    tpot: float | None
    whole: float | None = None
    tokens: int = 0

    def signal(self, name: str) -> float | None:
        if self.ttft is None:
            if self.whole is None or self.tokens < COMBINED_TOKENS or name == "ttft":
                return None
            per_token = self.whole / self.tokens
            return per_token if name == "tpot" else COMBINED_TOKENS * per_token
        if name == "ttft":
            return self.ttft
        if self.tpot is None:
            return None
        return self.tpot if name == "tpot" else self.ttft + (COMBINED_TOKENS - 1) * self.tpot


def sse_tokens(chunk: bytes) -> int:
    """Tokens in a piece of an OpenAI-style SSE response: its `data:` events, less the final
    usage event (`"choices":[]`) and `[DONE]`; of the Responses API (`/v1/responses`) only the
    `response.*.delta` events, told by their `event:` line or, without one, by the `type` that
    ends their data (vLLM and OpenAI write it last) — that stream opens with `response.created`
    and `response.in_progress` before any token, which counted as the first token read a TTFT
    of about 0. An engine (and Envoy) may put several tokens into one chunk, so chunks are not
    tokens."""
    n = 0
    event = b""
    for line in chunk.split(b"\n"):
        if line.startswith(b"event:"):
            event = line[6:].strip()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
            kind = event if event.startswith(b"response.") else _responses_type(data)
            if kind:
                n += kind.endswith(b".delta")
            elif data != b"[DONE]" and b'"choices":[]' not in data:
                n += 1
        elif not line.strip():
            event = b""  # a blank line ends the event
    return n


def _responses_type(data: bytes) -> bytes:
    m = _RESPONSES_TYPE.search(data, max(0, len(data) - 80))
    return m.group(1) if m else b""


# A Responses API event's data ends with its type: {..., "type":"response.output_text.delta"}
_RESPONSES_TYPE = re.compile(rb'"type"\s*:\s*"(response\.[a-z_.]+)"\s*\}\s*$')


@dataclass
class LatencyMeter:
    """The latency of one sampled response, from its body chunks as the processor receives them
    (pure: `now` is passed in).

    TTFT is the first chunk after the request's body has all arrived (`uploaded`; admission for
    a request whose body end is not seen). TPOT is the time from the first chunk to the last
    one over the tokens that came *after* the first chunk: a chunk may carry several tokens (the
    engine writes the tokens of one step together, Envoy may join chunks), so dividing by every
    token but one undercounts the time per token, and a response whose tokens all came in one
    chunk has no measurable TPOT at all (None). It used to read 0 there, and the `combined`
    signal of a short answer (2 tokens in one chunk) was then its TTFT alone: in the overload
    bench's sparse phase such answers (the P2 probe's, 2 tokens) gave windows at 1.7–2.5 s among
    3.0–4.5 s ones, each raising the limit by 6·lg, and Vegas climbed to ~230 (static-96: 96)."""

    admitted_at: float
    # When the request's body had all arrived (`uploaded`), if after admission: the model server
    # starts no work before it has the body, so the client's upload is not the servers' latency.
    sent_at: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    later_tokens: int = 0
    whole: bool | None = None  # a JSON body (not SSE), told by its first byte; None: no body yet
    tail: bytes = b""  # a JSON body's last WHOLE_TAIL bytes, where `usage` is
    # A choice index above 0 was seen (`n` > 1). The engine writes one event per choice per
    # step and counts every choice's tokens in `usage`, so any client's `n: 64` read a time per
    # token 64 times too short, enough to drag the pool's no-load latency down and the shared
    # limit with it (an attacker review); divided by the choices, choices that end at different
    # lengths read it up to 5x too long instead (a review of that fix). Such a response gives no
    # latency sample: it counts as finished.
    several_choices: bool = False

    def uploaded(self, now: float) -> None:
        """The request's body has all arrived (`now`): TTFT, and a whole response's time, count
        from here, not from admission. Timed from admission, a client that took 2 s to send its
        body read a TTFT of 2 s on a server answering in 10 ms (a review: two such clients beside
        ten quick ones took the mean TTFT from 0.011 s to 0.047 s), inflating the latency Vegas
        sizes every class's limit by. A body end after the response began says nothing more."""
        if self.first_at is None and self.whole is None and self.sent_at is None:
            self.sent_at = max(now, self.admitted_at)

    @property
    def started_at(self) -> float:
        """Where the response's latency counts from: the body's end, else admission."""
        return self.admitted_at if self.sent_at is None else self.sent_at

    def chunk(self, now: float, data: bytes) -> None:
        if self.whole is None and data.strip():
            self.whole = data.lstrip()[:1] == b"{"
        if not self.several_choices and b'"index"' in data:
            self.several_choices = any(int(m.group(1)) > 0 for m in _CHOICE_INDEX.finditer(data))
        if self.whole:
            self.tail = (self.tail + data)[-WHOLE_TAIL:]
            self.last_at = now
            return
        n = sse_tokens(data)
        if n > 0:
            if self.first_at is None:
                self.first_at = now
            else:
                self.later_tokens += n
                self.last_at = now

    def latency(self) -> Latency | None:
        if self.several_choices:
            return None
        if self.whole:
            found = _COMPLETION_TOKENS.findall(self.tail)
            if not found or self.last_at is None:
                return None
            return Latency(None, None, whole=self.last_at - self.started_at, tokens=int(found[-1]))
        if self.first_at is None:
            return None
        tpot = None
        if self.later_tokens > 0 and self.last_at is not None:
            tpot = (self.last_at - self.first_at) / self.later_tokens
        return Latency(self.first_at - self.started_at, tpot)


# A choice object of a completion (`text`), chat chunk (`delta`) or chat response (`message`):
# its index comes first (vLLM and OpenAI write it so); a tool call's index is followed by others.
_CHOICE_INDEX = re.compile(rb'\{\s*"index"\s*:\s*(\d{1,6})\s*,\s*"(?:text|delta|message)"')

# A whole response's token count: OpenAI's `usage.completion_tokens`, which vLLM writes after the
# choices, at the body's end (with the prompt token details and kv_transfer_params after it).
WHOLE_TAIL = 2048
_COMPLETION_TOKENS = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d{1,9})')  # (Responses API: output_tokens)


def sample_request(rand: float, rate: float, streaming: int, cap: int) -> bool:
    """Should an admitted request stream its response body to measure its latency? With
    probability `rate`, unless `cap` (> 0) sampled requests already stream: a sampled request
    costs one ext_proc message per response chunk, so messages per second are the sampled
    requests in flight over the time per token. Bounding how many stream at once bounds that
    cost whatever the limit climbs to; the windows still fill, from finished requests that
    stream one after another instead of all at once."""
    if cap > 0 and streaming >= cap:
        return False
    return rand < rate


@dataclass(frozen=True)
class LimitState:
    """The limiter state shared by every processor of a pool (stored in Redis)."""

    limit: float
    rtt_noload: float = 0.0  # 0 = not measured yet
    probe_count: int = 0
    probe_jitter: float = 1.0  # in [0.5, 1)
    noload_inflight: int = 0  # peak in-flight of the window that set rtt_noload
    epoch_rtt: float = 0.0  # lowest rtt since the last probe among low in-flight windows (0 = none)
    epoch_inflight: int = 0
    endpoints: int = 0  # active endpoints the limit was sized for (0 = not known; follow_endpoints)


@dataclass(frozen=True)
class Sample:
    """One window's aggregate: mean rtt (seconds, 0 = none measured), peak in-flight seen, and
    the share of its finished requests that were drops (upstream 5xx)."""

    rtt: float
    inflight: int
    dropped: bool = False
    drop_share: float = 0.0  # 0..1; a sample with `dropped` and no share counts as all drops
    # False: some measured request was admitted before the limit last changed, so the sample
    # does not show the current limit's latency and may not raise it (WindowedLimit).
    fresh: bool = True

    @property
    def drops(self) -> float:
        if not self.dropped:
            return 0.0
        return self.drop_share if self.drop_share > 0 else 1.0


class Limit(Protocol):
    @property
    def adaptive(self) -> bool:
        """False: the limit never moves, so latency need not be measured."""
        ...

    def initial(self, limit: int) -> LimitState: ...

    def update(self, state: LimitState, sample: Sample, rand: float) -> LimitState:
        """`rand` in [0, 1) for any randomness (passed in to keep this pure)."""
        ...


@dataclass(frozen=True)
class FixedLimit:
    limit: int

    @property
    def adaptive(self) -> bool:
        return False

    def initial(self, limit: int) -> LimitState:
        return LimitState(limit=float(self.limit))

    def update(self, state: LimitState, sample: Sample, rand: float) -> LimitState:
        return state if state.limit == self.limit else LimitState(limit=float(self.limit))


@dataclass
class SampleWindow:
    """Aggregates per-request outcomes into one sample (Netflix WindowedLimit).

    Every finished request counts (success or drop), whether or not its latency was measured,
    so the drop share is not skewed by sampling. A window closes when it has `min_samples`
    finished requests (at least one measured or dropped) and is at least `min_duration` old —
    as Netflix's, where every request is a sample: with `sample_rate` 0.5, counting only the
    measured ones would halve how fast the limit follows the load — or when it is
    `max_duration` old with at least one, so a quiet pool still learns.
    """

    min_samples: int = 10
    min_duration: float = 1.0
    max_duration: float = 10.0
    started: float | None = None
    count: int = 0  # measured latencies
    ok: int = 0  # successful requests (measured or not)
    rtt_sum: float = 0.0
    max_inflight: int = 0
    drops: int = 0
    stale: int = 0  # measured requests admitted before the limit last changed

    @property
    def dropped(self) -> bool:
        return self.drops > 0

    def add(self, now: float, rtt: float | None, inflight: int, dropped: bool = False, stale: bool = False) -> None:
        if self.started is None:
            self.started = now
        if dropped:
            self.drops += 1
        else:
            self.ok += 1
            if rtt is not None and rtt > 0:
                self.count += 1
                self.rtt_sum += rtt
                self.stale += stale
        self.max_inflight = max(self.max_inflight, inflight)

    def ready(self, now: float) -> bool:
        if self.started is None:
            return False
        age = now - self.started
        has_any = self.count > 0 or self.dropped
        return (has_any and self.ok + self.drops >= self.min_samples and age >= self.min_duration) or (
            has_any and age >= self.max_duration)

    def take(self) -> Sample | None:
        """Close the window and return its sample (None if it holds nothing usable)."""
        sample: Sample | None = None
        if self.count or self.drops:
            rtt = self.rtt_sum / self.count if self.count else 0.0
            share = self.drops / max(1, self.drops + self.ok)
            sample = Sample(rtt=rtt, inflight=self.max_inflight, dropped=self.drops > 0, drop_share=share,
                            fresh=self.stale == 0)
        self.started, self.count, self.ok, self.rtt_sum, self.max_inflight, self.drops = None, 0, 0, 0.0, 0, 0
        self.stale = 0
        return sample


@dataclass
class WindowedLimit:
    """A `Limit` fed per request: outcomes go into a window, each closed window updates the
    delegate. `record` returns the sample to apply (the caller applies it to the shared state
    with `update`), or None while the window is open.

    `fresh_only` (`limit.rise_once_per_rtt`, floodgate flavor; off by default): raise the
    limit only on evidence about it. A request
    admitted before the limit last changed (`limit_changed`) ran under the old limit; a
    window holding one (measured) closes as usual — it may lower or hold the limit — but may
    not raise it (`Sample.fresh`), so increases come at most once per round trip, as TCP
    Vegas adjusts once per RTT. Without this, an LLM request's latency arrives seconds after
    its admission (`combined` is the time to its 32nd token) while windows close every
    second, so a burst kept raising the limit by beta per window on the latency of requests
    admitted before the queue inside the engine built up: the elastic bench saw a limit of
    94–136 on four replicas of 8 slots, ~100 requests queued inside replicas that the new
    replicas could not take over."""

    delegate: Limit
    window: SampleWindow
    fresh_only: bool = False
    changed_at: float = -math.inf  # when the shared limit last changed, as this process knows

    @property
    def adaptive(self) -> bool:
        return self.delegate.adaptive

    def initial(self, limit: int) -> LimitState:
        return self.delegate.initial(limit)

    def update(self, state: LimitState, sample: Sample, rand: float) -> LimitState:
        return self.delegate.update(state, sample, rand)

    def limit_changed(self, now: float) -> None:
        """The shared limit changed at `now` (this process's update, another's, or a rescale)."""
        if self.fresh_only:
            self.changed_at = max(self.changed_at, now)

    def record(self, now: float, outcome: Outcome, rtt: float | None, inflight: int,
               admitted_at: float | None = None) -> Sample | None:
        if outcome == "ignored" or not self.adaptive:
            return None
        stale = self.fresh_only and admitted_at is not None and admitted_at < self.changed_at
        self.window.add(now, rtt, inflight, dropped=outcome == "dropped", stale=stale)
        return self.window.take() if self.window.ready(now) else None


def follow_endpoints(state: LimitState, endpoints: int, lo: int, hi: int) -> LimitState:
    """The limit after the pool's active endpoint count became `endpoints`: scaled by
    endpoints / state.endpoints, clamped to [lo, hi].

    The limit is pool-wide and Vegas moves it by at most 6·lg per window (+6 per ~1 s below
    a limit of 100), so without this a pool that grows from 3 to 10 replicas admits at the
    3-replica level for the ~10 windows Vegas needs to grow into the new capacity, and turns
    requests away while that capacity idles; a drained replica's share of the limit would
    likewise stay until latency rises. Each endpoint's share of the limit is what Vegas
    learnt per endpoint so far. No endpoints (nothing to scale from or to) and the first
    count seen only record the count. Idempotent: the same count again changes nothing, so
    every processor may apply it (compare-and-set) and the first one wins."""
    if endpoints <= 0 or endpoints == state.endpoints:
        return state
    if state.endpoints <= 0:
        return replace(state, endpoints=endpoints)
    limit = max(float(lo), min(float(hi), state.limit * endpoints / state.endpoints))
    return replace(state, limit=limit, endpoints=endpoints)


def cap_to_ceiling(state: LimitState, ceiling: float | None, lo: int) -> LimitState:
    """The limit held at or below `ceiling` (the controller's admission ceiling for the pool:
    per-endpoint ceiling x active endpoints; None = no cap), never below `lo`.

    Vegas reads latency, and an LLM engine's latency rises only after requests queue inside
    it; with the latency of requests admitted before the queue built still arriving, a burst
    raised the limit to 154 on 4 replicas of 8 slots (elastic bench, 20:31 UTC run) and ~100
    requests waited in the engines' FIFO queues, where no priority applies and a replica that
    comes up later cannot take them over. Above what the active replicas carry, requests wait
    in Floodgate's priority queue instead (and the turned-away ones are demand the controller
    scales for). Only lowers: below the ceiling Vegas moves the limit as before."""
    if ceiling is None or state.limit <= ceiling:
        return state
    return replace(state, limit=max(float(lo), float(ceiling)))


def lift_ceiling(state: LimitState, per_endpoint: float | None, endpoints: int, lo: int, hi: int) -> LimitState:
    """The limit once the controller's ceiling is taken back: the level per endpoint it had
    when the ceiling first lowered it (`per_endpoint`; None = it never did), times the active
    `endpoints`, clamped to [lo, hi] — unless it is higher already. The ceiling is an override
    while new replicas load, not something Vegas learnt: held near the replicas' capacity the
    limit would also shrink everything sized from it (class shares, the onset ramp's bucket,
    a share of L) once the pool has caught up."""
    if per_endpoint is None or endpoints <= 0:
        return state
    target = max(float(lo), min(float(hi), per_endpoint * endpoints))
    return state if state.limit >= target else replace(state, limit=target)


def writes_shared_limit(own_epoch: int, stored_epoch: int | None) -> bool:
    """May a processor change the pool's shared limit (Vegas samples, following the endpoint
    count, restoring a lost limit), given its own `settings_epoch` and the newest one it has
    seen stored? Not once a newer epoch replaced its settings: the limit is the new epoch's to
    set. An adaptive processor left on the old config went on moving it: a rollout from
    `vegas` to `static` 4 (epoch 1) ran at 10 two seconds after the first new processor set 4
    and at 34 from four seconds on, 14-16 in flight upstream, for as long as an old processor ran (an operator review). A processor
    whose settings differ at the same epoch keeps adapting (a new version whose shipped defaults
    differ leaves every processor so until the epoch is raised)."""
    return stored_epoch is None or stored_epoch <= own_epoch


def limit_for(pool: PoolConfig) -> WindowedLimit:
    """The pool's limit as configured: `static` holds `initial`, `vegas` adapts (vegas.py)."""
    from floodgate.extproc.vegas import VegasLimit

    c = pool.limit
    inner: Limit
    if c.mode == "static":
        inner = FixedLimit(c.initial)
    else:
        inner = VegasLimit(c.min, c.max, c.smoothing, c.probe_multiplier, c.rtt_tolerance, c.flavor,
                           pool.latency_target() if c.flavor == "floodgate" else 0.0,
                           decrease_gain=c.decrease_gain if c.flavor == "floodgate" else 0.0)
    return WindowedLimit(inner, SampleWindow(c.window_min_samples, c.window_s, c.window_max_s),
                         fresh_only=c.mode == "vegas" and c.flavor == "floodgate" and c.rise_once_per_rtt)
