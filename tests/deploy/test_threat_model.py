"""The shipped configs against the threat model's own rules (docs/operations.md "Threat model").

Fair order (pools[].fair_order) puts a tenant with no waiter at the head of its class. With a
tenant header the client chooses, a fresh tenant per request jumps the queue every time
(a review showed it through the real Envoy: a late request passed five waiters), so a shipped processor
config may keep fair_order on only if the Envoy config shipped with it sets or removes that
header before the ext_proc filter sees it (an auth filter). The same goes for
tenant_priorities: a tenant mapped to a priority is a claim anyone can make.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from floodgate.extproc.config import load_config

from floodgate.envoy_config import load_yaml

ROOT = Path(__file__).resolve().parents[2]
ENVOY_DIR = ROOT / "envoy"

# Each shipped processor config, and the Envoy configs it is shipped to run behind.
# Kubernetes ships no Envoy: docs/kubernetes.md builds the gateway from envoy/local.yaml (its
# !include files resolved, as `floodgate envoy` renders it).
PAIRS = {
    "kubernetes": (("deploy/kubernetes/config.yaml", "processor.yaml"), [ENVOY_DIR / "local.yaml"]),
    "compose": (("deploy/compose/processor.yaml", None), [ROOT / "deploy/compose/envoy.yaml"]),
    "istio": (("deploy/istio/processor.yaml", None),
              [ROOT / "deploy/istio/envoyfilter.yaml", ENVOY_DIR / "floodgate-sidecar-filter.yaml",
               ENVOY_DIR / "floodgate-strip-filter.yaml"]),
}


def shipped_processor_configs() -> set[str]:
    """Every processor config under deploy/: a YAML file (or ConfigMap key) with `pools` and `server`."""
    found = set()
    for f in (ROOT / "deploy").rglob("*.y*ml"):
        for doc in yaml.safe_load_all(f.read_text()):
            if not isinstance(doc, dict):
                continue
            if "pools" in doc and "server" in doc:
                found.add(f"{f.relative_to(ROOT)}")
            for key, text in (doc.get("data") or {}).items() if doc.get("kind") == "ConfigMap" else ():
                inner = yaml.safe_load(text)
                if isinstance(inner, dict) and "pools" in inner and "server" in inner:
                    found.add(f"{f.relative_to(ROOT)}:{key}")
    return found


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def envoy_sets_or_strips(configs: list[Path], header: str) -> bool:
    """Whether any of these Envoy configs removes the header or overwrites it with its own value:
    route/vhost `request_headers_to_remove`, `request_headers_to_add` with OVERWRITE, the
    header_mutation filter's remove / overwriting append, or jwt_authn `claim_to_headers`.
    (Appending keeps the client's value, so it does not count.)"""
    header = header.lower()
    for path in configs:
        docs = [load_yaml(path)] if path.is_relative_to(ENVOY_DIR) else list(yaml.safe_load_all(path.read_text()))
        for doc in docs:
            for d in _walk(doc):
                if header in [h.lower() for h in d.get("request_headers_to_remove", [])]:
                    return True
                if str(d.get("remove", "")).lower() == header:
                    return True
                appended = [d["append"]] if isinstance(d.get("append"), dict) else []  # header_mutation
                for add in d.get("request_headers_to_add", []) + appended:
                    if add.get("header", {}).get("key", "").lower() == header and \
                            add.get("append_action") == "OVERWRITE_IF_EXISTS_OR_ADD":
                        return True
                if any(c.get("header_name", "").lower() == header for c in d.get("claim_to_headers", [])):
                    return True
    return False


def load_processor(spec: tuple[str, str | None], tmp_path: Path) -> Any:
    rel, key = spec
    path = ROOT / rel
    if key is not None:  # a ConfigMap key, as mounted
        cm = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ConfigMap")
        path = tmp_path / key
        path.write_text(cm["data"][key])
    return load_config(path, env={})


def test_every_shipped_processor_config_is_checked() -> None:
    listed = {rel + (f":{key}" if key else "") for (rel, key), _ in PAIRS.values()}
    assert shipped_processor_configs() == listed


def test_the_checker_sees_an_auth_filter(tmp_path: Path) -> None:
    """The detector recognises the usual ways; otherwise the rule below could never hold."""
    f = tmp_path / "envoy.yaml"
    for cfg in ({"request_headers_to_remove": ["X-Tenant-Id"]},
                {"request_mutations": [{"remove": "x-tenant-id"}]},
                {"request_headers_to_add": [{"header": {"key": "x-tenant-id", "value": "%REQ(x-jwt-sub)%"},
                                             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]},
                {"providers": {"p": {"claim_to_headers": [{"header_name": "x-tenant-id", "claim_name": "sub"}]}}}):
        f.write_text(yaml.safe_dump(cfg))
        assert envoy_sets_or_strips([f], "x-tenant-id"), cfg
    f.write_text(yaml.safe_dump({"request_headers_to_add": [{"header": {"key": "x-tenant-id", "value": "a"}}]}))
    assert not envoy_sets_or_strips([f], "x-tenant-id")  # appended: the client's value stays


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_tenant_header_is_trusted_only_behind_an_envoy_that_sets_it(name: str, tmp_path: Path) -> None:
    spec, envoy_configs = PAIRS[name]
    cfg = load_processor(spec, tmp_path)
    if envoy_sets_or_strips(envoy_configs, cfg.admission.tenant_header):
        return
    # Clients choose the tenant header here: neither fair order nor tenant priorities may read it.
    for pool in cfg.pools:
        assert pool.fair_order is False, f"{spec[0]}: pool {pool.name} orders by a client-chosen {cfg.admission.tenant_header}"
    assert not cfg.admission.tenant_priorities, f"{spec[0]}: any client may claim a tenant's priority"
