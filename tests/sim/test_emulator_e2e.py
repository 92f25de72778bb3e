"""The emulator as a real process, driven by the official `openai` client and aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from floodgate.supervisor import Supervisor, free_port, wait_for_port

MODEL = "floodgate-sim-test"
# Fast model so the tests stay short: 5 ms steps, +1 ms per decoding sequence.
FAST_ARGS = (
    "--model", MODEL,
    "--decode-base-ms", "5", "--decode-per-seq-ms", "1", "--prefill-ms-per-token", "0.01",
    "--wake-delay-level1", "0.3", "--wake-delay-level2", "0.6", "--sleep-delay", "0.05",
    "--log-level", "warning",
)


class Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0)


def start(sup: Supervisor, name: str, extra: Sequence[str]) -> Server:
    port = free_port()
    child = sup.start_python(name, ["-m", "floodgate", "sim", "--port", str(port),
                                    *FAST_ARGS, *extra])
    try:
        wait_for_port("127.0.0.1", port, 15, child.proc)
    except (RuntimeError, TimeoutError):
        pytest.fail(f"emulator did not start:\n{child.log_tail()}")
    return Server(port)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Supervisor() as sup:
        yield start(sup, "sim", ["--cold-start", "0", "--enable-sleep-mode"])


async def metrics(server: Server) -> dict[str, float]:
    """Samples keyed by name plus the labels other than model_name/engine."""
    async with aiohttp.ClientSession() as s, s.get(server.base + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL
            extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                             if k not in ("model_name", "engine", "le"))
            key = sample.name + (f"{{{extra}}}" if extra else "")
            if "le" not in sample.labels:
                out[key] = sample.value
    return out


async def test_non_streaming_completion_and_chat(server: Server) -> None:
    client = server.client()
    cmpl = await client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7)
    assert cmpl.choices[0].finish_reason == "length"
    assert cmpl.usage is not None and cmpl.usage.completion_tokens == 7
    assert cmpl.choices[0].text.strip()
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_streaming_chat_with_usage_and_trace_headers(server: Server) -> None:
    client = server.client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=100,
        stream=True, stream_options={"include_usage": True},
        extra_headers={"x-sim-output-tokens": "12", "x-sim-prompt-tokens": "321"})
    content: list[str] = []
    finish = None
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                content.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(content) == 12
    assert finish == "stop"  # the trace length, not max_tokens, ended it
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (321, 12)


async def test_streaming_completion_without_usage(server: Server) -> None:
    client = server.client()
    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True)
    chunks = [c async for c in stream]
    assert len(chunks) == 4 and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_errors_look_like_openai_errors(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)


async def test_routing_errors_are_json_like_vllms_fastapi(server: Server) -> None:
    """A wrong method or path gets FastAPI's JSON `detail` as vLLM answers it (aiohttp's own was
    text/plain, which reached clients through the gateway for GET /v1/completions)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base + "/v1/completions") as r:
            assert r.status == 405 and r.headers["content-type"].startswith("application/json")
            assert await r.json() == {"detail": "Method Not Allowed"} and r.headers["allow"] == "POST"
        async with s.post(server.base + "/v1/nope", json={}) as r:
            assert r.status == 404 and await r.json() == {"detail": "Not Found"}


async def test_priority_is_refused_under_fcfs_like_vllm(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="Got priority -1 but Priority scheduling is not enabled"):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": -1})
    with pytest.raises(openai.BadRequestError, match="priority must be an integer"):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": "high"})
    ok = await client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 0})
    assert ok.choices[0].text


async def test_priority_policy_serves_the_lower_value_first() -> None:
    """One slot: a long low0 runs, low1..3 queue (in a known order), then a priority -1 request
    arrives: it is served next, ahead of the three that waited longer (fcfs would serve it last).
    Each request is sent only once the emulator's metrics show the previous one queued, so the
    order does not depend on how concurrent connections race on a loaded box."""
    with Supervisor() as sup:
        srv = start(sup, "sim-prio", ["--cold-start", "0", "--max-num-seqs", "1",
                                      "--scheduling-policy", "priority"])
        client = srv.client()
        done: list[str] = []

        async def one(name: str, prio: int, tokens: int) -> None:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=tokens, extra_body={"priority": prio})
            done.append(name)

        async def until_present(n: int) -> None:
            while True:
                m = await metrics(srv)
                if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= n:
                    return
                await asyncio.sleep(0.005)

        # low0 runs 600 steps of 5 ms (3 s): ample time to queue the rest behind it even on a loaded box.
        plan = [("low0", 0, 600), ("low1", 0, 15), ("low2", 0, 15), ("low3", 0, 15), ("high", -1, 15)]
        tasks = []
        for i, (name, prio, tokens) in enumerate(plan):
            tasks.append(asyncio.create_task(one(name, prio, tokens)))
            await until_present(i + 1)
        assert not done, "low0 finished before the queue formed"
        await asyncio.gather(*tasks)
        assert done == ["low0", "high", "low1", "low2", "low3"]


async def test_metrics_names_and_monotonic_counters(server: Server) -> None:
    before = await metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_success_total{finished_reason=length}",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:engine_sleep_state{sleep_state=awake}",
                 "vllm:engine_sleep_state{sleep_state=weights_offloaded}",
                 "vllm:engine_sleep_state{sleep_state=discard_all}"):
        assert name in before, name
    client = server.client()
    await asyncio.gather(*(client.completions.create(
        model=MODEL, prompt="count me", max_tokens=3,
        extra_headers={"x-sim-prompt-tokens": "10"}) for _ in range(5)))
    after = await metrics(server)
    assert after["vllm:request_success_total{finished_reason=length}"] >= \
        before["vllm:request_success_total{finished_reason=length}"] + 5
    assert after["vllm:prompt_tokens_total"] >= before["vllm:prompt_tokens_total"] + 50
    assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"] + 15
    assert after["vllm:time_to_first_token_seconds_count"] >= \
        before["vllm:time_to_first_token_seconds_count"] + 5
    assert after["vllm:inter_token_latency_seconds_count"] >= \
        before["vllm:inter_token_latency_seconds_count"] + 10
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0


async def test_client_disconnect_frees_the_sequence(server: Server) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + "/v1/completions",
                          json={"model": MODEL, "prompt": "x" * 4000, "max_tokens": 5000,
                                "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # the first token arrived: the sequence runs
            mid = await metrics(server)
            assert mid["vllm:num_requests_running"] >= 1
            assert mid["vllm:kv_cache_usage_perc"] > 0
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 5
    while True:
        now = await metrics(server)
        if now["vllm:num_requests_running"] == 0 and now["vllm:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.05)
    assert now["vllm:request_success_total{finished_reason=abort}"] >= 1

    # A non-streaming client that gives up is noticed too (the handler gets cancelled).
    client = server.client()
    task = asyncio.create_task(client.completions.create(model=MODEL, prompt="x",
                                                         max_tokens=5000))
    await asyncio.sleep(0.3)
    assert (await metrics(server))["vllm:num_requests_running"] >= 1
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await client.close()  # closes the pooled connection the request was using
    deadline = time.monotonic() + 5
    while (await metrics(server))["vllm:num_requests_running"] != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def _stream_timing(client: openai.AsyncOpenAI, tokens: int) -> tuple[float, float]:
    """(TTFT, mean gap between later chunks) as the client sees them."""
    t0 = time.monotonic()
    stream = await client.completions.create(model=MODEL, prompt="p", max_tokens=tokens,
                                             stream=True)
    stamps = [time.monotonic() async for _ in stream]
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def test_ttft_climbs_with_queueing_and_tpot_with_batch() -> None:
    with Supervisor() as sup:
        srv = start(sup, "sim-small", ["--cold-start", "0", "--max-num-seqs", "4",
                                       "--decode-per-seq-ms", "4"])
        client = srv.client()
        # 12 concurrent requests, 4 slots: three waves, later waves wait for earlier ones.
        results = await asyncio.gather(*(_stream_timing(client, 20) for _ in range(12)))
        ttfts = sorted(r[0] for r in results)
        wave = 20 * (0.005 + 4 * 0.004)  # ~0.42 s per wave of 4
        assert ttfts[-1] > ttfts[0] + wave  # generous: the last wave waits for two
        # TPOT: one stream alone (9 ms steps) vs four together (21 ms steps), as the client
        # sees it; the margin absorbs scheduling noise on a shared machine.
        solo = await _stream_timing(client, 30)
        together = await asyncio.gather(*(_stream_timing(client, 30) for _ in range(4)))
        assert statistics.mean(t[1] for t in together) > solo[1] * 1.4


async def test_sleep_wake_cycle(server: Server) -> None:
    client = server.client()
    async with aiohttp.ClientSession() as s:
        # mode=wait lets the in-flight request finish before sleeping.
        inflight = asyncio.create_task(client.completions.create(
            model=MODEL, prompt="x", max_tokens=30))
        await asyncio.sleep(0.05)
        async with s.post(server.base + "/sleep", params={"level": "1", "mode": "wait"}) as r:
            assert r.status == 200
        done = await inflight
        assert done.choices[0].finish_reason == "length"
        async with s.get(server.base + "/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": True}
        m = await metrics(server)
        assert m["vllm:engine_sleep_state{sleep_state=awake}"] == 0
        assert m["vllm:engine_sleep_state{sleep_state=weights_offloaded}"] == 1
        async with s.get(server.base + "/health") as r:
            assert r.status == 200  # like vLLM: alive while asleep
        with pytest.raises(openai.APIStatusError) as exc:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert exc.value.status_code == 503
        t0 = time.monotonic()
        async with s.post(server.base + "/wake_up") as r:
            assert r.status == 200
        assert time.monotonic() - t0 >= 0.25  # the level-1 wake delay (0.3 s)
        async with s.get(server.base + "/is_sleeping") as r:
            assert await r.json() == {"is_sleeping": False}
        ok = await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens == 2

        # mode=abort ends the in-flight stream at once; level 2 shows as discard_all.
        stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=10_000,
                                                 stream=True)
        first = await stream.__anext__()
        assert first.choices
        async with s.post(server.base + "/sleep", params={"level": "2", "mode": "abort"}) as r:
            assert r.status == 200
        rest = [c async for c in stream]
        assert rest[-1].choices[0].finish_reason == "abort"
        m = await metrics(server)
        assert m["vllm:engine_sleep_state{sleep_state=discard_all}"] == 1
        assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
        async with s.post(server.base + "/wake_up") as r:
            assert r.status == 200
        m = await metrics(server)
        assert m["vllm:engine_sleep_state{sleep_state=awake}"] == 1


async def test_cold_start_and_sleep_mode_disabled() -> None:
    with Supervisor() as sup:
        # Counted from spawn: long enough that a loaded box has started it (and is listening)
        # well before it ends (1.0 s was not always: /health already answered 200).
        srv = start(sup, "sim-cold", ["--cold-start", "4.0"])
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.base + "/health") as r:
                assert r.status == 503
            async with s.post(srv.base + "/v1/completions",
                              json={"model": MODEL, "prompt": "x"}) as r:
                assert r.status == 503
            deadline = time.monotonic() + 15
            while True:
                async with s.get(srv.base + "/health") as r:
                    if r.status == 200:
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            for method, path in (("POST", "/sleep"), ("POST", "/wake_up"),
                                 ("GET", "/is_sleeping")):
                async with s.request(method, srv.base + path) as r:
                    assert r.status == 404


def test_process_age_counts_from_spawn() -> None:
    """The cold start counts from process spawn: the age a child reports includes its own
    interpreter start-up and imports (≥ the sleep it did after them) and never exceeds what
    the parent measured around its whole life (+ one clock tick of /proc rounding)."""
    import subprocess
    import sys

    code = ("import time; from floodgate.sim.emulator import process_age; "
            "time.sleep(0.3); print(process_age())")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    elapsed = time.monotonic() - t0
    age = float(out.stdout)
    assert 0.3 <= age <= elapsed + 0.02


async def test_cold_start_is_never_shorter_than_configured_from_spawn() -> None:
    with Supervisor() as sup:
        port = free_port()
        t0 = time.monotonic()
        child = sup.start_python("sim-spawn", ["-m", "floodgate", "sim", "--port", str(port),
                                               *FAST_ARGS, "--cold-start", "1.5"])
        wait_for_port("127.0.0.1", port, 15, child.proc)
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.get(f"http://127.0.0.1:{port}/health") as r:
                    if r.status == 200:
                        break
                assert time.monotonic() - t0 < 15
                await asyncio.sleep(0.02)
        assert time.monotonic() - t0 >= 1.5 - 0.02


async def test_a_request_body_over_one_mib_is_served_as_vllm_serves_it(server: Server) -> None:
    """A chat with a 2 MiB base64 image part: vLLM's server has no body limit, so neither may
    the emulator (aiohttp's default would answer 413)."""
    image = "data:image/png;base64," + "A" * (2 * 1024 * 1024)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": image}}]}]}
    async with aiohttp.ClientSession() as s, s.post(server.base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, (r.status, (await r.text())[:200])


def _sim_exit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "floodgate", "sim", "--cold-start", "0", *args],
                          capture_output=True, text=True, timeout=30)


def test_a_port_in_use_is_one_line_naming_port(server: Server) -> None:
    # A second `floodgate sim` on the first one's port used to end in an OSError traceback, exit 1.
    r = _sim_exit("--port", str(server.port))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --port {server.port}: cannot listen on 127.0.0.1:{server.port}: Address already in use"]


@pytest.mark.parametrize(("host", "reason"), [
    ("999.1.1.1", "not a known host name or address"),  # was a socket.gaierror traceback
    ("192.0.2.1", "not an address of this host"),  # TEST-NET-1: nobody's address
])
def test_a_host_it_cannot_listen_on_is_one_line_naming_host(host: str, reason: str) -> None:
    r = _sim_exit("--host", host, "--port", str(free_port()))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --host {host}: {reason} ("), r.stderr
