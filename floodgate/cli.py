"""The `floodgate` command: one entry point, one subcommand per component.

Each component owns its subcommand in its own package (`extproc/cli.py`, `sim/cli.py`, ...)
and exposes `register(subparsers)`; the registered handler receives the parsed namespace and
returns an exit code. Only the module of the command being run is imported: `floodgate --help`
and `floodgate extproc` never pay for (or depend on) what `floodgate bench` imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from floodgate import __version__

# command -> (module with register(), one-line help), in --help order. The help strings repeat
# the modules' own so the top-level help needs no import.
COMMANDS: dict[str, tuple[str, str]] = {
    "extproc": ("floodgate.extproc.cli", "run the ext_proc admission processor"),
    "controller": ("floodgate.controller.cli", "scaling controller (and its backtest: `controller simulate`)"),
    "sim": ("floodgate.sim.cli", "run an emulated vLLM server (OpenAI API, vLLM metrics, sleep mode)"),
    "load": ("floodgate.sim.load_cli", "open-loop streaming load generator (synthetic shapes or trace replay)"),
    "up": ("floodgate.up", "run the whole local stack (and a demo load)"),
    "status": ("floodgate.status", "show the shared state: pools, limits, queues, leases, replicas"),
    "bench": ("floodgate.bench.cli", "run a benchmark (overhead, overload, elastic, faults, scale, ...)"),
}


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first non-option word), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command` fully registered and the other commands as names only."""
    parser = argparse.ArgumentParser(
        prog="floodgate",
        description=(
            "Admission control and elastic scaling for LLM inference served behind Envoy. "
            "Run `floodgate <command> --help` for the options of each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"floodgate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (module_name, help_text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module_name).register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            found: argparse.ArgumentParser = action.choices[command]
            return found
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C while the command's modules load (building its parser imports them: up to a
        # second or two), before its handler runs: exit 130 as after it, not a traceback from
        # deep inside an import (a docs review pressed Ctrl-C right after `floodgate up`).
        return 130


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command(argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports a subcommand's unknown option from the top-level parser, with its
        # usage; the subcommand's own usage (and its --help) is what helps.
        sub = _subparser(parser, args.command)
        (sub or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    import os

    from floodgate.supervisor import port_range_error

    bad_range = port_range_error(os.environ.get("FLOODGATE_PORT_RANGE", ""))
    if bad_range:
        print(f"floodgate {args.command}: {bad_range}", file=sys.stderr)
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return closed_stdout()


def closed_stdout() -> int:
    """The reader went away (`floodgate status | head`): stop quietly, as Unix tools do. stdout
    is pointed at /dev/null so the interpreter's final flush does not raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, like a shell tool killed by it


if __name__ == "__main__":
    sys.exit(main())
