"""Scrapers: vLLM /metrics parsing and histogram deltas, Envoy stats, and staleness — a dead
replica's scrape is marked failed and the policy holds instead of scaling down."""

from __future__ import annotations

import sys

import aiohttp
import pytest
from floodgate.controller.app import PoolController, Replica
from floodgate.controller.decider import DeciderState
from floodgate.controller.metrics import ControllerMetrics
from floodgate.controller.policy import REASON_HOLD_STALE, PolicyState
from floodgate.controller.scrape import parse_envoy, scrape_envoy, scrape_floodgate
from floodgate.controller.signals import ReplicaState, ReplicaView
from floodgate.controller.vllm import Histogram, VllmClient, parse_metrics
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.live import controller_config

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
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        async with aiohttp.ClientSession() as s:
            got = await VllmClient(s, f"127.0.0.1:{port}").scrape("r", 5.0)
        assert not got.metrics.ok and "kv_cache_usage_perc" in got.error
    finally:
        await runner.cleanup()


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
