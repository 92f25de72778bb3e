"""`floodgate bench <benchmark>`: side-by-side benchmarks that print ratios.

Each benchmark is a module in `bench/` exposing `SUMMARY` (one line for --help),
`add_arguments(parser)` and `run(args) -> exit code`. To add one (e.g. `overload`), write the
module and add it to `BENCHMARKS`. Modules are imported when the parser is built, so keep their
top level light and import heavy dependencies inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable

# Sub-benchmark name -> module, in --help order.
BENCHMARKS: dict[str, str] = {
    "overhead": "floodgate.bench.overhead",
    "overload": "floodgate.bench.overload",
    "elastic": "floodgate.bench.elastic",
    "scale": "floodgate.bench.scale",
    "script-instr": "floodgate.bench.script_instr",
    "vegas-knee": "floodgate.bench.vegas_knee",
    "reject": "floodgate.bench.reject_latency",
    "scrape": "floodgate.bench.scrape_cost",
    "faults": "floodgate.bench.faults",
}

HELP = """\
Run a benchmark against real processes started on this machine (Envoy, Redis, processors)
and print a table with ratios to its reference configuration. See docs/benchmarks.md.
"""


def terminable(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run` with SIGTERM turned into an exception, so that the benchmark's `with Supervisor()`
    blocks stop what they started, as they do on Ctrl-C: with Python's default SIGTERM the
    process died at once and left Redis, Envoy and the processors running (a review: a CI
    cancel or `timeout` left five processes behind)."""
    def handler(args: argparse.Namespace) -> int:
        from floodgate.binaries import BinaryNotFound

        def stop(signum: int, _frame: object) -> None:
            # once: a second SIGTERM during the cleanup would cut it short (a review: processes
            # left behind with a second signal 20 ms after the first)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise SystemExit(128 + signum)

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            return run(args)
        except BinaryNotFound as exc:
            # No Envoy or Redis server here (the image, a plain `pip install floodgate`): say what
            # to install on one line, as `floodgate up` does, not in a traceback.
            print(f"floodgate bench {args.benchmark}: {exc}", file=sys.stderr)
            return 2
        finally:
            signal.signal(signal.SIGTERM, previous)

    return handler


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark (" + ", ".join(BENCHMARKS) + ")",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = p.add_subparsers(dest="benchmark", metavar="<benchmark>")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or "").strip()
        bp = benches.add_parser(name, help=module.SUMMARY, description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(bp)
        bp.set_defaults(handler=terminable(module.run))

    def usage(_args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(handler=usage)
