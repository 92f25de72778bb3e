"""Processor configuration: one YAML file, validated by pydantic, with env overrides.

A bad file stops start-up with a message naming the field (`pools.0.limit.min: ...`), never
a traceback. Env overrides (`FLOODGATE_REDIS_URL`, `FLOODGATE_LISTEN`, ...) win over the file,
and CLI flags win over both.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from floodgate.extproc.endpoint_guard import parse_rule
from floodgate.extproc.prefill import BYTES_PER_TOKEN, MAX_REQUEST_TOKENS
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    NonNegativeInt,
    ValidationError,
    field_validator,
    model_validator,
)

from floodgate.validators import (
    ListenAddress,
    OptionalListenAddress,
    RedisURL,
    check_optional_listen,
    listeners_clash,
)
from floodgate.yamlconfig import STRICT, ConfigError, format_errors, name_env_sources, read_mapping

__all__ = ["POOL_NAME_PATTERN", "Config", "ConfigError", "PoolName", "check_pool_name", "load_config"]

PRIORITY_NAMES = ("critical", "standard", "sheddable")
# A priority class: 0 (critical), 1 (standard) or 2 (sheddable).
Priority = Annotated[int, Field(ge=0, le=2)]
# An HTTP header name (RFC 9110 token characters; matched case-insensitively).
HeaderName = Annotated[str, Field(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")]
# A pool name, the one rule for the processor's and the controller's configs: it is the Redis
# hash tag of all the pool's keys (`fg:{pool}:…`), so no braces (nor anything else odd).
POOL_NAME_PATTERN = r"^[A-Za-z0-9_.-]+$"


def check_pool_name(name: str) -> str:
    if not re.fullmatch(POOL_NAME_PATTERN, name):
        raise ValueError(f"{name!r} is not a pool name: use letters, digits, '_', '.' and '-' only "
                         "(it is the hash tag of the pool's Redis keys)")
    return name


PoolName = Annotated[str, AfterValidator(check_pool_name)]


class _Strict(BaseModel):
    model_config = STRICT


# `slo_reject_s` is a p99 target: a class that has one waits only when 99 % sure to be served.
REJECT_SLO_QUANTILE = 0.99


# OpenAI-compatible routes where vLLM runs the model (an `unadmitted_paths` entry among these
# turns admission off for them: `PoolConfig.class_warnings`).
MODEL_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
                         "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/score", "/v1/rerank",
                         "/v2/rerank", "/rerank", "/score", "/pooling", "/classify", "/invocations"})


class ClassConfig(_Strict):
    """Per-priority-class admission settings, derived from the class's SLO unless overridden."""

    slo_ttft_s: float = Field(default=2.0, gt=0, le=600, description="Time-to-first-token target of this class, queue wait included (the queue timeout and early drop derive from it).")
    slo_tpot_s: float = Field(default=0.1, gt=0, le=60, description="Time-per-output-token target of this class (the Vegas limit aims below the strictest class's, see `limit.slo_target`).")
    queue_wait_slo_share: float = Field(default=0.75, gt=0, le=100, description="Longest queue wait as a multiple of `slo_ttft_s` when `queue_timeout_s` is not set (< 1 leaves the rest of the TTFT target for prefill; > 1 for a class that should rather wait than fail).")
    queue_timeout_s: float = Field(default=0.0, ge=0, le=600, description="Longest a request of this class waits in the queue before 429 (0 = `queue_wait_slo_share` x `slo_ttft_s`).")
    max_queue: int = Field(ge=0, description="Queue length of this class beyond which new requests are rejected at once (queue_full).")
    slo_reject_s: float = Field(default=0.0, ge=0, le=600, description="Time-to-429 target of this class at p99 (0 = none: a rejection may come at the queue timeout). Below `queue_timeout_s` it says the class would rather be told at once than wait and then fail (a request that times out misses it): a request of this class then waits only when the grant loop reaches it in time with 99 % chance (`early_drop_min_chance` derives 0.99) at the rates' pessimistic bounds, and is turned away at once otherwise, also while the rates rest on too few releases to tell (docs/admission.md, early drop).")
    early_drop_min_chance: float = Field(default=0.5, ge=0, le=1, description="Early drop turns a request of this class away at once when the chance that the grant loop reaches it before its queue timeout (releases as a Poisson process at the measured rates' upper bound, higher classes' arrivals jumping ahead; the pessimistic bounds for a class with an `slo_reject_s` below its queue timeout) is below this. Lower: fewer requests turned away that would have been served in time; higher: fewer that wait their whole timeout and then get 429 (docs/admission.md has the trade-off curve). Unset: 0.5, or 0.99 (the quantile of `slo_reject_s`) for a class that would rather be told at once.")
    early_drop_counts_arrivals: bool = Field(default=True, description="Early drop counts, ahead of a request of this class, the higher-class requests expected to arrive while it waits (at their measured arrival rates). False: a request is turned away early only when the waiters already queued and the release rate keep the grant loop from reaching it in time. For a class without a reject target that removes the early drops of requests the grant loop would have served in time (the P1s a rate's prediction turned away where fewer higher-class requests came), at a cost: more of its requests wait their whole queue timeout and then get 429, and the ones that wait and are served keep the pool full where a drop left a permit free for the higher class (P0's TTFT p99 in the burst +63 % on the onset model; docs/admission.md, early drop).")
    share: float = Field(ge=0, le=1, description="Share of the limit this class keeps under contention (Netflix partitions).")
    headroom: float = Field(default=0.0, ge=0, le=1, description="Share of the limit that only this class and the classes above it may take: a lower class above its own `share` is admitted only while this many permits stay free. Arrivals of this class then find a free permit at once instead of waiting for a release while lower classes keep the pool full (at the cost of that many permits the lower classes cannot use).")
    tenant_queue_share: float = Field(default=0.5, gt=0, le=1, description="Most of this class's queue one named tenant may hold (tenant_cap).")
    reserve: Literal["when_waiting", "always"] = Field(
        default="when_waiting",
        description="`when_waiting`: other classes may borrow this class's share while it has no waiters (best utilization). `always`: the share stays free for this class (headroom: lower latency for it at the onset of a burst, less throughput for the others).")

    @model_validator(mode="after")
    def _derive_timeout(self) -> ClassConfig:
        if self.queue_timeout_s == 0:
            derived = min(600.0, self.queue_wait_slo_share * self.slo_ttft_s)
            object.__setattr__(self, "queue_timeout_s", round(derived, 6))
        if self.rejects_fast and "early_drop_min_chance" not in self.model_fields_set:
            # A p99 target that a timed-out wait misses: at most 1 % of its waiters may time out.
            object.__setattr__(self, "early_drop_min_chance", REJECT_SLO_QUANTILE)
        return self

    @property
    def spends_reject_budget(self) -> bool:
        """Does early drop spend this class's slow-rejection budget (policy.min_chance)? A class
        that would rather be told at once, whose `early_drop_min_chance` is derived, not set."""
        return self.rejects_fast and "early_drop_min_chance" not in self.model_fields_set

    @property
    def rejects_fast(self) -> bool:
        """Would this class rather be told at once than wait and fail? (Its time-to-429 target
        is shorter than its queue timeout, so any rejection after a wait misses it.)"""
        return 0 < self.slo_reject_s < self.queue_timeout_s


# The shipped classes as written (`_default_classes`): a class a config leaves out is this.
SHIPPED_CLASSES: dict[int, dict[str, Any]] = {
    0: {"queue_wait_slo_share": 10, "max_queue": 1000, "share": 0.5, "headroom": 0.1},
    1: {"queue_wait_slo_share": 0.75, "max_queue": 1000, "share": 0.1},
    2: {"queue_wait_slo_share": 0.5, "max_queue": 500, "share": 0.0, "slo_reject_s": 0.01},
}


def _default_classes() -> dict[int, ClassConfig]:
    # Interactive SLO for every class (TTFT 2 s, TPOT 100 ms); what differs is how long each
    # may wait for it: critical waits well past its TTFT target rather than fail (10 x = 20 s),
    # standard waits ~3/4 of it (the rest is prefill), sheddable half of it — and sheddable
    # would rather hear 429 at once (10 ms at p99) than wait and then hear it.
    # Shares are floors against starvation, not targets: standard keeps 10 % of the limit under
    # any flood of critical traffic, sheddable keeps nothing (it runs on what the others leave,
    # and is turned away at once while they are backlogged). Critical keeps 10 % of the limit
    # free as headroom so its arrivals rarely wait for a release (docs/admission.md, Guarantees).
    return {c: ClassConfig(**v) for c, v in SHIPPED_CLASSES.items()}


class LimitConfig(_Strict):
    """The Vegas limit on concurrent requests for a pool."""

    mode: Literal["vegas", "static"] = Field(default="vegas", description="`vegas` adapts to latency; `static` holds `initial`.")
    initial: int = Field(default=16, ge=1, description="Limit at first start (and the static limit).")
    min: int = Field(default=1, ge=1, description="Lowest the limit may fall.")
    max: int = Field(default=512, ge=1, description="Highest the limit may rise.")
    smoothing: float = Field(default=1.0, gt=0, le=1, description="Weight of a new limit versus the old (1 = no smoothing).")
    signal: Literal["ttft", "tpot", "combined"] = Field(
        default="combined", description="Latency signal fed to Vegas: `combined` (time to the 32nd token, TTFT + 31 x TPOT; sees both queueing behind full batches and batch slow-down), `tpot`, or `ttft` (see docs/admission.md).")
    probe_multiplier: int = Field(default=30, ge=1, description="rtt_noload is re-estimated every jitter[0.5,1)*probe_multiplier*L windows.")
    rtt_tolerance: float = Field(default=3.0, ge=1.0, le=10.0, description="Latency up to this multiple of the no-load latency counts as no queue (1.0 = Netflix Vegas; LLM latency grows with batch size before anything queues).")
    flavor: Literal["floodgate", "netflix"] = Field(
        default="floodgate",
        description="`floodgate`: the no-load baseline is re-estimated only from windows at low in-flight (it cannot drift up under sustained load), 5xx lower the limit by their share of the window, and latency up to `slo_target` counts as no queue. `netflix`: VegasLimit.java as written (a probe resets the baseline to the current latency, any 5xx in a window is a drop, no SLO target).")
    slo_target: float = Field(default=0.75, ge=0, le=1, description="Latency up to this fraction of the pool's SLO for the signal counts as no queue (strictest class; tpot: slo_tpot_s; ttft: slo_ttft_s x (1 - queue_wait_slo_share, at least 1/4); combined: that TTFT part + 31 x slo_tpot_s); 0 = no SLO target.")
    decrease_gain: float = Field(default=0.25, ge=0, le=1, description="`floodgate` flavor: a window whose queue estimate (`ceil(L x (1 - ref / rtt))`) is above 6 lg lowers the limit by this share of the excess, at least lg, instead of by lg (Netflix). A limit that rose while the pool was app-limited (in flight at least half of it) then comes back in a few windows instead of lg per window (overload bench, engine model: sparse phase ~150 instead of ~160 against a plateau of 112-136, its goodput +11-17 %). 0.5 halved the sparse phase's TPOT misses but dipped below 80 % of the knee too often with 5 % 5xx (`floodgate bench vegas-knee`: 98.7-99.6 % of the time above it, 99.9-100 % at 0.25). 0 = Netflix's lg step.")
    window_min_samples: int = Field(default=10, ge=1, description="Finished requests (at least one with a measured latency, or a 5xx) a window needs before it updates the limit.")
    window_s: float = Field(default=1.0, gt=0, description="Shortest window duration.")
    window_max_s: float = Field(default=10.0, gt=0, description="A window with at least one sample closes after this long.")
    sample_rate: float = Field(default=0.5, ge=0, le=1, description="Fraction of admitted requests whose response body is streamed to measure TTFT/TPOT, counted from the end of their request body, which they stream too (a slow upload is not server latency; two more messages per sampled request with a body) (with an adaptive limit only: a static limit needs no latency signal and samples none, so floodgate_ttft_seconds / floodgate_tpot_seconds stay empty).")
    max_sampled: int = Field(default=64, ge=0, description="Most sampled requests one processor streams at once (each costs an ext_proc message per response chunk, so without a bound that cost grows with the limit: a pool at 200 in flight streamed ~100 responses); a request admitted while this many stream is not sampled. Fewer measured requests make each window's mean noisier, and Vegas steps up further than down (+6 lg vs -lg), so keep it well above `window_min_samples` x the requests' duration / `window_s`. 0: no bound.")
    rise_once_per_rtt: bool = Field(default=False, description="`floodgate` flavor: a window holding a request admitted before the limit last changed may lower or hold the limit but not raise it (increases once per round trip, as TCP Vegas). Stops a burst from raising the limit window after window on the latency of requests admitted before the engine's queue built up (elastic bench: 82 instead of 136 on 4 replicas of 8 slots), but halves how fast the limit climbs out of `initial` (overload bench: burst goodput 96 % instead of 114 % of the best steady, Vegas 86 % of the best static limit). Off by default.")
    controller_ceiling: bool = Field(default=True, description="With endpoint picking and `vegas`: hold the limit at or below the ceiling the scaling controller publishes while it waits for cold starts (per-replica capacity x its `admission_ceiling.headroom`, times the active endpoints), so what the active replicas cannot start waits in Floodgate's priority queue (or is turned away, which the controller counts as demand) instead of in the engines' FIFO queues; when it is taken back the limit gets its level per endpoint from before the cap back. Nothing published (no controller, or no cold start awaited): Vegas alone.")
    controller_arrivals: bool = Field(default=True, description="With endpoint picking and `follow_endpoints`: count the capacity the scaling controller announces on its way (replicas cold-starting or waking, each due at a time it predicts from the cold starts and wakes it measured) in early drop: a request that the permits those replicas bring, granted before its queue timeout, would serve waits for them instead of being turned away. The announcement has a TTL and is trusted only up to each request's own deadline: a late or missing replica ends such waits at their timeouts, and once its time has passed it counts nothing (docs/admission.md, \"Capacity on its way\").")
    follow_endpoints: bool = Field(default=True, description="With endpoint picking and `vegas`: when the number of active endpoints serving changes, scale the limit in proportion at once (a new replica's share is granted as soon as it is active, a drained or ejected one's share is taken away: `eject_after_failures`), instead of Vegas growing or shrinking into it window by window.")

    @model_validator(mode="after")
    def _bounds(self) -> LimitConfig:
        if self.window_s > self.window_max_s:
            raise ValueError(f"window_s ({self.window_s}) is above window_max_s ({self.window_max_s})")
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max})")
        if not self.min <= self.initial <= self.max:
            raise ValueError(f"initial ({self.initial}) is outside [min, max] = [{self.min}, {self.max}]")
        return self


class PoolConfig(_Strict):
    name: PoolName = Field(default="default", description="Pool name: letters, digits, `_`, `.` and `-`; one Redis hash tag per pool.")
    match_authority: str | None = Field(default=None, min_length=1, description="Requests whose :authority equals this (case-insensitive, with or without a numeric :port) go to this pool (first pool is the default). Two pools may not share one.")
    endpoint_picking: bool = Field(default=False, description="Route each admitted request to the least-loaded active endpoint of the registry via x-gateway-destination-endpoint (needs the ORIGINAL_DST cluster include): the least estimated prefill queued (`prefill_tokens_per_s`), then the fewest permits routed there.")
    local_credits: int = Field(default=32, ge=0, le=1024, description="While nothing waits and the pool is at most half full, each processor may hold this many spare leases and admit P1 requests from them without a Redis round trip (P0 and P2 always ask Redis, which counts them in their class; 0 disables; not used with endpoint picking).")
    allowed_endpoints: list[str] = Field(
        default_factory=list,
        description="With endpoint picking: the only endpoints this processor routes to, whatever the Redis registry says: CIDRs, optionally with a port or range (`10.0.0.0/8:8000`, `[fd00::/8]:8000-8099`). Anything else gets 503 no_endpoints. Empty: any ip:port the registry lists. Without endpoint picking it does nothing (a warning at start).")
    unadmitted_paths: list[Annotated[str, Field(pattern=r"^/")]] = Field(
        default_factory=lambda: ["/v1/models", "/health"],
        description="Paths that take no permit (cheap reads; exact, before any `?`), whatever the method; with endpoint picking they are routed to any active endpoint. Counted in floodgate_unadmitted_total (reason `path`). A route where the model server runs the model (`/v1/completions`, `/v1/chat/completions`, ...) listed here warns at start: its requests would pass without admission.")
    unadmitted_methods: list[Annotated[str, Field(pattern=r"^[A-Za-z]{1,20}$"), AfterValidator(str.upper)]] = Field(
        default_factory=lambda: ["GET", "HEAD", "OPTIONS"],
        description="Request methods that run no model and take no permit on any path: a request with one of them passes unadmitted (like `unadmitted_paths`; routed to any active endpoint with endpoint picking; counted in floodgate_unadmitted_total, reason `method`) only when it also has no body (its headers end the request), asks for no protocol upgrade (`upgrade` header: vLLM's /v1/realtime runs the model over a WebSocket opened with GET) and carries no method-override header (`x-http-method-override`, `x-http-method`, `x-method-override`); otherwise it is admitted like any request. Methods compare case-insensitively. vLLM runs the model only on POST routes; CORS preflights (OPTIONS), HEAD and reads like GET /v1/models do not. A method not listed (POST, PUT, PATCH, DELETE, anything unknown) is admitted: list only methods your model server never runs the model on. Empty: every method is admitted.")
    settings_epoch: int = Field(default=0, ge=0, description="Version of this pool's admission settings (shares, reservations, queue caps, picking, initial limit). The first processor stores them in Redis and every grant uses the stored ones; a processor with different settings and the same epoch (or an older one) logs an error and sets floodgate_settings_mismatch, a static limit is set only by the processors whose settings are stored, and a processor that has seen a newer epoch stored no longer changes the shared limit. Raise it to roll out changed settings (the limit included).")
    fair_order: bool = Field(
        default=True,
        description="Order each class's queue fairly over tenants (the `x-tenant-id` header; requests without one are one tenant together): a tenant with no waiter joins the next round (behind the round of grants under way), one flooding the class waits behind everyone else's, one grant per tenant per round. The tenant header must then be one clients cannot choose freely (set it in an auth filter that replaces any client value): a client that may name a new tenant with every request joins every round. Off: arrival order within a class (docs/admission.md, \"Queue order\").")
    onset_ramp_rate: float = Field(
        default=0.1, ge=0, le=100,
        description="While a critical (P0) request is in flight, lower classes may raise the pool's in-flight by at most this share of the limit per second (at least 8 per second, and at least 4 per second per active endpoint of the registry) beyond what completions free (plus `onset_ramp_burst` at once): at a burst's onset their prompts reach the engines about as fast as the engines prefill them, instead of all at once ahead of the P0s arriving with them in the engines' FIFO queues. Paced requests wait in the queue (and may time out there); P0 is never paced. 0 = off (docs/admission.md, \"The onset ramp\").")
    onset_ramp_burst: float = Field(
        default=0.08, ge=0, le=1,
        description="With `onset_ramp_rate`: the growth lower classes may take at once, as a share of the limit (at least 8 permits, and at least 4 per active endpoint).")
    prefill_tokens_per_s: float = Field(
        default=6000.0, ge=0,
        description="With endpoint picking: prompt tokens one endpoint prefills per second. The grant script keeps an estimate per active endpoint of the prompt tokens routed to it and not yet prefilled (each request adds its own prompt size, estimated from its `content-length`: see `prefill_bytes_per_token`; draining at this rate), routes every grant to the least estimate (then the fewest permits) and, while a critical (P0) request is in flight, grants lower classes only while that least estimate is at most `prefill_pace_tokens`: on engines that prefill first come, first served (vLLM's default), the next P0 then waits behind little prefill. Too low a rate holds lower classes longer than needed while P0 runs; too high a rate is harmless but helps less. 0 = off: the least permits routed, no pacing (docs/admission.md, \"Prefill-aware picking\").")
    prefill_request_tokens: float = Field(
        default=512.0, gt=0,
        description="With `prefill_tokens_per_s`: the prompt tokens a routed request adds to its endpoint's estimate when its own size is not known (no or a malformed `content-length`, an encoded body, `prefill_bytes_per_token` 0, a request of an older processor): the mean prompt of the pool's traffic.")
    prefill_pace_tokens: float = Field(
        default=512.0, ge=0,
        description="With `prefill_tokens_per_s`: while a P0 is in flight, lower classes are granted only while the least endpoint estimate is at most this many prompt tokens (paced requests wait in the queue, and may time out there).")
    prefill_bytes_per_token: float = Field(
        default=BYTES_PER_TOKEN, ge=0,
        description="With `prefill_tokens_per_s`: a request's prompt size is estimated as its `content-length` (read from the request headers; the body is not buffered) divided by this, clamped to [1, `prefill_max_request_tokens`]. English text runs ~4 characters per token with Llama-style tokenizers and a JSON body adds its keys and escapes; the shipped 6 errs toward counting fewer tokens than a request has (counting more paces lower classes harder than `prefill_pace_tokens` and the rate intend, and costs goodput). A client sets its estimate within the clamp by the size of the body it sends (docs/admission.md, \"Prefill-aware picking\"). 0 = every request counts as `prefill_request_tokens`.")
    prefill_max_request_tokens: float = Field(
        default=MAX_REQUEST_TOKENS, ge=1,
        description="With `prefill_bytes_per_token`: the most prompt tokens one request counts for, whatever its body's size (a base64 image, padding): bounds how far one request can push its endpoint's estimate, and so how long it can hold lower classes back while a P0 is in flight.")
    eject_after_5xx: int = Field(
        default=5, ge=0, le=1000,
        description="With endpoint picking: after this many responses in a row from an endpoint with a 5xx status (no other answer from it in between), the processor ejects it as for `eject_after_failures` (Envoy's `consecutive_5xx`, default 5 there too). An engine that broke but still passes its health check answers every request with a fast 500, so it always has the fewest permits and the pick sent it most requests (a review: two thirds failed). A client that can provoke 5xx answers can eject an endpoint for `eject_base_s` only with that many in a row on it and no other request answered in between; when every active endpoint is ejected all are used. 0 = off.")
    eject_after_failures: int = Field(
        default=3, ge=0, le=1000,
        description="With endpoint picking: after this many requests in a row whose connection to an endpoint was refused, timed out or closed before any response (Envoy's `response.code_details`), no other request answered by it in between, the processor ejects it: every processor's picks avoid it for `eject_base_s` (doubled at each further ejection without an answered request, up to `eject_max_s`), unless every active endpoint is ejected. Needs `response.code_details` in the filter's `response_attributes` (the shipped include sends it). Without it a dead replica draws a third or more of the requests until the controller removes it from the registry: its requests fail at once, so it always has the fewest permits. 0 = off (docs/admission.md, \"Dead endpoints\").")
    eject_base_s: float = Field(default=10.0, gt=0, le=3600, description="With `eject_after_failures`: how long the first ejection of an endpoint lasts.")
    eject_max_s: float = Field(default=120.0, gt=0, le=3600, description="With `eject_after_failures`: the longest an ejection lasts (each further one doubles the one before).")
    engine_priority: dict[Priority, int] = Field(
        default_factory=dict,
        description="Class -> vLLM request `priority` (lower is scheduled first) written into the JSON body of that class's admitted requests, for engines started with `--scheduling-policy priority` (vLLM answers 400 to a non-zero priority under its default fcfs policy: leave this empty there). Only the listed classes' request bodies are buffered and rewritten (an existing `priority` is overwritten); the others pass untouched, so a caller of an unlisted class could send its own. A listed class's body that cannot be rewritten is refused, never passed on (it could carry a priority its client wrote): not a JSON object in UTF-8 with 400, encoded with 415, larger than `engine_priority_max_body_bytes` or Envoy's buffer with 413 (floodgate_engine_priority_total). So a listed class serves JSON endpoints only: send multipart requests (audio transcriptions) in a class that is not listed. Example: {0: -1, 1: 0, 2: 1} puts P0 first in the engines' waiting queues and P2 last, every body rewritten; {0: -1} alone buffers less but lets P1/P2 callers write their own priority (start-up and --check-config warn) (docs/admission.md, \"Engine priority\").")
    engine_priority_max_body_bytes: int = Field(
        default=1 << 20, ge=1,
        description="With `engine_priority`: a listed class's request body larger than this (or than Envoy's buffer, `per_connection_buffer_limit_bytes`, 1 MiB by default) is refused with 413: it cannot be rewritten, and passed unchanged it would keep a priority its client wrote. Bounds the JSON parse on the processor's event loop.")
    limit: LimitConfig = LimitConfig()
    classes: dict[int, ClassConfig] = Field(default_factory=_default_classes, description="Per-priority settings for 0 (critical), 1 (standard), 2 (sheddable). A class left out is the shipped one; a class you define is the whole class (the fields it leaves out take the generic defaults below, not the shipped class's: `--check-config` and start-up warn which shipped values that drops).")

    @field_validator("allowed_endpoints")
    @classmethod
    def _allowed_endpoints(cls, v: list[str]) -> list[str]:
        for entry in v:
            parse_rule(entry)
        return v

    @model_validator(mode="after")
    def _eject_times(self) -> PoolConfig:
        if self.eject_max_s < self.eject_base_s:
            raise ValueError(f"eject_max_s ({self.eject_max_s}) is below eject_base_s ({self.eject_base_s})")
        return self

    @field_validator("classes", mode="before")
    @classmethod
    def _known_classes(cls, v: Any) -> Any:
        # Before each class is validated: a class 3 reported its missing fields first. A class
        # left out is the shipped one (`classes: {2: {...}}` changes P2 alone).
        if isinstance(v, dict):
            unknown = [k for k in v if str(k) not in ("0", "1", "2")]
            if unknown:
                raise ValueError(f"the classes are 0, 1 and 2: {unknown!r} is none of them")
            given = {int(k) for k in v}
            if len(given) != len(v):
                raise ValueError(f"a class is given twice ({list(v)!r}: 2 and \"2\" are the same class)")
            v = {**{c: dict(d) for c, d in SHIPPED_CLASSES.items() if c not in given}, **v}
        return v

    @field_validator("engine_priority", mode="before")
    @classmethod
    def _engine_priority_once(cls, v: Any) -> Any:
        # As for `classes`: {"0": -1, 0: 5} kept one of the two silently (an operator review).
        if isinstance(v, dict):
            try:
                given = {int(str(k).strip()) for k in v}
            except ValueError:
                return v  # not a class at all: the field's own validation names it
            if len(given) != len(v):
                raise ValueError(f"a class is given twice ({list(v)!r}: 0, \"0\" and \"00\" are the same class)")
        return v

    def class_warnings(self) -> list[str]:
        """Warnings about the classes, logged at start and by `--check-config`: a class this
        config defines is the whole class (fields it leaves out take the generic defaults, not
        the shipped class's: say which shipped values it drops), and `engine_priority` that
        leaves a class out lets that class's callers write their own engine priority."""
        out = []
        for c, cc in sorted(self.classes.items()):
            shipped = SHIPPED_CLASSES[c]
            if cc.model_fields_set == set(shipped):
                continue  # the shipped class (left out, or written out as shipped)
            dropped = {k: v for k, v in shipped.items()
                       if k not in cc.model_fields_set and ClassConfig.model_fields[k].default != v}
            if dropped:
                out.append(f"pools[{self.name}].classes.{c} leaves out {', '.join(sorted(dropped))}: a class "
                           f"you define is the whole class, so the generic defaults apply, not the shipped "
                           f"{dropped} (set them to keep them; leave the class out for the shipped one)")
        if self.engine_priority and len(self.engine_priority) < 3:
            unlisted = sorted({0, 1, 2} - set(self.engine_priority))
            out.append(f"pools[{self.name}].engine_priority lists classes {sorted(self.engine_priority)} only: the "
                       f"request bodies of class{'es' if len(unlisted) > 1 else ''} "
                       f"{', '.join(map(str, unlisted))} pass untouched, so their callers can write their own "
                       f"vLLM `priority` into the body and run ahead of the listed ones (list every class, "
                       f"e.g. {{0: -1, 1: 0, 2: 1}}, to have the gateway overwrite it for everyone)")
        model = sorted(set(self.unadmitted_paths) & MODEL_PATHS)
        if model:
            out.append(f"pools[{self.name}].unadmitted_paths lists {', '.join(model)}, where the model server runs "
                       "the model: every request there passes without admission (no permit, no queue, no limit)")
        if self.allowed_endpoints and not self.endpoint_picking:
            out.append(f"pools[{self.name}].allowed_endpoints has no effect without endpoint_picking: Envoy's own "
                       "cluster picks the endpoint (restrict it there)")
        return out

    @field_validator("classes")
    @classmethod
    def _shares_fit(cls, v: dict[int, ClassConfig]) -> dict[int, ClassConfig]:
        # (the classes are 0, 1 and 2 by now: `_known_classes` named any other and filled the rest)
        if sum(c.share for c in v.values()) > 1.0 + 1e-9:
            shares = ", ".join(f"{k}: {c.share:g}" for k, c in sorted(v.items()))
            raise ValueError(f"class shares add up to more than 1 ({shares}; a class left out has its shipped share)")
        return v

    def latency_target(self) -> float:
        """Seconds of `limit.signal` that count as no queue for Vegas, from the strictest class
        SLO (0 = none). The engine-side part of each SLO: TPOT as is; `combined` is the time
        to the 32nd token; `ttft` is measured after admission, so the queue's part of the TTFT
        target is taken out (for `combined` too: TTFT's engine part + 31 x TPOT)."""
        if self.limit.slo_target <= 0:
            return 0.0
        cs = self.classes.values()
        if self.limit.signal == "tpot":
            base = min(c.slo_tpot_s for c in cs)
        elif self.limit.signal == "combined":
            base = min(c.slo_ttft_s * max(0.25, 1 - c.queue_wait_slo_share) + 31 * c.slo_tpot_s for c in cs)
        else:
            base = min(c.slo_ttft_s * max(0.25, 1 - c.queue_wait_slo_share) for c in cs)
        return self.limit.slo_target * base


class TrustConfig(_Strict):
    """Who may set `x-request-priority` themselves."""

    cidrs: list[str] = Field(default_factory=list, description="Source address ranges whose priority header is honoured (the TCP peer Envoy reports; an IPv4 client of a dual-stack listener, `::ffff:a.b.c.d`, matches as its IPv4 address).")
    spiffe_ids: list[str] = Field(default_factory=list, description="mTLS peer URI SANs whose priority header is honoured (exact, or prefix ending in '/').")
    spiffe_priorities: dict[str, Priority] = Field(default_factory=dict, description="mTLS peer URI SAN -> priority, applied when the caller sends no header.")

    @field_validator("spiffe_ids", "spiffe_priorities")
    @classmethod
    def _spiffe(cls, v: Any) -> Any:
        # A peer's URI SAN is a SPIFFE ID; anything else never matches, silently (a review).
        for sid in v:
            if not (isinstance(sid, str) and sid.startswith("spiffe://") and len(sid) > len("spiffe://")):
                raise ValueError(f"{sid!r} is not a SPIFFE ID (spiffe://<trust-domain>/...): it would never match a peer")
        return v

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        for c in v:
            try:
                ipaddress.ip_network(c, strict=False)
            except ValueError as exc:
                raise ValueError(f"{c!r} is not a CIDR") from exc
        return v


# Longest tenant name stored as it is; a longer one is stored by its digest (server.tenant_key).
TENANT_MAX_CHARS = 128


class AdmissionConfig(_Strict):
    default_priority: int = Field(default=1, ge=0, le=2, description="Priority when no trusted header or tenant mapping applies.")
    priority_header: HeaderName = Field(default="x-request-priority", description="Header carrying the requested priority.")
    tenant_header: HeaderName = Field(default="x-tenant-id", description="Header naming the tenant (set it in an auth filter you trust, overwriting any the client sent: a request whose header names two different tenants, as repeated values or as one comma-separated value, is refused with 400 conflicting_tenant).")
    tenant_priorities: dict[str, Priority] = Field(default_factory=dict, description="Tenant -> priority for callers that are not trusted (a tenant name is 1-128 characters, without a comma or surrounding spaces).")
    trust: TrustConfig = TrustConfig()
    retry_after_min_s: float = Field(default=1, ge=0, description="Smallest Retry-After sent (the header "
                                     "is whole seconds: a fraction rounds up; `retry-after-ms` carries the exact "
                                     "value).")
    retry_after_max_s: float = Field(default=60, gt=0, description="Largest Retry-After sent (whole seconds: "
                                     "a fraction rounds down, never below the smallest).")
    retry_after_jitter: float = Field(default=0.2, ge=0, le=1, description="Retry-After is spread uniformly over a band this wide (relative), also at the min/max clamps.")
    anonymous_tenant_cap: bool = Field(default=False, description="Apply `tenant_queue_share` to requests without a tenant header as if they were one tenant (default: they are not capped).")
    retry_count_header: str = Field(default="x-stainless-retry-count", pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]*$", description="Header in which a client says how many times it sent this request before (OpenAI's SDKs send `x-stainless-retry-count` and retry a 429 twice by default). A request turned away with a count above 0 is counted as `retried`, not as demand: its first attempt was counted already, and counting every retry made the controller read up to 3x the demand admission turned away. An admitted retry whose first attempt this processor turned away (same class, tenant and caller: mTLS peer, else source address) is counted `retried_admitted`, which the controller takes off the turned-away count. Admission itself ignores it. Empty: every turned-away request counts.")

    @model_validator(mode="after")
    def _two_headers(self) -> AdmissionConfig:
        if self.priority_header.lower() == self.tenant_header.lower():
            raise ValueError(f"priority_header and tenant_header are both {self.priority_header!r}: "
                             "one header cannot carry both")
        retry = self.retry_count_header.lower()
        if retry and retry in (self.priority_header.lower(), self.tenant_header.lower()):
            raise ValueError(f"retry_count_header {self.retry_count_header!r} is also the priority or tenant "
                             "header: one header cannot carry both")
        return self

    @field_validator("tenant_priorities")
    @classmethod
    def _tenant_names(cls, v: dict[str, int]) -> dict[str, int]:
        # A request's tenant is read as the header's comma-separated items, stripped, and one
        # longer than TENANT_MAX_CHARS is stored by its digest: a key that breaks any of these
        # could never match, and its tenant would silently run at the default priority.
        for name in v:
            if not name or name != name.strip(" \t") or "," in name or len(name) > TENANT_MAX_CHARS:
                raise ValueError(f"tenant {name[:40]!r}{'...' if len(name) > 40 else ''} can never match a request: "
                                 f"a tenant is 1-{TENANT_MAX_CHARS} characters, without a comma or surrounding spaces")
        return v

    @model_validator(mode="after")
    def _retry_after_bounds(self) -> AdmissionConfig:
        if self.retry_after_min_s > self.retry_after_max_s:
            raise ValueError(f"retry_after_min_s ({self.retry_after_min_s}) is above retry_after_max_s ({self.retry_after_max_s})")
        return self


class RedisConfig(_Strict):
    url: RedisURL = Field(default="redis://127.0.0.1:6379/0", description="Redis URL: redis://, rediss:// (TLS), unix://, redis+sentinel://h1:26379,h2:26379/service or redis+cluster://h1:6379,h2:6379 (see docs/operations.md); password in the URL or below.")
    password: str | None = Field(default=None, description="Password, if not in the URL.")
    op_timeout_s: float = Field(default=0.25, gt=0, le=5, description="A Redis call slower than this counts as an outage.")
    lease_ttl_s: float = Field(default=15, gt=0.3, description="Lease lifetime; a killed processor's permits return within this. Give every processor of a pool the same value: the way back from degraded mode reads the others' last sync with it.")
    poll_interval_s: float = Field(default=0.25, gt=0, description="Waiters poll Redis this often in case a grant message is lost.")
    reconnect_interval_s: float = Field(default=0.5, gt=0, description="While degraded, how often Redis is retried.")
    degraded_full_share_after_s: float = Field(default=300, gt=0, description="While degraded (Redis unreachable), after this long each processor may admit up to its full rank share of the last seen limit instead of what it held when Redis went plus its share of what was free: set it to the longest a request can run (the route timeout; the shipped Envoy config's is 300 s), after which every permit held anywhere before the outage is surely gone, so the shares add up to L again. Lower is sooner service in a long outage, and overshoot above L while requests older than it still run (docs/admission.md, \"When Redis is unreachable\").")
    expected_gateways: int = Field(default=2, ge=1, description="Processors expected per pool: one that has never reached Redis admits limit.initial / this while degraded (afterwards it uses the last seen limit split over the live processors).")

    @model_validator(mode="after")
    def _ttl_outlasts_a_renewal(self) -> RedisConfig:
        # A renewal's call may take two timeouts (one retry on a fresh connection): a TTL within
        # that lets leases expire under live requests, and their permits go to others.
        if self.lease_ttl_s <= 2 * self.op_timeout_s:
            raise ValueError(f"lease_ttl_s ({self.lease_ttl_s}) must exceed two op_timeout_s ({self.op_timeout_s}): "
                             "a renewal may take that long (docs/operations.md, \"Sizing\")")
        return self


class TlsConfig(_Strict):
    """TLS on the ext_proc gRPC port; with `client_ca_file`, mutual TLS (Envoy must present a
    certificate that CA signed, see envoy/floodgate-extproc-tls.yaml)."""

    cert_file: str = Field(description="PEM certificate chain the processor presents.")
    key_file: str = Field(description="PEM private key of that certificate.")
    client_ca_file: str | None = Field(default=None, description="PEM CA bundle: clients (Envoy) must present a certificate it signed. Unset: TLS without client authentication.")

    @model_validator(mode="after")
    def _readable(self) -> TlsConfig:
        for name in ("cert_file", "key_file", "client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path} is not a readable file")
        # Load them as the server will: a file that is no PEM certificate or key, or a key that
        # is not the certificate's, is named here instead of failing the listen at start-up.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"cert_file / key_file: {self.cert_file} and {self.key_file} are not a PEM "
                             f"certificate chain and its private key ({exc})") from None
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(self.client_ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(f"client_ca_file: {self.client_ca_file} is not a PEM CA bundle ({exc})") from None
        return self


class ServerConfig(_Strict):
    listen: ListenAddress = Field(default="127.0.0.1:50051", description="gRPC listen address of the ext_proc service, HOST:PORT with IPv6 in brackets (loopback by default: only a co-located Envoy reaches it).")
    tls: TlsConfig | None = Field(default=None, description="TLS / mTLS on the ext_proc port (unset: plaintext, for loopback or a mesh that encrypts).")
    health_listen: OptionalListenAddress = Field(default=None, description="Extra plaintext gRPC address serving only grpc.health.v1 (for probes that cannot speak TLS, e.g. the kubelet's); unset: health is served on `listen` only.")
    metrics_listen: Annotated[str, AfterValidator(check_optional_listen)] = Field(default="127.0.0.1:9464", description="HTTP address serving /metrics (empty to disable).")
    gateway_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
                                   description="Id of this processor in the shared state (default: host-pid-random). Two running processors must never share one (each would drop the other's permits): a processor whose id another live process renews refuses to start (exit 2, naming this field), and two that share one anyway log an error and count floodgate_gateway_id_conflicts_total. A restart may reuse it (a pod's name, compose's fixed ids): after a crash it waits until the dead process's claim on the id is one renewal old (at most lease_ttl_s / 3 + 1 s; none after a clean stop), then takes back at once what the dead process left in Redis.")
    gc_freeze: bool = Field(default=True, description="After start-up, move every object then alive (modules, protobuf descriptors, config) into Python's permanent generation (`gc.freeze()`), so no later collection walks them: a full collection then costs what the live requests cost, not what the process imported (measured: a generation-2 pass stopped the event loop 39-80 ms without, 4-9 ms with; docs/benchmarks.md). false: the interpreter's default.")
    gc_threshold: tuple[NonNegativeInt, NonNegativeInt, NonNegativeInt] | None = Field(default=None, description="Python's collection thresholds (`gc.set_threshold`: allocations before a generation-0 pass, and generation-0/1 passes before the next older one); unset: the interpreter's default (700, 10, 10). Larger values mean fewer, longer passes.")
    switch_interval_s: float | None = Field(default=0.001, gt=0, le=0.1, description="How long Python lets one thread hold the interpreter lock while another waits for it (`sys.setswitchinterval`). gRPC's completion-queue thread hands every incoming message to the event loop through that lock, and the /metrics thread holds it for 10-20 ms per scrape: with the interpreter's 5 ms a message can wait 5 ms per hand-over. null: the interpreter's default (5 ms).")
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="After SIGTERM: how long requests in flight through this processor (streaming responses, queued requests) may still run before they are cut. Meanwhile health checks read NOT_SERVING, so Envoy sends new requests to the other processors, and this one keeps serving whatever still comes. Keep it below the orchestrator's kill deadline (Kubernetes `terminationGracePeriodSeconds`, compose `stop_grace_period`). A second SIGTERM cuts at once.")
    shutdown_quiet_s: float = Field(default=2.0, ge=0, description="After SIGTERM the processor stops as soon as nothing is in flight and no new stream has started for this long (Envoy has moved to the other processors: its health check interval, 2 s in envoy/floodgate-cluster.yaml), or when `shutdown_grace_s` is over.")
    max_requests: int = Field(default=0, ge=0, description="Recycle the processor: after this many requests (ext_proc streams; each processor draws its own number from [max_requests, 1.25 x max_requests), so processors started together do not stop together) it drains as on SIGTERM (health NOT_SERVING, Envoy moves new requests to the other processors, the streams in flight finish within `shutdown_grace_s`) and exits 0, for its platform to start it again (Kubernetes and compose's `restart: unless-stopped` do; under systemd set `Restart=always`; `floodgate up` does not). It bounds the native memory grpcio's asyncio server leaks per request Envoy resets (about 57 bytes, grpc/grpc#43360: ~0.5 GB a day at 100 requests/s; docs/operations.md, \"What is kept, and for how long\"). Run at least two processors. 0: never.")
    envoy_message_timeout_s: float = Field(default=35.0, gt=1, le=3600, description="The ext_proc filter's `message_timeout` in your Envoy (35 s in envoy/floodgate-filter.yaml). A queued request holds its request-headers reply while it waits, and Envoy answers 504 (\"no processor answered\") to one still waiting at that timeout: every class's `queue_timeout_s` must end at least 1 s before it (checked at start-up). Raise both together.")
    max_headers: int = Field(default=100, ge=10, le=10000, description="Envoy's header-count limit (`max_headers_count`, 100 unless your HTTP connection manager sets it). Near it, the informational headers Floodgate adds (x-floodgate-priority, x-floodgate-queue-ms) are left out rather than pushing a request over the limit (Envoy would answer 500).")


# A queued request is answered at least this long before Envoy's ext_proc message_timeout.
MESSAGE_TIMEOUT_MARGIN_S = 1.0


class Config(_Strict):
    """The processor's configuration."""

    server: ServerConfig = Field(default=ServerConfig(), description="Listen addresses and process identity.")
    redis: RedisConfig = Field(default=RedisConfig(), description="The shared state every processor uses.")
    admission: AdmissionConfig = Field(default=AdmissionConfig(), description="Priority, trust and Retry-After rules.")
    pools: list[PoolConfig] = Field(default_factory=lambda: [PoolConfig()], min_length=1,
                                    description="Model pools (one Envoy cluster each); the first is the default.")

    @field_validator("pools")
    @classmethod
    def _unique_pools(cls, v: list[PoolConfig]) -> list[PoolConfig]:
        names = [p.name for p in v]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        # Authorities compare case-insensitively: two pools with one authority would leave the
        # first without traffic (the last one wins), silently.
        seen: dict[str, str] = {}
        for p in v:
            if p.match_authority:
                a = p.match_authority.lower()
                if a in seen:
                    raise ValueError(f"pools {seen[a]!r} and {p.name!r} both match_authority {p.match_authority!r} "
                                     "(compared case-insensitively): each authority can select one pool")
                seen[a] = p.name
        return v

    @model_validator(mode="after")
    def _fits_envoy(self) -> Config:
        # Envoy answers 504 to a request still queued at its ext_proc message_timeout, with the
        # local reply of a processor that never answered (a review: a P0 with a 60 s queue
        # timeout got "admission unavailable, retry after 1 s" after 35 s).
        room = self.server.envoy_message_timeout_s - MESSAGE_TIMEOUT_MARGIN_S
        for i, p in enumerate(self.pools):
            for c, cc in sorted(p.classes.items()):
                if cc.queue_timeout_s > room:
                    raise ValueError(
                        f"pools.{i}.classes.{c}.queue_timeout_s is {cc.queue_timeout_s:g} s, but a queued request must "
                        f"be answered {MESSAGE_TIMEOUT_MARGIN_S:g} s before Envoy's ext_proc message_timeout "
                        f"(server.envoy_message_timeout_s: {self.server.envoy_message_timeout_s:g} s), or Envoy answers "
                        "it 504 as if no processor ran: lower the queue timeout (or slo_ttft_s x queue_wait_slo_share), "
                        "or raise message_timeout in your Envoy's ext_proc filter and server.envoy_message_timeout_s "
                        "together")
        s = self.server
        named = [(n, a) for n, a in (("server.listen", s.listen), ("server.health_listen", s.health_listen),
                                     ("server.metrics_listen", s.metrics_listen)) if a]
        for i, (na, a) in enumerate(named):
            for nb, b in named[i + 1:]:
                if listeners_clash(a, b):
                    raise ValueError(f"{na} ({a}) and {nb} ({b}) cannot both bind: the same port on the same "
                                     "address (or a wildcard one)")
        return self

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)


ENV_OVERRIDES: dict[str, tuple[str, ...]] = {
    "FLOODGATE_REDIS_URL": ("redis", "url"),
    "FLOODGATE_REDIS_PASSWORD": ("redis", "password"),
    "FLOODGATE_LISTEN": ("server", "listen"),
    "FLOODGATE_METRICS_LISTEN": ("server", "metrics_listen"),
    "FLOODGATE_GATEWAY_ID": ("server", "gateway_id"),
}
ENV_EMPTY_MEANS_OFF = ("FLOODGATE_METRICS_LISTEN",)  # set but empty: no metrics listener


def load_config(path: str | Path | None = None, overrides: dict[tuple[str, ...], Any] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Read, merge and validate. Raises ConfigError with an operator-facing message."""
    raw: dict[str, Any] = read_mapping(path) if path is not None else {}
    environ: Mapping[str, str] = os.environ if env is None else env
    merged: dict[tuple[str, ...], Any] = {}
    from_env: dict[tuple[str, ...], str] = {}
    for var, where in ENV_OVERRIDES.items():
        # An empty variable is unset, except where an empty value means something: metrics off
        # (as `--metrics-listen ''`).
        if environ.get(var) or (var in ENV_EMPTY_MEANS_OFF and var in environ):
            merged[where], from_env[where] = environ[var], var
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    merged.update(flags)
    for where in flags:
        from_env.pop(where, None)
    for where, value in merged.items():
        node = raw
        for key in where[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config: {'.'.join(where[:-1])} must be a mapping")
        node[where[-1]] = value
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(name_env_sources(format_errors(exc), from_env)) from None
