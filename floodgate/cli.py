"""The `floodgate` command: one entry point, one subcommand per component.

Each component owns its subcommand in its own package (`extproc/cli.py`, `sim/cli.py`, ...)
and exposes `register(subparsers)`; the registered handler receives the parsed namespace and
returns an exit code. Imports are lazy so `floodgate --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from floodgate import __version__

# (module, description) per subcommand, in --help order.
_COMPONENTS: tuple[str, ...] = (
    "floodgate.extproc.cli",
    "floodgate.controller.cli",
    "floodgate.sim.cli",
    "floodgate.sim.load_cli",
    "floodgate.up",
    "floodgate.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="floodgate",
        description=(
            "Admission control and elastic scaling for LLM inference served behind Envoy. "
            "Run `floodgate <command> --help` for the options of each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"floodgate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for module_name in _COMPONENTS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # A component not built yet (or an optional extra missing) must not break the rest.
            if exc.name and module_name.startswith(exc.name.split(".")[0]):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
