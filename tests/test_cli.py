"""The `floodgate` command line as a user types it."""

from __future__ import annotations

import pytest

from floodgate.cli import main


@pytest.mark.parametrize(("argv", "prog", "unknown"), [
    (["up", "--no-dmeo"], "floodgate up", "--no-dmeo"),
    (["load", "--durration", "5"], "floodgate load", "--durration 5"),
    (["controller", "simulate", "--bogus"], "floodgate controller", "--bogus"),
])
def test_a_mistyped_option_gets_the_subcommands_usage(argv: list[str], prog: str, unknown: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: unrecognized arguments: {unknown}" in err
    assert err.startswith(f"usage: {prog}")


def test_controller_without_config_says_it_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["controller", "--check-config"]) == 2
    assert "--config is required" in capsys.readouterr().err


def _option_helps(argv: list[str]) -> dict[str, str]:
    """Each option's --help entry (its lines joined), from `floodgate <argv> --help`."""
    import contextlib
    import io
    import re

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    text = out.getvalue().split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", text.split("\n\n", 1)[0])
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries}


def test_controller_simulate_help_names_each_default_once() -> None:
    # --mode said "(default: tile with --trace, else synthetic) (default: None)".
    helps = _option_helps(["controller", "simulate"])
    for entry in helps.values():
        assert entry.count("default") <= 1, entry
        assert "(default: None)" not in entry and "(default: )" not in entry, entry
    assert "(default: tile with --trace, else synthetic)" in helps["--mode"]
    for option in ("--seed", "--cold-start", "--wake"):
        assert "default:" in helps[option], helps[option]
    for entry in _option_helps(["controller", "suite"]).values():
        assert entry.count("default") <= 1, entry


@pytest.mark.parametrize("bench", ["vegas-knee", "elastic"])
def test_bench_options_say_what_they_do_and_their_default(bench: str) -> None:
    import argparse

    from floodgate.cli import _subparser, build_parser

    bench_parser = _subparser(build_parser("bench"), "bench")
    assert bench_parser is not None
    parser = _subparser(bench_parser, bench)
    assert parser is not None
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        if not isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
            assert "default" in action.help, f"{action.option_strings} does not say its default: {action.help!r}"
    helps = _option_helps(["bench", bench])  # and --help prints them
    assert {a.option_strings[0] for a in parser._actions} == set(helps)


def test_config_reference_shows_the_type_inside_annotated() -> None:
    # docs/configuration.md said "map str → Annotated" and "list of Annotated".
    from pathlib import Path

    from floodgate.config_reference import render

    text = render()
    assert "Annotated" not in text
    assert "| `admission.tenant_priorities` | map str → int (0-2) |" in text
    assert "| `pools[].engine_priority` | map int (0-2) → int |" in text
    assert "| `pools[].unadmitted_paths` | list of str |" in text
    assert "Annotated" not in (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("argv", [
    ["load", "--dry-run", "--out", "{file}/report"],
    ["controller", "simulate", "--out", "{file}"],
    ["controller", "suite", "--out", "{file}/suite"],
    ["up", "--out", "{file}/up"],
])
def test_an_output_directory_that_cannot_be_one_is_refused_before_the_run(
        argv: list[str], tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    """The reports are written at the end of a run: an --out under a file (or not writable) was
    a NotADirectoryError traceback after the whole load, demo or backtest, its results lost (a
    user review: `floodgate up --out FILE/x` after its 90 s demo, `floodgate load` likewise)."""
    from pathlib import Path

    file = Path(str(tmp_path)) / "a-file"
    file.write_text("")
    from floodgate.cli import build_parser

    with pytest.raises(SystemExit) as exc:  # (parsed only: without the check `up` would start the stack)
        build_parser(argv[0]).parse_args([a.replace("{file}", str(file)) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --out: " in err and "is not a directory" in err, err


def test_up_checks_its_default_output_directory_before_the_demo(tmp_path: pytest.TempPathFactory,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`runs/up` (no flag, so no argparse type) under a `runs` that is a file: said before anything
    starts, not after the demo; nothing to write without a demo."""
    from pathlib import Path

    from floodgate.cli import build_parser
    from floodgate.up import check_args

    monkeypatch.chdir(str(tmp_path))
    (Path(str(tmp_path)) / "runs").write_text("")
    parser = build_parser("up")
    said = check_args(parser.parse_args(["up"]))
    assert said is not None and said.startswith("--out: runs/up: ") and "is not a directory" in said, said
    assert check_args(parser.parse_args(["up", "--no-demo"])) is None


def test_ctrl_c_while_the_command_loads_exits_130_without_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a command's parser imports its modules (aiohttp, pydantic, ...: up to a second or
    two after `floodgate up`): a Ctrl-C then was a KeyboardInterrupt traceback from inside an
    import (a docs review, SIGINT 0.3-0.9 s after start). Now it exits 130, as one later does."""
    import floodgate.cli as cli

    def interrupted(_command: str | None = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["up", "--no-demo"]) == 130
