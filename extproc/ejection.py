"""Passive ejection of endpoints that refuse connections (endpoint picking only).

With endpoint picking a dead replica is worse than a slow one: a request routed to it fails at
once (Envoy answers `503 upstream connect error`), so its permit comes back at once, so it always
has the fewest permits routed to it, and the pick sends it most requests (an operator's test:
67 % of requests failed while the controller, which removes dead replicas from the registry,
was down). Envoy's own outlier detection cannot help: with the ORIGINAL_DST cluster the host is
the one the processor names.

So the processor watches the outcome of the requests it routes. Envoy tells it, in the
`response.code_details` attribute of the response headers, why a response did not come from the
upstream: `upstream_reset_before_response_started{<reason>|...}`. The endpoint failed when the
reason is a refused or failed connect (`remote_connection_failure`, `connection_failure`), a
connect timeout (`connection_timeout`), or a connection it closed before answering
(`connection_termination`: a proxy in front of a crashed app, a wedged listener). Envoy's own
local failures (`local_connection_failure`: out of file descriptors, which a client can bring
about by holding connections open), overflows and resets are not the endpoint's. A response
from the endpoint itself (`via_upstream`, whatever its status) is an answer; other local
replies (a timeout, a reset after headers) count for neither. After
`consecutive_failures` failures in a row (no answer in between), or `consecutive_errors` 5xx
answers in a row (an engine that broke but still passes its health check: its fast 500s free its
permits at once, so it too always has the fewest), the endpoint is ejected for
`base_s`; each further ejection without an answer in between doubles that, up to `max_s` (and
then one failure after it ends ejects it again). The ejection is written to Redis (leases.lua
`eject`), so every processor's picks avoid it, and kept here for this process's own picks; a
write that fails (Redis unreachable) is sent again when Redis answers (`unshared`). When it
ends, requests go there again: an answer clears the record; a failure ejects it again, longer.

A replica that hangs (accepts connections, never answers) is not detected here: its requests
hold their permits until their timeouts, so it draws no more than its share.

Pure: `now` (seconds, any monotonic clock) is passed in; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# `response.code_details` of a response the upstream sent, and the prefix of Envoy's local reply
# when the upstream connection failed or was reset before any response (router_filter.cc).
VIA_UPSTREAM = "via_upstream"
_RESET_PREFIX = "upstream_reset_before_response_started{"
# Reset reasons (Http::StreamResetReason as the code details spell it) that are the endpoint's.
ENDPOINT_FAILURES = frozenset({"remote_connection_failure", "connection_failure", "connection_timeout",
                               "connection_termination"})

EndpointOutcome = Literal["answered", "failed", "error", "other"]


def endpoint_outcome(code_details: object, status: int | None = None) -> EndpointOutcome:
    """What a picked request's response headers say of its endpoint, from Envoy's
    `response.code_details` and the status: `answered` (the endpoint responded), `error` (it
    responded with a 5xx), `failed` (it refused, timed out or dropped the connection before
    responding), `other` (unknown: no attribute, another local reply, Envoy's own failure)."""
    if not isinstance(code_details, str):
        return "other"
    if code_details == VIA_UPSTREAM:
        return "error" if status is not None and status >= 500 else "answered"
    if code_details.startswith(_RESET_PREFIX):
        reason = code_details[len(_RESET_PREFIX):].split("|", 1)[0].rstrip("}")
        if reason in ENDPOINT_FAILURES:
            return "failed"
    return "other"


# Envoy's own replies that still say the upstream was too slow: its response timeouts (504).
# `response_timeout` is the route's own timeout as Envoy 1.40 names it (router.cc
# onResponseTimeout; read from a real Envoy's access log): left out, every 504 of a replica too
# slow to answer within it was `ignored`, no drop (tests/test_admission_e2e.py).
_UPSTREAM_TIMEOUTS = ("upstream_response_timeout", "upstream_per_try_timeout", "upstream_per_try_idle_timeout")
_ROUTE_TIMEOUT = "response_timeout"


def load_signal(code_details: object) -> bool:
    """May a 5xx with these `response.code_details` count as overload for the limit? Only what
    the upstream answered (`via_upstream`) or Envoy's timeout of an upstream too slow to answer;
    not Envoy's own replies that never reached a replica (`no_healthy_upstream` while a model
    server restarts, a refused connection, a circuit breaker's `overflow`): a fault review saw
    40 `no_healthy_upstream` 503s take the shared limit 16 -> 12. Unknown (no attribute: an
    include that does not send it) counts, as before."""
    if not isinstance(code_details, str):
        return True
    return code_details in (VIA_UPSTREAM, _ROUTE_TIMEOUT) or code_details.startswith(_UPSTREAM_TIMEOUTS)


def ejectable(endpoint: str) -> bool:
    """Can the script store this endpoint in its ejection list (no '|', no whitespace)? A
    registry entry that cannot (written by hand) is simply never ejected."""
    return bool(endpoint) and not any(ch == "|" or ch.isspace() for ch in endpoint)


@dataclass(frozen=True)
class EjectionSettings:
    """`consecutive_failures` / `consecutive_errors` 0 turns that kind of ejection off."""

    consecutive_failures: int = 3
    base_s: float = 10.0
    max_s: float = 120.0
    consecutive_errors: int = 0  # upstream 5xx in a row (Envoy's consecutive_5xx)

    @property
    def on(self) -> bool:
        return self.consecutive_failures > 0 or self.consecutive_errors > 0


@dataclass
class _Record:
    errors: int = 0  # 5xx answers since the last other answer (or ejection)
    failures: int = 0  # connection failures since the last answered request (or ejection)
    ejections: int = 0  # ejections since the last answered request
    until: float = float("-inf")  # ejected until
    shared: bool = True  # the ejection is written to Redis (false: to send again)


@dataclass
class Ejector:
    settings: EjectionSettings
    _eps: dict[str, _Record] = field(default_factory=dict)
    # Ejections read from Redis (any processor's): endpoint -> until, on this process's clock.
    _seen: dict[str, float] = field(default_factory=dict)

    def failed(self, endpoint: str, now: float) -> float | None:
        """A request routed to `endpoint` failed on the endpoint's side (`endpoint_outcome`). Returns the ejection's length in
        seconds when this failure ejects it, else None (below the threshold, or already ejected:
        requests in flight when it was ejected fail too and must not lengthen it)."""
        return self._strike(endpoint, now, "failures", self.settings.consecutive_failures)

    def errored(self, endpoint: str, now: float) -> float | None:
        """A request routed to `endpoint` got a 5xx from it (`error`): as `failed`, after
        `consecutive_errors` in a row. An engine that broke mid-run answers every completion
        with a fast 500 while its health check passes: with least-loaded picking it always has
        the fewest permits and drew two thirds of the requests (a review)."""
        return self._strike(endpoint, now, "errors", self.settings.consecutive_errors)

    def _strike(self, endpoint: str, now: float, kind: str, threshold: int) -> float | None:
        if threshold <= 0 or not endpoint:
            return None
        rec = self._eps.setdefault(endpoint, _Record())
        if rec.until > now:
            return None
        setattr(rec, kind, getattr(rec, kind) + 1)
        # Once ejected, one strike after the ejection ends is proof enough (none answered since).
        if getattr(rec, kind) < (1 if rec.ejections else threshold):
            return None
        length = min(self.settings.max_s, self.settings.base_s * 2 ** rec.ejections)
        rec.ejections += 1
        rec.failures = rec.errors = 0
        rec.until = now + length
        rec.shared = False
        return length

    def shared(self, endpoint: str) -> None:
        """Its ejection is written to Redis."""
        rec = self._eps.get(endpoint)
        if rec is not None:
            rec.shared = True

    def unshared(self, now: float) -> list[tuple[str, float]]:
        """Ejections not yet written to Redis, with the seconds they have left."""
        return [(ep, rec.until - now) for ep, rec in self._eps.items() if not rec.shared and rec.until > now]

    def see(self, ejections: dict[str, float]) -> None:
        """The ejections stored in Redis as last read (endpoint -> until, this process's clock)."""
        self._seen = dict(ejections)

    def avoid(self, now: float) -> frozenset[str]:
        """Endpoints this process's own picks leave out: its ejections and those last read."""
        return self.ejected(now) | frozenset(ep for ep, until in self._seen.items() if until > now)

    def answered(self, endpoint: str) -> None:
        """A request routed to `endpoint` got a response from it: the record starts over."""
        self._eps.pop(endpoint, None)

    def ejected(self, now: float) -> frozenset[str]:
        """The endpoints this process ejected whose ejection has not ended."""
        return frozenset(ep for ep, rec in self._eps.items() if rec.until > now)

    def forget(self, keep: set[str] | frozenset[str]) -> None:
        """Drop the records of endpoints no longer registered (bounded memory)."""
        for ep in [ep for ep in self._eps if ep not in keep]:
            del self._eps[ep]
