"""The Kubernetes actuator against the fake API server (tests/controller/fake_kube.py).

These prove the actuator's API calls, their JSON, its idempotency bookkeeping and its
restart story against a server that behaves like the real one for the endpoints used; they do
not prove behaviour of a real cluster (see docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from floodgate.controller.actuators.base import Actuator
from floodgate.controller.actuators.kubernetes import (
    DELETION_COST_ANNOTATION,
    LEDGER_ANNOTATION,
    KubernetesActuator,
    KubernetesActuatorConfig,
)
from kubernetes_asyncio import client
from pydantic import ValidationError

from tests.controller.fake_kube import FakeKube

pytestmark = pytest.mark.timeout(20)

NS, DEP = "inference", "vllm"
CFG = KubernetesActuatorConfig(namespace=NS, deployment=DEP, selector="app=vllm", port=8000)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = FakeKube()
    await fake.start()
    fake.add_deployment(NS, DEP, replicas=0, labels={"app": "vllm"}, template_labels={"app-state": "warm-pool"})
    try:
        yield fake
    finally:
        await fake.close()


ActuatorFactory = Callable[[], KubernetesActuator]


@pytest.fixture
async def make(kube: FakeKube) -> AsyncIterator[ActuatorFactory]:
    """Build actuators on fresh ApiClients, as separate controller processes would."""
    clients: list[client.ApiClient] = []

    def factory() -> KubernetesActuator:
        api = client.ApiClient(client.Configuration(host=kube.url))
        clients.append(api)
        return KubernetesActuator(CFG, api_client=api)

    yield factory
    for api in clients:
        await api.close()


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_satisfies_protocol(make: ActuatorFactory) -> None:
    act: Actuator = make()  # mypy checks the structural match
    assert act.name == "kubernetes"


async def test_start_then_pod_appears_with_endpoint(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    assert await act.list() == []
    assert await act.start("r1") is None  # Kubernetes names the pod itself
    assert kube.replicas(NS, DEP) == 1
    handles = await act.list()
    assert len(handles) == 1 and handles[0].running and handles[0].endpoint is None  # Pending, no IP yet
    assert handles[0].role == "warm-pool"  # the template's label: new pods start outside traffic
    await kube.settle()
    (h,) = await act.list()
    assert h.endpoint is not None and h.endpoint.endswith(":8000") and h.endpoint.startswith("10.244.")
    assert h.running and h.labels["app"] == "vllm"


async def test_start_is_idempotent_across_restart(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    await act.start("r1")
    await act.start("r1")  # a retry
    assert kube.replicas(NS, DEP) == 1
    restarted = make()  # a new controller process repeating its last call
    await restarted.start("r1")
    assert kube.replicas(NS, DEP) == 1
    await restarted.start("r2")
    assert kube.replicas(NS, DEP) == 2
    assert await restarted.replicas() == 2
    await kube.settle()
    assert len(await act.list()) == 2


async def test_concurrent_starts_do_not_lose_updates(kube: FakeKube, make: ActuatorFactory) -> None:
    a, b = make(), make()
    await asyncio.gather(*(x.start(f"r{i}") for i, x in enumerate([a, b, a, b, a])))
    assert kube.replicas(NS, DEP) == 5  # resourceVersion precondition + retry on 409


async def test_conflict_is_retried(kube: FakeKube, make: ActuatorFactory) -> None:
    kube.conflicts_to_inject = 2
    await make().start("r1")
    assert kube.replicas(NS, DEP) == 1


async def test_set_role_labels_pod(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    await act.start("r1")
    await act.start("r2")
    await kube.settle()
    first, second = await act.list()
    await act.set_role(first.replica_id, "active")
    await act.set_role(first.replica_id, "active")  # idempotent
    roles = {h.replica_id: h.role for h in await act.list()}
    assert roles == {first.replica_id: "active", second.replica_id: "warm-pool"}
    pod = kube.pods[(NS, first.replica_id)]
    assert pod["metadata"]["labels"]["app-state"] == "active"
    assert pod["metadata"]["labels"]["app"] == "vllm"  # the selector label is untouched
    await act.set_role(first.replica_id, "warm-pool")
    assert {h.role for h in await act.list()} == {"warm-pool"}
    await act.set_role("no-such-pod", "active")  # unknown ids are ignored
    with pytest.raises(ValueError):
        await act.set_role(first.replica_id, "bogus")  # type: ignore[arg-type]


async def test_stop_deletes_exactly_that_pod(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    for i in range(3):
        await act.start(f"r{i}")
    await kube.settle()
    names = [h.replica_id for h in await act.list()]
    victim = names[1]  # neither the newest (the ReplicaSet's default choice) nor the oldest
    await act.stop(victim)
    assert kube.replicas(NS, DEP) == 2
    assert kube.pods[(NS, victim)]["metadata"]["annotations"][DELETION_COST_ANNOTATION] == "-1000"
    gone = {h.replica_id: h.running for h in await act.list()}
    assert gone[victim] is False  # terminating: listed, not running
    await kube.settle()
    assert [h.replica_id for h in await act.list()] == [names[0], names[2]]


async def test_stop_is_idempotent_across_restart(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    for i in range(3):
        await act.start(f"r{i}")
    await kube.settle()
    victim = (await act.list())[0].replica_id
    await act.stop(victim)
    # Repeat before the ReplicaSet acted (pod not yet terminating): the ledger stops it.
    kube.terminate_delay = 0.3
    await make().stop(victim)
    assert kube.replicas(NS, DEP) == 2
    await kube.settle()
    await make().stop(victim)  # the pod is gone now: ignored
    await make().stop("never-existed")
    assert kube.replicas(NS, DEP) == 2
    assert len(await act.list()) == 2


async def test_stop_repeated_before_replicaset_acts(kube: FakeKube, make: ActuatorFactory) -> None:
    """The annotated-and-decremented pod may still be untouched when the stop is repeated."""
    act = make()
    for i in range(3):
        await act.start(f"r{i}")
    await kube.settle()
    victim = (await act.list())[2].replica_id
    kube._loop_task.cancel()  # type: ignore[union-attr]  # freeze the ReplicaSet stand-in
    deps = kube.deployments[(NS, DEP)]
    replicas_before = deps["spec"]["replicas"]
    real_reconcile = kube.reconcile
    kube.reconcile = lambda: None  # type: ignore[method-assign]
    try:
        await act.stop(victim)
        await make().stop(victim)
        assert deps["spec"]["replicas"] == replicas_before - 1
    finally:
        kube.reconcile = real_reconcile  # type: ignore[method-assign]
    kube.reconcile()
    assert "deletionTimestamp" in kube.pods[(NS, victim)]["metadata"]


async def test_crash_between_annotate_and_decrement_is_repaired(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    for i in range(2):
        await act.start(f"r{i}")
    await kube.settle()
    victim = (await act.list())[0].replica_id
    # The first controller annotated the pod, then died before scaling down.
    kube.pods[(NS, victim)]["metadata"]["annotations"][DELETION_COST_ANNOTATION] = "-1000"
    await make().stop(victim)
    assert kube.replicas(NS, DEP) == 1
    await kube.settle()
    assert victim not in [h.replica_id for h in await act.list()]


async def test_restart_rebuilds_view_from_list(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    for i in range(3):
        await act.start(f"r{i}")
    await kube.settle()
    a, b, c = (h.replica_id for h in await act.list())
    await act.set_role(a, "active")
    await act.set_role(b, "active")
    kube.terminate_delay = 5.0  # keep c terminating while we look
    await act.stop(c)
    await act.close()

    restarted = make()
    view = {h.replica_id: h for h in await restarted.list()}
    assert set(view) == {a, b, c}
    assert (view[a].role, view[b].role) == ("active", "active")
    assert view[a].running and view[b].running and not view[c].running
    assert all(h.endpoint for h in view.values())
    # Nothing the restarted controller repeats changes the cluster.
    for i in range(3):
        await restarted.start(f"r{i}")
    await restarted.stop(c)
    assert kube.replicas(NS, DEP) == 2


async def test_list_only_selected_pods(kube: FakeKube, make: ActuatorFactory) -> None:
    kube.add_pod(NS, "redis-0", {"app": "redis"})
    kube.add_pod("other", "vllm-elsewhere", {"app": "vllm"})
    act = make()
    await act.start("r1")
    await kube.settle()
    assert [h.labels["app"] for h in await act.list()] == ["vllm"]
    await act.stop("redis-0")  # a pod outside the selector is never stopped
    assert kube.replicas(NS, DEP) == 1
    assert "deletionTimestamp" not in kube.pods[(NS, "redis-0")]["metadata"]


async def test_set_replicas_and_ledger_is_bounded(kube: FakeKube, make: ActuatorFactory) -> None:
    act = make()
    await act.set_replicas(2)
    await act.set_replicas(2)
    assert kube.replicas(NS, DEP) == 2
    small = KubernetesActuator(CFG.model_copy(update={"ledger_size": 8}),
                               api_client=client.ApiClient(client.Configuration(host=kube.url)))
    try:
        for i in range(20):
            await small.start(f"s{i}")
    finally:
        await small._client.close()  # type: ignore[union-attr]
    assert kube.replicas(NS, DEP) == 22
    ledger = kube.deployments[(NS, DEP)]["metadata"]["annotations"][LEDGER_ANNOTATION]
    assert '"s19"' in ledger and '"s11"' not in ledger
    with pytest.raises(ValueError):
        await act.set_replicas(-1)


async def test_missing_deployment_raises(kube: FakeKube) -> None:
    api = client.ApiClient(client.Configuration(host=kube.url))
    act = KubernetesActuator(CFG.model_copy(update={"deployment": "nope"}), api_client=api)
    try:
        with pytest.raises(client.ApiException) as exc:
            await act.start("r1")
        assert exc.value.status == 404
    finally:
        await api.close()


def test_config_refuses_role_label_in_selector() -> None:
    with pytest.raises(ValidationError, match="role label"):
        KubernetesActuatorConfig(selector="app=vllm,app-state=active")
    with pytest.raises(ValidationError, match="role label"):
        KubernetesActuatorConfig(selector="app=vllm, app-state in (active)")
    with pytest.raises(ValidationError):
        KubernetesActuatorConfig(selector=" ")
    with pytest.raises(ValidationError):
        KubernetesActuatorConfig(namespaces="x")  # type: ignore[call-arg]
    cfg = KubernetesActuatorConfig.model_validate({"namespace": "llm", "deployment": "qwen", "selector": "app=qwen",
                                                   "port": 8080, "in_cluster": False, "kubeconfig": "/tmp/kc"})
    assert (cfg.port, cfg.in_cluster) == (8080, False)


def test_an_api_server_that_cannot_answer_now_is_told_from_a_refusal() -> None:
    from aiohttp import ClientConnectionError
    from floodgate.controller.actuators.kubernetes import api_unavailable
    from kubernetes_asyncio.client.exceptions import ApiException

    for status in (0, 408, 429, 500, 502, 503, 504):
        assert api_unavailable(ApiException(status=status)), status
    for status in (400, 401, 403, 404, 409, 422):
        assert not api_unavailable(ApiException(status=status)), status
    assert api_unavailable(ClientConnectionError("reset")) and api_unavailable(TimeoutError())
    assert not api_unavailable(ValueError("a bug"))


async def test_list_on_an_unavailable_api_server_raises_actuator_unavailable(kube: FakeKube,
                                                                              make: ActuatorFactory) -> None:
    from floodgate.controller.actuators.base import ActuatorUnavailable
    from kubernetes_asyncio.client.exceptions import ApiException

    act = make()
    kube.outage_status = 503
    with pytest.raises(ActuatorUnavailable, match="HTTP 503"):
        await act.list()
    kube.outage_status = 403  # a refusal no retry fixes (RBAC): raised as it is
    with pytest.raises(ApiException):
        await act.list()
    kube.outage_status = None
    assert await act.list() == []


async def _pending_beside_a_stop(kube: FakeKube, make: ActuatorFactory) -> tuple[KubernetesActuator, str, str]:
    """Two running pods, a third started and still Pending, then a stop of the first: the
    ReplicaSet (its ranking: Pending before Running, whatever the cost) deletes the Pending pod
    and keeps the one the stop annotated. Returns (actuator, the stopped pod, the other one)."""
    act = make()
    for i in range(2):
        await act.start(f"r{i}")
    await kube.settle()
    victim, other = (h.replica_id for h in await act.list())
    kube.start_delay = 60.0  # the next pod stays Pending
    await act.start("r2")
    await act.stop(victim)
    live = {p["metadata"]["name"] for p in kube.pods_of(NS, DEP)}
    assert live == {victim, other}, live  # the decrement went to the Pending pod
    assert kube.replicas(NS, DEP) == 2
    return act, victim, other


async def test_a_stop_whose_decrement_the_replicaset_spent_elsewhere_is_made_again(
        kube: FakeKube, make: ActuatorFactory) -> None:
    act, victim, other = await _pending_beside_a_stop(kube, make)
    listed = {h.replica_id: h.running for h in await act.list()}
    assert (listed[victim], listed[other]) == (False, True)  # (and the Pending pod, terminating)
    await make().stop(victim)  # the repeat (the next controller's, or this one's `_forget`)
    assert kube.replicas(NS, DEP) == 1
    assert "deletionTimestamp" in kube.pods[(NS, victim)]["metadata"]
    assert "deletionTimestamp" not in kube.pods[(NS, other)]["metadata"]
    await make().stop(victim)  # and again: the pod is going, nothing more
    assert kube.replicas(NS, DEP) == 1


async def test_the_controller_stops_a_listed_dead_replica_again_until_it_is_gone(
        kube: FakeKube, make: ActuatorFactory) -> None:
    # The controller's side: a replica listed not running that it does not know is stopped
    # again every FORGET_AGAIN_S while listed (once, the repeat came a tick after the stop,
    # before the ReplicaSet acted, and the pod ran on for good).
    import aiohttp
    from floodgate.controller.app import FORGET_AGAIN_S, PoolController
    from floodgate.controller.metrics import ControllerMetrics
    from floodgate.extproc.state import redis_client

    from tests.controller.live import controller_config

    act, victim, _ = await _pending_beside_a_stop(kube, make)
    now = [1000.0]
    cfg = controller_config("redis://127.0.0.1:1/0")  # (never connected to here)
    redis = redis_client("redis://127.0.0.1:1/0")
    async with aiohttp.ClientSession() as s:
        pc = PoolController(cfg.pools[0], act, redis, s, ControllerMetrics(), clock=lambda: now[0])
        (h,) = [h for h in await act.list() if h.replica_id == victim]
        real_reconcile = kube.reconcile
        kube.reconcile = lambda: None  # type: ignore[method-assign]  # the ReplicaSet lags: the first repeat finds it acting
        deps = kube.deployments[(NS, DEP)]
        deps["status"]["replicas"] = 3
        try:
            await pc._forget(h)
        finally:
            kube.reconcile = real_reconcile  # type: ignore[method-assign]
        kube.reconcile()
        assert kube.replicas(NS, DEP) == 2 and "deletionTimestamp" not in kube.pods[(NS, victim)]["metadata"]
        now[0] += 1.0
        await pc._forget(h)  # not yet due again
        assert kube.replicas(NS, DEP) == 2
        now[0] += FORGET_AGAIN_S
        await pc._forget(h)
        assert kube.replicas(NS, DEP) == 1
        assert "deletionTimestamp" in kube.pods[(NS, victim)]["metadata"]
        assert [e["event"] for e in pc.events].count("forgotten") == 1
    await redis.aclose()
