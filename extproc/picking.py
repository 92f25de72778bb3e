"""Endpoint picking on the processor side.

With `endpoint_picking`, the shared grant (leases.lua `pick`) routes each admitted request to
the least-loaded active endpoint atomically with the grant (the least estimated prefill queued,
then the fewest permits: extproc/prefill.py). This module holds the rest: the
processor's cached view of the active endpoints (refreshed from the registry every second),
the pick while Redis is unreachable (least of this process's own requests, not an endpoint it
ejected: extproc/ejection.py), the endpoint for
requests admitted without a permit, and `accept`, the hook through which an endpoint may be
refused (e.g. an address allowlist) — a refused or missing endpoint makes the permit go back
and the request get 503 `no_endpoints`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable


class Picker:
    def __init__(self, enabled: bool, accept: Callable[[str], bool] | None = None) -> None:
        self.enabled = enabled
        self.active: list[str] = []  # last seen active endpoints, sorted
        self._accept = accept

    def update(self, active: Iterable[str]) -> None:
        self.active = sorted(ep for ep in active if self._accept is None or self._accept(ep))

    def accept(self, endpoint: str) -> bool:
        """May an admitted request be sent to `endpoint`? ('' = none picked.)"""
        if not self.enabled:
            return True
        return bool(endpoint) and (self._accept is None or self._accept(endpoint))

    def usable(self, avoid: Collection[str] = ()) -> list[str]:
        """The active endpoints without those in `avoid` (ejected: extproc/ejection.py), unless
        that leaves none."""
        if not avoid:
            return self.active
        return [ep for ep in self.active if ep not in avoid] or self.active

    def pick_local(self, routed: Iterable[str], avoid: Collection[str] = ()) -> str:
        """Degraded pick: the active endpoint with the fewest of this process's requests
        (`routed`: the endpoints of the permits it holds), not one in `avoid` unless all are.
        '' if picking is off or none is known."""
        eps = self.usable(avoid)
        if not self.enabled or not eps:
            return ""
        load = Counter(ep for ep in routed if ep in eps)
        return min(eps, key=lambda ep: load[ep])

    def any_active(self, rand: float, avoid: Collection[str] = ()) -> str | None:
        """An active endpoint for a request routed without admission (e.g. /v1/models)."""
        eps = self.usable(avoid)
        return eps[int(rand * len(eps)) % len(eps)] if eps else None
