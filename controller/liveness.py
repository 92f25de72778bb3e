"""When a replica counts as dead though its process runs, and how fast failing starts retry (pure).

The actuator's `list()` says whether a replica's process (pod, endpoint) exists, not whether it
serves: a hung process (SIGSTOP, a deadlocked server, a frozen node) stays "running" while its
scrapes fail, and the controller held such a replica active for good, with every tick stale and
no scale-down (docs/operations.md). `Unresponsive` tracks an active or draining replica's run
of failed scrapes; once it lasts `after_s`, the controller asks /health once more and fails the replica
only if that does not answer either, so a slow or broken /metrics alone never costs a replica
its in-flight requests.

A start that fails (a missing binary, a command that crashes, an endpoint that never gets
healthy) used to be retried at once, since the plan still wants the replica: 372 attempts in
8 s in a review, each burning a replica id and a log file. `StartBackoff` spaces them out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Unresponsive:
    """An active replica's current run of failed scrapes: since when (None: its last scrape was
    fine, or it is not active)."""

    since: float | None = None

    def observe(self, now: float, scrape_ok: bool | None) -> Unresponsive:
        """One tick's scrape: True fine, False failed, None not scraped this tick (keeps the run)."""
        if scrape_ok is None:
            return self
        if scrape_ok:
            return Unresponsive()
        return self if self.since is not None else Unresponsive(now)

    def due(self, now: float, after_s: float) -> bool:
        """Has the run lasted `after_s` (0: never)? Then /health decides."""
        return after_s > 0 and self.since is not None and now - self.since >= after_s


@dataclass(frozen=True, slots=True)
class StartBackoff:
    """Failed starts in a row, when the next may go, when the last one failed, and whether a
    replica came up since (then starts are trusted again, `starts_allowed`)."""

    failures: int = 0
    until: float = 0.0
    came_up: bool = False
    failed_at: float = 0.0

    def failed(self, now: float, base_s: float, max_s: float) -> StartBackoff:
        n = self.failures + 1
        return StartBackoff(n, now + min(max_s, base_s * 2.0 ** (n - 1)), failed_at=now)

    def paused(self, now: float, pause_s: float) -> StartBackoff:
        """Hold starts for `pause_s` without counting a failure (the platform refused a start for
        now: nothing failed to load, so no one-at-a-time afterwards; the pause only keeps the
        retries of an outage to one per `pause_s` instead of one per tick and kick)."""
        return replace(self, until=max(self.until, now + pause_s))

    def up(self) -> StartBackoff:
        """A replica came up (it may still die young: that is a failure again)."""
        return replace(self, came_up=True) if self.failures else self

    def succeeded(self) -> StartBackoff:
        return StartBackoff()

    def blocks(self, now: float) -> bool:
        return now < self.until

    def starts_allowed(self, starting: int, now: float, forget_s: float) -> int | None:
        """How many starts may go now, with `starting` replicas started and not yet up (None:
        no cap). After a failed start, one at a time until a replica comes up: a circuit
        breaker's half-open state. When the wait ended every planned start went at once, so a
        missing binary, a crashing command or an endpoint that never gets healthy failed N at a
        time, N model loads a round; the first to come up lets the rest start together. A
        replica that dies young after coming up (`crash_loop_s`) is a failure again, which
        puts starts back to one at a time. A failure `forget_s` old with no start since is
        forgotten: one pod lost mid-load must not hold a burst hours later to one start a
        cold start (a review); while a probe is loading, the cap stays."""
        if self.failures == 0 or self.came_up:
            return None
        if starting:
            return 0  # the probe is still on its way (a model load can take minutes)
        return None if now - self.failed_at >= forget_s else 1
