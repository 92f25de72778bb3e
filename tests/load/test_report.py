"""Summary, markdown, JSON and plots computed from hand-built records."""

from __future__ import annotations

from pathlib import Path

import pytest
from floodgate.sim.loadgen import ERROR, OK, REJECTED, LoadResult, Record, Sample
from floodgate.sim.report import (
    SLO,
    load_json,
    produced_goodput,
    rate_series,
    render_markdown,
    summarize,
    summarize_window,
    write_report,
)


def make_records() -> list[Record]:
    recs: list[Record] = []
    for i in range(60):
        t = i * 0.5  # 2 req/s for 30 s
        prio = i % 3
        r = Record(i, t, prio, f"t{i % 2}", 100, 20)
        r.t_sent = t
        burst = 10 <= t < 20
        if burst and prio == 2:
            r.outcome, r.status, r.reject_reason, r.retry_after = REJECTED, 429, "early_drop", 1.5
            r.t_done = t + 0.01
        elif burst and prio == 1 and i % 2 == 0:
            r.outcome, r.status, r.reject_reason = REJECTED, 429, "queue_timeout"
            r.t_done = t + 5
        elif i == 59:
            r.outcome, r.status, r.error = ERROR, 504, "HTTP 504: upstream timeout"
            r.t_done = t + 1
        else:
            r.outcome, r.status, r.tokens = OK, 200, 20
            # Burst arrivals are slow (TTFT 3 s > SLO), the rest fast.
            r.ttft_s = 3.0 if burst else 0.2
            r.tpot_s = 0.02
            r.queue_ms = 2900.0 if burst else 1.0
            r.e2e_s = r.ttft_s + 19 * r.tpot_s
            r.t_done = t + r.e2e_s
        recs.append(r)
    return recs


def test_summary_counts_and_invariant() -> None:
    recs = make_records()
    s = summarize(recs, SLO(2.0, 0.1))
    s.check()
    o = s.overall
    assert o.offered == 60
    assert o.offered == o.admitted + o.rejected + o.errors
    assert o.rejected == s.per_priority[2].rejected + s.per_priority[1].rejected
    assert s.per_priority[2].rejected_by_reason == {"early_drop": 7}
    assert o.rejected_by_reason["queue_timeout"] == s.per_priority[1].rejected
    assert o.errors == 1 and o.errors_by_kind == {"HTTP 504": 1}
    # SLO: only admitted requests that arrived outside the burst meet TTFT <= 2 s.
    outside_ok = [r for r in recs if r.outcome == OK and not 10 <= r.t_planned < 20]
    assert o.slo_met == len(outside_ok)
    assert o.goodput_tok_s == pytest.approx(20 * len(outside_ok) / s.duration_s)
    assert o.ttft_p50 == pytest.approx(0.2)
    assert s.per_priority[0].success_rate == 1.0


def test_window_summary_is_during_the_burst() -> None:
    recs = make_records()
    w = summarize_window(recs, 10, 20)
    w.check()
    assert w.overall.offered == 20 and w.duration_s == 10
    assert w.overall.slo_met == 0 and w.overall.goodput_tok_s == 0
    assert w.per_priority[2].admitted == 0
    assert w.per_priority[0].ttft_p99 == pytest.approx(3.0)


def test_rate_series_keeps_the_invariant_per_bin() -> None:
    s = rate_series(make_records())
    assert (s["offered"] == s["admitted"] + s["rejected"] + s["errors"]).all()
    assert s["offered"].sum() == 60


def test_markdown_sections() -> None:
    md = render_markdown(summarize(make_records()), {"target": "http://x", "requests": 60})
    for section in ("# Load run summary", "## Admission", "## Rejections by reason",
                    "## Latency", "## Throughput", "## Errors"):
        assert section in md
    assert "early_drop" in md and "queue_timeout" in md and "P2 sheddable" in md
    assert "| overall | 60 |" in md


def test_markdown_tells_failed_metrics_scrapes() -> None:
    summary = summarize(make_records())
    meta = {"metrics_url": "http://m/metrics", "scrapes": 4, "scrape_errors": 4,
            "scrape_last_error": "ClientConnectorError: refused"}
    assert ("- WARNING: every scrape of --metrics-url http://m/metrics failed (4 of 4, last: "
            "ClientConnectorError: refused): no metrics sampled") in render_markdown(summary, meta)
    md = render_markdown(summary, {**meta, "scrape_errors": 1})
    assert "WARNING" not in md and "- metrics scrapes failed: 1 of 4 (last: ClientConnectorError: refused)" in md
    assert "scrape" not in render_markdown(summary, {**meta, "scrape_errors": 0})


def test_write_report_files_and_roundtrip(tmp_path: Path) -> None:
    recs = make_records()
    samples = [Sample(float(t), {"floodgate_queue_depth": float(t % 5), "floodgate_limit": 10.0})
               for t in range(30)]
    result = LoadResult(recs, samples, {"target": "http://x"})
    paths = write_report(tmp_path, result, SLO(), windows={"burst": (10, 20)})
    for key in ("json", "summary", "rates", "latency", "metrics"):
        assert paths[key].exists(), key
    for key in ("rates", "latency", "metrics"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["summary"].read_text()
    assert "## Window: burst" in md and "### Admission" in md
    back = load_json(paths["json"])
    assert [r.to_dict() for r in back.records] == [r.to_dict() for r in recs]
    assert back.samples[3].values == samples[3].values
    # No samples: no metrics plot, everything else still written.
    paths2 = write_report(tmp_path / "b", LoadResult(recs), plots=True)
    assert "metrics" not in paths2 and paths2["rates"].exists()


def _ok(t_sent: float, ttft: float, tpot: float, tokens: int) -> Record:
    r = Record(0, t_sent, 1, "t", 100, tokens)
    r.t_sent, r.outcome, r.status, r.tokens, r.ttft_s, r.tpot_s = t_sent, OK, 200, tokens, ttft, tpot
    r.t_done = t_sent + ttft + tpot * (tokens - 1)
    return r


def test_goodput_is_counted_where_the_tokens_were_produced() -> None:
    slo = SLO(ttft_s=2.0, tpot_s=0.1)
    # Arrived in [10, 20), 101 tokens over 10 s (0.1 s each) from 15 s: half of them after 20 s.
    late = _ok(14.0, 1.0, 0.1, 101)
    assert produced_goodput([late], slo, 10.0, 20.0) == pytest.approx(50.5 / 10)
    # Counted by arrival, all 101 fell in the window: the burst read ~2x what it produced.
    assert summarize([late], slo, window=(10.0, 20.0)).overall.goodput_tok_s == pytest.approx(101 / 10)
    # A request from before the window produces inside it: counted there.
    early = _ok(5.0, 0.5, 0.1, 101)  # tokens over 5.5-15.5 s
    assert produced_goodput([early], slo, 10.0, 20.0) == pytest.approx(101 * 5.5 / 10 / 10)
    # A steady flow reads the same either way (edges cancel); SLO misses and one-token answers.
    steady = [_ok(t * 0.5, 0.2, 0.05, 41) for t in range(200)]  # 2 req/s, 2 s each
    by_prod = produced_goodput(steady, slo, 20.0, 80.0)
    by_arrival = summarize(steady, slo, window=(20.0, 80.0)).overall.goodput_tok_s
    assert by_prod == pytest.approx(by_arrival, rel=0.01)
    assert produced_goodput([_ok(12.0, 3.0, 0.05, 41)], slo, 10.0, 20.0) == 0.0  # TTFT over the SLO
    assert produced_goodput([_ok(12.0, 0.2, 0.0, 1)], slo, 10.0, 20.0) == pytest.approx(0.1)
