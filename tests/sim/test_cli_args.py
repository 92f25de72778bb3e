"""`floodgate sim` and `floodgate load` reject bad option values as argparse errors (exit 2, the
option named, no traceback) instead of failing later or silently doing something else."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from floodgate.cli import main


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("usage: floodgate "), err
    return err


@pytest.mark.parametrize("port", ["70000", "-1", "0", "65536", "http"])
def test_sim_rejects_a_port_outside_1_65535(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    # 70000 used to log "serving on :70000" while listening on 4464 (70000 mod 65536); -1
    # crashed with socket.gaierror.
    err = _usage_error(["sim", "--port", port, "--check-config"], capsys)
    assert "floodgate sim: error: argument --port: expected a port number 1-65535" in err


def test_sim_accepts_the_port_range_ends(capsys: pytest.CaptureFixture[str]) -> None:
    for port in ("1", "65535"):
        assert main(["sim", "--port", port, "--check-config"]) == 0
        assert f'"port": {port}' in capsys.readouterr().out


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--time-scale", "nan", "expected a number > 0"),
    ("--cold-start", "inf", "expected a number >= 0"),
    ("--max-num-seqs", "eight", "expected an integer >= 1"),
    ("--max-num-seqs", "0", "must be >= 1"),
    ("--decode-base-ms", "-1", "must be >= 0"),
])
def test_sim_rejects_bad_numbers(option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["sim", option, value, "--check-config"], capsys)
    assert f"floodgate sim: error: argument {option}: {message}" in err


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--rate", "-5", "must be > 0"),  # was a ValueError traceback from sim/arrivals.py
    ("--rate", "0", "must be > 0"),
    ("--duration", "-1", "must be > 0"),
    ("--timeout", "0", "must be > 0"),
    ("--retry", "-1", "must be >= 0"),
    ("--retry-max-wait", "-1", "must be >= 0"),
    ("--burst-start", "-1", "must be >= 0"),
    ("--burst-duration", "-1", "must be >= 0"),
    ("--burst-multiplier", "-2", "must be >= 0"),
    ("--speedup", "0", "must be > 0"),
    ("--rate-scale", "-1", "must be > 0"),
    ("--trace-start", "-1", "must be >= 0"),
    ("--seed", "-1", "must be >= 0"),  # was a ValueError traceback from numpy
    ("--prompt-mean", "0", "must be > 0"),
    ("--prompt-sigma", "-0.5", "must be >= 0"),
    ("--prompt-max", "0", "must be >= 1"),
    ("--output-mean", "-3", "must be > 0"),
    ("--output-sigma", "-1", "must be >= 0"),
    ("--output-max", "-1", "must be >= 1"),
    ("--slo-ttft", "0", "must be > 0"),
    ("--slo-tpot", "-1", "must be > 0"),
    ("--sample-interval", "0", "must be > 0"),
    ("--rate", "inf", "expected a number > 0"),
    ("--phases", "10:-1", "a phase's duration and rate must be >= 0"),
    ("--tenants", "a:-1,b:2", "tenant shares must be >= 0 with a positive sum"),
    ("--priority-mix", "nan,1,1", "priority shares must be >= 0"),
    ("--window", "w=5:1", "a window needs 0 <= T0 < T1"),
])
def test_load_rejects_bad_numbers(option: str, value: str, message: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["load", f"{option}={value}", "--dry-run"], capsys)
    assert f"floodgate load: error: argument {option}: {message}" in err


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1/metrics", "http://", "127.0.0.1:9464/metrics",
                                 "http://127.0.0.1:99999/metrics"])
def test_load_refuses_a_metrics_url_that_is_not_http(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # Was accepted and every scrape failed silently (exit 0, only meta.scrape_errors told).
    err = _usage_error(["load", "--metrics-url", url, "--dry-run"], capsys)
    assert f"floodgate load: error: argument --metrics-url: expected an http:// or https:// URL, got {url!r}" in err


@pytest.mark.parametrize("url", ["ftp://x", "localhost:10000", "http://"])
def test_load_refuses_a_target_that_is_not_http(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    # ftp://x ran and exited 1 "cannot reach" (a review expected the usage error it now gets).
    err = _usage_error(["load", "--target", url, "--dry-run"], capsys)
    assert f"floodgate load: error: argument --target: expected an http:// or https:// URL, got {url!r}" in err


def test_load_options_that_disagree_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["load", "--shape", "burst", "--duration", "60", "--burst-start", "50", "--dry-run"], capsys)
    assert "floodgate load: error: --shape burst: burst window [50.0, 70.0) must lie inside [0, 60.0]" in err
    err = _usage_error(["load", "--shape", "step", "--dry-run"], capsys)
    assert "floodgate load: error: --shape step needs --phases" in err


def _trace_error(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    err = _usage_error(["load", "--shape", "trace", "--trace", str(path), "--dry-run"], capsys)
    line = err.strip().splitlines()[-1]
    assert line.startswith("floodgate load: error: argument --trace: ") and str(path) in line, err
    return err


def test_load_names_a_trace_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was a UnicodeDecodeError traceback from load_trace.
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff\xfe,1,2\n")
    assert "not a UTF-8 text CSV" in _trace_error(path, capsys)


def test_load_names_other_unreadable_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_gzip = tmp_path / "t.csv.gz"
    not_gzip.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert "not a readable gzip file" in _trace_error(not_gzip, capsys)
    truncated = tmp_path / "cut.csv.gz"
    truncated.write_bytes(gzip.compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n" * 100)[:30])
    assert "not a readable gzip file" in _trace_error(truncated, capsys)
    bad_row = tmp_path / "row.csv"
    bad_row.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\nyesterday,1,2\n")
    assert "line 3: bad row" in _trace_error(bad_row, capsys)
    short_row = tmp_path / "short.csv"
    short_row.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374\n")
    assert "line 2: bad row" in _trace_error(short_row, capsys)
    no_columns = tmp_path / "cols.csv"
    no_columns.write_text("a,b\n1,2\n")
    assert "missing columns" in _trace_error(no_columns, capsys)
    assert "no such file" in _trace_error(tmp_path / "absent.csv", capsys)
    err = _usage_error(["load", "--shape", "trace", "--trace", str(tmp_path), "--dry-run"], capsys)
    assert f"argument --trace: cannot read {tmp_path}: Is a directory" in err


def test_load_replays_a_good_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:47.0000000,100,10\n")
    assert main(["load", "--shape", "trace", "--trace", str(path), "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("2 requests over")


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--duration", "1.5", "expected an integer >= 1"),  # wrk's -d takes whole seconds: it failed after the set-up
    ("--duration", "0", "must be >= 1"),
    ("--warmup", "0.5", "expected an integer >= 0"),
])
def test_bench_overhead_takes_whole_seconds(option: str, value: str, message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["bench", "overhead", option, value], capsys)
    assert f"floodgate bench overhead: error: argument {option}: {message}" in err
