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
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], nudge_s: float = 0.5) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again every `nudge_s` the ones
    still running (a lost cancellation). An error a task ended with is retrieved, not raised:
    each task handles (or logs) its own operations' errors."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=nudge_s)
    for t in tasks:
        if not t.cancelled():
            t.exception()
