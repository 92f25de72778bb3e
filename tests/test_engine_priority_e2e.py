"""Engine priority end to end: real Envoy, real processor, real Redis-protocol server and the real
emulator (`floodgate sim`, vLLM's scheduling policies). The deployment docs/admission.md
recommends where the FIFO engine queue holds P0 back ("Engine priority"): the pool sets
`engine_priority: {0: -1}` and the engines run `--scheduling-policy priority`."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import pytest

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.helpers import drained, metrics, wait_until

pytestmark = pytest.mark.integration

MODEL = "floodgate-sim-test"
# 5 ms steps, one sequence at a time: the emulator's waiting queue is where the order shows
SIM_ARGS = ["--model", MODEL, "--cold-start", "0", "--max-num-seqs", "1", "--decode-base-ms", "5",
            "--decode-per-seq-ms", "1", "--prefill-ms-per-token", "0.01", "--log-level", "warning"]
CONFIG: dict[str, Any] = {
    "pools": [{"name": "default", "limit": {"mode": "static", "initial": 16}, "engine_priority": {0: -1}}],
    "admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
}


def start_sim(stack: LocalStack, policy: str) -> int:
    port = free_port()
    stack.start_upstream([sys.executable, "-m", "floodgate", "sim", "--port", str(port), *SIM_ARGS,
                          "--scheduling-policy", policy], name=f"sim-{policy}", port=port)
    return port


async def complete(s: aiohttp.ClientSession, url: str, prio: int, tokens: int) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": "x", "max_tokens": tokens}
    async with s.post(url + "/v1/completions", json=body, headers={"x-request-priority": str(prio)}) as r:
        return r.status, await r.text()


async def present(s: aiohttp.ClientSession, sim: int) -> int:
    m = await metrics(s, f"http://127.0.0.1:{sim}/metrics")
    return int(sum(v for k, v in m.items()
                   if k.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))))


async def test_a_p0_through_the_gateway_goes_ahead_of_the_engines_queue(stack: LocalStack) -> None:
    """One engine slot: a long P1 runs, three P1s queue in the engine, then a P0 comes through
    Envoy and the processor: it is served next (fcfs would serve it last). Each request is sent
    only once the emulator's metrics show the one before it, so the order does not depend on how
    concurrent connections race on a loaded box; Floodgate's limit (16) queues none of them."""
    stack.start_redis()
    proc = stack.start_processor(CONFIG)
    sim = start_sim(stack, "priority")
    envoy = stack.start_envoy([("127.0.0.1", sim)])
    done: list[str] = []
    async with aiohttp.ClientSession() as s:
        async def one(name: str, prio: int, tokens: int) -> None:
            status, text = await complete(s, envoy.url, prio, tokens)
            assert status == 200, text
            done.append(name)

        # low0: 600 steps of >= 5 ms, ample time to queue the rest behind it even on a loaded box
        plan = [("low0", 1, 600), ("low1", 1, 15), ("low2", 1, 15), ("low3", 1, 15), ("p0", 0, 15)]
        tasks = []
        for i, (name, prio, tokens) in enumerate(plan):
            tasks.append(asyncio.create_task(one(name, prio, tokens)))
            assert await wait_until(lambda n=i + 1: _at_least(s, sim, n), 20), f"{name} never reached the engine"
        assert not done, "low0 finished before the queue formed"
        await asyncio.gather(*tasks)
        m = await metrics(s, proc.metrics_url)
    assert done == ["low0", "p0", "low1", "low2", "low3"]
    assert m.get('floodgate_engine_priority_total{outcome="set",pool="default",priority="0"}') == 1, m
    assert (await drained(stack.redis_url)).inflight_total == 0


async def _at_least(s: aiohttp.ClientSession, sim: int, n: int) -> bool:
    return await present(s, sim) >= n


async def test_engine_priority_needs_the_engines_priority_policy(stack: LocalStack) -> None:
    """The coupling the docs warn about: against an engine on vLLM's default fcfs policy every
    P0 the processor writes a priority into is answered 400 by the engine (P1 is untouched), so
    `engine_priority` is off by default and is turned on together with the engines' flag."""
    stack.start_redis()
    stack.start_processor(CONFIG)
    sim = start_sim(stack, "fcfs")
    envoy = stack.start_envoy([("127.0.0.1", sim)])
    async with aiohttp.ClientSession() as s:
        p0 = await complete(s, envoy.url, 0, 2)
        p1 = await complete(s, envoy.url, 1, 2)
    assert p0[0] == 400 and "Priority scheduling is not enabled" in p0[1], p0
    assert p1[0] == 200, p1
    assert (await drained(stack.redis_url)).inflight_total == 0
