"""Mesh sidecars: deploy/istio/envoyfilter.yaml and envoy/floodgate-sidecar-filter.yaml.

Offline: the Envoy config embedded in the EnvoyFilter's patches, wrapped in a minimal inbound
bootstrap (listener + HCM + the filter; the patched cluster), passes the real Envoy 1.40's
`--mode validate`; so does the plain include. Live (real Envoy, real processor, real Redis):
the sidecar filter admits inference calls through the processor and skips everything else.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from floodgate.extproc.config import load_config

from floodgate.envoy_config import ENVOY_DIR, load_yaml, write_config
from floodgate.stack import LocalStack
from floodgate.supervisor import free_port, wait_for_port
from tests.conftest import ROOT
from tests.test_envoy_config import validate

ISTIO = ROOT / "deploy" / "istio"
SIDECAR_FILTER = ENVOY_DIR / "floodgate-sidecar-filter.yaml"
EXT_PROC = "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"


def envoyfilter() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ISTIO / "envoyfilter.yaml").read_text())
    return doc


def patches(apply_to: str) -> list[dict[str, Any]]:
    return [p for p in envoyfilter()["spec"]["configPatches"] if p["applyTo"] == apply_to]


def http_filter_patches() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the header-strip patch, the ext_proc patch), in the order they are applied."""
    strip, http = patches("HTTP_FILTER")
    return strip, http


def ext_proc_config(filt: dict[str, Any]) -> dict[str, Any]:
    """The ExternalProcessor inside the (matcher-wrapped) filter."""
    tc: dict[str, Any] = filt["typed_config"]
    if tc["@type"].endswith("ExtensionWithMatcher"):
        tc = tc["extension_config"]["typed_config"]
    assert tc["@type"].endswith(EXT_PROC)
    return tc


def inbound_bootstrap(http_filter: dict[str, Any], clusters: list[dict[str, Any]], *,
                      port: int = 15006, admin_port: int | None = None,
                      app_port: int = 8000, strip: dict[str, Any] | None = None) -> dict[str, Any]:
    """What an inbound sidecar looks like, minimally: one listener whose HCM runs the filter and
    routes to the local replica (`inbound|8000||`), plus the given clusters."""
    boot: dict[str, Any] = {"static_resources": {
        "listeners": [{
            "name": "virtualInbound",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "inbound_0.0.0.0_8000",
                "route_config": {"name": "inbound|8000||", "virtual_hosts": [{"name": "inbound|http|8000", "domains": ["*"],
                                 "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "inbound|8000||", "timeout": "0s"}}]}]},
                "http_filters": [*([strip] if strip else []), http_filter, {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}],
        "clusters": [*clusters, {"name": "inbound|8000||", "type": "STATIC", "connect_timeout": "1s",
                                 "load_assignment": {"cluster_name": "inbound|8000||", "endpoints": [{"lb_endpoints": [
                                     {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                                  "port_value": app_port}}}}]}]}}]}}
    if admin_port is not None:
        boot["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return boot


# Istio's sidecar bootstrap defines the SDS cluster the patched cluster's mTLS reads
# certificates from; stand in for it so validation sees the same cluster graph.
ISTIO_SDS_CLUSTER = {
    "name": "sds-grpc", "type": "STATIC", "connect_timeout": "1s",
    "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}},
    "load_assignment": {"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
        "pipe": {"path": "./var/run/secrets/workload-spiffe-uds/socket"}}}}]}]},
}


# --- the EnvoyFilter ------------------------------------------------------------------------

def test_envoyfilter_shape() -> None:
    doc = envoyfilter()
    assert doc["apiVersion"].startswith("networking.istio.io/") and doc["kind"] == "EnvoyFilter"
    assert doc["spec"]["workloadSelector"]["labels"], "must select the inference workload only"
    strip, http = http_filter_patches()
    assert strip["patch"]["value"] == load_yaml(ENVOY_DIR / "floodgate-strip-filter.yaml")
    assert strip["match"] == http["match"] and strip["patch"]["operation"] == "INSERT_BEFORE"
    (hcm,) = patches("NETWORK_FILTER")
    assert hcm["match"]["context"] == "SIDECAR_INBOUND" and hcm["patch"]["operation"] == "MERGE"
    assert hcm["match"]["listener"]["portNumber"] == http["match"]["listener"]["portNumber"]
    merged = hcm["patch"]["value"]["typed_config"]
    assert merged["use_remote_address"] is True and merged["xff_num_trusted_hops"] == 0
    assert http["match"]["context"] == "SIDECAR_INBOUND"
    assert http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    assert http["patch"]["operation"] == "INSERT_BEFORE"
    (cluster,) = patches("CLUSTER")
    assert cluster["patch"]["operation"] == "ADD"
    assert cluster["patch"]["value"]["name"] == ext_proc_config(http["patch"]["value"])["grpc_service"]["envoy_grpc"]["cluster_name"]
    # Admission only: nothing in the mesh config steers requests (no ORIGINAL_DST anywhere).
    # The destination header appears only where it is removed.
    text = json.dumps(doc["spec"])
    assert "ORIGINAL_DST" not in text
    assert text.count("x-gateway-destination-endpoint") == 1 and '"remove": "x-gateway-destination-endpoint"' in text


def test_envoyfilter_embeds_exactly_the_sidecar_include() -> None:
    _, http = http_filter_patches()
    assert http["patch"]["value"] == load_yaml(SIDECAR_FILTER)


def test_envoyfilter_validates_in_a_minimal_inbound_bootstrap(tmp_path: Path) -> None:
    strip, http = http_filter_patches()
    (cluster,) = patches("CLUSTER")
    (hcm,) = patches("NETWORK_FILTER")
    boot = inbound_bootstrap(http["patch"]["value"], [cluster["patch"]["value"], ISTIO_SDS_CLUSTER],
                             strip=strip["patch"]["value"])
    merged = {k: v for k, v in hcm["patch"]["value"]["typed_config"].items() if k != "@type"}
    boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].update(merged)
    # SDS needs a node identity; Istio's bootstrap sets one per pod.
    boot["node"] = {"id": "sidecar~10.0.0.7~vllm-0.floodgate~floodgate.svc.cluster.local", "cluster": "vllm.floodgate"}
    validate(boot, tmp_path)


def test_sidecar_include_validates_with_the_cluster_include(tmp_path: Path) -> None:
    validate(inbound_bootstrap(load_yaml(SIDECAR_FILTER), [load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")]), tmp_path)


def test_sidecar_filter_settings() -> None:
    ext = ext_proc_config(load_yaml(SIDECAR_FILTER))
    local = load_yaml(ENVOY_DIR / "floodgate-filter.yaml")["typed_config"]
    # Same stream lifetime and timeouts as the gateway filter (design §3).
    # (response_attributes: a refused connection is no overload drop: an operator review)
    for key in ("processing_mode", "allow_mode_override", "message_timeout", "grpc_service", "response_attributes"):
        assert ext[key] == local[key], key
    assert ext["failure_mode_allow"] is True  # explicit; admission-only, fail-open (docs/mesh.md)
    assert {"connection.mtls", "connection.uri_san_peer_certificate"} <= set(ext["request_attributes"])


def test_cluster_points_at_the_processor_service() -> None:
    (cluster,) = patches("CLUSTER")
    c = cluster["patch"]["value"]
    include = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    for key in ("typed_extension_protocol_options", "circuit_breakers", "health_checks", "outlier_detection", "common_lb_config"):
        assert c[key] == include[key], key
    (ep,) = [e["endpoint"]["address"]["socket_address"] for g in c["load_assignment"]["endpoints"] for e in g["lb_endpoints"]]
    m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", ep["address"])
    assert m, ep
    service, namespace = m.groups()
    mesh_cfg = load_config(ISTIO / "processor.yaml", env={})
    assert ep["port_value"] == int(mesh_cfg.server.listen.rsplit(":", 1)[1])
    # The Kubernetes manifests (deploy/kubernetes/) define that Service: name, port, headless.
    manifests = ROOT / "deploy" / "kubernetes" / "processor.yaml"
    if manifests.exists():
        svcs = [d for d in yaml.safe_load_all(manifests.read_text()) if d and d.get("kind") == "Service"]
        svc = next(s for s in svcs if s["metadata"]["name"] == service)
        assert svc["spec"].get("clusterIP") == "None", "STRICT_DNS needs every pod IP (headless Service)"
        assert ep["port_value"] in {p["port"] for p in svc["spec"]["ports"]}
        assert svc["metadata"]["namespace"] == namespace
    # mTLS: the peer must be a workload of the processor's namespace.
    san = c["transport_socket"]["typed_config"]["common_tls_context"]["combined_validation_context"][
        "default_validation_context"]["match_typed_subject_alt_names"][0]["matcher"]["prefix"]
    assert san == f"spiffe://cluster.local/ns/{namespace}/sa/"


# --- the mesh processor config --------------------------------------------------------------

def test_mesh_processor_config() -> None:
    cfg = load_config(ISTIO / "processor.yaml", env={})
    assert cfg.pools and all(not p.endpoint_picking for p in cfg.pools)
    assert cfg.server.listen.startswith("0.0.0.0:")
    trust = cfg.admission.trust
    assert trust.spiffe_priorities, "priority must come from the caller's identity"
    assert set(trust.spiffe_priorities.values()) == {0, 1, 2}
    spiffe = re.compile(r"spiffe://[a-z0-9.-]+/ns/[a-z0-9-]+/sa/[a-z0-9-]+")
    for sid in trust.spiffe_priorities:
        assert spiffe.fullmatch(sid), sid
    for sid in trust.spiffe_ids:
        assert sid.startswith("spiffe://") and (sid.endswith("/") or spiffe.fullmatch(sid)), sid
    assert not trust.cidrs  # in a mesh, identities decide, not addresses


def test_mesh_processors_admit_into_the_pool_the_controller_scales(tmp_path: Path) -> None:
    """The controller reads a pool's queue and turned-away demand by its name: the mesh
    processors' pool must be one the shipped controller config scales (it was not: the
    controller never saw Floodgate's queue)."""
    from floodgate.controller.config import load_config as load_controller_config

    mesh = {p.name for p in load_config(ISTIO / "processor.yaml", env={}).pools}
    cm = next(d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "config.yaml").read_text())
              if d and d.get("kind") == "ConfigMap" and "controller.yaml" in d.get("data", {}))
    (tmp_path / "controller.yaml").write_text(cm["data"]["controller.yaml"])
    scaled = {p.name for p in load_controller_config(tmp_path / "controller.yaml", env={}).pools}
    assert mesh <= scaled, (mesh, scaled)


def test_admin_paths_policy_covers_the_gateways_blocked_paths() -> None:
    pol = next(d for d in yaml.safe_load_all((ISTIO / "authorizationpolicy.yaml").read_text())
               if d["metadata"]["name"] == "vllm-admin-paths")
    assert pol["spec"]["action"] == "DENY"
    assert pol["spec"]["selector"]["matchLabels"] == envoyfilter()["spec"]["workloadSelector"]["labels"]
    paths = {p for r in pol["spec"]["rules"] for t in r["to"] for p in t["operation"]["paths"]}
    from floodgate.envoy_config import ENVOY_DIR, load_yaml

    # Every path the gateway blocks (envoy/local.yaml's admin route) is denied here too.
    local = load_yaml(ENVOY_DIR / "local.yaml")
    routes = local["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    blocked = []
    for route in routes:
        regex = route["match"].get("safe_regex", {}).get("regex", "")
        if route.get("direct_response", {}).get("status") == 404 and regex.startswith("^/"):
            head, names = regex[2:].split("(", 1)
            names = names.split(")", 1)[0]
            if names == "load|unload":  # ^/v1/(load|unload)_lora_adapter
                blocked += [f"{head}{n}_lora_adapter" for n in names.split("|")]
            else:
                blocked += [head + n for n in names.split("|")]
    assert "v1/load_lora_adapter" in blocked and "server_info" in blocked
    for admin in blocked:
        if admin != "metrics":  # Prometheus scrapes the replicas' /metrics in the mesh
            assert f"/{admin}" in paths, admin


def test_only_the_inference_sidecars_may_open_ext_proc_streams() -> None:
    """Under STRICT mTLS every workload has a certificate; the stream carries the caller
    identity the processor maps to a priority, so 50051 is ALLOWed only for the inference
    pods' service account (the sidecars that run the filter), metrics stay reachable."""
    from tests.deploy.test_kubernetes_manifests import container, find

    pol = next(d for d in yaml.safe_load_all((ISTIO / "authorizationpolicy.yaml").read_text())
               if d["metadata"]["name"] == "floodgate-extproc")
    processor = find("Deployment", "floodgate-extproc")
    assert pol["metadata"]["namespace"] == processor["metadata"]["namespace"]
    labels = processor["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["action"] == "ALLOW"
    assert pol["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: str(p["containerPort"]) for p in container(processor)["ports"]}
    rules = {tuple(p for t in r["to"] for p in t["operation"]["ports"]): r.get("from") for r in pol["spec"]["rules"]}
    assert set(rules) == {(ports["grpc"],), (ports["metrics"],)}
    inference = find("Deployment", "vllm")
    sa = inference["spec"]["template"]["spec"].get("serviceAccountName", "default")
    assert rules[(ports["grpc"],)] == [{"source": {"principals": [
        f"cluster.local/ns/{inference['metadata']['namespace']}/sa/{sa}"]}}]
    assert envoyfilter()["metadata"]["namespace"] == inference["metadata"]["namespace"]


# --- live: the sidecar filter in a real Envoy -----------------------------------------------

def _request(url: str, method: str = "GET", body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _ext_proc_stat(admin_port: int, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?format=json&filter=ext_proc.{name}$",
                                timeout=2) as r:
        stats = json.load(r)["stats"]
    return sum(int(s["value"]) for s in stats)


def _streams(admin_port: int) -> int:
    return _ext_proc_stat(admin_port, "streams_started")


def _start_sidecar(stack: LocalStack, filt: dict[str, Any], processor_port: int, app_port: int) -> tuple[int, int]:
    cluster = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = processor_port
    port, admin = free_port(), free_port()
    path = write_config(inbound_bootstrap(filt, [cluster], port=port, admin_port=admin, app_port=app_port),
                        stack.sup.workdir / f"sidecar{port}.json")
    child = stack.sup.start_envoy(path, admin, name=f"sidecar{port}")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    return port, admin


COMPLETION = json.dumps({"prompt": "hi", "max_tokens": 4, "stream": True}).encode()


@pytest.mark.integration
def test_sidecar_filter_admits_inference_calls_and_skips_the_rest(stack: LocalStack, upstream: int) -> None:
    stack.start_redis()
    proc = stack.start_processor({"pools": [{"name": "mesh", "endpoint_picking": False}]})
    port, admin = _start_sidecar(stack, load_yaml(SIDECAR_FILTER), proc.port, upstream)
    base = f"http://127.0.0.1:{port}"
    assert _request(f"{base}/v1/completions", "POST", COMPLETION) == 200
    assert _streams(admin) == 1
    for path, method in (("/health", "GET"), ("/metrics", "GET"), ("/sleep?level=1", "POST"), ("/wake_up", "POST"),
                         ("/ping", "GET"), ("/version", "GET"), ("/v1/models", "GET")):
        _request(base + path, method, b"" if method == "POST" else None)  # (the stand-in may 404 some)
        assert _streams(admin) == 1, f"{path}: admin and health paths must skip admission"
    assert _request(f"{base}/sleep?level=1", "POST", b"") == 200
    # Every other path is admitted: vLLM also generates outside /v1/ (SageMaker's /invocations
    # runs chat or completion, and the pooling routes run the model), and a server's next
    # route must not bypass admission either.
    model_calls = ["/invocations", "/pooling", "/score", "/rerank", "/v2/rerank", "/classify", "/tokenize",
                   "/v1/chat/completions", "/healthz", "/health/x", "/metrics2", "/v1/models/../chat/completions"]
    for n, path in enumerate(model_calls, start=2):
        _request(base + path, "POST", COMPLETION)  # (the stand-in upstream may 404 it: admitted all the same)
        assert _streams(admin) == n, f"{path} skipped admission"


@pytest.mark.integration
def test_sidecar_filter_fails_open_as_shipped_and_closed_when_set(stack: LocalStack, upstream: int) -> None:
    dead = free_port()  # no processor listens here
    port, admin = _start_sidecar(stack, load_yaml(SIDECAR_FILTER), dead, upstream)
    assert _request(f"http://127.0.0.1:{port}/v1/completions", "POST", COMPLETION) == 200
    # The only trace of a call that passed unadmitted: the stat docs/mesh.md tells operators to watch.
    assert _ext_proc_stat(admin, "failure_mode_allowed") == 1
    closed = load_yaml(SIDECAR_FILTER)
    ext_proc_config(closed)["failure_mode_allow"] = False
    port, _ = _start_sidecar(stack, closed, dead, upstream)
    assert _request(f"http://127.0.0.1:{port}/v1/completions", "POST", COMPLETION) >= 500
    assert _request(f"http://127.0.0.1:{port}/health") == 200  # skipped: never asks the processor


@pytest.mark.integration
def test_sidecar_patches_ignore_forwarded_for_and_strip_internal_headers(stack: LocalStack, upstream: int) -> None:
    """The EnvoyFilter's inbound patches in a real Envoy: the HCM merge (use_remote_address,
    no trusted hops), the strip filter and the ext_proc filter. A caller from 127.0.0.1 that
    claims a trusted 10.x address in x-forwarded-for stays untrusted; forged internal headers
    never reach the replica, on admitted and skipped paths."""
    stack.start_redis()
    proc = stack.start_processor({"pools": [{"name": "mesh", "endpoint_picking": False}],
                                  "admission": {"trust": {"cidrs": ["10.0.0.0/8"]}}})
    strip, http = http_filter_patches()
    (hcm,) = patches("NETWORK_FILTER")
    cluster = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = proc.port
    port, admin = free_port(), free_port()
    boot = inbound_bootstrap(http["patch"]["value"], [cluster], port=port, admin_port=admin, app_port=upstream,
                             strip=strip["patch"]["value"])
    merged = {k: v for k, v in hcm["patch"]["value"]["typed_config"].items() if k != "@type"}
    boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].update(merged)
    path = write_config(boot, stack.sup.workdir / "sidecar-trust.json")
    child = stack.sup.start_envoy(path, admin, name="sidecar-trust")
    wait_for_port("127.0.0.1", port, 20, child.proc)
    forged = {"x-forwarded-for": "10.1.2.3", "x-envoy-external-address": "10.1.2.3", "x-request-priority": "0",
              "x-gateway-destination-endpoint": "127.0.0.1:1", "x-floodgate-priority": "0", "x-floodgate-x": "1"}
    for url, method, body in ((f"http://127.0.0.1:{port}/v1/completions", "POST", COMPLETION),
                              (f"http://127.0.0.1:{port}/health", "GET", None)):
        req = urllib.request.Request(url, data=body, method=method,
                                     headers={"content-type": "application/json", **forged, "x-test-id": method})
        with urllib.request.urlopen(req, timeout=20) as r:
            r.read()
            assert r.status == 200
            if method == "POST":
                assert r.headers["x-floodgate-priority"] == "1"  # not trusted by the spoofed address
    with urllib.request.urlopen(f"http://127.0.0.1:{upstream}/stats", timeout=5) as r:
        seen = {h.get("x-test-id"): h for h in json.load(r)["seen"]}
    assert "x-request-priority" not in seen["POST"]  # untrusted: removed by the processor
    for h in seen.values():
        assert "x-gateway-destination-endpoint" not in h and "x-floodgate-x" not in h, h
    assert seen["POST"]["x-floodgate-priority"] == "1" and "x-floodgate-priority" not in seen["GET"]


def test_the_shipped_service_gives_the_envoyfilter_its_inbound_http_chain() -> None:
    """Istio builds a port's inbound HTTP chain only for a port of a Service selecting the pod,
    and treats it as HTTP only when the port says so: without the Service the EnvoyFilter's
    `portNumber` patches matched nothing and every call passed unadmitted (a review)."""
    svc = yaml.safe_load((ISTIO / "service.yaml").read_text())
    assert svc["kind"] == "Service" and svc["metadata"]["namespace"] == envoyfilter()["metadata"]["namespace"]
    (port,) = svc["spec"]["ports"]
    _, http = http_filter_patches()
    assert port["port"] == http["match"]["listener"]["portNumber"] == port["targetPort"]
    assert port["name"] == "http" and port["appProtocol"] == "http"
    selector = svc["spec"]["selector"]
    assert selector == {**envoyfilter()["spec"]["workloadSelector"]["labels"], "app-state": "active"}
    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "inference.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    assert {k: v for k, v in selector.items() if k != "app-state"}.items() <= pod["metadata"]["labels"].items()
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    assert port["targetPort"] in ports
