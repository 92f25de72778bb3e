"""Every config value is checked when the config is loaded (`--check-config` and start), and a
bad one is reported with its field's dotted path, never a traceback later."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from floodgate.controller.config import parse_config
from floodgate.extproc.config import ConfigError, load_config

from floodgate.validators import check_listen, check_redis_url


@pytest.mark.parametrize("value", ["127.0.0.1:50051", "0.0.0.0:1", "[::]:50051", "[::1]:9464",
                                   "localhost:8080", "floodgate-redis.floodgate.svc:65535"])
def test_good_listen_addresses(value: str) -> None:
    assert check_listen(value) == value


@pytest.mark.parametrize("value", ["50051", ":50051", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536",
                                   "127.0.0.1:http", "::1:50051", "[zz]:1", "300.1.1.1:80", "a b:80"])
def test_bad_listen_addresses(value: str) -> None:
    with pytest.raises(ValueError):
        check_listen(value)


@pytest.mark.parametrize("value", ["redis://h:6379/0", "rediss://user:pw@h:6380/1", "unix:///run/redis.sock"])
def test_good_redis_urls(value: str) -> None:
    assert check_redis_url(value) == value


@pytest.mark.parametrize("value", ["http://h:6379", "h:6379", "redis://", "redis://h:99999", "unix://"])
def test_bad_redis_urls(value: str) -> None:
    with pytest.raises(ValueError):
        check_redis_url(value)


PROCESSOR_BAD = [
    ({"admission": {"tenant_priorities": {"gold": 9}}}, "admission.tenant_priorities.gold"),
    ({"admission": {"tenant_priorities": {"gold": -1}}}, "admission.tenant_priorities.gold"),
    ({"admission": {"trust": {"spiffe_priorities": {"spiffe://x/y": 3}}}}, "admission.trust.spiffe_priorities.spiffe://x/y"),
    ({"admission": {"priority_header": "x priority"}}, "admission.priority_header"),
    ({"admission": {"tenant_header": ""}}, "admission.tenant_header"),
    ({"admission": {"retry_after_min_s": 10, "retry_after_max_s": 5}}, "admission"),
    ({"server": {"listen": "0.0.0.0"}}, "server.listen"),
    ({"server": {"listen": "127.0.0.1:99999"}}, "server.listen"),
    ({"server": {"metrics_listen": "9464"}}, "server.metrics_listen"),
    ({"redis": {"url": "http://redis:6379"}}, "redis.url"),
    ({"redis": {"url": "localhost:6379"}}, "redis.url"),
    ({"pools": [{"name": "a", "limit": {"window_s": 20, "window_max_s": 10}}]}, "pools.0.limit"),
    ({"pools": [{"name": "a", "unadmitted_paths": ["health"]}]}, "pools.0.unadmitted_paths.0"),
    ({"pools": [{"name": "a"}, {"name": "a"}]}, "pools"),
]


@pytest.mark.parametrize(("raw", "field"), PROCESSOR_BAD)
def test_processor_bad_value_names_its_field(tmp_path: Path, raw: dict, field: str) -> None:
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as exc:
        load_config(p, env={})
    assert f"  {field}:" in str(exc.value), str(exc.value)


def test_processor_metrics_listen_may_be_empty() -> None:
    assert load_config(None, {("server", "metrics_listen"): ""}, env={}).server.metrics_listen == ""


CONTROLLER_BAD = [
    ({"redis": {"url": "http://r:6379"}}, "redis.url"),
    ({"envoy": {"admin_url": "127.0.0.1:9901"}}, "envoy.admin_url"),
    ({"metrics_listen": "0.0.0.0"}, "metrics_listen"),
    ({"leader": {"ttl_s": 0.1}}, "leader.ttl_s"),
    ({"pools": [{"name": "a", "actuator": {"kind": "kubernetes", "options": {"port": 0}}}]}, "pools.0.actuator"),
    ({"pools": [{"name": "a", "actuator": {"kind": "kubernetes", "options": {"deploymnet": "x"}}}]},
     "pools.0.actuator"),
]


@pytest.mark.parametrize(("raw", "field"), CONTROLLER_BAD)
def test_controller_bad_value_names_its_field(raw: dict, field: str) -> None:
    from floodgate.controller.config import ConfigError as ControllerConfigError

    doc = {"pools": [{"name": "default"}], **raw}
    with pytest.raises(ControllerConfigError) as exc:
        parse_config(doc, env={})
    assert f"  {field}:" in str(exc.value), str(exc.value)


def test_controller_kubernetes_options_error_names_the_nested_option() -> None:
    from floodgate.controller.config import ConfigError as ControllerConfigError

    with pytest.raises(ControllerConfigError) as exc:
        parse_config({"pools": [{"name": "a", "actuator": {"kind": "kubernetes", "options": {"port": 0}}}]}, env={})
    assert "options.port" in str(exc.value)


@pytest.mark.parametrize(("command", "raw", "field"), [
    ("extproc", {"admission": {"tenant_priorities": {"gold": 9}}}, "admission.tenant_priorities.gold"),
    ("extproc", {"server": {"listen": "nonsense"}}, "server.listen"),
    ("extproc", {"redis": {"url": "memcached://x:1"}}, "redis.url"),
    ("controller", {"pools": [{"name": "a"}], "redis": {"url": "tcp://x:1"}}, "redis.url"),
    ("controller", {"pools": [{"name": "a"}], "metrics_listen": "x"}, "metrics_listen"),
])
@pytest.mark.parametrize("check", [True, False], ids=["check-config", "start"])
def test_cli_rejects_bad_values_at_check_and_at_start(tmp_path: Path, command: str, raw: dict, field: str,
                                                      check: bool) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(raw))
    argv = [sys.executable, "-m", "floodgate", command, "--config", str(p), *(["--check-config"] if check else [])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(("command", "raw", "field"), [
    ("extproc", {"server": {"metrics_listen": "127.0.0.1:{busy}", "listen": "127.0.0.1:{free}"}}, "server.metrics_listen"),
    ("extproc", {"server": {"listen": "127.0.0.1:{busy}", "metrics_listen": ""}}, "server.listen"),
    ("extproc", {"server": {"health_listen": "127.0.0.1:{busy}", "listen": "127.0.0.1:{free}", "metrics_listen": ""}},
     "server.health_listen"),
    ("controller", {"pools": [{"name": "a", "actuator": {"kind": "static", "endpoints": ["127.0.0.1:1"]}}],
                    "metrics_listen": "127.0.0.1:{busy}"}, "metrics_listen"),
])
def test_a_busy_address_stops_start_up_naming_the_setting(tmp_path: Path, command: str, raw: dict,
                                                          field: str) -> None:
    import socket

    from floodgate.supervisor import free_port

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        # No Redis on this port: the processor starts degraded, the controller stands by; neither
        # needs one to find its address taken.
        raw = {**raw, "redis": {"url": f"redis://127.0.0.1:{free_port()}/0"}}
        text = yaml.safe_dump(raw).replace("{busy}", str(busy.getsockname()[1])).replace("{free}", str(free_port()))
        p = tmp_path / "c.yaml"
        p.write_text(text)
        argv = [sys.executable, "-m", "floodgate", command, "--config", str(p)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert f"error: {field} " in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
