"""KEDA/HPA mode: replicas someone else creates, discovered from the model Service's EndpointSlices.

With KEDA (or an HPA) owning the inference Deployment's `spec.replicas`, the controller must not
write it; it runs metrics-only: it still computes the desired count (exported as
`floodgate_desired_replicas` and `floodgate_warm_pool_target`, which the ScaledObject in
deploy/kubernetes-keda/ scales to), and it still runs the replica side for pods it did not
create: every endpoint of the Service is adopted, health-checked, warmed up, registered in Redis
(so endpoint picking routes to it), promoted from or put into the warm pool (vLLM sleep), and
drained before it sleeps.

This actuator is the StaticActuator's model (endpoints that exist independently: `start` wakes a
sleeping one, `stop` puts one to sleep) over a set that changes: a `kubernetes_asyncio` list +
watch of `discovery.k8s.io/v1` EndpointSlices labelled `kubernetes.io/service-name=<service>`.

* A new endpoint (a pod KEDA started) appears in `list()`; the controller adopts it.
* `start()` wakes a sleeping endpoint if there is one; otherwise it returns None: the pod will
  come from KEDA (the desired count is already exported), and is adopted when it appears.
* A terminating endpoint (the pod KEDA/HPA is deleting) is no longer `running`, so the controller
  drops it from the registry at once: no new request is routed to it; those in flight finish
  within the pod's termination grace period.
* A vanished endpoint is forgotten the same way.

RBAC: `list` and `watch` on `endpointslices` in the `discovery.k8s.io` group (see
docs/kubernetes.md); nothing is ever written to the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from floodgate.controller.actuators.base import ReplicaHandle
from floodgate.controller.actuators.static import StaticActuator
from floodgate.controller.vllm import VllmError
from floodgate.extproc.cancel import cancel_and_wait
from pydantic import BaseModel, Field

from floodgate.yamlconfig import STRICT

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class EndpointSliceConfig(BaseModel):
    """Where the pool's pods are found (the `options` of actuator kind `endpointslices`)."""

    model_config = STRICT

    namespace: str = Field(default="default", min_length=1, description="Namespace of the model Service.")
    service: str = Field(default="vllm", min_length=1, description="The model Service whose EndpointSlices list the pods.")
    port_name: str | None = Field(default=None, description="EndpointSlice port name of the vLLM API (default: the slice's first port).")
    in_cluster: bool = Field(default=True, description="Use the pod's service account; false: read `kubeconfig`.")
    kubeconfig: str | None = Field(default=None, description="Kubeconfig path when not in cluster.")
    context: str | None = Field(default=None, description="Kubeconfig context (default: the current one).")
    request_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of one API call (and of the first sync).")
    watch_timeout_s: int = Field(default=300, ge=1, description="A watch is re-opened after this long (the server may close it sooner).")
    retry_s: float = Field(default=1.0, gt=0, description="Wait before re-listing after a failed list or watch.")
    wake_timeout_s: float = Field(default=120.0, gt=0, description="Longest POST /wake_up or /sleep.")


@dataclass(frozen=True)
class DiscoveredEndpoint:
    replica_id: str  # the pod name (targetRef), else the address
    endpoint: str  # "ip:port"
    terminating: bool


def endpoints_of(slices: dict[str, Any], port_name: str | None) -> dict[str, DiscoveredEndpoint]:
    """Pure: the endpoints of these EndpointSlices (kubernetes_asyncio V1EndpointSlice objects).

    Every address of an endpoint whose pod is not terminating counts, ready or not: a pod still
    loading its model is the controller's to health-check and warm up."""
    out: dict[str, DiscoveredEndpoint] = {}
    for s in slices.values():
        ports = [p for p in (s.ports or []) if p.port and (port_name is None or p.name == port_name)]
        if not ports:
            continue
        port = ports[0].port
        for ep in s.endpoints or []:
            cond = ep.conditions
            terminating = bool(cond and cond.terminating)
            ref = ep.target_ref
            for i, addr in enumerate(ep.addresses or []):
                host = f"[{addr}]" if ":" in addr else addr
                rid = ref.name if ref is not None and ref.name and i == 0 else addr
                prev = out.get(rid)
                if prev is None or prev.terminating:
                    out[rid] = DiscoveredEndpoint(rid, f"{host}:{port}", terminating)
    return out


class EndpointSliceActuator(StaticActuator):
    """Metrics-only actuator: never creates or deletes a pod, sleeps and wakes discovered ones."""

    name = "endpointslices"

    @property
    def capacity(self) -> None:  # type: ignore[override]
        """KEDA (or an HPA) adds pods from the exported desired count: a start beyond the
        endpoints found is a placeholder adopted when its pod appears (`start` returns None)."""
        return None

    def __init__(self, config: EndpointSliceConfig, api_client: Any | None = None) -> None:
        super().__init__({}, timeout_s=config.wake_timeout_s)
        self.config = config
        self._api_client = api_client
        self._owns_client = api_client is None
        self._slices: dict[str, Any] = {}
        self._found: dict[str, DiscoveredEndpoint] = {}
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.syncs = 0  # full lists done (watch restarts included)

    # -- discovery -----------------------------------------------------------------------
    async def _kube(self) -> Any:
        if self._api_client is None:
            from kubernetes_asyncio import client, config

            if self.config.in_cluster:
                config.load_incluster_config()
                self._api_client = client.ApiClient()
            else:
                conf = client.Configuration()
                await config.load_kube_config(config_file=self.config.kubeconfig, context=self.config.context,
                                              client_configuration=conf)
                self._api_client = client.ApiClient(conf)
        return self._api_client

    def _update(self) -> None:
        self._found = endpoints_of(self._slices, self.config.port_name)
        self.endpoints = {rid: d.endpoint for rid, d in self._found.items()}
        self._stopped &= set(self.endpoints)

    async def _run(self) -> None:
        from kubernetes_asyncio import client, watch

        sel = f"{SERVICE_NAME_LABEL}={self.config.service}"
        ns = self.config.namespace
        while True:
            try:
                api = client.DiscoveryV1Api(await self._kube())
                listed = await api.list_namespaced_endpoint_slice(
                    ns, label_selector=sel, _request_timeout=self.config.request_timeout_s)
                self._slices = {s.metadata.name: s for s in listed.items}
                self._update()
                self.syncs += 1
                self._synced.set()
                async with watch.Watch() as w:
                    events = w.stream(api.list_namespaced_endpoint_slice, ns, label_selector=sel,
                                      resource_version=listed.metadata.resource_version,
                                      timeout_seconds=self.config.watch_timeout_s)
                    async for ev in events:
                        obj = ev["object"]
                        if ev["type"] == "DELETED":
                            self._slices.pop(obj.metadata.name, None)
                        elif ev["type"] in ("ADDED", "MODIFIED"):
                            self._slices[obj.metadata.name] = obj
                        else:
                            break  # ERROR (e.g. 410 Gone): list again
                        self._update()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("EndpointSlice watch of %s/%s failed: %s: %s (re-listing)", ns,
                            self.config.service, type(exc).__name__, exc)
                await asyncio.sleep(self.config.retry_s)

    async def _ensure_synced(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"endpointslices:{self.config.service}")
        if not self._synced.is_set():
            await asyncio.wait_for(self._synced.wait(), self.config.request_timeout_s)

    # -- Actuator protocol ---------------------------------------------------------------
    async def list(self) -> list[ReplicaHandle]:
        await self._ensure_synced()
        return [ReplicaHandle(rid, d.endpoint, running=not d.terminating and rid not in self._stopped,
                              role=self._roles.get(rid))
                for rid, d in sorted(self._found.items())]

    async def start(self, replica_id: str) -> ReplicaHandle | None:
        await self._ensure_synced()
        if replica_id in self._found and replica_id not in self._stopped:
            return self._handle(replica_id)
        asleep = sorted(rid for rid in self._stopped if not self._found[rid].terminating)
        if not asleep:
            return None  # KEDA starts the pod from the exported desired count; adopted from list()
        rid = replica_id if replica_id in asleep else asleep[0]
        with contextlib.suppress(VllmError):
            await self._client(rid).wake(self.timeout_s)
        self._stopped.discard(rid)
        return self._handle(rid)

    async def stop(self, replica_id: str) -> None:
        if replica_id not in self._found or replica_id in self._stopped:
            return
        with contextlib.suppress(VllmError):
            await self._client(replica_id).sleep(1, self.timeout_s)
        self._stopped.add(replica_id)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await super().close()
        if self._owns_client and self._api_client is not None:
            await self._api_client.close()
            self._api_client = None
