"""Event-loop health: how late the loop runs a timer, and how long garbage collection stops it.

Every ext_proc message is handled on one asyncio loop. Whatever holds that loop (a GC pass
over a big heap, a synchronous call, a long coroutine step) delays every message that arrives
meanwhile, which no per-request timer inside the handler sees: `floodgate_decision_seconds`
starts when the handler runs, after the wait. These two probes see it.

* `LoopLagProbe` sleeps `interval_s` again and again and records how much later than asked it
  woke up. The probe wakes at times unrelated to the loop's work, so its lag distribution is
  the delay a message arriving at a random moment waits before the loop can look at it.
* `GcPauses` times every collection through `gc.callbacks` (start to stop, per generation).
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

LAG_INTERVAL_S = 0.05  # 20 wake-ups a second: negligible CPU, thousands of samples a minute


class LoopLagProbe:
    """Records `observe(lag_seconds)` once per `interval_s`. `clock` and `sleep` are injectable
    so a test can drive it without a real clock."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = LAG_INTERVAL_S, *,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.observe = observe
        self.interval_s = interval_s
        self.clock = clock
        self.sleep = sleep

    async def run(self, rounds: int | None = None) -> None:
        """Probe forever (or `rounds` times); cancel the task to stop."""
        n = 0
        while rounds is None or n < rounds:
            asked = self.clock() + self.interval_s
            await self.sleep(self.interval_s)
            self.observe(max(0.0, self.clock() - asked))
            n += 1


class GcPauses:
    """A `gc.callbacks` hook: `observe(generation, seconds)` for every collection."""

    def __init__(self, observe: Callable[[int, float], None], *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.observe = observe
        self.clock = clock
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = self.clock()
        elif phase == "stop" and self._started is not None:
            self.observe(info.get("generation", -1), self.clock() - self._started)
            self._started = None

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def tune_runtime(*, gc_freeze: bool, gc_threshold: tuple[int, int, int] | None,
                 switch_interval_s: float | None) -> None:
    """Apply the processor's interpreter settings (server.gc_freeze, gc_threshold,
    switch_interval_s); call once, after start-up allocated what lives for the whole run."""
    if gc_threshold is not None:
        gc.set_threshold(*gc_threshold)
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    if gc_freeze:
        # Collect first so start-up garbage is freed rather than frozen for the process's life.
        gc.collect()
        gc.freeze()
