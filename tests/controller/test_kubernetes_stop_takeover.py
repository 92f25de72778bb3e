"""The controller with the Kubernetes actuator when its actions fail part-way or the API server
cannot answer: a stop its controller left half done (the pod annotated, the scale-down write
failed, the controller gone) is finished by the next one, not served on; an API server outage
(503, 429) during a drain skips ticks instead of stopping the controller; starts it refused do
not back the scale-up off. Live: the fake API server (tests/controller/fake_kube.py), real Redis
and a real emulator (`floodgate sim`) behind every pod, each on its own 127.0.0.x address."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from floodgate.controller.actuators.kubernetes import (
    DELETION_COST_ANNOTATION,
    KubernetesActuator,
    KubernetesActuatorConfig,
)
from kubernetes_asyncio import client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.fake_kube import FakeKube
from tests.controller.live import (
    StreamStats,
    controller_config,
    count,
    emulator_pods,
    registry_states,
    running,
    stream_once,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

NS, DEP = "inference", "vllm"


@contextlib.asynccontextmanager
async def cluster(stack: LocalStack, port: int) -> AsyncIterator[FakeKube]:
    """The fake API server; each pod is a real emulator on its own loopback address, killed
    (SIGKILL) when the ReplicaSet stand-in deletes the pod."""
    kube = FakeKube(start_delay=0.1, terminate_delay=0.5)
    emulator_pods(kube, stack, port, first_ip=40, stop_signal=signal.SIGKILL)
    await kube.start()
    kube.add_deployment(NS, DEP, replicas=0, labels={"app": "vllm"}, template_labels={"app-state": "warm-pool"})
    try:
        yield kube
    finally:
        await kube.close()


_clients: list[client.ApiClient] = []


def _actuator(kube: FakeKube, port: int) -> KubernetesActuator:
    cfg = KubernetesActuatorConfig(namespace=NS, deployment=DEP, selector="app=vllm", port=port,
                                   request_timeout_s=5, in_cluster=False)
    api = client.ApiClient(client.Configuration(host=kube.url))
    _clients.append(api)
    return KubernetesActuator(cfg, api_client=api)


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        await _clients.pop().close()


def _kube_pool(port: int, *, max_total: int) -> dict[str, Any]:
    """The pool settings every test here runs: the Kubernetes actuator on the fake's Deployment,
    no warm pool (a drained pod is stopped, not kept), replicas never declared unresponsive."""
    return {"warm_pool": {"enabled": False, "max_total": max_total}, "timeouts": {"unresponsive_s": 60},
            "actuator": {"kind": "kubernetes", "options": {"namespace": NS, "deployment": DEP, "port": port}}}


def _pod_of(kube: FakeKube, name: str) -> dict[str, Any] | None:
    return kube.pods.get((NS, name))


async def test_a_stop_its_controller_left_half_done_is_finished_not_served_on(stack: LocalStack) -> None:
    url = stack.start_redis()
    port = free_port()
    cfg = _kube_pool(port, max_total=2)
    two = controller_config(url, policy={"min_replicas": 2, "max_replicas": 2}, **cfg)
    one = controller_config(url, policy={"min_replicas": 1, "max_replicas": 2}, **cfg)
    async with cluster(stack, port) as kube, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        # "a" brings up two active pods.
        act_a = _actuator(kube, port)
        async with running(two, act_a, holder="a"):
            await wait_for(lambda: _active(url, 2), 60)
        first, second = sorted(p["metadata"]["name"] for p in kube.pods_of(NS, DEP))
        endpoints = {name: f"http://{_pod_of(kube, name)['status']['podIP']}:{port}"  # type: ignore[index]
                     for name in (first, second)}
        # "b" wants one: it drains the idle pod (`second`: `first` serves a stream), takes it out
        # of the registry and annotates it, but its scale-down write fails (the API server
        # answers 409 to every Deployment write), so the stop is left half done when "b" goes.
        hold = StreamStats()
        holding = asyncio.create_task(stream_once(s, endpoints[first], 300, hold))
        await wait_for(lambda: _running_on(s, endpoints[first]), 10, interval=0.05)
        kube.conflicts_to_inject = 10**6
        act_b = _actuator(kube, port)
        async with running(one, act_b, holder="b") as ctl_b:
            pc_b = ctl_b.pools["default"]
            await wait_for(lambda: _stop_failed(pc_b.events), 30, interval=0.05)
        kube.conflicts_to_inject = 0
        pod = _pod_of(kube, second)
        assert pod is not None and "deletionTimestamp" not in pod["metadata"], "the stop was not left half done"
        assert pod["metadata"]["annotations"].get(DELETION_COST_ANNOTATION) == "-1000"
        assert kube.replicas(NS, DEP) == 2
        await holding

        # "c" takes over with the same config as "b". Requests go where the registry says
        # (as the processors route them): two long streams to each active pod but one, whose
        # single stream is short, so the pool's scale-down drains that one.
        act_c = _actuator(kube, port)
        streams = StreamStats()
        async with running(one, act_c, holder="c") as ctl_c:
            pc_c = ctl_c.pools["default"]
            states = await registry_states(url)
            active = sorted(rid for rid, st in states.items() if st == "active")
            # A pod whose stop has begun is never served on: the deletion cost makes the
            # ReplicaSet delete it first at the next scale-down, whichever pod that was meant for.
            adopted = {e["replica"]: e["state"] for e in pc_c.events if e["event"] == "adopt"}
            short, long_ = active[0], active[1:]
            tasks = [asyncio.create_task(stream_once(s, endpoints[short], 20, streams))]
            tasks += [asyncio.create_task(stream_once(s, endpoints[rid], 400, streams)) for rid in long_ for _ in range(2)]
            await asyncio.gather(*tasks)

            async def settled() -> bool:
                live = kube.pods_of(NS, DEP, include_terminating=True)
                return kube.replicas(NS, DEP) == 1 and len(live) == 1 and await _active(url, 1)

            await wait_for(settled, 30, interval=0.1)
        assert hold.failed == [] and hold.ok == 1
        assert streams.failed == [], (
            f"streams cut: {streams.failed}; registry under c: {states}; c adopted {adopted}; "
            f"{second} was being stopped by b")
        assert second not in active, f"c serves on {second}, whose stop b began: {adopted}"
        (left,) = kube.pods_of(NS, DEP)
        assert left["metadata"]["name"] == first
        assert DELETION_COST_ANNOTATION not in left["metadata"].get("annotations", {})


async def _active(url: str, n: int) -> bool:
    return count(await registry_states(url), "active") == n


async def _running_on(s: aiohttp.ClientSession, base: str) -> bool:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    return any(line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]) >= 1
               for line in text.splitlines())


async def _stop_failed(events: Any) -> bool:
    return any(e["event"] == "action_failed" and e.get("action") == "stop" for e in list(events))


@pytest.mark.parametrize("status", [503, 429])
async def test_an_api_server_outage_during_a_drain_skips_ticks_and_the_drain_ends_after_it(
        stack: LocalStack, status: int) -> None:
    # The API server unavailable for a few seconds (an upgrade of a managed control plane: 503;
    # API Priority and Fairness under load: 429) while a drain with a stream in flight runs. The
    # controller skips the ticks it cannot list the pods on, as it does on a Redis outage, and
    # goes on: the drain ends when the stream does and the drained pod is stopped.
    url = stack.start_redis()
    port = free_port()
    cfg = _kube_pool(port, max_total=2)
    two = controller_config(url, policy={"min_replicas": 2, "max_replicas": 2}, **cfg)
    one = controller_config(url, policy={"min_replicas": 1, "max_replicas": 2}, **cfg)
    async with cluster(stack, port) as kube, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async with running(two, _actuator(kube, port), holder="a"):
            await wait_for(lambda: _active(url, 2), 60)
        endpoints = {p["metadata"]["name"]: f"http://{p['status']['podIP']}:{port}" for p in kube.pods_of(NS, DEP)}
        first, second = sorted(endpoints)
        # A long stream on each pod: the one the scale-down drains stays draining for its length.
        stats = StreamStats()
        streams = [asyncio.create_task(stream_once(s, endpoints[rid], 250, stats)) for rid in (first, second)]
        await wait_for(lambda: _running_on(s, endpoints[first]), 10, interval=0.05)
        await wait_for(lambda: _running_on(s, endpoints[second]), 10, interval=0.05)
        async with running(one, _actuator(kube, port), holder="b") as ctl:
            await wait_for(lambda: _draining(url), 10, interval=0.05)
            kube.outage_status = status
            ticks = _tick_count(ctl)
            # Ticks come and go meanwhile (skipped ones included), or the controller has stopped.
            await wait_for(lambda: _ticked_past(ctl, ticks + 6), 20, interval=0.05)
            kube.outage_status = None
            run_task = next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Controller.run")  # type: ignore[union-attr]
            assert not run_task.done(), run_task.exception()

            async def settled() -> bool:
                return (not run_task.done() and kube.replicas(NS, DEP) == 1
                        and len(kube.pods_of(NS, DEP, include_terminating=True)) == 1 and await _active(url, 1))

            await wait_for(settled, 30, interval=0.1)
        await asyncio.gather(*streams)
        assert stats.failed == [] and stats.ok == 2


async def _draining(url: str) -> bool:
    return count(await registry_states(url), "draining") == 1


def _tick_count(ctl: Any) -> float:
    return ctl.metrics.registry.get_sample_value("floodgate_controller_tick_seconds_count", {"pool": "default"}) or 0.0


async def _ticked_past(ctl: Any, n: float) -> bool:
    return _tick_count(ctl) >= n


async def test_starts_the_api_server_could_not_take_do_not_back_off_the_scale_up(stack: LocalStack) -> None:
    # A scale-up while the API server answers 503 to Deployment writes (its pod list still
    # answers): the starts it refused never happened, they are no failing model starts. Counted
    # as such, they built a start backoff and, once the API server was back, held the scale-up
    # to one start at a time until a replica had come up (a whole cold start each).
    url = stack.start_redis()
    port = free_port()
    cfg = _kube_pool(port, max_total=4)
    one = controller_config(url, policy={"min_replicas": 1, "max_replicas": 3}, **cfg)
    three = controller_config(url, policy={"min_replicas": 3, "max_replicas": 3}, **cfg)
    async with cluster(stack, port) as kube:
        async with running(one, _actuator(kube, port), holder="a"):
            await wait_for(lambda: _active(url, 1), 60)
        kube.outage_status, kube.outage_resources = 503, frozenset({"deployments"})
        t0 = asyncio.get_running_loop().time()
        async with running(three, _actuator(kube, port), holder="b") as ctl:
            pc = ctl.pools["default"]

            async def refused(n: int) -> bool:
                return sum(1 for e in list(pc.events) if e["event"] == "action_failed" and e.get("action") == "start") >= n

            await wait_for(lambda: refused(2), 20, interval=0.05)
            await asyncio.sleep(3)  # the outage goes on a while
            kube.outage_status = None
            outage_s = asyncio.get_running_loop().time() - t0
            attempts = sum(1 for e in list(pc.events) if e["event"] == "action_failed" and e.get("action") == "start")
            await wait_for(lambda: _active(url, 3), 60)
            backoffs = [e for e in pc.events if e["event"] == "start_backoff"]
            failures = pc.start_backoff.failures
        assert backoffs == [] and failures == 0, backoffs
        # Paced (timeouts.start_backoff_s, 1 s), not retried at every tick and kick: two starts
        # at a time, about once a second (8 in 4.2 s here; unpaced, 219: a loose bound).
        assert attempts <= 4 * (outage_s + 2), (attempts, outage_s)
        assert kube.replicas(NS, DEP) == 3
