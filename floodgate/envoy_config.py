"""Render the shipped Envoy files into a bootstrap Envoy can run.

`envoy/local.yaml` pulls the filter and cluster includes in with `!include` (Envoy has no
include mechanism of its own), so the includes a user pastes are the very files the local stack
and the tests run. `render_local` resolves the includes and sets addresses and ports.

    python -m floodgate.envoy_config > /tmp/envoy.yaml   # the defaults, ready for envoy -c
    python -m floodgate.envoy_config --compose > deploy/compose/envoy.yaml   # compose.yaml's
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Installed from a wheel, envoy/ is package data at floodgate/envoy/ (pyproject's package-dir);
# in the repository (and an editable install) it is the top-level envoy/ folder.
_HERE = Path(__file__).resolve().parent
ENVOY_DIR = _HERE / "envoy" if (_HERE / "envoy" / "local.yaml").is_file() else _HERE.parent / "envoy"


class _IncludeLoader(yaml.SafeLoader):
    pass


def _include(loader: _IncludeLoader, node: yaml.Node) -> Any:
    base = Path(getattr(loader, "name", ENVOY_DIR / "x")).parent
    return load_yaml(base / str(loader.construct_scalar(node)))  # type: ignore[arg-type]


_IncludeLoader.add_constructor("!include", _include)


def load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.load(f, Loader=_IncludeLoader)


@dataclass(frozen=True)
class ProcessorTls:
    """Files for Envoy's side of the mTLS channel to the processors."""

    ca_file: str
    cert_file: str
    key_file: str
    server_name: str = "floodgate-extproc"

    def transport_socket(self) -> dict[str, Any]:
        sock: dict[str, Any] = copy.deepcopy(load_yaml(ENVOY_DIR / "floodgate-extproc-tls.yaml"))
        tls = sock["typed_config"]
        tls["sni"] = self.server_name
        ctx = tls["common_tls_context"]
        ctx["tls_certificates"] = [{"certificate_chain": {"filename": self.cert_file},
                                    "private_key": {"filename": self.key_file}}]
        ctx["validation_context"]["trusted_ca"] = {"filename": self.ca_file}
        ctx["validation_context"]["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": self.server_name}}]
        return sock


def _endpoints(addrs: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
        "address": host, "port_value": port}}}} for host, port in addrs]}]


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _ext_proc_filter(cfg: dict[str, Any]) -> dict[str, Any] | None:
    for f in _hcm(cfg)["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            tc: dict[str, Any] = f["typed_config"]
            return tc
    return None


# Where a request's time went inside Envoy: when it started (unix, µs), the whole duration
# (first byte in to last byte out), when the last request byte arrived and the first response
# byte left (ms from start), and the ext_proc filter's own view of its request-headers call
# (Envoy's send to the processor's reply, µs). `x-probe-id` joins a line to the request the
# overload bench's P2 probe sent (bench/reject_probe.py).
_EXT_PROC = "envoy.filters.http.ext_proc"
ACCESS_LOG_FORMAT: dict[str, str] = {
    "start": "%START_TIME(%s.%6f)%",
    "duration_ms": "%DURATION%",
    "request_ms": "%REQUEST_DURATION%",
    "response_ms": "%RESPONSE_DURATION%",
    "code": "%RESPONSE_CODE%",
    "details": "%RESPONSE_CODE_DETAILS%",
    "probe": "%REQ(X-PROBE-ID)%",
    "priority": "%REQ(X-REQUEST-PRIORITY)%",
    "conn": "%CONNECTION_ID%",
    "ext_proc_header_us": f"%FILTER_STATE({_EXT_PROC}:FIELD:request_header_latency_us)%",
    "ext_proc_header_status": f"%FILTER_STATE({_EXT_PROC}:FIELD:request_header_call_status)%",
}


def render_local(*, listen_port: int = 10000, admin_port: int = 9901,
                 processors: Sequence[tuple[str, int]] = (("127.0.0.1", 50051),),
                 upstreams: Sequence[tuple[str, int]] = (("127.0.0.1", 8000),),
                 failure_mode_allow: bool | None = None, admission: bool = True,
                 message_timeout_s: float | None = None,
                 extra_filters: Sequence[dict[str, Any]] = (),
                 picking: bool = False,
                 processor_tls: ProcessorTls | None = None,
                 access_log: Path | None = None,
                 processor_keepalive_s: float | None = None,
                 request_timeout_s: float | None = None,
                 stream_flush_timeout_s: float | None = None,
                 route_timeout_s: float | None = None,
                 source: Path | None = None) -> dict[str, Any]:
    """The local bootstrap with ports set. `admission=False` removes the ext_proc filter
    (the no-admission baseline of the benchmarks); `extra_filters` go before the router;
    `picking=True` routes `/v1/` to the ORIGINAL_DST cluster the processor steers;
    `processor_tls` talks mTLS to the processors (envoy/floodgate-extproc-tls.yaml);
    `access_log` writes one JSON line per request there (`ACCESS_LOG_FORMAT`: Envoy's own timings
    and the ext_proc filter's, for the benchmarks); `processor_keepalive_s` sets the HTTP/2 ping
    interval to the processors, `request_timeout_s` the listener's bound on a request's
    arrival, `stream_flush_timeout_s` on a response waiting for a client that does not read,
    and `route_timeout_s` the inference route's (`/v1/`) upstream timeout (tests: the
    shipped 10 s, 60 s and 300 s, faster)."""
    cfg = copy.deepcopy(load_yaml(source or ENVOY_DIR / "local.yaml"))
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listen_port
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == "floodgate_extproc":
            cluster["type"] = "STATIC"
            cluster["load_assignment"]["endpoints"] = _endpoints(processors)
            if processor_tls is not None:
                cluster["transport_socket"] = processor_tls.transport_socket()
            if processor_keepalive_s is not None:
                opts = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
                opts["explicit_http_config"]["http2_protocol_options"]["connection_keepalive"]["interval"] = \
                    f"{processor_keepalive_s}s"
        elif cluster["name"] == "model":
            cluster["load_assignment"]["endpoints"] = _endpoints(upstreams)
    hcm = _hcm(cfg)
    if request_timeout_s is not None:
        hcm["request_timeout"] = f"{request_timeout_s}s"
    if stream_flush_timeout_s is not None:
        hcm["stream_flush_timeout"] = f"{stream_flush_timeout_s}s"
    if route_timeout_s is not None:
        for vh in hcm["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                if route["match"].get("prefix") == "/v1/" and "route" in route:
                    route["route"]["timeout"] = f"{route_timeout_s}s"
    ext = _ext_proc_filter(cfg)
    if ext is not None:
        if failure_mode_allow is not None:
            ext["failure_mode_allow"] = failure_mode_allow
        if message_timeout_s is not None:
            ext["message_timeout"] = f"{message_timeout_s}s"
    filters = hcm["http_filters"]
    if access_log is not None:
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(access_log), "log_format": {"json_format": ACCESS_LOG_FORMAT}}}]
    if not admission:
        filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
        for vh in hcm["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                route.pop("typed_per_filter_config", None)
        cfg["static_resources"]["clusters"] = [
            c for c in cfg["static_resources"]["clusters"] if c["name"] != "floodgate_extproc"]
    if picking:
        if not admission:
            raise ValueError("endpoint picking needs the admission filter (it sets the destination)")
        cfg["static_resources"]["clusters"].append(load_yaml(ENVOY_DIR / "floodgate-picking-cluster.yaml"))
        for vh in hcm["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                if "route" in route and route["route"].get("cluster") == "model":
                    # Every model route goes through the processor, which picks the endpoint
                    # (cheap reads like /v1/models take no permit: `unadmitted_paths`, nor do
                    # requests that run no model, a body-less GET/HEAD/OPTIONS: `unadmitted_methods`).
                    route["route"]["cluster"] = "model_picked"
                    # the destination is the processor's pick: a retry would go to the same
                    # replica (the processor ejects a dead one: eject_after_failures)
                    route["route"].pop("retry_policy", None)
                    route.pop("typed_per_filter_config", None)
    router_at = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.router")
    filters[router_at:router_at] = list(extra_filters)
    return cfg


def write_config(cfg: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML; Envoy reads either
    return path


# The docker compose stack (compose.yaml): service names and ports Envoy reaches. The ORIGINAL_DST
# (picking) cluster needs IP addresses, so the replicas have fixed ones on the compose network;
# the controller config (deploy/compose/controller.yaml) registers those.
COMPOSE_BOOTSTRAP = Path(__file__).resolve().parent.parent / "deploy" / "compose" / "envoy.yaml"
COMPOSE_PROCESSORS: tuple[tuple[str, int], ...] = (("processor-1", 50051), ("processor-2", 50051))
COMPOSE_UPSTREAMS: tuple[tuple[str, int], ...] = (("vllm-1", 8000), ("vllm-2", 8000), ("vllm-3", 8000))
COMPOSE_HEADER = (
    "# GENERATED from envoy/local.yaml and its includes by\n"
    "#   .venv/bin/python -m floodgate.envoy_config --compose > deploy/compose/envoy.yaml\n"
    "# Do not edit: change envoy/ and regenerate (tests/deploy/test_compose.py checks they match).\n"
)


def stats_listener(port: int, admin_port: int, address: str = "0.0.0.0") -> dict[str, Any]:
    """A listener that exposes only GET /stats* of the admin interface (read-only metrics)."""
    not_found = {"status": 404, "body": {"inline_string": "not found"}}
    return {
        "name": "stats",
        "address": {"socket_address": {"address": address, "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "stats",
            "normalize_path": True,
            "merge_slashes": True,
            "path_with_escaped_slashes_action": "REJECT_REQUEST",
            "route_config": {"name": "stats", "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": [
                {"match": {"prefix": "/stats", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
                 "route": {"cluster": "envoy_admin", "timeout": "5s"}},
                {"match": {"prefix": "/"}, "direct_response": not_found}]}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}],
    }


def render_compose(*, listen_port: int = 10000, admin_port: int = 9901, stats_port: int = 9902,
                   processors: Sequence[tuple[str, int]] = COMPOSE_PROCESSORS,
                   upstreams: Sequence[tuple[str, int]] = COMPOSE_UPSTREAMS,
                   picking: bool = True) -> dict[str, Any]:
    """The local bootstrap for a container network: the gateway listener on 0.0.0.0, the
    processor and model clusters `STRICT_DNS` over compose service names (each name resolves
    to its container), endpoint picking on by default (the controller moves replicas between
    active and warm, and only the processor knows which are active).

    The admin interface stays on 127.0.0.1 inside the container (anything that reaches it can
    POST /quitquitquit or /drain_listeners); the controller and Prometheus read Envoy's stats
    through a separate listener on `stats_port` that forwards only GET /stats* to it."""
    cfg = render_local(listen_port=listen_port, admin_port=admin_port, processors=processors,
                       upstreams=upstreams, picking=picking)
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = "0.0.0.0"
    cfg["static_resources"]["listeners"].append(stats_listener(stats_port, admin_port))
    cfg["static_resources"]["clusters"].append({
        "name": "envoy_admin", "type": "STATIC", "connect_timeout": "0.25s",
        "load_assignment": {"cluster_name": "envoy_admin", "endpoints": _endpoints([("127.0.0.1", admin_port)])}})
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] in ("floodgate_extproc", "model"):
            cluster["type"] = "STRICT_DNS"
            cluster["dns_lookup_family"] = "V4_ONLY"
    return cfg


def dump_yaml(cfg: dict[str, Any], header: str = "") -> str:
    return header + yaml.safe_dump(cfg, sort_keys=False, width=200)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m floodgate.envoy_config",
                                     description="Print a complete Envoy bootstrap rendered from envoy/.")
    parser.add_argument("--compose", action="store_true",
                        help="the docker compose bootstrap (deploy/compose/envoy.yaml) instead of the local one")
    args = parser.parse_args(argv)
    try:
        if args.compose:
            sys.stdout.write(dump_yaml(render_compose(), COMPOSE_HEADER))
        else:
            yaml.safe_dump(render_local(), sys.stdout, sort_keys=False)
        sys.stdout.flush()
    except BrokenPipeError:
        from floodgate.cli import closed_stdout

        return closed_stdout()
    return 0


if __name__ == "__main__":
    sys.exit(main())
