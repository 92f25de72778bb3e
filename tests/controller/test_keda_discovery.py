"""KEDA mode: the controller in the metrics-only role (`endpointslices` actuator) against the fake
API server, real Redis, and a real emulator (`floodgate sim`) behind every pod.

A stand-in for KEDA reads the controller's exported metrics (the ScaledObject's query:
desired + warm-pool target) and writes the Deployment's replicas; the fake's ReplicaSet and
EndpointSlice controllers start pods (each an emulator on its own 127.0.0.x address) and publish
them in the Service's EndpointSlice, which the controller watches. The controller never writes
to the API: the test checks every call it made was a list or watch of endpointslices.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from floodgate.controller.app import Controller
from floodgate.controller.config import ControllerConfig, parse_config
from floodgate.controller.discovery import EndpointSliceActuator, EndpointSliceConfig, endpoints_of
from floodgate.extproc.schema import PoolSettings
from floodgate.extproc.state import PoolState, redis_client
from kubernetes_asyncio import client

from floodgate.stack import LocalStack
from floodgate.supervisor import free_port
from tests.controller.fake_kube import FakeKube
from tests.controller.live import count, emulator_pods, registry_states, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NS = "inference"


def keda_config(redis_url: str) -> ControllerConfig:
    return parse_config({
        "redis": {"url": redis_url},
        "tick_interval_s": 0.25,
        "metrics_listen": None,
        "leader": {"enabled": False},
        "pools": [{
            "name": "default",
            "policy": {"min_replicas": 2, "max_replicas": 4, "stabilization_window_s": 0,
                       "scale_down_interval_s": 0, "panic_window_s": 0},
            "forecast": {"enabled": False},
            "warm_pool": {"min_size": 1, "max_size": 1, "burst_fraction": 0, "warm_min_age_s": 0},
            "timeouts": {"health_s": 30, "warmup_s": 10, "wake_s": 10, "sleep_s": 30, "adopt_grace_s": 5},
            "actuator": {"kind": "endpointslices", "options": {"namespace": NS, "service": "vllm"}},
        }],
    }, env={})


@contextlib.asynccontextmanager
async def cluster(stack: LocalStack, port: int) -> AsyncIterator[FakeKube]:
    """The fake API server; each pod is a real emulator on its own loopback address."""
    kube = FakeKube(start_delay=0.1, terminate_delay=1.0)
    emulator_pods(kube, stack, port, first_ip=20)
    await kube.start()
    kube.add_deployment(NS, "vllm", replicas=1, labels={"app": "vllm"})
    kube.add_service(NS, "vllm", {"app": "vllm"}, port)
    try:
        yield kube
    finally:
        await kube.close()


async def keda(ctl: Controller, kube: FakeKube, stop: asyncio.Event) -> None:
    """What the ScaledObject in deploy/kubernetes-keda/ does: replicas = desired + warm target."""
    reg = ctl.metrics.registry
    while not stop.is_set():
        desired = reg.get_sample_value("floodgate_desired_replicas", {"pool": "default"})
        warm = reg.get_sample_value("floodgate_warm_pool_target", {"pool": "default"})
        if desired is not None and warm is not None:
            kube.deployments[(NS, "vllm")]["spec"]["replicas"] = max(1, int(desired + warm))
        await asyncio.sleep(0.2)


async def test_controller_registers_and_routes_to_pods_keda_starts(stack: LocalStack) -> None:
    url = stack.start_redis()
    port = free_port()
    async with cluster(stack, port) as kube:
        api = client.ApiClient(client.Configuration(host=kube.url))
        act = EndpointSliceActuator(EndpointSliceConfig(namespace=NS, service="vllm", request_timeout_s=5),
                                    api_client=api)
        cfg = keda_config(url)
        ctl = Controller(cfg, {"default": act}, holder="test")
        stop = asyncio.Event()
        run_task = asyncio.create_task(ctl.run(stop))
        keda_task = asyncio.create_task(keda(ctl, kube, stop))
        try:
            # min_replicas 2 + a warm pool of 1, starting from the one pod the Deployment had:
            # the controller exports 3, "KEDA" scales to 3, the pods are adopted from the slice.
            async def pool_ready() -> bool:
                st = await registry_states(url)
                return count(st, "active") == 2 and count(st, "sleeping") + count(st, "warm") == 1

            assert await wait_for(pool_ready, 60), await registry_states(url)
            assert kube.replicas(NS, "vllm") == 3
            states = await registry_states(url)
            pods = {p["metadata"]["name"] for p in kube.pods_of(NS, "vllm")}
            assert set(states) == pods  # replica ids are the pod names
            # Endpoint picking routes to the pods KEDA started (every active one gets a request).
            c = redis_client(url, op_timeout_s=2)
            try:
                st = PoolState(c, "default", lease_ttl_s=15,
                               settings=PoolSettings(8, (0.5, 0.3, 0.1), picking=True))
                await st.configure()
                routed = {(await st.acquire(f"gw/{i}", "gw", i + 1, 1, "t")).endpoint for i in range(4)}
                await st.release(*(f"gw/{i}" for i in range(4)))
            finally:
                await c.aclose()
            slice_eps = endpoints_of({"s": _slice(kube, api)}, None)
            active_eps = {slice_eps[rid].endpoint for rid, s in states.items() if s == "active"}
            assert routed == active_eps and len(active_eps) == 2

            # HPA/KEDA deletes a pod (its choice, e.g. a scale-in): the moment its endpoint turns
            # terminating it leaves the registry, before the pod is gone.
            keda_task.cancel()
            victim = sorted(rid for rid, s in states.items() if s == "active")[0]
            victim_pod = kube.pods[(NS, victim)]
            from tests.controller.fake_kube import _now_rfc3339

            victim_pod["metadata"]["deletionTimestamp"] = _now_rfc3339()
            kube._timers[(NS, victim)] = asyncio.get_running_loop().time() + 3.0
            kube.deployments[(NS, "vllm")]["spec"]["replicas"] = 2
            kube.reconcile()

            async def victim_gone() -> bool:
                return victim not in await registry_states(url)

            assert await wait_for(victim_gone, 5)
            assert (NS, victim) in kube.pods  # still terminating: the registry was faster
            # The controller wakes its warm replica to keep 2 active (no pod was created by it).
            async def two_active() -> bool:
                return count(await registry_states(url), "active") == 2

            assert await wait_for(two_active, 30), await registry_states(url)
        finally:
            stop.set()
            keda_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keda_task
            await asyncio.wait_for(run_task, 15)
            await api.close()
    # Metrics-only: the controller read EndpointSlices and never wrote to the API.
    verbs = {(c.verb, c.group, c.resource) for c in kube.calls}
    assert verbs <= {("list", "discovery.k8s.io", "endpointslices"), ("watch", "discovery.k8s.io", "endpointslices")}
    assert ("watch", "discovery.k8s.io", "endpointslices") in verbs


def _slice(kube: FakeKube, api: client.ApiClient) -> Any:
    """The fake's current slice as the client's model (what the actuator sees)."""
    raw = kube.slices[(NS, "vllm-abcde")]

    class _Resp:
        data = __import__("json").dumps(raw)

    return api.deserialize(_Resp(), "V1EndpointSlice")


def test_endpoints_of_skips_terminating_duplicates_and_picks_the_named_port() -> None:
    s = client.V1EndpointSlice(
        address_type="IPv4",
        ports=[client.DiscoveryV1EndpointPort(name="metrics", port=9000),
               client.DiscoveryV1EndpointPort(name="http", port=8000)],
        endpoints=[
            client.V1Endpoint(addresses=["10.0.0.1"], conditions=client.V1EndpointConditions(ready=True),
                              target_ref=client.V1ObjectReference(kind="Pod", name="vllm-a")),
            client.V1Endpoint(addresses=["10.0.0.2"],
                              conditions=client.V1EndpointConditions(ready=False, terminating=True),
                              target_ref=client.V1ObjectReference(kind="Pod", name="vllm-b")),
            client.V1Endpoint(addresses=["10.0.0.3"], conditions=client.V1EndpointConditions(ready=False)),
        ])
    eps = endpoints_of({"s": s}, "http")
    assert {rid: (e.endpoint, e.terminating) for rid, e in eps.items()} == {
        "vllm-a": ("10.0.0.1:8000", False), "vllm-b": ("10.0.0.2:8000", True), "10.0.0.3": ("10.0.0.3:8000", False)}
    assert endpoints_of({"s": s}, "grpc") == {}
    assert endpoints_of({"s": s}, None)["vllm-a"].endpoint == "10.0.0.1:9000"


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_keda_role_grants_exactly_the_calls_the_discovery_makes() -> None:
    """The calls the test above sees (list and watch of endpointslices) are the Role's rules."""
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "deploy/kubernetes-keda/controller-rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role")
    grants = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
              for v in rule["verbs"]}
    assert grants == {("discovery.k8s.io", "endpointslices", "list"), ("discovery.k8s.io", "endpointslices", "watch")}
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "floodgate-controller", "namespace": "floodgate"}]
    svc = yaml.safe_load((ROOT / "deploy/kubernetes-keda/service.yaml").read_text())
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["namespace"] == role["metadata"]["namespace"]


def test_documented_keda_controller_config_is_valid_and_matches_the_manifests() -> None:
    import re

    import yaml

    text = (ROOT / "docs/kubernetes.md").read_text()
    section = text[text.index("## KEDA mode"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    doc = yaml.safe_load(__import__("textwrap").dedent(block.group(1)))
    cfg = parse_config({"redis": {"url": "redis://floodgate-redis:6379/0"}, **doc}, env={})
    opts = EndpointSliceConfig.model_validate(cfg.pools[0].actuator.options)
    svc = yaml.safe_load((ROOT / "deploy/kubernetes-keda/service.yaml").read_text())
    assert (opts.namespace, opts.service) == (svc["metadata"]["namespace"], svc["metadata"]["name"])
    assert opts.port_name in {p["name"] for p in svc["spec"]["ports"]}
    so = yaml.safe_load((ROOT / "deploy/kubernetes-keda/scaledobject.yaml").read_text())
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    assert "floodgate_desired_replicas" in query and "floodgate_warm_pool_target" in query
    # Scoped to this install's controller (an attacker review: unscoped, any scraped target
    # exporting the series, or a second install, set the vLLM Deployment's size).
    ctl = next(d for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/controller.yaml").read_text())
               if d and d.get("kind") == "Deployment")
    for series in re.findall(r"floodgate_\w+\{([^}]*)\}", query):
        assert f'namespace="{ctl["metadata"]["namespace"]}"' in series, series
        pod = re.search(r'pod=~"([^"]+)"', series)
        assert pod is not None and re.fullmatch(pod.group(1), ctl["metadata"]["name"] + "-7d9f8c6b5-x2x4q"), series
    assert so["spec"]["maxReplicaCount"] >= cfg.pools[0].policy.max_replicas + cfg.pools[0].warm_pool.max_size
