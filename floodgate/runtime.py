"""Run a server coroutine until SIGTERM or SIGINT: the shared `main` of every long-running
command (`extproc`, `sim`, `controller`, the benchmarks' no-op processor)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_until_signalled(body: Callable[[asyncio.Event], Coroutine[Any, Any, T]], *,
                        use_uvloop: bool = True) -> T:
    """Run `body(stop)`; SIGTERM and SIGINT set `stop` so the body can shut down cleanly.
    On uvloop when installed (it roughly halves per-request CPU in the servers)."""

    async def main() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        return await body(stop)

    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())
