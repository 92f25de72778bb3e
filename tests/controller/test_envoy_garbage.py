"""A controller review: one Envoy /stats/prometheus page with a +Inf gateway counter stopped the
whole controller (OverflowError in the policy). Now that scrape fails and the controller goes on."""
from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web
from floodgate.controller.app import Controller
from floodgate.controller.config import parse_config
from floodgate.extproc import schema
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port


async def test_a_garbage_envoy_stats_page_does_not_stop_the_controller(stack: LocalStack) -> None:
    url = stack.start_redis()
    port = free_port()
    stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--host", "127.0.0.1", "--port", str(port),
                          "--enable-sleep-mode", "--max-num-seqs", "4", "--cold-start", "0.2",
                          "--log-level", "warning"], name="sim", port=port)
    ep = f"127.0.0.1:{port}"
    state = {"total": 0.0, "rej": 0.0, "inf": False}

    async def stats(_: web.Request) -> web.Response:
        state["total"] += 10
        state["rej"] += 5
        t, r = ("+Inf", "+Inf") if state["inf"] else (state["total"], state["rej"])
        body = (f'envoy_http_downstream_rq_total{{envoy_http_conn_manager_prefix="gateway"}} {t}\n'
                f'envoy_http_ext_proc_immediate_responses_sent{{envoy_http_conn_manager_prefix="gateway"}} {r}\n')
        return web.Response(text=body)

    app = web.Application()
    app.router.add_get("/stats/prometheus", stats)
    runner = web.AppRunner(app)
    await runner.setup()
    eport = free_port()
    await web.TCPSite(runner, "127.0.0.1", eport).start()
    cfg = parse_config({"redis": {"url": url}, "tick_interval_s": 0.25, "metrics_listen": None,
                        "envoy": {"admin_url": f"http://127.0.0.1:{eport}"},
                        "leader": {"enabled": False},
                        "pools": [{"name": "default", "policy": {"min_replicas": 1, "max_replicas": 1},
                                   "forecast": {"enabled": False}, "warm_pool": {"enabled": False},
                                   "actuator": {"kind": "static", "endpoints": {"default-r0": ep}}}]}, env={})
    ctl = Controller(cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    c = redis_client(url, op_timeout_s=5)
    session = aiohttp.ClientSession()
    streams = []
    try:
        await asyncio.wait_for(ctl.ready.wait(), 30)
        body = {"model": "floodgate-sim-8b", "prompt": "x", "stream": True, "max_tokens": 4000}

        async def one() -> None:
            async with session.post(f"http://{ep}/v1/completions", json=body,
                                    headers={"x-sim-output-tokens": "4000"}) as r:
                await r.read()
        streams = [asyncio.create_task(one()) for _ in range(3)]
        for _ in range(12):  # Floodgate's counters: 10 admitted/s, running > 0 on the replica
            await c.hincrby(schema.key("default", schema.DEMAND), "1:admitted", 3)
            await asyncio.sleep(0.25)
        assert not task.done()
        state["inf"] = True  # one garbage page from the admin endpoint
        await asyncio.sleep(3)
        assert not task.done(), f"controller exited: {task.exception()!r}"
        assert ctl.metrics.registry.get_sample_value("floodgate_scrape_failures_total", {"source": "envoy"}), \
            "the garbage page is a failed scrape"
    finally:
        stop.set()
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await session.close()
        await asyncio.gather(task, return_exceptions=True)
        await c.aclose()
        await runner.cleanup()
