"""Passive ejection of endpoints that refuse connections (endpoint picking only).

With endpoint picking a dead replica is worse than a slow one: a request routed to it fails at
once (Envoy answers `503 upstream connect error`), so its permit comes back at once, so it always
has the fewest permits routed to it, and the pick sends it most requests (an operator's test:
67 % of requests failed while the controller, which removes dead replicas from the registry,
was down). Envoy's own outlier detection cannot help: with the ORIGINAL_DST cluster the host is
the one the processor names.

So the processor watches the outcome of the requests it routes. Envoy tells it, in the
`response.flags` attribute of the response headers, that the connection to the upstream failed
(`UF`): a refused or timed-out connect, which a client cannot cause. After
`consecutive_failures` such failures in a row on one endpoint (no answered request in between),
the endpoint is ejected for `base_s`; each further ejection without an answered request in
between doubles that, up to `max_s` (and then one connection failure after it ends ejects it
again: it has not answered since). The ejection is written to Redis (leases.lua `eject`), so
every processor's picks avoid the endpoint, and kept here for this process's own picks while
Redis is unreachable. When it ends, requests go there again: one that is answered clears the
record; a connection failure ejects it again, for longer.

Pure: `now` (seconds, any monotonic clock) is passed in; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Envoy's response flag UF (UpstreamConnectionFailure), as the `response.flags` attribute
# carries it (a bit field: envoy/stream_info/stream_info.h, ResponseFlag).
UPSTREAM_CONNECTION_FAILURE = 0x20


def connect_failed(flags: float | int | None) -> bool:
    """Did Envoy fail to connect to the upstream (response flag UF)? None: no flags sent."""
    if flags is None:
        return False
    try:
        return bool(int(flags) & UPSTREAM_CONNECTION_FAILURE)
    except (TypeError, ValueError, OverflowError):
        return False


def ejectable(endpoint: str) -> bool:
    """Can the script store this endpoint in its ejection list (no '|', no whitespace)? A
    registry entry that cannot (written by hand) is simply never ejected."""
    return bool(endpoint) and not any(ch == "|" or ch.isspace() for ch in endpoint)


@dataclass(frozen=True)
class EjectionSettings:
    """`consecutive_failures` 0 turns ejection off."""

    consecutive_failures: int = 3
    base_s: float = 10.0
    max_s: float = 120.0

    @property
    def on(self) -> bool:
        return self.consecutive_failures > 0


@dataclass
class _Record:
    failures: int = 0  # connection failures since the last answered request (or ejection)
    ejections: int = 0  # ejections since the last answered request
    until: float = float("-inf")  # ejected until


@dataclass
class Ejector:
    settings: EjectionSettings
    _eps: dict[str, _Record] = field(default_factory=dict)

    def failed(self, endpoint: str, now: float) -> float | None:
        """A request routed to `endpoint` could not connect. Returns the ejection's length in
        seconds when this failure ejects it, else None (below the threshold, or already ejected:
        requests in flight when it was ejected fail too and must not lengthen it)."""
        if not self.settings.on or not endpoint:
            return None
        rec = self._eps.setdefault(endpoint, _Record())
        if rec.until > now:
            return None
        rec.failures += 1
        # Once ejected, one failure after the ejection ends is proof enough (none answered since).
        if rec.failures < (1 if rec.ejections else self.settings.consecutive_failures):
            return None
        length = min(self.settings.max_s, self.settings.base_s * 2 ** rec.ejections)
        rec.ejections += 1
        rec.failures = 0
        rec.until = now + length
        return length

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
