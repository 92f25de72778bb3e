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
