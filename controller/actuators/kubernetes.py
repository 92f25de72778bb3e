"""Kubernetes actuator: one inference Deployment per pool, its pods are the replicas.

Model (docs/controller.md):

* replicas = pods matching `selector` in `namespace`; `replica_id` = pod name, endpoint =
  `podIP:port` once the pod has an IP; `running` = no deletionTimestamp and phase
  Pending/Running.
* role = pod label `app-state: active|warm-pool` (a merge patch of the pod's labels). The
  Deployment's selector must not include that label, or relabelling would orphan the pod —
  the config refuses such a selector.
* start = Deployment `spec.replicas` + 1; the new pod shows up in `list()` under its own name,
  so `start()` returns None.
* stop(pod) = annotate the pod `controller.kubernetes.io/pod-deletion-cost: "-1000"` and
  `floodgate.io/stopping: "true"`, then `spec.replicas` − 1, so the ReplicaSet deletes that pod
  rather than another one. From the first step on, `list()` reports the pod not running.

Idempotency (the controller may repeat a call after a restart): every change of
`spec.replicas` is written in the same patch as a bounded ledger annotation on the Deployment
(`floodgate.io/actuator-ledger`: the last replica ids started and pod names stopped), guarded
by `metadata.resourceVersion` (optimistic concurrency, 409 → re-read and retry). A repeated
`start(id)` or `stop(pod)` whose id is already in the ledger changes nothing, and a crash
between the two steps of `stop` is repaired by the repeat (the annotation is idempotent and the
decrement has not been recorded): the next controller repeats it because `list()` reports the
annotated pod not running (it stops such a pod instead of adopting it). The ledger lives in the cluster, so it survives the
controller. `set_replicas(n)` is there for a controller that prefers to reconcile by count.

RBAC this needs (deploy/kubernetes/controller-rbac.yaml, checked by a test against the fake
API server's request log): apps/deployments get, patch; core pods get, list, patch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, get_args

import aiohttp
from floodgate.controller.actuators.base import ActuatorUnavailable, ReplicaHandle, Role
from pydantic import BaseModel, Field, field_validator, model_validator

from floodgate.yamlconfig import STRICT

log = logging.getLogger(__name__)

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# Set with the deletion cost in `stop`'s first step: this pod's stop has begun. `list()` reports
# such a pod not running, so a controller that finds it (its predecessor died, or lost the lease,
# between the two steps, or after a failed scale-down write) finishes the stop instead of adopting
# it: adopted, it was served on with the deletion cost still set, and the next scale-down of any
# other pod deleted it, streams and all (its cost ties the other's, and newer pods go first).
STOPPING_ANNOTATION = "floodgate.io/stopping"
LEDGER_ANNOTATION = "floodgate.io/actuator-ledger"
ROLES: tuple[str, ...] = get_args(Role)
# Merge patch (RFC 7386) rather than the client's default strategic merge: plain semantics
# that every API server and the test fake agree on, and `resourceVersion` in the body acts
# as a precondition.
MERGE_PATCH = "application/merge-patch+json"
# {"starts": [replica ids], "stops": [pod names]}, newest last; module-level because the
# class's own `list` method would shadow the builtin in annotations inside it.
Ledger = dict[str, list[str]]


class KubernetesActuatorConfig(BaseModel):
    """Where the pool's replicas live. Embeddable in the controller's config."""

    model_config = STRICT

    namespace: str = Field(default="default", description="Namespace of the inference Deployment and its pods.")
    deployment: str = Field(default="vllm", description="Name of the inference Deployment whose pods are the replicas.")
    selector: str = Field(default="app=vllm", description="Label selector of the Deployment's pods (must not use the role label).")
    port: int = Field(default=8000, ge=1, le=65535, description="Container port of the vLLM OpenAI API; endpoint = podIP:port.")
    role_label: str = Field(default="app-state", description="Pod label carrying the role (active | warm-pool).")
    deletion_cost: int = Field(default=-1000, description="pod-deletion-cost set on a pod before scaling down, so it is the one deleted.")
    in_cluster: bool = Field(default=True, description="Use the pod's service account; false: read `kubeconfig`.")
    kubeconfig: str | None = Field(default=None, description="Kubeconfig path when not in cluster (default: $KUBECONFIG or ~/.kube/config).")
    context: str | None = Field(default=None, description="Kubeconfig context (default: the current one).")
    request_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of one API call.")
    ledger_size: int = Field(default=64, ge=8, description="Recent start ids / stopped pods remembered on the Deployment for idempotency.")
    max_conflict_retries: int = Field(default=8, ge=1, description="Re-reads after a 409 (another writer changed the Deployment).")

    @field_validator("selector")
    @classmethod
    def _selector_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("an empty selector would match every pod of the namespace")
        return v

    @model_validator(mode="after")
    def _selector_without_role(self) -> KubernetesActuatorConfig:
        keys = {_selector_key(term) for term in self.selector.split(",") if term.strip()}
        if self.role_label in keys:
            raise ValueError(f"selector {self.selector!r} uses the role label {self.role_label!r}: "
                             "relabelling a pod would take it out of its Deployment")
        return self


def _selector_key(term: str) -> str:
    term = term.strip().lstrip("!")
    for op in ("!=", "==", "=", " in ", " notin "):
        if op in term:
            return term.split(op, 1)[0].strip()
    return term


class KubernetesActuator:
    """Actuator over one Deployment. Every call is idempotent (see the module docstring)."""

    name = "kubernetes"
    capacity: int | None = None

    def __init__(self, config: KubernetesActuatorConfig, api_client: Any | None = None) -> None:
        self.config = config
        # Tests (and embedders) pass a ready ApiClient; otherwise it is built on first use,
        # because loading a kubeconfig is itself async.
        self._client: Any | None = api_client
        self._owns_client = api_client is None
        self._init_lock = asyncio.Lock()

    # -- client plumbing ---------------------------------------------------------------
    async def _api(self) -> Any:
        if self._client is None:
            async with self._init_lock:
                if self._client is None:
                    from kubernetes_asyncio import client, config

                    if self.config.in_cluster:
                        config.load_incluster_config()
                        self._client = client.ApiClient()
                    else:
                        conf = client.Configuration()
                        await config.load_kube_config(config_file=self.config.kubeconfig,
                                                      context=self.config.context,
                                                      client_configuration=conf)
                        self._client = client.ApiClient(conf)
        return self._client

    async def _core(self) -> Any:
        from kubernetes_asyncio import client

        return client.CoreV1Api(await self._api())

    async def _apps(self) -> Any:
        from kubernetes_asyncio import client

        return client.AppsV1Api(await self._api())

    @property
    def _timeout(self) -> float:
        return self.config.request_timeout_s

    # -- Actuator protocol ---------------------------------------------------------------
    async def list(self) -> list[ReplicaHandle]:
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self._core()
        try:
            pods = await core.list_namespaced_pod(self.config.namespace, label_selector=self.config.selector,
                                                  _request_timeout=self._timeout)
        except (ApiException, aiohttp.ClientError, TimeoutError) as exc:
            # An API server that answers 503 while it restarts (a managed control plane's
            # upgrade) or 429 under load stopped the controller (a review: ApiException out of
            # the tick, "a bug in a pool's tick"), drains in flight and all, until its Pod restarted.
            if api_unavailable(exc):
                raise ActuatorUnavailable(f"kubernetes: listing pods of {self.config.namespace}/"
                                          f"{self.config.deployment}: {_describe(exc)}") from exc
            raise
        handles = [self._handle(p) for p in pods.items]
        handles.sort(key=lambda h: h.replica_id)
        return handles

    async def start(self, replica_id: str) -> ReplicaHandle | None:
        def change(replicas: int, ledger: Ledger) -> int | None:
            if replica_id in ledger["starts"]:
                return None  # a repeat: this start already raised the count
            ledger["starts"].append(replica_id)
            return replicas + 1

        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await self._update_replicas(change, f"start {replica_id}")
        except (ApiException, aiohttp.ClientError, TimeoutError) as exc:
            # Refused for now, not a model that fails to start: the controller must not count
            # it toward its start backoff (`PoolController._guard`).
            if api_unavailable(exc):
                raise ActuatorUnavailable(f"kubernetes: start {replica_id}: {_describe(exc)}") from exc
            raise
        return None

    async def stop(self, replica_id: str) -> None:
        pod = await self._read_pod(replica_id)
        if pod is None or pod.metadata.deletion_timestamp is not None:
            return  # unknown or already going: nothing to do, and never a second decrement
        if not _matches(pod.metadata.labels or {}, self.config.selector):
            log.warning("stop %s ignored: the pod is not one of %s", replica_id, self.config.selector)
            return
        # Step 1: make this pod the cheapest to delete. Idempotent, so a repeat after a crash
        # between the steps simply does it again.
        if not await self._patch_pod(replica_id, {"metadata": {"annotations": {
                DELETION_COST_ANNOTATION: str(self.config.deletion_cost), STOPPING_ANNOTATION: "true"}}}):
            return

        # Step 2: one replica fewer, recorded in the ledger in the same write.
        def change(replicas: int, ledger: Ledger) -> int | None:
            if replica_id in ledger["stops"]:
                return None
            ledger["stops"].append(replica_id)
            return max(0, replicas - 1)

        if not await self._update_replicas(change, f"stop {replica_id}"):
            await self._stop_again_if_spent(replica_id)

    async def _stop_again_if_spent(self, replica_id: str) -> None:
        """A repeated stop of a pod whose decrement is recorded: if the ReplicaSet spent that
        decrement on another pod (a Pending or not-Ready pod ranks before this one whatever its
        cost: "Caveats of `stop`" in docs/kubernetes.md), make it again. Without this such a pod,
        listed not running (`STOPPING_ANNOTATION`), ran on for good. The Deployment is read
        before the pod, and the write is conditional on that read (`resourceVersion`): a
        ReplicaSet still acting on the first decrement (its status not caught up) or any change
        since gives no second one; the next repeat looks again."""
        from kubernetes_asyncio.client.exceptions import ApiException

        dep = await self._read_deployment()
        spec = int(dep.spec.replicas if dep.spec.replicas is not None else 1)
        if not decrement_spent_elsewhere(spec, _status_of(dep)):
            return
        pod = await self._read_pod(replica_id)
        if pod is None or pod.metadata.deletion_timestamp is not None:
            return
        ledger = _load_ledger((dep.metadata.annotations or {}).get(LEDGER_ANNOTATION))
        ledger["stops"].append(replica_id)
        body = {"metadata": {"resourceVersion": dep.metadata.resource_version,
                             "annotations": {LEDGER_ANNOTATION: _dump_ledger(ledger, self.config.ledger_size)}},
                "spec": {"replicas": max(0, spec - 1)}}
        apps = await self._apps()
        try:
            await apps.patch_namespaced_deployment(self.config.deployment, self.config.namespace, body,
                                                   _content_type=MERGE_PATCH, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 409:
                return
            raise
        log.warning("stop %s: the ReplicaSet deleted another pod for its scale-down and kept this one: "
                    "%s/%s replicas %d -> %d again", replica_id, self.config.namespace, self.config.deployment,
                    spec, spec - 1)

    async def set_role(self, replica_id: str, role: Role) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        await self._patch_pod(replica_id, {"metadata": {"labels": {self.config.role_label: role}}})

    async def close(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.close()
            self._client = None

    # -- extras --------------------------------------------------------------------------
    async def replicas(self) -> int:
        """The Deployment's desired replica count (`spec.replicas`)."""
        dep = await self._read_deployment()
        return int(dep.spec.replicas or 0)

    async def set_replicas(self, n: int) -> None:
        """Set the count outright: naturally idempotent, for reconciling by target count."""
        if n < 0:
            raise ValueError("replicas must be >= 0")
        await self._update_replicas(lambda _r, _l: n, f"set replicas {n}", record=False)

    # -- internals -----------------------------------------------------------------------
    def _handle(self, pod: Any) -> ReplicaHandle:
        meta, status = pod.metadata, pod.status
        labels: Mapping[str, str] = dict(meta.labels or {})
        stopping = STOPPING_ANNOTATION in (meta.annotations or {})  # a stop began: finish it, never adopt
        ip = status.pod_ip if status is not None else None
        phase = status.phase if status is not None else None
        role_value = labels.get(self.config.role_label)
        role: Role | None = role_value if role_value in ROLES else None  # type: ignore[assignment]
        return ReplicaHandle(
            replica_id=meta.name,
            endpoint=f"{ip}:{self.config.port}" if ip else None,
            running=meta.deletion_timestamp is None and phase in ("Pending", "Running") and not stopping,
            role=role,
            labels=labels,
        )

    async def _read_deployment(self) -> Any:
        apps = await self._apps()
        return await apps.read_namespaced_deployment(self.config.deployment, self.config.namespace,
                                                     _request_timeout=self._timeout)

    async def _read_pod(self, name: str) -> Any | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self._core()
        try:
            return await core.read_namespaced_pod(name, self.config.namespace, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def _patch_pod(self, name: str, body: dict[str, Any]) -> bool:
        """Merge-patch a pod; False when it no longer exists (unknown ids are ignored)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        core = await self._core()
        try:
            await core.patch_namespaced_pod(name, self.config.namespace, body,
                                            _content_type=MERGE_PATCH, _request_timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 404:
                log.info("pod %s/%s is gone; nothing to patch", self.config.namespace, name)
                return False
            raise
        return True

    async def _update_replicas(self, change: Callable[[int, Ledger], int | None],
                               what: str, record: bool = True) -> bool:
        """Read-modify-write of spec.replicas (+ ledger) under a resourceVersion precondition.
        False: already applied, nothing written."""
        from kubernetes_asyncio.client.exceptions import ApiException

        apps = await self._apps()
        for attempt in range(self.config.max_conflict_retries):
            dep = await self._read_deployment()
            current = int(dep.spec.replicas if dep.spec.replicas is not None else 1)
            ledger = _load_ledger((dep.metadata.annotations or {}).get(LEDGER_ANNOTATION))
            target = change(current, ledger)
            if target is None or (target == current and not record):
                log.debug("%s: already applied (replicas %d)", what, current)
                return False
            metadata: dict[str, Any] = {"resourceVersion": dep.metadata.resource_version}
            if record:
                metadata["annotations"] = {LEDGER_ANNOTATION: _dump_ledger(ledger, self.config.ledger_size)}
            body = {"metadata": metadata, "spec": {"replicas": target}}
            try:
                await apps.patch_namespaced_deployment(self.config.deployment, self.config.namespace, body,
                                                       _content_type=MERGE_PATCH,
                                                       _request_timeout=self._timeout)
            except ApiException as exc:
                if exc.status == 409:
                    # Someone else (another call, an HPA, kubectl) wrote first: re-read.
                    await asyncio.sleep(min(0.5, 0.02 * 2 ** attempt))
                    continue
                raise
            log.info("%s: %s/%s replicas %d -> %d", what, self.config.namespace, self.config.deployment,
                     current, target)
            return True
        raise RuntimeError(f"{what}: gave up after {self.config.max_conflict_retries} conflicting writes "
                           f"to deployment {self.config.namespace}/{self.config.deployment}")


# Answers that mean "not now" rather than "never": 0 is kubernetes_asyncio's status for a
# connection or TLS failure, 408/504 time-outs, 429 API Priority and Fairness, 5xx the server.
UNAVAILABLE_STATUSES = frozenset({0, 408, 429, 500, 502, 503, 504})


def api_unavailable(exc: BaseException) -> bool:
    """Is `exc` an API server that cannot answer now (retry next tick), not a refusal that no
    retry fixes (403: RBAC; 404: no such namespace)? Pure."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and type(exc).__name__ == "ApiException":
        return status in UNAVAILABLE_STATUSES
    return isinstance(exc, (aiohttp.ClientError, TimeoutError, OSError))


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if type(exc).__name__ == "ApiException":
        return f"HTTP {status} {reason or ''}".rstrip()
    return f"{type(exc).__name__}: {exc}"


def _status_of(dep: Any) -> tuple[int | None, int | None, int | None]:
    """(status.replicas, status.observedGeneration, metadata.generation) of a Deployment."""
    st = dep.status
    return (getattr(st, "replicas", None) if st is not None else None,
            getattr(st, "observed_generation", None) if st is not None else None,
            getattr(dep.metadata, "generation", None))


def decrement_spent_elsewhere(spec_replicas: int, status: tuple[int | None, int | None, int | None]) -> bool:
    """For a pod whose stop is recorded and that is still alive: has the Deployment caught up with
    `spec_replicas` (its controller saw the spec, and it counts that many live pods), so that this
    pod is one of them and the recorded decrement removed another? Pure. Not caught up (the
    ReplicaSet has not acted yet), or no status: no."""
    replicas, observed, generation = status
    if replicas is None or replicas != spec_replicas:
        return False
    return observed is None or generation is None or observed >= generation


def _load_ledger(raw: str | None) -> Ledger:
    ledger: Ledger = {"starts": [], "stops": []}
    if raw:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            data = json.loads(raw)
            for key in ledger:
                ledger[key] = [str(x) for x in data.get(key, [])]
    return ledger


def _dump_ledger(ledger: Ledger, size: int) -> str:
    return json.dumps({k: v[-size:] for k, v in ledger.items()}, separators=(",", ":"))


def _matches(labels: Mapping[str, str], selector: str) -> bool:
    """Equality-based selector check (`a=b,c!=d,e,!f`), enough to refuse a foreign pod."""
    for term in (t.strip() for t in selector.split(",")):
        if not term or " in " in term or " notin " in term:
            continue  # set-based terms: the API server already filtered list(); trust it
        if "!=" in term:
            k, v = (s.strip() for s in term.split("!=", 1))
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True

