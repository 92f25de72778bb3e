"""The real load generator against the real emulator (`floodgate sim` as a process).

The rejection test uses a tiny in-test HTTP endpoint that only answers with Floodgate's §5
rejection shape (429 + headers + OpenAI error body): it stands in for the gateway's reject
path, not for the emulator, so retry and header parsing are covered before extproc exists.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from floodgate.sim.arrivals import PlannedRequest
from floodgate.sim.loadgen import (
    DEFAULT_MODEL,
    ERROR,
    OK,
    REJECTED,
    _error_text,
    resolve_model,
    run_load,
    run_load_detailed,
)
from floodgate.sim.report import summarize

from floodgate.cli import main as floodgate_main
from floodgate.supervisor import Supervisor, free_port, wait_for_port
from tests.helpers import serving


@pytest.fixture(scope="module")
def emulator() -> Iterator[str]:
    # Only the emulator tests depend on it; the rejection and unreachable tests run regardless.
    pytest.importorskip("floodgate.sim.emulator", reason="the vLLM emulator (floodgate.sim.emulator) is not importable")
    port = free_port()
    with Supervisor() as sup:
        child = sup.start_python(
            "sim", ["-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0", "--log-level", "warning"]
        )
        wait_for_port("127.0.0.1", port, 20, child.proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"emulator never became healthy:\n{child.log_tail()}")
            time.sleep(0.1)
        yield url


def plan(n: int, rate: float, output_tokens: int, prompt_tokens: int = 64) -> list[PlannedRequest]:
    return [
        PlannedRequest(i / rate, i % 3, f"tenant-{i % 2}", prompt_tokens, output_tokens) for i in range(n)
    ]


async def test_open_loop_streaming_against_emulator(emulator: str) -> None:
    result = await run_load_detailed(
        plan(24, rate=24.0, output_tokens=120),
        emulator,
        request_timeout=60,
        metrics_url=emulator + "/metrics",
        metrics=["vllm:num_requests_running", "vllm:num_requests_waiting", "floodgate_queue_depth"],
        sample_interval=0.25,
    )
    recs = result.records
    assert [r.outcome for r in recs] == [OK] * 24, [r.error for r in recs if r.error]
    for r in recs:
        assert r.status == 200 and r.tokens == 120
        assert r.ttft_s is not None and r.ttft_s > 0
        assert r.tpot_s is not None and r.tpot_s > 0
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s
        assert r.queue_ms is None  # no gateway in front
    # Open loop: every request went out before the first one (>= 120 decode steps) finished.
    assert max(r.t_sent or 0 for r in recs) < min(r.t_done or 0 for r in recs)
    assert result.meta["model"] and result.meta["requests"] == 24
    assert result.samples, "the sampler recorded nothing"
    assert max(s.values.get("vllm:num_requests_running", 0) for s in result.samples) > 0
    assert all("floodgate_queue_depth" not in s.values for s in result.samples)  # absent stays absent
    s = summarize(recs)
    s.check()
    assert s.overall.admitted == 24 and s.overall.ttft_p50 is not None


def test_cli_writes_report(emulator: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rc = floodgate_main([
        "load", "--target", emulator, "--shape", "constant", "--rate", "10", "--duration", "1.5",
        "--prompt-mean", "32", "--prompt-sigma", "0", "--output-mean", "8", "--output-sigma", "0",
        "--tenants", "a,b", "--priority-mix", "1,1,1", "--window", "mid=0.5:1.0", "--out", str(out), "--quiet",
    ])
    assert rc == 0
    data = json.loads((out / "requests.json").read_text())
    assert len(data["records"]) == 15
    assert all(r["outcome"] == OK and r["tokens"] == 8 for r in data["records"])
    assert {r["tenant"] for r in data["records"]} <= {"a", "b"}
    md = (out / "summary.md").read_text()
    assert "| overall | 15 | 15 | 0 | 0 |" in md and "## Window: mid" in md
    assert (out / "rates.png").exists() and (out / "latency.png").exists()


async def test_a_json_error_without_an_error_key_keeps_its_status(emulator: str) -> None:
    # The emulator answers an unknown path like vLLM's FastAPI: 404 {"detail": "Not Found"}. That
    # used to raise KeyError in the loadgen: status None, "loadgen: KeyError('error')", exit 1.
    recs = await run_load(plan(2, rate=20.0, output_tokens=4), emulator + "/v1", model="floodgate-sim-8b",
                          request_timeout=10)
    for r in recs:
        assert r.outcome == ERROR and r.status == 404, r
        assert r.error == "HTTP 404: Not Found"


@pytest.mark.parametrize(("body", "text"), [
    ('{"error": {"message": "no", "type": "x"}}', "HTTP 400: no"),
    ('{"object": "error", "message": "bad model", "type": "NotFoundError"}', "HTTP 400: bad model"),
    ('{"error": "plain"}', "HTTP 400: plain"),
    ('{"detail": [{"loc": ["body"], "msg": "field required"}]}',
     'HTTP 400: {"detail": [{"loc": ["body"], "msg": "field required"}]}'),
    ('["a"]', 'HTTP 400: ["a"]'),
    ("null", "HTTP 400: null"),
    ("upstream connect error ", "HTTP 400: upstream connect error"),
])
def test_error_text_of_other_json_shapes(body: str, text: str) -> None:
    assert _error_text(400, body) == text


def test_cli_takes_a_target_ending_in_v1_as_its_base_url(emulator: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # An OpenAI client's base_url ends in /v1; requests went to /v1/v1/completions (404, exit 1).
    out = tmp_path / "run"
    rc = floodgate_main([
        "load", "--target", emulator + "/v1/", "--shape", "constant", "--rate", "10", "--duration", "0.5",
        "--prompt-mean", "16", "--output-mean", "4", "--output-sigma", "0", "--no-plots", "--out", str(out), "--quiet",
    ])
    assert rc == 0
    assert f"--target is the base URL without /v1; sending to {emulator}/v1/..." in capsys.readouterr().err
    data = json.loads((out / "requests.json").read_text())
    assert data["meta"]["target"] == emulator
    assert {r["outcome"] for r in data["records"]} == {OK}


async def test_model_fallback_is_announced(emulator: str, capsys: pytest.CaptureFixture[str]) -> None:
    # No /v1/models under this prefix (404): the fallback name is served by no server, so say so.
    async with aiohttp.ClientSession() as session:
        assert await resolve_model(session, emulator) == "floodgate-sim-8b"
        assert capsys.readouterr().err == ""
        assert await resolve_model(session, emulator + "/nowhere") == DEFAULT_MODEL
    err = capsys.readouterr().err
    assert f"warning: no model from {emulator}/nowhere/v1/models (it answered HTTP 404)" in err
    assert f"sending model {DEFAULT_MODEL!r} (pass --model NAME)" in err


def test_cli_says_when_every_metrics_scrape_failed(emulator: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens at the metrics URL: the run succeeds but must not look as if it sampled.
    metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
    out = tmp_path / "run"
    rc = floodgate_main([
        "load", "--target", emulator, "--shape", "constant", "--rate", "10", "--duration", "0.5",
        "--prompt-mean", "16", "--output-mean", "4", "--output-sigma", "0", "--metrics-url", metrics_url,
        "--sample-interval", "0.2", "--no-plots", "--out", str(out), "--quiet",
    ])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"floodgate load: warning: every scrape of --metrics-url {metrics_url} failed (" in err
    assert "no metrics sampled" in err and "ClientConnectorError" in err
    assert f"- WARNING: every scrape of --metrics-url {metrics_url} failed (" in (out / "summary.md").read_text()
    meta = json.loads((out / "requests.json").read_text())["meta"]
    assert meta["scrapes"] >= 1 and meta["scrape_errors"] == meta["scrapes"]
    # Scrapes that work: no warning.
    rc = floodgate_main([
        "load", "--target", emulator, "--shape", "constant", "--rate", "10", "--duration", "0.5",
        "--prompt-mean", "16", "--output-mean", "4", "--output-sigma", "0", "--metrics-url", emulator + "/metrics",
        "--metrics", "vllm:num_requests_running", "--no-plots", "--out", str(out), "--quiet",
    ])
    assert rc == 0 and "scrape" not in capsys.readouterr().err
    assert "scrape" not in (out / "summary.md").read_text()


def test_unreachable_target_exits_nonzero_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens here
    rc = floodgate_main(["load", "--target", f"http://127.0.0.1:{port}", "--rate", "5",
                         "--duration", "600", "--timeout", "5", "--quiet"])  # told at once, not in 10 min
    assert rc == 1
    assert "cannot reach" in capsys.readouterr().err


async def test_rejection_headers_and_bounded_retry() -> None:
    seen: list[dict[str, Any]] = []

    async def reject(request: web.Request) -> web.Response:
        seen.append({"headers": dict(request.headers), "body": await request.json()})
        if request.headers.get("x-tenant-id") == "no-reason":
            return web.Response(status=503, text="no healthy upstream")
        return web.json_response(
            {"error": {"message": "predicted wait exceeds timeout", "type": "rate_limit_error",
                       "code": "early_drop"}},
            status=429,
            headers={"retry-after": "0.05", "x-floodgate-reject-reason": "early_drop",
                     "x-floodgate-priority": "2"},
        )

    app = web.Application()
    app.router.add_post("/v1/completions", reject)
    async with serving(app) as port:
        p = [PlannedRequest(0.0, 2, "noisy", 40, 7), PlannedRequest(0.01, 0, "no-reason", 40, 7)]
        recs = await run_load(p, f"http://127.0.0.1:{port}", retry=2, request_timeout=5)
    rej, err = recs
    assert rej.outcome == REJECTED and rej.status == 429 and rej.reject_reason == "early_drop"
    assert rej.retry_after == pytest.approx(0.05) and rej.retries == 2
    assert rej.gateway_priority == 2
    assert rej.error is not None and "predicted wait exceeds timeout" in rej.error
    # A 503 without Floodgate's reason header is an upstream error, not a rejection; no retry.
    assert err.outcome == ERROR and err.status == 503 and err.retries == 0
    first = next(s for s in seen if s["headers"]["x-tenant-id"] == "noisy")
    assert sum(s["headers"]["x-tenant-id"] == "noisy" for s in seen) == 3  # 1 + 2 retries
    # Each retry says so, as OpenAI's SDKs do (the processors count one turned away again as no demand).
    assert [s["headers"].get("x-stainless-retry-count") for s in seen if s["headers"]["x-tenant-id"] == "noisy"] \
        == [None, "1", "2"]
    h, body = first["headers"], first["body"]
    assert h["x-request-priority"] == "2" and h["x-sim-output-tokens"] == "7" and h["x-sim-prompt-tokens"] == "40"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 7 and len(body["prompt"].split()) == pytest.approx(40, abs=2)


def test_ctrl_c_ends_the_run_with_a_report_of_what_was_sent(emulator: str, tmp_path: Path) -> None:
    # A long run stopped with Ctrl-C used to end in a traceback and no report; like wrk, hey and
    # k6, it now reports the requests sent: the finished ones as they ended, the ones in flight
    # as errors of kind "interrupted", the ones never sent left out. Exit 130.
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "floodgate", "load", "--target", emulator, "--shape", "constant", "--rate", "10",
         "--duration", "120", "--prompt-mean", "32", "--prompt-sigma", "0", "--output-mean", "400",
         "--output-sigma", "0", "--out", str(out), "--no-plots", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As a terminal starts it: a pytest-xdist worker ignores SIGINT, and a child inherits
        # that (Python then leaves it ignored, as for a background job: Ctrl-C never arrives).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        running = 0.0
        while running < 3:  # streams in flight on the emulator when the interrupt comes
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the emulator never had 3 streams running"
            with urllib.request.urlopen(emulator + "/metrics", timeout=2) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        running = float(line.split()[-1])
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "floodgate load: interrupted after" in err and "Traceback" not in err
    data = json.loads((out / "requests.json").read_text())
    recs = data["records"]
    assert data["meta"]["interrupted"] is True
    assert 3 <= len(recs) < 1200  # only what was sent, not the 1,200 planned
    assert all(r["t_sent"] is not None for r in recs)
    interrupted = [r for r in recs if r["outcome"] == ERROR]
    assert len(interrupted) >= 3 and all(r["error"].startswith("interrupted") for r in interrupted)
    assert all(r["outcome"] in (OK, ERROR) for r in recs)
    assert "| overall |" in (out / "summary.md").read_text()
