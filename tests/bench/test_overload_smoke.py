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


@pytest.mark.timeout(180)
def test_overload_smoke(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Admission overhead\n\nsomeone else's section\n")
    # ~5 s of arrivals per config; capacity given so the engine-model search is skipped.
    # The unloaded reference pass: its minimum (10 s) at this scale; a priority mix of our own.
    args = _args(tmp_path, "--configs", "none", "vegas", "static-24@engine-priority", "static-24@picking", "--scale", "0.1", "--capacity", "15",
                 "--no-calibrate", "--timeout", "15", "--mix", "0.3", "0.4", "0.3")
    assert overload.run(args) == 0

    out = tmp_path / "out"
    report = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in report["rows"]}
    assert set(rows) == {"none", f"vegas-{overload.parse_config('vegas').signal}", "static-24@engine-priority",
                         "static-24@picking"}
    # endpoint picking: the processor routed every admitted request to a registered replica
    # (none registered, or the ORIGINAL_DST cluster not steered, would be 503 no_endpoints / errors)
    assert report["floodgate_configs"]["static-24@picking"]["pools"][0]["endpoint_picking"] is True
    pick = rows["static-24@picking"]
    assert pick["errors"] == 0 and pick["admitted"] > 0
    with gzip.open(out / "static-24@picking.json.gz", "rt") as f:
        recs = json.load(f)["records"]
    assert not [r for r in recs if r["reject_reason"] == "no_endpoints" or r["status"] == 503]
    # engine priority: the emulators ran the priority policy (a P0 body without its priority, or
    # with one under fcfs, would be an error) and the processor wrote it into every admitted P0
    prio = rows["static-24@engine-priority"]
    assert report["floodgate_configs"]["static-24@engine-priority"]["pools"][0]["engine_priority"] == {"0": -1}
    assert prio["errors"] == 0 and prio["engine_priority"].get("set", 0) > 0
    assert sum(prio["engine_priority"].values()) == prio["engine_priority"]["set"]  # nothing passed unchanged
    assert rows["none"]["engine_priority"] == {}
    assert report["workload"]["priority_shares"] == [0.3, 0.4, 0.3]
    ref = report["reference"]
    # 10 s at 0.3 x 15 req/s, every request P0, the first 2.5 s left out as warm-up
    assert ref["duration_s"] == overload.REFERENCE_MIN_S and 15 < ref["samples"] <= ref["offered"]
    assert ref["p0_ttft_p50_s"] <= ref["p0_ttft_p99_s"]
    for name, r in rows.items():
        assert r["offered"] == report["plan_requests"] > 0, name
        assert r["offered"] == r["admitted"] + r["rejected"] + r["errors"], name
        assert r["consistent"], name
        # every row's ratio divides by the reference pass, not the unloaded phase's few P0s
        assert r["p0_ttft_ref_p99_s"] == ref["p0_ttft_p99_s"], name
        if r["p0_ttft_p99_burst_s"]:
            assert r["p0_ttft_ratio"] == pytest.approx(r["p0_ttft_p99_burst_s"] / ref["p0_ttft_p99_s"]), name
        raw = json.loads(gzip.open(out / f"{name}.json.gz", "rt").read())
        assert len(raw["records"]) == r["offered"]
        outcomes = [rec["outcome"] for rec in raw["records"]]
        assert outcomes.count("ok") == r["admitted"] and outcomes.count("rejected") == r["rejected"]
    # The P2 probe ran in its own process over its window in every config: every probe has an
    # answer (a 429 timed send -> answer, or an admitted completion) and its own send lag.
    a, b = report["probe"]["window_s"]
    assert report["probe"]["rate"] == 8.0
    for name, r in rows.items():
        assert r["probe_sent"] == int((b - a) * 8.0) > 0, name
        assert r["probe_errors"] == 0, name
        raw = json.loads(gzip.open(out / f"{name}.json.gz", "rt").read())
        probes = raw["meta"]["probe"]["probes"]
        assert isinstance(raw["meta"]["probe"]["nice"], int)  # the niceness it ran at, as measured
        assert len(probes) == r["probe_sent"], name
        assert sum(1 for p in probes if p["status"] == 429) == r["probe_rejected"], name
        assert all(p["status"] in (200, 429) and p["latency_s"] > 0 and p["lag_s"] > -0.01 for p in probes), name
        # aligned with the plan's clock: each probe was sent inside its window, in order
        sent = [p["t_sent"] for p in probes]
        assert sent == sorted(sent) and a - 0.5 <= sent[0] and sent[-1] <= b + 0.5, name
        # Envoy's access log has every probe's line (joined by x-probe-id): its status, a start
        # after the probe's send, and, behind the admission filter, the ext_proc call's time
        # inside Envoy's own duration, which is inside what the probe measured.
        for p in probes:
            e = p["envoy"]
            assert int(e["code"]) == p["status"], (name, p)
            assert e["to_start_ms"] > -5 and e["duration_ms"] <= p["latency_s"] * 1000 + 1, (name, p)
            if name == "none":
                assert e["ext_proc_ms"] is None
            else:
                assert 0 < e["ext_proc_ms"] <= e["duration_ms"] + 1, (name, p)
        rejected = [p for p in probes if p["status"] == 429]
        if rejected:
            assert r["probe_ext_proc_p99_ms"] is not None and r["probe_to_envoy_p99_ms"] is not None, name
        if r["probe_rejected"]:
            assert r["probe_reject_p50_ms"] <= r["probe_reject_p99_ms"], name
    # At a fifth of capacity nothing is shed without admission control (the probes neither).
    assert rows["none"]["rejected"] == 0 and rows["none"]["probe_rejected"] == 0
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
    assert overload.parse_config("static-96@picking").picking and not overload.parse_config("static-96").picking
    with pytest.raises(argparse.ArgumentTypeError):
        overload.parse_config("static-x")
    sampled = overload.parse_config("vegas-combined@sample0.1")
    assert sampled.sample == 0.1 and sampled.name == "vegas-combined@sample0.1"
    assert overload.floodgate_config(sampled)["pools"][0]["limit"] == {"mode": "vegas", "sample_rate": 0.1}
    assert "sample_rate" not in overload.floodgate_config(overload.parse_config("vegas-combined"))["pools"][0]["limit"]
    for bad in ("static-96@sample0.1", "vegas-combined@sample1.5", "vegas-combined@samplex"):
        with pytest.raises(argparse.ArgumentTypeError):
            overload.parse_config(bad)


def test_adaptive_concurrency_config_is_valid_envoy(tmp_path: Path) -> None:
    cfg = render_local(admission=False, extra_filters=[overload.adaptive_concurrency_filter()])
    path = write_config(cfg, tmp_path / "adaptive.json")
    proc = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_histogram_quantile_is_prometheus_like() -> None:
    buckets = [[0.001, 50.0], [0.01, 90.0], [1.0, 99.0], [1.1, 100.0], [float("inf"), 100.0]]
    assert overload.histogram_quantile(buckets, 0.5) == pytest.approx(0.001)
    assert overload.histogram_quantile(buckets, 0.7) == pytest.approx(0.001 + 0.009 * 0.5)
    assert overload.histogram_quantile(buckets, 0.995) == pytest.approx(1.05)
    assert overload.histogram_quantile([], 0.5) is None
    merged = overload._merge([[[0.01, 1.0], [float("inf"), 2.0]], [[0.01, 3.0], [float("inf"), 3.0]]])
    assert merged == [[0.01, 4.0], [float("inf"), 5.0]]


def test_p0_bound_on_the_engine_model() -> None:
    """The engine-priority policy's P0 TTFT grows with the batch it holds, and so does goodput;
    the FIFO bound's paragraph names the floor, the best point and every point's figures."""
    import math

    from floodgate.bench.p0_bound import ideal_policy, p0_fifo_bound

    w = overload.Workload()
    small = ideal_policy(w, 8, 5.0, 60.0, 2.0, 0.1, seed=1)
    big = ideal_policy(w, 64, 5.0, 60.0, 2.0, 0.1, seed=1)
    assert big.goodput_tok_s > 1.3 * small.goodput_tok_s
    assert big.p0_ttft_p50_s > small.p0_ttft_p50_s and small.p0_count > 100
    b = p0_fifo_bound(w, 19.1, 1222.0, 2.0, 0.1, duration=40.0, seeds=(1,), ns=(8, 48), caps=(0, math.inf)).to_dict()
    text = overload.render_bound(b, [])
    assert b["best"] is not None and ("N = 48, K = 0" in text or "N = 48, no cap" in text)
    assert f"{1000 * b['p0_alone']['p0_ttft_p99_s']:.0f} ms" in text
    assert text.count("P0 TTFT p99 ms (goodput tok/s)") == 2
    assert overload.render_bound(None, []) == ""
