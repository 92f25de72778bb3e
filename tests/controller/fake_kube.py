"""A tiny fake Kubernetes API server for the Kubernetes actuator's tests (aiohttp, 127.0.0.1).

It serves just what the actuator uses, with the API server's real paths and JSON shapes so that
`kubernetes_asyncio` talks to it unmodified:

* apps/v1 deployments: get, patch (merge patch; `metadata.resourceVersion` in the body is a
  precondition → 409 like the real server); deployments/scale: get, patch.
* v1 pods: list (with `labelSelector`), get, patch.
* discovery.k8s.io/v1 endpointslices: list and watch (with `labelSelector`, `resourceVersion`,
  `timeoutSeconds`), one slice per Service added with `add_service`, kept in step with its pods
  the way the EndpointSlice controller does (address = podIP, targetRef = the pod, conditions
  ready/serving/terminating); every change is a watch event streamed as JSON lines.

and a small ReplicaSet-like reconcile loop: pods are created (Pending, no IP) when `spec.replicas`
rises, become Running with a fake IP after `start_delay`, and on a scale-down the pods to
delete are ranked the way the ReplicaSet controller does it for the parts that matter here
(not-yet-running before running, then lower `controller.kubernetes.io/pod-deletion-cost`,
then newest first); deleted pods carry a deletionTimestamp for `terminate_delay` before they
vanish. Every request is logged as (verb, group, resource, subresource) so a test can compare
the calls made with the RBAC Role shipped in deploy/kubernetes/.

What it does not model: authentication/RBAC enforcement, watches of anything but
EndpointSlices, strategic-merge list semantics, admission, scheduling, readiness probes (a
Running pod is ready), rolling updates with several ReplicaSets.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


@dataclass(frozen=True)
class Call:
    verb: str  # get | list | watch | create | update | patch | delete
    group: str  # "" for core
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""


@dataclass
class FakeKube:
    start_delay: float = 0.05
    terminate_delay: float = 0.05
    tick: float = 0.01
    deployments: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    conflicts_to_inject: int = 0  # the next N deployment writes answer 409, as if raced
    # While set, every request answers this status (503: an API server restarting or being
    # upgraded; 429: API Priority and Fairness turning a client away), as a Status object.
    outage_status: int | None = None
    outage_resources: frozenset[str] | None = None  # only requests for these (e.g. "deployments"); None: all
    _rv: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _ip: itertools.count[int] = field(default_factory=lambda: itertools.count(10))
    _timers: dict[tuple[str, str], float] = field(default_factory=dict)
    _runner: web.AppRunner | None = None
    _loop_task: asyncio.Task[None] | None = None
    url: str = ""
    # Tests that run real servers for pods: the IP a new pod gets, and a hook called when a pod
    # turns Running (e.g. start an emulator on that IP) or is deleted.
    ip_allocator: Any = None  # Callable[[], str] | None
    on_running: Any = None  # Callable[[dict], None] | None
    on_deleted: Any = None  # Callable[[dict], None] | None
    services: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    slices: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    slice_events: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)  # (rv, type, slice)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _closing: bool = False

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._loop_task = asyncio.create_task(self._loop())
        return self.url

    async def close(self) -> None:
        self._closing = True  # open watches end within a second (the runner waits for them)
        self._changed.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if self._runner is not None:
            await self._runner.cleanup()

    # -- fixtures ------------------------------------------------------------------------
    def add_deployment(self, namespace: str, name: str, replicas: int = 0,
                       labels: dict[str, str] | None = None,
                       template_labels: dict[str, str] | None = None) -> None:
        match = labels or {"app": name}
        self.deployments[(namespace, name)] = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "resourceVersion": self._next_rv(), "annotations": {}, "generation": 1},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": dict(match)},
                "template": {"metadata": {"labels": {**match, **(template_labels or {})}},
                             "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}},
            },
            "status": {"replicas": 0},
        }
        self.reconcile()

    def add_pod(self, namespace: str, name: str, labels: dict[str, str], phase: str = "Running") -> None:
        """A pod owned by nobody (e.g. another app in the namespace)."""
        self.pods[(namespace, name)] = self._pod(namespace, name, labels, owner=None)
        self.pods[(namespace, name)]["status"] = {"phase": phase, "podIP": self._fake_ip()}

    def add_service(self, namespace: str, name: str, selector: dict[str, str], port: int,
                    port_name: str = "http") -> None:
        """A Service; its EndpointSlice follows the pods its selector matches."""
        self.services[(namespace, name)] = {"selector": dict(selector), "port": port, "port_name": port_name}
        self._sync_slices()

    def pods_of(self, namespace: str, deployment: str, include_terminating: bool = False) -> list[dict[str, Any]]:
        out = [p for (ns, _), p in self.pods.items() if ns == namespace
               and p["metadata"].get("_owner") == deployment
               and (include_terminating or "deletionTimestamp" not in p["metadata"])]
        return sorted(out, key=lambda p: p["metadata"]["name"])

    def replicas(self, namespace: str, deployment: str) -> int:
        return int(self.deployments[(namespace, deployment)]["spec"]["replicas"])

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait until every Deployment has exactly its replicas Running and nothing terminating."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            done = True
            for (ns, name), dep in self.deployments.items():
                pods = self.pods_of(ns, name, include_terminating=True)
                if len(pods) != dep["spec"]["replicas"] or any(
                        p["status"].get("phase") != "Running" or "deletionTimestamp" in p["metadata"] for p in pods):
                    done = False
            if done:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("fake cluster did not settle")
            await asyncio.sleep(self.tick)

    # -- the ReplicaSet stand-in ---------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            self.reconcile()

    def reconcile(self) -> None:
        now = asyncio.get_running_loop().time()
        for key, pod in list(self.pods.items()):
            due = self._timers.get(key)
            if due is None or now < due:
                continue
            if "deletionTimestamp" in pod["metadata"]:
                del self.pods[key]
                self._timers.pop(key)
                if self.on_deleted is not None:
                    self.on_deleted(pod)
            elif pod["status"].get("phase") == "Pending":
                pod["status"] = {"phase": "Running", "podIP": self._fake_ip()}
                pod["metadata"]["resourceVersion"] = self._next_rv()
                self._timers.pop(key)
                if self.on_running is not None:
                    self.on_running(pod)
        for (ns, name), dep in self.deployments.items():
            live = self.pods_of(ns, name)
            want = int(dep["spec"]["replicas"])
            for _ in range(want - len(live)):
                pod_name = f"{name}-5d8f7c-{next(self._seq):05d}"
                labels = dict(dep["spec"]["template"]["metadata"]["labels"])
                labels["pod-template-hash"] = "5d8f7c"
                pod = self._pod(ns, pod_name, labels, owner=name)
                self.pods[(ns, pod_name)] = pod
                self._timers[(ns, pod_name)] = now + self.start_delay
            if len(live) > want:
                # ReplicaSet ranking (pkg/controller/replicaset): unready before ready, lower
                # pod-deletion-cost first, newer first.
                def rank(p: dict[str, Any]) -> tuple[int, int, int]:
                    cost = int(p["metadata"].get("annotations", {}).get(DELETION_COST, "0"))
                    return (0 if p["status"].get("phase") != "Running" else 1, cost, -p["metadata"]["_seq"])
                for p in sorted(live, key=rank)[: len(live) - want]:
                    p["metadata"]["deletionTimestamp"] = _now_rfc3339()
                    p["metadata"]["resourceVersion"] = self._next_rv()
                    self._timers[(ns, p["metadata"]["name"])] = now + self.terminate_delay
            dep["status"] = {"replicas": len(self.pods_of(ns, name)),  # (live pods: terminating ones not counted)
                             "observedGeneration": dep["metadata"]["generation"]}
        self._sync_slices()

    # -- the EndpointSlice controller stand-in -------------------------------------------
    def _sync_slices(self) -> None:
        for (ns, svc), spec in self.services.items():
            endpoints = []
            for (pns, _), pod in sorted(self.pods.items()):
                ip = pod["status"].get("podIP")
                if pns != ns or not ip or not _selects(",".join(f"{k}={v}" for k, v in spec["selector"].items()),
                                                       pod["metadata"].get("labels", {})):
                    continue
                terminating = "deletionTimestamp" in pod["metadata"]
                running = pod["status"].get("phase") == "Running"
                endpoints.append({
                    "addresses": [ip],
                    "conditions": {"ready": running and not terminating, "serving": running,
                                   "terminating": terminating},
                    "targetRef": {"kind": "Pod", "name": pod["metadata"]["name"], "namespace": ns},
                })
            key = (ns, f"{svc}-abcde")
            old = self.slices.get(key)
            if old is not None and old["endpoints"] == endpoints:
                continue
            rv = self._next_rv()
            obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": key[1], "namespace": ns, "resourceVersion": rv,
                                "labels": {"kubernetes.io/service-name": svc,
                                           "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
                   "addressType": "IPv4", "endpoints": endpoints,
                   "ports": [{"name": spec["port_name"], "port": spec["port"], "protocol": "TCP"}]}
            self.slices[key] = obj
            self.slice_events.append((int(rv), "ADDED" if old is None else "MODIFIED", copy.deepcopy(obj)))
            self._changed.set()

    async def _slice_watch(self, request: web.Request, ns: str, sel: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or 0)
        timeout = float(request.query.get("timeoutSeconds") or 300)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sent = since
        while loop.time() < deadline and not self._closing:
            for rv, typ, obj in list(self.slice_events):
                if rv > sent and obj["metadata"]["namespace"] == ns and _selects(sel, obj["metadata"]["labels"]):
                    await resp.write((json.dumps({"type": typ, "object": obj}) + "\n").encode())
                sent = max(sent, rv)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), max(0.0, min(1.0, deadline - loop.time())))
        await resp.write_eof()
        return resp

    # -- HTTP ----------------------------------------------------------------------------
    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        m = re.fullmatch(r"/(?:api/(?P<cv>v1)|apis/(?P<g>[^/]+)/(?P<gv>[^/]+))/namespaces/(?P<ns>[^/]+)/"
                         r"(?P<res>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?", request.path)
        if m is None:
            self.calls.append(Call(request.method.lower(), "?", request.path))
            return _status(404, "NotFound", f"no route {request.path}")
        group = m["g"] or ""
        res, name, sub, ns = m["res"], m["name"] or "", m["sub"] or "", m["ns"]
        verb = {"GET": "get" if name else ("watch" if request.query.get("watch", "").lower() in ("1", "true") else "list"),
                "PATCH": "patch", "PUT": "update", "POST": "create", "DELETE": "delete"}.get(request.method, "?")
        self.calls.append(Call(verb, group, res, sub, ns, name))
        if self.outage_status is not None and (self.outage_resources is None or res in self.outage_resources):
            return _status(self.outage_status, "ServiceUnavailable" if self.outage_status == 503 else "TooManyRequests",
                           "the fake API server is unavailable")
        body = await request.json() if request.can_read_body else None
        if (group, res) == ("discovery.k8s.io", "endpointslices") and not name:
            sel = request.query.get("labelSelector", "")
            if verb == "watch":
                return await self._slice_watch(request, ns, sel)
            items = [copy.deepcopy(o) for (sns, _), o in sorted(self.slices.items())
                     if sns == ns and _selects(sel, o["metadata"]["labels"])]
            return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                      "metadata": {"resourceVersion": str(self._peek_rv())}, "items": items})
        if (group, res) == ("apps", "deployments") and name:
            return self._deployment(verb, ns, name, sub, body, request.content_type)
        if (group, res) == ("", "pods"):
            if verb == "list":
                sel = request.query.get("labelSelector", "")
                items = [_public(p) for (pns, _), p in sorted(self.pods.items())
                         if pns == ns and _selects(sel, p["metadata"].get("labels", {}))]
                return web.json_response({"apiVersion": "v1", "kind": "PodList",
                                          "metadata": {"resourceVersion": str(self._peek_rv())}, "items": items})
            if name and not sub:
                return self._pod_item(verb, ns, name, body, request.content_type)
        return _status(405, "MethodNotAllowed", f"{request.method} {request.path} is not implemented by the fake")

    def _deployment(self, verb: str, ns: str, name: str, sub: str, body: Any, ctype: str) -> web.Response:
        dep = self.deployments.get((ns, name))
        if dep is None:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if sub not in ("", "scale"):
            return _status(404, "NotFound", f"no subresource {sub}")
        if verb == "patch":
            if err := _check_patch(ctype, body):
                return err
            if self.conflicts_to_inject > 0:
                self.conflicts_to_inject -= 1
                return _status(409, "Conflict", "the object has been modified (injected)")
            want_rv = (body.get("metadata") or {}).get("resourceVersion")
            if want_rv is not None and want_rv != dep["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", "the object has been modified; please apply your changes to the latest version")
            if sub == "scale":
                if "replicas" in (body.get("spec") or {}):
                    dep["spec"]["replicas"] = int(body["spec"]["replicas"])
            else:
                body = copy.deepcopy(body)
                (body.get("metadata") or {}).pop("resourceVersion", None)
                _merge(dep, body)
            dep["metadata"]["resourceVersion"] = self._next_rv()
            dep["metadata"]["generation"] += 1
            self.reconcile()
        elif verb != "get":
            return _status(405, "MethodNotAllowed", verb)
        if sub == "scale":
            sel = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
            return web.json_response({
                "apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": ns, "resourceVersion": dep["metadata"]["resourceVersion"]},
                "spec": {"replicas": dep["spec"]["replicas"]},
                "status": {"replicas": dep["status"]["replicas"], "selector": sel}})
        return web.json_response(dep)

    def _pod_item(self, verb: str, ns: str, name: str, body: Any, ctype: str) -> web.Response:
        pod = self.pods.get((ns, name))
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        if verb == "patch":
            if err := _check_patch(ctype, body):
                return err
            body = copy.deepcopy(body)
            (body.get("metadata") or {}).pop("resourceVersion", None)
            _merge(pod, body)
            pod["metadata"]["resourceVersion"] = self._next_rv()
        elif verb != "get":
            return _status(405, "MethodNotAllowed", verb)
        return web.json_response(_public(pod))

    # -- helpers -------------------------------------------------------------------------
    def _pod(self, ns: str, name: str, labels: dict[str, str], owner: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": ns, "labels": labels, "annotations": {},
                                "resourceVersion": self._next_rv(), "creationTimestamp": _now_rfc3339(),
                                "_seq": next(self._seq), "_owner": owner}
        if owner:
            meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"{owner}-5d8f7c",
                                        "uid": f"uid-rs-{owner}", "controller": True}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
                "status": {"phase": "Pending"}}

    def _next_rv(self) -> str:
        return str(next(self._rv))

    def _peek_rv(self) -> int:
        rv = next(self._rv)
        return rv

    def _fake_ip(self) -> str:
        if self.ip_allocator is not None:
            return str(self.ip_allocator())
        n = next(self._ip)
        return f"10.244.{n // 250}.{n % 250 + 1}"


def _public(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"] = {k: v for k, v in out["metadata"].items() if not k.startswith("_")}
    return out


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386 JSON merge patch (null deletes a key)."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def _check_patch(ctype: str, body: Any) -> web.Response | None:
    if ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
        return _status(415, "UnsupportedMediaType", f"patch content type {ctype!r} not supported by the fake")
    if not isinstance(body, dict):
        return _status(400, "BadRequest", "patch body must be an object")
    return None


def _selects(selector: str, labels: dict[str, str]) -> bool:
    for term in (t.strip() for t in re.split(r",(?![^()]*\))", selector)):
        if not term:
            continue
        if m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term):
            values = {v.strip() for v in m[3].split(",")}
            if (labels.get(m[1]) in values) != (m[2] == "in"):
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": reason,
                              "message": message, "code": code}, status=code)


def _now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def dumps(obj: Any) -> str:  # handy in assertion messages
    return json.dumps(obj, indent=1, sort_keys=True)
