"""Prefill-aware endpoint picking: the reference model that leases.lua's `pick` mirrors.

vLLM's default scheduler is first come, first served: a request routed to an engine waits for
every prompt routed there before it to be prefilled. A critical (P0) request therefore wants
the endpoint with the least prefill work queued, and lower classes should not pile prompts
onto the engines while a P0 is in flight (docs/admission.md, "Prefill-aware picking").

The processor does not see the engines' queues, so the grant script keeps an **estimate** per
active endpoint: every request routed there adds its own prompt size, estimated from its
`content-length` header (`prompt_tokens`: bytes / `bytes_per_token`, clamped to [1,
`max_request_tokens`]; `request_tokens`, the pool's mean prompt, when the header is absent,
malformed or the body is encoded, and for requests of older processors, which send no size), and
the estimate drains at `rate` tokens per second, never below zero. With it, when endpoint picking
is on:

* every grant goes to the active endpoint with the least estimate (then the fewest permits
  routed to it, then the rotation that spreads an idle pool: `Picker` order before this);
* while a P0 is in flight, a lower-class request is granted only while that least estimate is
  at most `pace_tokens`: its prompt would queue ahead of the next P0 for no longer than that.

Pure: times are integer milliseconds of the script's clock (Redis `TIME`), passed in. The
arithmetic is the script's (doubles), so tests compare the script's choices with this model's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Bytes of request body per prompt token the shipped estimate assumes (`prefill_bytes_per_token`).
# English prose runs ~4 characters per token with Llama-style tokenizers (the emulator counts a
# body without its trace header so: sim/emulator.py `_estimate_tokens`), a JSON body adds its keys
# and escapes, and the overload bench's bodies carry ~6.1 bytes per prompt token. 6 errs toward
# counting fewer tokens than a request has, on purpose: counting more paces lower classes harder
# than `prefill_pace_tokens` and the rate were chosen for (on the bench's model, 4 bytes per token
# cost a fifth of the burst goodput and tripled P1's queue timeouts), counting fewer only protects
# P0 less (8 still beat the fixed mean prompt). docs/admission.md, "Prefill-aware picking".
BYTES_PER_TOKEN = 6.0
# The most prompt tokens one request counts for (`prefill_max_request_tokens`): 16 mean prompts.
MAX_REQUEST_TOKENS = 8192.0


def body_encoded(content_encoding: Sequence[str] | None) -> bool:
    """Is the body encoded (a `content-encoding` value other than empty or identity), so its
    bytes are neither the prompt's size nor the JSON? A list of codings in one value counts as
    encoded unless it is exactly identity."""
    return bool(content_encoding) and any(v.strip().lower() not in ("", "identity") for v in content_encoding or ())


def prompt_tokens(content_length: Sequence[str] | None, content_encoding: Sequence[str] | None, *,
                  bytes_per_token: float, default: float, max_tokens: float) -> float:
    """The prompt tokens a request counts for in its endpoint's estimate, from its request
    headers alone (the body is not buffered): `content-length` / `bytes_per_token`, rounded,
    clamped to [1, `max_tokens`]. `default` (the pool's mean prompt) when the size cannot be
    read: no header (HTTP/2 without it, chunked), several or malformed values, an encoded body
    (`content-encoding` other than identity: compressed bytes say little about tokens), or
    `bytes_per_token` 0 (reading it is off). Never raises: a bad header only loses the estimate.

    A client controls this number (within the clamp) by the size of the body it sends, not by
    the header alone: Envoy frames the body by it (HTTP/1.1) or rejects a mismatch (HTTP/2), and
    a request that ends unprefilled (its body never came, the upstream refused it) takes it
    back (`unprefilled`)."""
    if bytes_per_token <= 0 or not content_length or len(set(content_length)) != 1:
        return default
    if body_encoded(content_encoding):
        return default
    raw = content_length[0].strip()
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 15:
        return default
    return float(min(max(1.0, max_tokens), max(1, round(int(raw) / bytes_per_token))))


@dataclass(frozen=True)
class PrefillSettings:
    """`rate`: prompt tokens one endpoint prefills per second (0 = off: pick by permits only, no
    pacing); `request_tokens`: what a routed request adds when its own size is not known;
    `pace_tokens`: the least estimate above which lower classes wait while a P0 is in flight."""

    rate: float = 0.0
    request_tokens: float = 512.0
    pace_tokens: float = 512.0

    @property
    def on(self) -> bool:
        return self.rate > 0

    @property
    def rate_ms(self) -> float:
        return self.rate / 1000.0


def drained(level: float, ts_ms: int, now_ms: int, rate_ms: float) -> float:
    """An estimate stored at `ts_ms`, brought to `now_ms`."""
    return max(0.0, level - rate_ms * max(0, now_ms - ts_ms))


def unprefilled(status: int | None) -> bool:
    """Did a request end without its prompt having been prefilled, as far as the gateway can
    tell: no response headers came back (its body never came, or its client left before a
    non-streaming answer), or the upstream refused it (a status of 400 or more: a route or
    method the engine does not serve, a malformed body, an engine error). Its whole size then
    leaves its endpoint's estimate (the script's `refund`, floored at 0). The estimate's drain
    over the time it was routed belonged to the requests that were prefilled, not to it: taking
    back only its size less that drain left most of it counted when many were held at once (a
    review: 30 header-only requests held 0.5 s left 78k tokens, 13 s of pacing). A request
    prefilled and then cancelled before a non-streaming answer also counts as unprefilled:
    the estimate then undercounts by that one prompt, which its client paid for in full."""
    return status is None or status >= 400


@dataclass
class PrefillEstimate:
    """Per-endpoint estimates of prompt tokens routed and not yet prefilled: endpoint ->
    (level, ms it was stored at), as the script keeps them in `fg:{pool}:epfill`."""

    settings: PrefillSettings
    levels: dict[str, tuple[float, int]] = field(default_factory=dict)

    def level(self, endpoint: str, now_ms: int) -> float:
        rec = self.levels.get(endpoint)
        return 0.0 if rec is None else drained(rec[0], rec[1], now_ms, self.settings.rate_ms)

    def least(self, endpoints: Sequence[str], now_ms: int) -> float:
        return min((self.level(ep, now_ms) for ep in endpoints), default=0.0)

    def pick(self, endpoints: Sequence[str], loads: Mapping[str, int], start: int, now_ms: int) -> str:
        """The endpoint a grant goes to: least estimate, then fewest permits, ties to the first
        from `start` in the sorted list (the script's rotation). '' with no endpoint."""
        eps = sorted(endpoints)
        n = len(eps)
        best, key = "", (float("inf"), float("inf"))
        for i in range(n):
            ep = eps[(start + i) % n]
            k = (self.level(ep, now_ms), float(loads.get(ep, 0)))
            if k < key:
                best, key = ep, k
        return best

    def routed(self, endpoint: str, now_ms: int, tokens: float | None = None) -> None:
        """A request was routed to `endpoint`: its prompt (`tokens`; None: not known, the pool's
        `request_tokens`) joins the estimate."""
        size = self.settings.request_tokens if tokens is None else tokens
        self.levels[endpoint] = (self.level(endpoint, now_ms) + size, now_ms)

    def refunded(self, endpoint: str, now_ms: int, tokens: float) -> None:
        """A request routed to `endpoint` ended unprefilled (`unprefilled`): its `tokens` leave
        its estimate, never below 0 (the script's `refund`)."""
        if endpoint in self.levels and tokens > 0:
            self.levels[endpoint] = (max(0.0, self.level(endpoint, now_ms) - tokens), now_ms)

    def open(self, cls: int, p0_inflight: int, endpoints: Sequence[str], now_ms: int) -> bool:
        """May a grant to class `cls` (0-based) go ahead as far as prefill pacing goes? P0
        always, lower classes freely while no P0 is in flight or with no endpoint known."""
        if not self.settings.on or cls == 0 or p0_inflight == 0 or not endpoints:
            return True
        return self.least(endpoints, now_ms) <= self.settings.pace_tokens
