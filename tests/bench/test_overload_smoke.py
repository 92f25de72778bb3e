"""`floodgate bench overload` at tiny scale: the report is produced and its numbers add up."""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
from pathlib import Path

import pytest
from floodgate.bench import overload

from floodgate.binaries import envoy_binary
from floodgate.envoy_config import render_local, write_config

pytestmark = pytest.mark.integration


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    overload.add_arguments(parser)
    return parser.parse_args(["--out", str(tmp_path / "out"), "--doc", str(tmp_path / "benchmarks.md"),
                              "--quiet", *extra])


@pytest.mark.timeout(90)
def test_overload_smoke(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Admission overhead\n\nsomeone else's section\n")
    # ~5 s of arrivals per config; capacity given so the engine-model search is skipped.
    args = _args(tmp_path, "--configs", "none", "vegas", "--scale", "0.1", "--capacity", "15",
                 "--no-calibrate", "--timeout", "15")
    assert overload.run(args) == 0

    out = tmp_path / "out"
    report = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"none", f"vegas-{overload.parse_config('vegas').signal}"}
    for name, r in rows.items():
        assert r["offered"] == report["plan_requests"] > 0, name
        assert r["offered"] == r["admitted"] + r["rejected"] + r["errors"], name
        assert r["consistent"], name
        raw = json.loads(gzip.open(out / f"{name}.json.gz", "rt").read())
        assert len(raw["records"]) == r["offered"]
        outcomes = [rec["outcome"] for rec in raw["records"]]
        assert outcomes.count("ok") == r["admitted"] and outcomes.count("rejected") == r["rejected"]
    # At a fifth of capacity nothing is shed without admission control.
    assert rows["none"]["rejected"] == 0
    assert (out / "timeline.png").stat().st_size > 0

    text = doc.read_text()
    assert "someone else's section" in text
    assert text.count(overload.SECTION_START) == 1 and "## Overload" in text
    for name in rows:
        assert f"| {name} |" in text


def test_update_doc_replaces_only_its_section(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    doc.write_text("# B\n\n## Other\n\nkeep me\n")
    overload.update_doc(doc, f"{overload.SECTION_START}\n## Overload\n\nfirst\n{overload.SECTION_END}\n")
    overload.update_doc(doc, f"{overload.SECTION_START}\n## Overload\n\nsecond\n{overload.SECTION_END}\n")
    text = doc.read_text()
    assert "keep me" in text and "second" in text and "first" not in text
    assert text.count(overload.SECTION_START) == 1


def test_config_names() -> None:
    assert overload.parse_config("static-96").limit == 96
    assert overload.parse_config("vegas-ttft").signal == "ttft"
    with pytest.raises(argparse.ArgumentTypeError):
        overload.parse_config("static-x")


def test_adaptive_concurrency_config_is_valid_envoy(tmp_path: Path) -> None:
    cfg = render_local(admission=False, extra_filters=[overload.adaptive_concurrency_filter()])
    path = write_config(cfg, tmp_path / "adaptive.json")
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
