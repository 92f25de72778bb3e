"""Cancelling a task for sure.

Python 3.11's `asyncio.wait_for` returns the inner result when the inner call completes just as
the outer task is cancelled: the cancellation is lost. redis-py sends every command through
`wait_for(send, socket_timeout)`, so a task looping on Redis calls can survive its `cancel()`
once in a while, and a `cancel(); await task` then waits for ever (the fault bench's clock
keeper kept a CI run waiting for its 120 s timeout; the controller's stop waited for a tick or
a start's `/health` polling). Python 3.12 rewrote `wait_for` on `asyncio.timeout`; this module
stays correct on both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("floodgate.cancel")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], nudge_s: float = 0.5) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again the ones still running
    after `nudge_s`, then after twice that, and so on up to 16 x `nudge_s` between cancels (a
    lost cancellation; the growing pause leaves a slow clean-up, such as closing a connection to
    a server that does not answer, the time to finish, where a cancel every 0.5 s cut it short
    again and again). A task still running 60 x `nudge_s` (30 s) after its first cancel is
    logged by name, once. An error a task ended with is retrieved, not raised: each task
    handles (or logs) its own operations' errors."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    waited, pause, warned = 0.0, nudge_s, False
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=pause)
        waited += pause
        pause = min(16 * nudge_s, pause * 2)
        if pending and waited >= 60 * nudge_s and not warned:
            warned = True
            log.warning("tasks still running %.0f s after their cancellation: %s", waited,
                        ", ".join(sorted(t.get_name() for t in pending)))
    for t in tasks:
        if not t.cancelled():
            t.exception()
