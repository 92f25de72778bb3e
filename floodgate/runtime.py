"""Run a server coroutine until SIGTERM, SIGINT or SIGHUP: the shared `main` of every
long-running command (`extproc`, `sim`, `controller`, the benchmarks' no-op processor)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("floodgate.runtime")


class StartupError(Exception):
    """A server cannot start as configured: said in one line naming the setting, exit 2 like a
    config error."""


class ListenError(StartupError):
    """A server could not open one of its configured addresses (in use, not this host's, no
    permission)."""


def run_until_signalled(body: Callable[[asyncio.Event], Coroutine[Any, Any, T]], *,
                        use_uvloop: bool = True) -> T:
    """Run `body(stop)`; SIGTERM and SIGINT set `stop` so the body can shut down cleanly.
    SIGHUP, which operators and tools send to ask for a config reload, stops the same way with a
    WARNING: the config is read only at start. Before, its default action killed the process
    without a word (a controller's leader lease then stayed held until its TTL). A SIGHUP the
    process was started ignoring (`nohup`) stays ignored.
    On uvloop when installed (it roughly halves per-request CPU in the servers)."""

    def on_sighup(stop: asyncio.Event) -> None:
        log.warning("SIGHUP: stopping as on SIGTERM. There is no config reload (the config is read only "
                    "at start): start the process again to apply a new config")
        stop.set()

    async def main() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        sighup = getattr(signal, "SIGHUP", None)  # not on Windows
        # An ignored SIGHUP stays ignored (`nohup`: the terminal's hangup must not stop it).
        if sighup is not None and signal.getsignal(sighup) is not signal.SIG_IGN:
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sighup, on_sighup, stop)
        return await body(stop)

    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            factory = uvloop.new_event_loop
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main())
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
