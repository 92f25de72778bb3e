"""Every shipped Envoy file passes `envoy --mode validate` (the real Envoy 1.40 binary)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from floodgate.binaries import envoy_binary
from floodgate.envoy_config import ENVOY_DIR, ProcessorTls, load_yaml, render_local, write_config
from tests.certs import make_pki


def validate(cfg: dict[str, Any], tmp_path: Path, name: str = "envoy.json") -> None:
    path = write_config(cfg, tmp_path / name)
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]


def minimal_bootstrap(http_filters: list[dict[str, Any]], clusters: list[dict[str, Any]]) -> dict[str, Any]:
    return {"static_resources": {"listeners": [{
        "name": "l", "address": {"socket_address": {"address": "127.0.0.1", "port_value": 10000}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "t",
            "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "model"}}]}]},
            "http_filters": [*http_filters, {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}],
        "clusters": [*clusters, {"name": "model", "type": "STATIC", "load_assignment": {
            "cluster_name": "model", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}}]}}


def test_local_bootstrap_validates(tmp_path: Path) -> None:
    validate(render_local(), tmp_path)


def test_local_bootstrap_variants_validate(tmp_path: Path) -> None:
    validate(render_local(admission=False), tmp_path, "noadm.json")
    validate(render_local(failure_mode_allow=True, processors=[("127.0.0.1", 1), ("127.0.0.1", 2)]),
             tmp_path, "open.json")
    validate(render_local(picking=True), tmp_path, "picking.json")
    validate(render_local(access_log=tmp_path / "access.log"), tmp_path, "access.json")
    pki = make_pki(tmp_path / "pki")
    client = pki.issue("envoy", client=True)
    tls = ProcessorTls(ca_file=str(pki.ca), cert_file=str(client.cert), key_file=str(client.key))
    validate(render_local(processor_tls=tls), tmp_path, "tls.json")


def test_strip_and_tls_includes_validate_in_a_minimal_bootstrap(tmp_path: Path) -> None:
    cluster = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    pki = make_pki(tmp_path / "pki")
    client = pki.issue("envoy", client=True)
    cluster["transport_socket"] = ProcessorTls(str(pki.ca), str(client.cert), str(client.key)).transport_socket()
    validate(minimal_bootstrap([load_yaml(ENVOY_DIR / "floodgate-strip-filter.yaml"),
                                load_yaml(ENVOY_DIR / "floodgate-filter.yaml")], [cluster]), tmp_path)


def test_edge_listener_trusts_no_forwarded_for_and_strips_internal_headers_first() -> None:
    for cfg in (render_local(), render_local(picking=True)):
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        assert hcm["use_remote_address"] is True and hcm.get("xff_num_trusted_hops", 0) == 0
        assert hcm["http_filters"][0]["name"] == "envoy.filters.http.header_mutation"
        routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
        for r in routes:
            skips = r.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {}).get("disabled")
            if "route" in r and (skips or r["match"].get("path") in ("/v1/models", "/health")):
                assert "x-request-priority" in r.get("request_headers_to_remove", []), r["match"]


def test_picking_cluster_include_validates(tmp_path: Path) -> None:
    filt = load_yaml(ENVOY_DIR / "floodgate-filter.yaml")
    cfg = minimal_bootstrap([filt], [load_yaml(ENVOY_DIR / "floodgate-cluster.yaml"),
                                     load_yaml(ENVOY_DIR / "floodgate-picking-cluster.yaml")])
    validate(cfg, tmp_path)


def test_picking_only_behind_the_processor() -> None:
    """Every route to the ORIGINAL_DST cluster runs the ext_proc filter, which fails closed."""
    cfg = render_local(picking=True)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext["typed_config"]["failure_mode_allow"] is False
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    picked = [r for r in routes if r.get("route", {}).get("cluster") == "model_picked"]
    assert picked
    for r in picked:
        per = r.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {})
        assert not per.get("disabled")
    with pytest.raises(ValueError):
        render_local(picking=True, admission=False)


def test_filter_and_cluster_includes_validate_in_a_minimal_bootstrap(tmp_path: Path) -> None:
    filt = load_yaml(ENVOY_DIR / "floodgate-filter.yaml")
    cluster = load_yaml(ENVOY_DIR / "floodgate-cluster.yaml")
    validate(minimal_bootstrap([filt], [cluster]), tmp_path)


def test_filter_include_keeps_the_stream_open_until_request_end() -> None:
    f = load_yaml(ENVOY_DIR / "floodgate-filter.yaml")["typed_config"]
    mode = f["processing_mode"]
    assert mode["response_trailer_mode"] == "SEND"  # stream end == request end (design §3)
    assert mode["request_body_mode"] == "NONE" and mode["response_body_mode"] == "NONE"
    # SEND here makes Envoy 1.40 drop its own codec replies (426/431/400) as an empty reply
    # (real Envoy: tests/test_local_replies.py); the processor turns them on per admitted request.
    assert mode["response_header_mode"] == "SKIP"
    assert f["allow_mode_override"] is True
    from floodgate.extproc.server import _MODES, _admit_reply
    for sampled in (False, True):
        for buffer_body in (False, True):
            override = _admit_reply(1, "0", "", (), sampled, True, buffer_body).mode_override
            assert override == _MODES[(sampled, buffer_body)]
            assert override.response_header_mode == override.SEND
            assert override.response_trailer_mode == override.SEND
    # every override the processor sends must stay allowed: response body STREAMED (latency
    # samples) and request body BUFFERED_PARTIAL (engine_priority; real Envoy in
    # tests/test_admission_e2e.py::test_engine_priority_writes_the_body_of_listed_classes_only)
    assert not f.get("allowed_override_modes")
    assert "failure_mode_allow" in f  # explicit, documented
    # message_timeout must exceed the longest default queue timeout (P0, 30 s)
    from floodgate.extproc.config import load_config
    longest = max(c.queue_timeout_s for c in load_config(None, env={}).pools[0].classes.values())
    assert float(f["message_timeout"].rstrip("s")) > longest
    assert {"source.address", "connection.mtls", "connection.uri_san_peer_certificate"} <= set(f["request_attributes"])


@pytest.mark.parametrize("path", sorted(p.name for p in ENVOY_DIR.glob("*.yaml")))
def test_every_shipped_file_is_covered(path: str) -> None:
    assert path in {"floodgate-filter.yaml", "floodgate-cluster.yaml", "floodgate-picking-cluster.yaml",
                    "local.yaml", "floodgate-sidecar-filter.yaml", "floodgate-strip-filter.yaml",
                    "floodgate-extproc-tls.yaml"}, (
        f"envoy/{path} is shipped but no test validates it")


def test_envoys_own_errors_are_json_and_leave_floodgates_replies_alone() -> None:
    """Every local-reply mapper of the shipped bootstrap writes an OpenAI-style JSON error and
    none can match a reply of the processor (details `floodgate_*`; real Envoy:
    tests/test_local_replies.py)."""
    hcm = render_local()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mappers = hcm["local_reply_config"]["mappers"]
    assert len(mappers) >= 4
    import re

    for m in mappers:
        expr = m["filter"]["extension_filter"]["typed_config"]["expression"]
        exact = re.search(r"response\.code_details == '([a-z_]+)'", expr)  # one detail of Envoy's own
        assert expr.startswith("response.code_details.startsWith('ext_proc_error')") or \
            "!response.code_details.startsWith('floodgate_')" in expr or \
            (exact is not None and not exact.group(1).startswith("floodgate_")), expr
        assert set(m["body_format_override"]["json_format"]["error"]) == {"message", "type", "param", "code"}



def _seconds(d: str) -> float:
    assert d.endswith("s"), d
    return float(d[:-1])


def test_a_stopped_processor_loses_its_streams_before_its_leases_expire() -> None:
    """A processor SIGSTOPped (a frozen VM) keeps its leases until 2/3 of `lease_ttl_s` after its
    last renewal at the soonest; Envoy must have cut its streams by then, or their requests still
    run upstream while Redis hands their permits out again (a fault review: 14 of L 8 for ~1 s
    with the 10 s + 5 s keepalive that shipped). Every shipped copy of the processor cluster:
    interval x 1.15 (Envoy's default jitter) + timeout below that."""
    import yaml
    from floodgate.extproc.config import RedisConfig

    ttl = RedisConfig(url="redis://127.0.0.1:6379/0").lease_ttl_s
    root = ENVOY_DIR.parent
    istio = [d for d in yaml.safe_load_all((root / "deploy/istio/envoyfilter.yaml").read_text()) if d]
    clusters = [load_yaml(ENVOY_DIR / "floodgate-cluster.yaml"),
                *(c for c in yaml.safe_load((root / "deploy/compose/envoy.yaml").read_text())["static_resources"]["clusters"]
                  if c["name"] == "floodgate_extproc"),
                *(p["patch"]["value"] for d in istio for p in d["spec"]["configPatches"]
                  if p["applyTo"] == "CLUSTER" and p["patch"]["value"].get("name") == "floodgate_extproc")]
    assert len(clusters) == 3, len(clusters)
    for c in clusters:
        opts = c["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        ka = opts["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"]
        assert _seconds(ka["interval"]) * 1.15 + _seconds(ka["timeout"]) < ttl * 2 / 3, ka
