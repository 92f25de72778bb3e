"""Scrapers: vLLM /metrics parsing and histogram deltas, Envoy stats, and staleness — a dead
replica's scrape is marked failed and the policy holds instead of scaling down."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import sys
from collections.abc import Callable

import aiohttp
import pytest
from floodgate.controller.app import PoolController, Replica
from floodgate.controller.decider import DeciderState
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.policy import REASON_HOLD_STALE, PolicyState
from floodgate.controller.scrape import ReplicaScraper, parse_envoy, scrape_envoy, scrape_floodgate
from floodgate.controller.signals import ReplicaState, ReplicaView
from floodgate.controller.vllm import (
    Histogram,
    MetricsError,
    VllmClient,
    VllmError,
    VllmSample,
    parse_metrics,
)
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.live import controller_config, wait_for
from tests.helpers import serving

PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{model_name="m",sleep_state="awake"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} %d
vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} %d
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} %d
vllm:time_to_first_token_seconds_count{model_name="m"} %d
vllm:time_to_first_token_seconds_sum{model_name="m"} %f
"""


def test_parse_metrics_and_histogram_deltas() -> None:
    a = parse_metrics(PAGE % (2, 4, 4, 4, 1.0), "r", 10.0)
    m = a.metrics
    assert (m.ok, m.running, m.waiting, m.kv_cache_usage, a.asleep) == (True, 3, 5, 0.42, False)
    # First scrape: a baseline. The cumulative histogram holds the replica's whole life (a
    # pool replica is not scraped while it sleeps: re-promoted, its page still holds what it
    # served in the last burst), not this tick.
    assert a.ttft.count == 4 and a.ttft_delta.count == 0 and a.itl_delta.count == 0
    b = parse_metrics(PAGE % (2, 9, 10, 10, 4.0), "r", 11.0, prev=a)
    d = b.ttft_delta
    assert (d.count, d.total, d.mean) == (6, 3.0, 0.5)
    assert dict(d.buckets)[0.1] == 0 and dict(d.buckets)[1.0] == 5
    assert d.quantile(0.5) == 1.0 and d.quantile(1.0) == float("inf")
    # a restarted replica (counters reset) starts a fresh delta instead of going negative
    c = parse_metrics(PAGE % (1, 1, 1, 1, 0.05), "r", 12.0, prev=b)
    assert c.ttft_delta.count == 1
    assert Histogram().quantile(0.9) is None
    with pytest.raises(ValueError):
        parse_metrics("# TYPE other gauge\nother 1\n", "r", 1.0)  # not a vLLM page: never zeros


def test_after_a_failed_scrape_the_delta_covers_the_gap_not_the_replicas_life() -> None:
    """A review: the good scrape after one failure carried the replica's whole life (54 TTFTs
    where 1 request had been served), and the learned capacity fell 7.00 -> 4.54 on a light
    load that met the SLO. The failed sample keeps the last good histograms; the delta is
    taken from them. A replica whose first scrapes failed starts with a baseline, as ever."""
    from floodgate.controller.vllm import failed_sample

    a = parse_metrics(PAGE % (50, 54, 54, 54, 300.0), "r", 10.0, prev=parse_metrics(PAGE % (0, 0, 0, 0, 0.0), "r", 9.0))
    lost = failed_sample("r", 11.0, "HTTP 500", prev=a)
    b = parse_metrics(PAGE % (51, 55, 55, 55, 300.03), "r", 12.0, prev=lost)
    assert b.ttft_delta.count == 1 and b.ttft_delta.total == pytest.approx(0.03)
    twice = failed_sample("r", 12.5, "timeout", prev=failed_sample("r", 12.2, "timeout", prev=b))
    assert parse_metrics(PAGE % (52, 56, 56, 56, 300.06), "r", 13.0, prev=twice).ttft_delta.count == 1
    never = failed_sample("r", 1.0, "connection refused")  # no good scrape yet
    assert parse_metrics(PAGE % (50, 54, 54, 54, 300.0), "r", 2.0, prev=never).ttft_delta.count == 0


def test_both_kv_metric_names_and_missing_metrics_fail_the_scrape() -> None:
    old = PAGE.replace("kv_cache_usage_perc", "gpu_cache_usage_perc") % (0, 0, 0, 0, 0.0)
    assert parse_metrics(old, "r", 1.0).metrics.kv_cache_usage == 0.42  # vLLM < 0.10
    both = (PAGE % (0, 0, 0, 0, 0.0)) + "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parse_metrics(both, "r", 1.0).metrics.kv_cache_usage == 0.42  # the current name wins
    page = PAGE % (0, 0, 0, 0, 0.0)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        lines = [ln for ln in page.splitlines() if name not in ln]
        with pytest.raises(ValueError, match=name.split(":")[1] if "kv" not in name else "kv_cache_usage_perc"):
            parse_metrics("\n".join(lines) + "\n", "r", 1.0)


async def test_missing_kv_gauge_is_a_failed_scrape_not_zero() -> None:
    from aiohttp import web

    page = "\n".join(ln for ln in (PAGE % (0, 0, 0, 0, 0.0)).splitlines() if "kv_cache" not in ln) + "\n"

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as port, aiohttp.ClientSession() as s:
        got = await VllmClient(s, f"127.0.0.1:{port}").scrape("r", 5.0)
    assert not got.metrics.ok and "kv_cache_usage_perc" in got.error


GOOD = PAGE % (2, 4, 4, 4, 1.0)
_GAUGE = r"^(vllm:{name}(\{{[^}}]*\}})?) .*$"


def _set(page: str, name: str, value: str) -> str:
    """`page` with every sample of the metric `name` (without the `vllm:` prefix) set to `value`."""
    out, n = re.subn(_GAUGE.format(name=re.escape(name)), r"\1 " + value, page, flags=re.M)
    assert n, name
    return out


# Pages the parser cannot turn into finite, sane numbers, and what the error names. Each one is
# a failed scrape (MetricsError), never a crash and never a value (a NaN KV used to read as 0).
BAD_PAGES: dict[str, tuple[str, str]] = {
    "bucket_without_le": (GOOD + 'vllm:time_to_first_token_seconds_bucket{model_name="x"} 3\n', "without a numeric le"),
    "bucket_le_not_a_number": (GOOD.replace('le="0.1"', 'le="abc"'), "without a numeric le"),
    "bucket_le_nan": (GOOD.replace('le="0.1"', 'le="NaN"'), "without a numeric le"),
    "waiting_nan": (_set(GOOD, "num_requests_waiting", "NaN"), "num_requests_waiting is nan"),
    "waiting_negative": (_set(GOOD, "num_requests_waiting", "-100"), "num_requests_waiting is -100"),
    "waiting_minus_inf": (_set(GOOD, "num_requests_waiting", "-Inf"), "num_requests_waiting is -inf"),
    "running_inf": (_set(GOOD, "num_requests_running", "+Inf"), "num_requests_running is inf"),
    "running_nan": (_set(GOOD, "num_requests_running", "NaN"), "num_requests_running is nan"),
    "kv_nan": (_set(GOOD, "kv_cache_usage_perc", "NaN"), "kv_cache_usage_perc is nan"),
    "kv_nan_old_name": (_set(GOOD, "kv_cache_usage_perc", "NaN").replace("kv_cache_usage_perc", "gpu_cache_usage_perc"),
                        "gpu_cache_usage_perc is nan"),
    "kv_negative": (_set(GOOD, "kv_cache_usage_perc", "-0.5"), "kv_cache_usage_perc is -0.5"),
    "kv_above_one": (_set(GOOD, "kv_cache_usage_perc", "57"), "kv_cache_usage_perc is 57"),
    "sleep_state_nan": (_set(GOOD, "engine_sleep_state", "NaN"), "engine_sleep_state is nan"),
    "bucket_nan": (GOOD.replace('le="1.0",model_name="m"} 4', 'le="1.0",model_name="m"} NaN'), "_bucket is nan"),
    "bucket_negative": (GOOD.replace('le="1.0",model_name="m"} 4', 'le="1.0",model_name="m"} -4'), "_bucket is -4"),
    "sum_inf": (_set(GOOD, "time_to_first_token_seconds_sum", "+Inf"), "_sum is inf"),
    "count_nan": (_set(GOOD, "time_to_first_token_seconds_count", "NaN"), "_count is nan"),
    # Finite on every line, beyond any engine's queue (and infinite once summed over label sets).
    "waiting_overflows": (GOOD + "vllm:num_requests_waiting{model_name=\"a\"} 1e308\n"
                          "vllm:num_requests_waiting{model_name=\"b\"} 1e308\n", "num_requests_waiting is 1e+308"),
    # A review: an idle replica reporting 1e12 waiting scaled its pool 1 -> 6 of 6 in 2 s.
    "waiting_absurd": (_set(GOOD, "num_requests_waiting", "1e12"), "num_requests_waiting is 1000000000000.0"),
    "running_absurd": (_set(GOOD, "num_requests_running", "250000"), "num_requests_running is 250000"),
    "garbage": ("<html>500 oops</html>\n", "unparseable page"),
    # A review: a page repeating its series 20 times read as 20x the running and waiting requests.
    "series_twice": (GOOD + "\n".join(ln for ln in GOOD.splitlines() if ln.startswith("vllm:num_requests_running"))
                     + "\n", "appears twice on the page"),
}


@pytest.mark.parametrize("case", list(BAD_PAGES))
def test_a_page_without_finite_sane_numbers_is_a_metrics_error(case: str) -> None:
    page, says = BAD_PAGES[case]
    with pytest.raises(MetricsError, match=re.escape(says)) as err:
        parse_metrics(page, "r", 1.0, prev=parse_metrics(GOOD, "r", 0.0))
    # The module's own error: a VllmError (what the scrape turns into a failed one) and still a
    # ValueError (what the parser raised before for a missing gauge or unparseable text).
    assert isinstance(err.value, VllmError) and isinstance(err.value, ValueError)


def _sane_sample(s: VllmSample) -> bool:
    m = s.metrics
    nums = [m.waiting, m.running, m.kv_cache_usage]
    for h in (s.ttft, s.itl):
        nums += [h.total, h.count, *(c for _, c in h.buckets)]
        if any(math.isnan(le) for le, _ in h.buckets):
            return False
    return m.ok and all(math.isfinite(v) and v >= 0 for v in nums) and m.kv_cache_usage <= 1


def test_mangled_pages_give_sane_numbers_or_a_metrics_error() -> None:
    """Fuzz-ish: a vLLM page with a few characters changed, removed or inserted parses to
    finite, sane numbers or raises MetricsError; nothing else (the reviewer's fuzzing of the old
    parser: KeyError 'le' in ~1 % of mutations, and NaN values returned as numbers)."""
    rng = random.Random(7)
    alphabet = ' {}="\\\n#,le+-.NaInf0123456789abc_:'
    base = GOOD + "# TYPE vllm:inter_token_latency_seconds histogram\n" + "".join(
        f'vllm:inter_token_latency_seconds_bucket{{le="{le}",model_name="m"}} {c}\n'
        for le, c in (("0.01", 3), ("0.1", 9), ("+Inf", 10))) + \
        'vllm:inter_token_latency_seconds_count{model_name="m"} 10\n' \
        'vllm:inter_token_latency_seconds_sum{model_name="m"} 0.4\n'
    assert _sane_sample(parse_metrics(base, "r", 0.0))
    outcomes = {"ok": 0, "error": 0}
    for _ in range(1500):
        b = list(base)
        for _ in range(rng.randint(1, 4)):
            i, op = rng.randrange(len(b)), rng.random()
            if op < 0.4:
                b[i] = rng.choice(alphabet)
            elif op < 0.7:
                del b[i]
            else:
                b.insert(i, rng.choice(alphabet))
        try:
            s = parse_metrics("".join(b), "r", 1.0)
        except MetricsError:
            outcomes["error"] += 1
            continue
        assert _sane_sample(s), "".join(b)
        outcomes["ok"] += 1
    assert outcomes["ok"] > 100 and outcomes["error"] > 100  # both outcomes were exercised


async def test_a_bad_page_is_a_failed_scrape_keeping_the_previous_histograms() -> None:
    from aiohttp import web

    page = {"text": GOOD}

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page["text"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as port, aiohttp.ClientSession() as s:
        vc = VllmClient(s, f"127.0.0.1:{port}")
        good = await vc.scrape("r", 1.0)
        assert good.metrics.ok and good.ttft.count == 4
        for case in ("bucket_without_le", "waiting_nan", "kv_nan", "running_inf"):
            page["text"], says = BAD_PAGES[case]
            got = await vc.scrape("r", 2.0, prev=good)
            assert not got.metrics.ok and says in got.error, case
            assert got.ttft == good.ttft  # the next good scrape's delta covers the gap
        # A review: a 22 MB page of valid text held the controller's loop past its leader lease.
        page["text"] = GOOD + "".join(f'vllm:other_gauge{{n="{i}"}} 1\n' for i in range(250_000))
        got = await vc.scrape("r", 3.0, prev=good)
        assert not got.metrics.ok and "a page over 4 MiB" in got.error


async def test_a_replica_streaming_a_huge_reply_fails_the_call_read_no_further() -> None:
    """Every reply but `/metrics` is a few hundred bytes; read whole, a replica streaming one
    (compromised, or a buggy server) grew the controller's memory for as long as the call's
    timeout allowed (a review: the warm-up's 60 s of a 1,200 MiB stream, past the shipped pod's
    512 MiB limit). Now a reply past MAX_REPLY_BYTES is a failed call, and the connection is
    dropped there: the server gets to send little more than the cap and the socket buffers."""
    from aiohttp import web
    from floodgate.controller.vllm import MAX_REPLY_BYTES, VllmError

    sent = {"/health": 0, "/v1/completions": 0}
    chunk = b"a" * (1 << 16)

    async def stream(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse()
        await r.prepare(request)
        try:
            for _ in range(64 << 4):  # 64 MiB
                await r.write(chunk)
                sent[request.path] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return r

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/health", stream)
    app.router.add_post("/v1/completions", stream)
    app.router.add_get("/v1/models", models)
    async with serving(app) as port, aiohttp.ClientSession() as s:
        vc = VllmClient(s, f"127.0.0.1:{port}", timeout_s=30.0)
        assert await vc.health() is False
        with pytest.raises(VllmError, match="a page over 1 MiB"):
            await vc.warmup(timeout_s=30.0)
        await asyncio.sleep(0.2)
    for path, n in sent.items():
        assert MAX_REPLY_BYTES < n < 32 << 20, (path, n)  # dropped long before the 64 MiB end


async def test_a_models_list_of_many_lora_adapters_is_read() -> None:
    """vLLM lists every LoRA adapter it serves on /v1/models (~500 bytes each): under the 1 MiB
    reply cap a pool of 2,000 adapters could never warm a replica up (a review of the cap)."""
    from aiohttp import web

    cards = [{"id": "base" if i == 0 else f"lora-{i}", "object": "model", "owned_by": "vllm", "root": "base",
              "permission": [{"id": f"modelperm-{i:032d}", "object": "model_permission", "allow_sampling": True,
                              "allow_logprobs": True, "organization": "*", "is_blocking": False}] * 2}
             for i in range(4000)]

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as port, aiohttp.ClientSession() as s:
        vc = VllmClient(s, f"127.0.0.1:{port}", timeout_s=10.0)
        assert await vc.model_name() == "base"


async def test_an_unexpected_error_in_one_replicas_scrape_is_its_failed_scrape(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever escapes `VllmClient.scrape` for one replica (here a bug) is that replica's
    failed scrape, counted and logged with its traceback (once per run of failures), never an
    exception out of the pool's tick; the other replicas' samples are unaffected."""
    broken = {"on": True}

    async def scrape(self: VllmClient, replica_id: str, now: float, prev: VllmSample | None = None) -> VllmSample:
        if replica_id == "bad" and broken["on"]:
            raise ZeroDivisionError("a bug")
        return parse_metrics(GOOD, replica_id, now, prev)

    monkeypatch.setattr(VllmClient, "scrape", scrape)
    failures: list[str] = []
    async with aiohttp.ClientSession() as session:
        rs = ReplicaScraper(session, on_failure=failures.append)
        eps = {"good": "127.0.0.1:1", "bad": "127.0.0.1:2"}
        with caplog.at_level(logging.ERROR, logger="floodgate.controller.scrape"):
            for t in (1.0, 2.0):
                out = await rs.scrape(eps, t)
                assert out["good"].metrics.ok
                assert not out["bad"].metrics.ok and out["bad"].error == "unexpected ZeroDivisionError: a bug"
            broken["on"] = False
            assert (await rs.scrape(eps, 3.0))["bad"].metrics.ok
        assert failures == ["vllm", "vllm"]
        logged = [r for r in caplog.records if r.name == "floodgate.controller.scrape"]
        assert len(logged) == 1 and logged[0].exc_info is not None and "bad" in logged[0].getMessage()


async def test_replicas_gone_leave_no_logged_scrape_error_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unbounded-growth review: a replica whose scrape failed unexpectedly stayed in the
    scraper's logged set after it was gone (30 such replicas, 30 kept for as long as the
    controller ran); the samples of gone replicas were already forgotten."""
    async def scrape(self: VllmClient, replica_id: str, now: float, prev: VllmSample | None = None) -> VllmSample:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(VllmClient, "scrape", scrape)
    async with aiohttp.ClientSession() as session:
        rs = ReplicaScraper(session)
        for i in range(30):
            await rs.scrape({f"r{i}": "127.0.0.1:1"}, float(i))
        assert rs._logged == {"r29"}  # (was 30 ids)


def test_parse_envoy_stats() -> None:
    text = """\
# TYPE envoy_cluster_upstream_rq_active gauge
envoy_cluster_upstream_rq_active{envoy_cluster_name="model_picked"} 7
envoy_cluster_upstream_rq_active{envoy_cluster_name="floodgate_extproc"} 3
# TYPE envoy_cluster_upstream_rq_pending_active gauge
envoy_cluster_upstream_rq_pending_active{envoy_cluster_name="model_picked"} 2
# TYPE envoy_cluster_upstream_rq counter
envoy_cluster_upstream_rq{envoy_response_code="429",envoy_cluster_name="model_picked"} 4
envoy_cluster_upstream_rq{envoy_response_code="200",envoy_cluster_name="model_picked"} 40
# TYPE envoy_cluster_upstream_rq_xx counter
envoy_cluster_upstream_rq_xx{envoy_response_code_class="5",envoy_cluster_name="model_picked"} 1
"""
    e = parse_envoy(text, None, 5.0)
    assert (e.ok, e.rq_active, e.rq_pending, e.rq_429, e.rq_5xx) == (True, 7, 2, 4, 1)
    assert parse_envoy(text, frozenset({"floodgate_extproc"}), 5.0).rq_active == 3
    assert e.gateway is None  # no gateway listener stats on the page: unknown, not 0
    gw = GATEWAY_STATS + text
    g = parse_envoy(gw, None, 5.0).gateway
    assert g is not None and (g.rq_total, g.rejected, g.taken_at) == (8, 7, 5.0)
    assert parse_envoy(gw, None, 5.0, gateway_prefix="other").gateway is None


# Verbatim from Envoy 1.40's /stats/prometheus (8 requests, 7 answered 429 by the processor).
GATEWAY_STATS = """\
# TYPE envoy_http_downstream_rq_total counter
envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="gateway"} 8
# TYPE envoy_http_downstream_rq_xx counter
envoy_http_downstream_rq_xx{envoy_response_code_class="4",envoy_http_conn_manager_prefix="gateway"} 7
# TYPE envoy_http_ext_proc_immediate_responses_sent counter
envoy_http_ext_proc_immediate_responses_sent{envoy_http_conn_manager_prefix="gateway"} 7
# TYPE envoy_listener_http_downstream_rq_completed counter
envoy_listener_http_downstream_rq_completed{envoy_http_conn_manager_prefix="gateway",envoy_listener_address="127.0.0.1_56021"} 8
"""


@pytest.mark.integration
async def test_dead_replica_is_marked_failed_and_policy_holds(stack: LocalStack) -> None:
    url = stack.start_redis()
    port = free_port()
    child = stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0",
                                  "--log-level", "warning"], name="sim", port=port)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    ep = f"127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        # A live replica: fresh values and TTFT deltas between scrapes.
        vc = VllmClient(s, ep)
        a = await vc.scrape("r0", 1.0)
        assert a.metrics.ok and a.asleep is False
        await vc.warmup()  # one request (model name from /v1/models)
        b = await vc.scrape("r0", 2.0, prev=a)
        assert b.ttft_delta.count == 1 and b.ttft_delta.mean is not None

        # Envoy admin unreachable and Redis fine: marked vs. real values.
        e = await scrape_envoy(s, f"http://{dead}", None, 3.0, timeout_s=0.5)
        assert not e.ok and e.error
        rc = redis_client(url, op_timeout_s=2)
        fg = await scrape_floodgate(rc, "default", 3.0)
        assert fg.signal.ok and fg.signal.depth == 0

        # The pool controller with two active replicas, one of them dead, no load at all: a
        # scale-down would be due (min 1), but the dead one's scrape is marked failed, so the
        # tick is stale and the policy holds at 2.
        cfg = controller_config(url, policy={"min_replicas": 1}, warm_pool={"enabled": False})
        metrics = ControllerMetrics()

        class Fixed:
            name = "fixed"
            capacity = None

            async def list(self) -> list[object]:
                from floodgate.controller.actuators.base import ReplicaHandle
                return [ReplicaHandle("r0", ep, True), ReplicaHandle("r1", dead, True)]

            async def start(self, replica_id: str) -> None:
                raise AssertionError("no start expected")

            async def stop(self, replica_id: str) -> None:
                raise AssertionError("no stop expected")

            async def set_role(self, replica_id: str, role: str) -> None:
                return None

            async def close(self) -> None:
                return None

        pc = PoolController(cfg.pools[0], Fixed(), rc, s, metrics)  # type: ignore[arg-type]
        now = pc.clock()
        pc.replicas = {rid: Replica(ReplicaView(rid, ReplicaState.ACTIVE, now - 600), e2)
                       for rid, e2 in (("r0", ep), ("r1", dead))}
        pc.state = DeciderState(policy=PolicyState(desired=2), history=pc.state.history)
        plan = await pc.tick()
        assert plan.stale and plan.desired == 2 and plan.reason == REASON_HOLD_STALE
        assert pc.replicas["r1"].sample is not None and not pc.replicas["r1"].sample.metrics.ok
        assert pc.replicas["r0"].sample is not None and pc.replicas["r0"].sample.metrics.ok
        assert all(v.state is ReplicaState.ACTIVE for v in (r.view for r in pc.replicas.values()))
        assert 'floodgate_scrape_failures_total{source="vllm"} 1.0' in metrics.render().decode()

        # Kill the live one too: every scrape fails, and an all-dark pool is still not idle.
        child.stop()
        plan = await pc.tick()
        assert plan.stale and plan.desired == 2
        assert plan.reason == REASON_HOLD_STALE
        await rc.aclose()


@pytest.mark.integration
async def test_real_envoy_gateway_counters(stack: LocalStack) -> None:
    """Arrivals and requests the processor turned away, as the controller reads them from a
    real Envoy: one permit, P2 never queues, 6 concurrent P2 streams -> 1 served, 5 turned away."""
    import asyncio

    stack.start_redis()
    port = free_port()
    stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0",
                          "--log-level", "warning"], name="sim", port=port)
    classes = {c: {"queue_timeout_s": 5, "max_queue": 0 if c == 2 else 100, "share": 0.3} for c in (0, 1, 2)}
    proc = stack.start_processor({"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
                                  "pools": [{"name": "default", "classes": classes, "local_credits": 0,
                                             "limit": {"mode": "static", "initial": 1, "min": 1, "max": 1}}]})
    envoy = stack.start_envoy([("127.0.0.1", port)], processors=[proc])
    admin = f"http://127.0.0.1:{envoy.admin_port}"
    async with aiohttp.ClientSession() as s:
        before = (await scrape_envoy(s, admin, None, 1.0)).gateway
        assert before is not None

        async def one() -> int:
            body = {"model": "floodgate-sim-8b", "prompt": "x", "max_tokens": 40}
            async with s.post(envoy.url + "/v1/completions", json=body, headers={"x-request-priority": "2"}) as r:
                await r.read()
                return r.status

        codes = await asyncio.gather(*(one() for _ in range(6)))
        after = (await scrape_envoy(s, admin, None, 2.0)).gateway
    assert after is not None
    assert sorted(codes) == [200] + [429] * 5
    assert (after.rq_total - before.rq_total, after.rejected - before.rejected) == (6, 5)
    # The same requests in Floodgate's own per-class counters (the other offered-demand source).
    # Processors add to them in batches about once a second: wait for the batch.
    rc = redis_client(stack.redis_url, op_timeout_s=2)
    for _ in range(50):
        fg = await scrape_floodgate(rc, "default", 3.0)
        assert fg.counters is not None and fg.counters.ok
        p2 = fg.counters.classes[2]
        if p2.admitted + p2.turned_away >= 6:
            break
        await asyncio.sleep(0.1)
    await rc.aclose()
    assert (p2.admitted, p2.turned_away) == (1, 5)


# How the proxy below rewrites a real replica's page, per mode (the reviewer's mproxy.py modes).
REWRITE: dict[str, Callable[[str], str]] = {
    "pass": lambda t: t,
    "nan_kv": lambda t: _set(t, "kv_cache_usage_perc", "NaN"),
    "no_le": lambda t: t + 'vllm:time_to_first_token_seconds_bucket{model_name="x"} 3\n',
    "nan_wait": lambda t: _set(t, "num_requests_waiting", "NaN"),
    "neg_wait": lambda t: _set(t, "num_requests_waiting", "-100"),
    "inf_run": lambda t: _set(t, "num_requests_running", "+Inf"),
    "garbage": lambda t: "<html>oops</html>\n",
}


class MetricsProxy:
    """A pass-through proxy in front of a real replica that rewrites its `/metrics` page by
    `mode` (a key of REWRITE): the replica as a controller sees it when its page goes bad."""

    def __init__(self, upstream: str, mode: str) -> None:
        self.upstream = f"http://{upstream}"
        self.mode = mode
        self.runner: aiohttp.web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        from aiohttp import web

        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"127.0.0.1:{port}"

    async def _handle(self, req: aiohttp.web.Request) -> aiohttp.web.Response:
        from aiohttp import web

        assert self.session is not None
        if req.path == "/metrics":
            async with self.session.get(self.upstream + "/metrics") as r:
                text = await r.text()
            return web.Response(text=REWRITE[self.mode](text), content_type="text/plain")
        body = await req.read()
        async with self.session.request(req.method, self.upstream + req.path_qs, data=body or None,
                                        headers={"Content-Type": req.headers.get("Content-Type", "")}) as r:
            return web.Response(status=r.status, body=await r.read(),
                                headers={"Content-Type": r.headers.get("Content-Type", "text/plain")})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()


@pytest.mark.integration
async def test_controller_survives_a_replica_with_a_bad_metrics_page_and_does_not_scale_on_it(
        stack: LocalStack) -> None:
    """The real controller and two real replicas (`floodgate sim`), the second one's `/metrics`
    rewritten by a proxy: a NaN KV gauge (was read as KV 0: an idle pool, scaled down), a
    histogram bucket without `le` (was KeyError: the controller exited, every pool with it), a
    NaN (was ValueError in the policy: the same) or negative waiting gauge, an infinite running
    gauge, garbage. Each is that replica's failed scrape: counted, the tick stale, the pool held
    at its size (an idle pool of 2 with min 1 would scale down on any fresh tick), the
    controller ticking on. Once the page is sane again, the same controller scales down."""
    from floodgate.controller.app import Controller
    from floodgate.controller.config import parse_config
    from floodgate.extproc.registry import Registry

    url = stack.start_redis()
    sims = []
    for i in range(2):
        port = free_port()
        stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0",
                              "--log-level", "warning"], name=f"sim{i}", port=port)
        sims.append(f"127.0.0.1:{port}")
    proxy = MetricsProxy(sims[1], "nan_kv")
    bad_ep = await proxy.start()
    rc = redis_client(url, op_timeout_s=5)
    registry = Registry(rc, "default")
    await registry.set(sims[0], "active", "r0")
    await registry.set(bad_ep, "active", "r1")
    cfg = parse_config({
        "redis": {"url": url}, "tick_interval_s": 0.1, "metrics_listen": None, "leader": {"enabled": False},
        "pools": [{"name": "default",
                   "policy": {"min_replicas": 1, "max_replicas": 3, "stabilization_window_s": 0,
                              "scale_down_interval_s": 0, "panic_window_s": 0},
                   "forecast": {"enabled": False}, "warm_pool": {"enabled": False},
                   "timeouts": {"scrape_s": 1.0},
                   "actuator": {"kind": "static", "endpoints": {"r0": sims[0], "r1": bad_ep}}}],
    }, env={})
    ctl = Controller(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))

    def pool() -> PoolController | None:
        if task.done():
            raise AssertionError(f"the controller stopped: {task.exception()!r}")
        return ctl.pools.get("default")

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return ctl.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def vllm_failures() -> float:
        return value("floodgate_scrape_failures_total", {"source": "vllm"})

    try:
        for mode, says in (("nan_kv", "kv_cache_usage_perc is nan"), ("no_le", "without a numeric le"),
                           ("nan_wait", "num_requests_waiting is nan"), ("neg_wait", "num_requests_waiting is -100"),
                           ("inf_run", "num_requests_running is inf"), ("garbage", "unparseable page")):
            proxy.mode = mode

            async def failed_on_it(mode: str = mode, says: str = says) -> bool:
                pc = pool()
                if pc is None or pc.last_plan is None:
                    return False
                assert pc.last_plan.desired == 2, f"scaled on a bad page ({mode}): {pc.last_plan}"
                s = pc.replicas["r1"].sample
                return s is not None and not s.metrics.ok and says in s.error

            await wait_for(failed_on_it, 15)
            failures, ticks = vllm_failures(), value("floodgate_controller_ticks_total")

            async def ticked_on(ticks: float = ticks) -> bool:
                return pool() is not None and value("floodgate_controller_ticks_total") >= ticks + 3

            await wait_for(ticked_on, 10)
            pc = pool()
            assert pc is not None and pc.last_plan is not None
            plan = pc.last_plan
            assert (plan.desired, plan.active, plan.stale, plan.reason) == (2, 2, True, REASON_HOLD_STALE), mode
            assert vllm_failures() >= failures + 2, mode  # one per tick, for r1 only
            assert pc.replicas["r0"].sample is not None and pc.replicas["r0"].sample.metrics.ok
            assert {e.replica_id: e.state for e in (await registry.endpoints()).values()} == \
                {"r0": "active", "r1": "active"}, mode

        # The page is sane again: the same controller reads an idle pool of 2 and scales down.
        proxy.mode = "pass"

        async def scaled_down() -> bool:
            pc = pool()
            return pc is not None and pc.last_plan is not None and pc.last_plan.desired == 1
        await wait_for(scaled_down, 15)
        stop.set()
        await asyncio.wait_for(task, 15)  # a clean exit: no exception from any tick
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=15)
        await proxy.stop()
        await rc.aclose()


@pytest.mark.parametrize("value", ["+Inf", "NaN", "-Inf", "-5", "1e18"])
@pytest.mark.parametrize("series", [
    'envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="gateway"}',
    'envoy_http_ext_proc_immediate_responses_sent{envoy_http_conn_manager_prefix="gateway"}',
    'envoy_cluster_upstream_rq_active{envoy_cluster_name="model"}',
])
def test_an_envoy_value_no_envoy_exports_fails_the_scrape(series: str, value: str) -> None:
    """A controller review: one stats page with a +Inf gateway counter reached the policy as an
    infinite turned-away rate, `math.ceil` raised OverflowError and the controller exited (with
    `--stop-replicas-on-exit`, stopping every replica); a NaN read as 0 offered demand, 1e18 as
    5e17 requests/s. Such a page is a failed scrape, as a vLLM one is (vllm._sane)."""
    good = ('envoy_http_downstream_rq_total{envoy_http_conn_manager_prefix="gateway"} 100\n'
            'envoy_cluster_upstream_rq_active{envoy_cluster_name="model"} 3\n')
    assert parse_envoy(good, None, 1.0).gateway.rq_total == 100  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="not a count Envoy exports"):
        parse_envoy(good + f"{series} {value}\n", None, 1.0)


def test_offered_demand_drops_a_gateway_read_that_is_no_number() -> None:
    """The demand window keeps no non-finite gateway read (whoever built it): the policy never
    sees an infinite rate."""
    from floodgate.controller import demand as dm

    cfg = dm.DemandConfig()
    w = dm.DemandWindow()
    for i, total in enumerate([0.0, 100.0, math.inf, math.nan, 300.0]):
        w = dm.observe(w, 10.0 + i, cfg, None, dm.GatewayCounters(10.0 + i, True, total, total / 2))
    assert [g.rq_total for g in w.gateway] == [0.0, 100.0, 300.0]
    off = dm.offered(w, 14.0, cfg)
    assert all(math.isfinite(v) for v in off.offered_rate.values())
