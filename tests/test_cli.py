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
