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
                                   "localhost:8080", "floodgate-redis.floodgate.svc:65535",
                                   "vllm_1:8000", "compose_vllm_1.net:8000"])
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
    # names no request can carry: over 128 characters, a comma (read as two tenants), spaces, empty
    ({"admission": {"tenant_priorities": {"org-" + "x" * 125: 0}}}, "admission.tenant_priorities"),
    ({"admission": {"tenant_priorities": {"vip,gold": 0}}}, "admission.tenant_priorities"),
    ({"admission": {"tenant_priorities": {" vip": 0}}}, "admission.tenant_priorities"),
    ({"admission": {"tenant_priorities": {"": 0}}}, "admission.tenant_priorities"),
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
    # one authority for two pools: the first would never get traffic (compared case-insensitively)
    ({"pools": [{"name": "a", "match_authority": "llm.example.com"},
                {"name": "b", "match_authority": "LLM.example.com"}]}, "pools"),
    # infinite values passed every lower bound and crashed start-up (OverflowError)
    ({"redis": {"lease_ttl_s": float("inf")}}, "redis.lease_ttl_s"),
    ({"server": {"shutdown_grace_s": float("inf")}}, "server.shutdown_grace_s"),
    ({"admission": {"retry_after_max_s": float("nan")}}, "admission.retry_after_max_s"),
    ({"pools": [{"name": "a", "limit": {"window_s": float("inf")}}]}, "pools.0.limit.window_s"),
    # accepted before (a review): a negative collection threshold (a pass on nearly every
    # allocation), one header for priority and tenant, a body cap no request body fits, a TTL a
    # renewal can outlast
    ({"server": {"gc_threshold": [-1, 0, 0]}}, "server.gc_threshold.0"),
    ({"admission": {"priority_header": "X-Tenant-Id"}}, "admission"),
    ({"admission": {"retry_count_header": "x-tenant-id"}}, "admission"),
    ({"admission": {"retry_count_header": "retry count"}}, "admission.retry_count_header"),
    ({"pools": [{"name": "a", "engine_priority": {0: -1}, "engine_priority_max_body_bytes": 0}]},
     "pools.0.engine_priority_max_body_bytes"),
    ({"redis": {"lease_ttl_s": 1, "op_timeout_s": 3}}, "redis"),
    ({"redis": {"lease_ttl_s": 1, "op_timeout_s": 0.5}}, "redis"),
    # a class that does not exist is named before its fields are checked
    ({"pools": [{"name": "a", "classes": {3: {"max_queue": 5}}}]}, "pools.0.classes"),
    ({"pools": [{"name": "a", "classes": {2: {"max_queue": 5, "share": 0}, "2": {"max_queue": 9, "share": 0}}}]},
     "pools.0.classes"),
    # the same for engine_priority: {"0": -1, 0: 5} kept one silently (an operator review)
    ({"pools": [{"name": "a", "engine_priority": {"0": -1, 0: 5}}]}, "pools.0.engine_priority"),
    ({"pools": [{"name": "a", "engine_priority": {"0": -1, "00": 5}}]}, "pools.0.engine_priority"),
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
    ({"pools": [{"name": "default", "policy": {"target_concurrency": float("inf")}}]}, "pools.0.policy.target_concurrency"),
    ({"pools": [{"name": "default", "warm_pool": {"max_drain_s": float("inf")}}]}, "pools.0.warm_pool.max_drain_s"),
    ({"redis": {"url": "http://r:6379"}}, "redis.url"),
    ({"envoy": {"admin_url": "127.0.0.1:9901"}}, "envoy.admin_url"),
    ({"metrics_listen": "0.0.0.0"}, "metrics_listen"),
    ({"leader": {"ttl_s": 0.1}}, "leader.ttl_s"),
    ({"pools": [{"name": "a", "actuator": {"kind": "kubernetes", "options": {"port": 0}}}]}, "pools.0.actuator"),
    ({"pools": [{"name": "a", "actuator": {"kind": "kubernetes", "options": {"deploymnet": "x"}}}]},
     "pools.0.actuator"),
    # accepted before (a review): a class that does not exist, and no cluster to sum
    ({"pools": [{"name": "default", "demand": {"exclude_classes": [7]}}]}, "pools.0.demand.exclude_classes.0"),
    ({"envoy": {"clusters": []}}, "envoy.clusters"),
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
@pytest.mark.parametrize("reuseport", [False, True], ids=["plain", "so_reuseport"])
def test_a_busy_address_stops_start_up_naming_the_setting(tmp_path: Path, command: str, raw: dict,
                                                          field: str, reuseport: bool) -> None:
    # so_reuseport: the port is held the way another processor (gRPC sets SO_REUSEPORT by
    # default) or Envoy holds it. The processor used to bind beside it and log "listening"
    # (a review: two processors on one port, Envoy's connections split between them).
    import socket

    from floodgate.supervisor import free_port

    with socket.socket() as busy:
        if reuseport:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
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


@pytest.mark.parametrize("check", [True, False], ids=["check-config", "start"])
@pytest.mark.parametrize("exe", ["no-such-floodgate-binary", "/nonexistent/bin/floodgate"])
def test_a_process_command_that_cannot_run_stops_check_and_start(tmp_path: Path, exe: str, check: bool) -> None:
    # It passed --check-config and every start failed at run time, backing off for good (review
    # user: the docs' own `command: [floodgate, sim, ...]` where floodgate is not on PATH).
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"pools": [{"name": "a", "actuator": {
        "kind": "process", "state_dir": str(tmp_path / "st"), "command": [exe, "sim", "--port", "{port}"]}}]}))
    argv = [sys.executable, "-m", "floodgate", "controller", "--config", str(p), *(["--check-config"] if check else [])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "pools.0.actuator.command:" in r.stderr and exe in r.stderr and "Traceback" not in r.stderr, r.stderr
    # the interpreter, by its full path, is fine
    p.write_text(yaml.safe_dump({"pools": [{"name": "a", "actuator": {
        "kind": "process", "state_dir": str(tmp_path / "st"), "command": [sys.executable, "-m", "floodgate", "sim",
                                                                          "--port", "{port}"]}}]}))
    r = subprocess.run([sys.executable, "-m", "floodgate", "controller", "--config", str(p), "--check-config"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


PROCESS = {"kind": "process"}
STATIC2 = {"kind": "static", "endpoints": ["127.0.0.1:8001", "127.0.0.1:8002"]}

# Sections that contradict each other, or a setting the controller would silently ignore:
# (pool, the field the error is reported at, words the message must hold).
CONTROLLER_CONTRADICTIONS = [
    ({"warm_pool": {"min_size": 10, "max_size": 2}, "actuator": PROCESS},
     "pools.0.warm_pool", "min_size (10) is above max_size (2)"),
    ({"warm_pool": {"min_size": 3, "max_size": 3}, "policy": {"max_replicas": 2}, "actuator": PROCESS},
     "pools.0", "warm_pool.min_size (3) is above policy.max_replicas (2)"),
    ({"policy": {"min_replicas": 3, "max_replicas": 3}, "warm_pool": {"max_total": 2}, "actuator": PROCESS},
     "pools.0", "policy.min_replicas (3) is above warm_pool.max_total (2)"),
    ({"policy": {"min_replicas": 3, "max_replicas": 4}, "actuator": STATIC2},
     "pools.0", "policy.min_replicas (3) is above the 2 static actuator.endpoints"),
    ({"actuator": {"kind": "static", "endpoints": ["not an endpoint"]}},
     "pools.0.actuator", "endpoints.0: 'not an endpoint' is not HOST:PORT"),
    ({"actuator": {"kind": "static", "endpoints": ["127.0.0.1:8001", "http://x:1/"]}},
     "pools.0.actuator", "endpoints.1: 'http://x:1/' is not HOST:PORT"),
    ({"actuator": {"kind": "static", "endpoints": ["127.0.0.1:8001", "127.0.0.1:8001"]}},
     "pools.0.actuator", "endpoints.1: 127.0.0.1:8001 is also endpoints.0"),
    ({"actuator": {"kind": "static", "endpoints": {"a": "127.0.0.1:1", "b": "127.0.0.1:1"}}},
     "pools.0.actuator", "endpoints.b: 127.0.0.1:1 is also endpoints.a"),
    ({"actuator": {"kind": "process", "endpoints": ["127.0.0.1:1"]}},
     "pools.0.actuator", "kind 'process' would ignore endpoints"),
    ({"actuator": {"kind": "process", "options": {"namespace": "x"}}},
     "pools.0.actuator", "kind 'process' would ignore options"),
    ({"actuator": {"kind": "static", "endpoints": ["127.0.0.1:1"], "command": ["x", "{port}"]}},
     "pools.0.actuator", "kind 'static' would ignore command"),
    ({"name": "a}b{c", "actuator": PROCESS}, "pools.0.name", "'a}b{c' is not a pool name"),
]


@pytest.mark.parametrize(("pool", "field", "words"), CONTROLLER_CONTRADICTIONS)
def test_controller_contradictions_name_the_fields(pool: dict, field: str, words: str) -> None:
    from floodgate.controller.config import ConfigError as ControllerConfigError

    with pytest.raises(ControllerConfigError) as exc:
        parse_config({"pools": [{"name": "a", **pool}]}, env={})
    assert f"  {field}: " in str(exc.value) and words in str(exc.value), str(exc.value)


def test_a_static_endpoint_serves_one_pool_only() -> None:
    """Two pools listing one static endpoint: one slept it under the other, whose registry still
    listed it active (an operator review: 503 "The model is sleeping")."""
    from floodgate.controller.config import ConfigError as ControllerConfigError

    pools = [{"name": "a", "actuator": {"kind": "static", "endpoints": ["127.0.0.1:1", "127.0.0.1:2"]},
              "policy": {"min_replicas": 0, "max_replicas": 2}},
             {"name": "b", "actuator": {"kind": "static", "endpoints": {"x": "127.0.0.1:3", "y": "127.0.0.1:2"}},
              "policy": {"min_replicas": 0, "max_replicas": 2}}]
    with pytest.raises(ControllerConfigError) as exc:
        parse_config({"pools": pools}, env={})
    assert "  pools: " in str(exc.value) and "pool 'b': actuator.endpoints 127.0.0.1:2 is also pool 'a'" in str(exc.value)
    pools[1]["actuator"]["endpoints"]["y"] = "127.0.0.1:4"
    assert [p.name for p in parse_config({"pools": pools}, env={}).pools] == ["a", "b"]


@pytest.mark.parametrize("pool", [
    # Legitimate, if surprising (docs/controller.md, "Config"): allowed.
    {"policy": {"min_replicas": 1, "max_replicas": 8}, "warm_pool": {"max_total": 4}},  # max_total caps scale-ups
    {"policy": {"min_replicas": 2, "max_replicas": 3}, "warm_pool": {"min_size": 3}},  # never kept in full
    {"policy": {"max_replicas": 2}, "warm_pool": {"enabled": False, "min_size": 5, "max_size": 5}},  # pool off
    {"actuator": {"kind": "process", "options": {}, "endpoints": []}},  # empty: nothing ignored
    {"actuator": {"kind": "static", "endpoints": {"a": "10.0.0.5:8000", "b": "vllm-2.svc:8000", "c": "[::1]:8000"}},
     "policy": {"min_replicas": 3, "max_replicas": 3}},
])
def test_controller_accepts_legitimate_combinations(pool: dict) -> None:
    parse_config({"pools": [{"name": "a", "actuator": PROCESS, **pool}]}, env={})


@pytest.mark.parametrize("name", ["a}b{c", "a b", "", "pool:1", "x/y", "default", "chat-v2.1_b"])
def test_processor_and_controller_accept_the_same_pool_names(tmp_path: Path, name: str) -> None:
    from floodgate.controller.config import ConfigError as ControllerConfigError

    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump({"pools": [{"name": name}]}))
    try:
        load_config(p, env={})
        processor_ok = True
    except ConfigError as exc:
        processor_ok, processor_err = False, str(exc)
    try:
        parse_config({"pools": [{"name": name, "actuator": PROCESS}]}, env={})
        controller_ok = True
    except ControllerConfigError as exc:
        controller_ok, controller_err = False, str(exc)
    assert processor_ok == controller_ok == (name in ("default", "chat-v2.1_b"))
    if not processor_ok:
        assert "pools.0.name" in processor_err and "pools.0.name" in controller_err


def test_a_duplicate_yaml_key_is_an_error_naming_it(tmp_path: Path) -> None:
    from floodgate.controller.config import ConfigError as ControllerConfigError
    from floodgate.controller.config import load_config as load_controller

    p = tmp_path / "c.yaml"
    p.write_text("pools:\n  - name: a\n    policy: {min_replicas: 5}\n    policy: {min_replicas: 1}\n"
                 "    actuator: {kind: process}\n")
    with pytest.raises(ControllerConfigError, match=r"duplicate key pools\.0\.policy \(line 4; first on line 3\)"):
        load_controller(p, env={})
    # The processor reads its file with the same loader.
    p.write_text("redis: {url: redis://a:1/0}\npools: [{name: a}]\nredis: {url: redis://b:1/0}\n")
    with pytest.raises(ConfigError, match=r"duplicate key redis \(line 3"):
        load_config(p, env={})
    p.write_text("pools:\n  - name: a\n    limit: {min: 1, min: 2}\n")
    with pytest.raises(ConfigError, match=r"duplicate key pools\.0\.limit\.min "):
        load_config(p, env={})
    # A key merged in from an anchor may be overridden: that is what `<<` is for.
    from floodgate.yamlconfig import read_mapping

    p.write_text("a: &base {min_replicas: 1, max_replicas: 4}\nb:\n  <<: *base\n  max_replicas: 8\nc: *base\n")
    assert read_mapping(p) == {"a": {"min_replicas": 1, "max_replicas": 4},
                               "b": {"min_replicas": 1, "max_replicas": 8},
                               "c": {"min_replicas": 1, "max_replicas": 4}}


def test_state_dir_is_tried_at_check_and_created_at_start(tmp_path: Path) -> None:
    from floodgate.controller.config import ConfigError as ControllerConfigError
    from floodgate.controller.config import check_state_dirs

    def cfg(state_dir: Path) -> object:
        return parse_config({"pools": [{"name": "a", "actuator": {"kind": "process", "state_dir": str(state_dir)}}]},
                            env={})

    new = tmp_path / "x" / "y" / "st"
    check_state_dirs(cfg(new), create=False)  # type: ignore[arg-type]
    assert not (tmp_path / "x").exists()  # --check-config leaves nothing behind
    check_state_dirs(cfg(new), create=True)  # type: ignore[arg-type]
    assert new.is_dir()
    (tmp_path / "file").write_text("")
    for bad, words in ((tmp_path / "file" / "st", "cannot create"), (tmp_path / "file", "is not a directory")):
        for create in (False, True):
            with pytest.raises(ControllerConfigError) as exc:
                check_state_dirs(cfg(bad), create=create)  # type: ignore[arg-type]
            assert "  pools.0.actuator.state_dir: " in str(exc.value) and words in str(exc.value), str(exc.value)


@pytest.mark.parametrize(("text", "field"), [
    ("pools:\n  - name: a\n    actuator: {kind: process}\n    warm_pool: {min_size: 10, max_size: 2}\n",
     "pools.0.warm_pool"),
    ("pools:\n  - name: a\n    actuator: {kind: process}\n    policy: {min_replicas: 3, max_replicas: 3}\n"
     "    warm_pool: {max_total: 2}\n", "warm_pool.max_total"),
    ("pools:\n  - name: a\n    policy: {min_replicas: 5}\n    policy: {min_replicas: 1}\n"
     "    actuator: {kind: process}\n", "pools.0.policy"),
    ("pools:\n  - name: a\n    actuator: {kind: static, endpoints: ['not an endpoint']}\n", "endpoints.0"),
    ("pools:\n  - name: a\n    actuator: {kind: process, endpoints: ['127.0.0.1:1']}\n", "endpoints"),
    ("pools:\n  - name: 'a}b{c'\n    actuator: {kind: process}\n", "pools.0.name"),
    ("pools:\n  - name: a\n    actuator: {kind: process, state_dir: '{tmp}/file/st'}\n", "pools.0.actuator.state_dir"),
])
@pytest.mark.parametrize("check", [True, False], ids=["check-config", "start"])
def test_cli_rejects_contradictions_at_check_and_at_start(tmp_path: Path, text: str, field: str,
                                                          check: bool) -> None:
    (tmp_path / "file").write_text("")
    p = tmp_path / "c.yaml"
    p.write_text(text.replace("{tmp}", str(tmp_path)))
    argv = [sys.executable, "-m", "floodgate", "controller", "--config", str(p),
            *(["--check-config"] if check else [])]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_check_config_prints_no_redis_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`--check-config` output lands in CI logs: the Redis password (in the URL, in the config,
    from FLOODGATE_REDIS_PASSWORD) prints as ***, and the rest of the config as validated."""
    import json

    from floodgate.cli import main

    p = tmp_path / "p.yaml"
    p.write_text('redis: {url: "redis+sentinel://u:pw-in-url@s1:26379/mymaster?sentinel_password=pw-sentinel"}\n')
    monkeypatch.setenv("FLOODGATE_REDIS_PASSWORD", "pw-from-env")
    assert main(["extproc", "--check-config", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "pw-" not in out, out
    redis = json.loads(out)["redis"]
    assert redis["url"] == "redis+sentinel://u:***@s1:26379/mymaster?sentinel_password=***"
    assert redis["password"] == "***" and redis["op_timeout_s"] > 0


def test_controller_check_config_prints_no_redis_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from floodgate.cli import main

    p = tmp_path / "c.yaml"
    p.write_text('redis: {url: "redis://u:pw-in-url@h:6379/0", password: pw-in-config}\n'
                 'pools: [{name: default, actuator: {kind: static, endpoints: {a: "127.0.0.1:8000"}}}]\n')
    assert main(["controller", "--check-config", "--config", str(p)]) == 0
    out = capsys.readouterr().out
    assert "pw-" not in out, out
    assert json.loads(out)["redis"]["url"] == "redis://u:***@h:6379/0"


def test_check_config_masks_no_password_a_url_does_not_have(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """deploy/compose/processor.yaml names its ACL user in the URL and takes the password from
    FLOODGATE_REDIS_PASSWORD: `--check-config` printed `redis://floodgate-processor:***@redis...`
    beside `"password": null`, a password the URL does not have (a docs review)."""
    import json

    from floodgate.controller import config as ctl_config
    from floodgate.extproc.redis_client import redact_url

    from floodgate.cli import main

    p = tmp_path / "p.yaml"
    p.write_text('redis: {url: "redis://floodgate-processor@redis:6379/0"}\n')
    assert main(["extproc", "--check-config", "--config", str(p)]) == 0
    assert json.loads(capsys.readouterr().out)["redis"]["url"] == "redis://floodgate-processor@redis:6379/0"
    assert redact_url("redis://u:pw@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    # The default state_dir an earlier version derived from the masked URL is still found.
    c = tmp_path / "c.yaml"
    c.write_text('redis: {url: "redis://floodgate-controller@h:6379/0"}\n'
                 'pools: [{name: default, actuator: {kind: process}}]\n')
    cfg = ctl_config.load_config(c)
    assert "redis://floodgate-controller:***@h:6379/0" in ctl_config._legacy_table_owner(cfg, cfg.pools[0])


def test_tls_files_that_are_no_certificate_or_key_are_named(tmp_path: Path) -> None:
    # They passed --check-config (the files existed) and start-up then blamed the listen address.
    from tests.certs import make_pki

    pki = make_pki(tmp_path / "pki")
    a, b = pki.issue("a"), pki.issue("b")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for tls, words in (({"cert_file": str(junk), "key_file": str(a.key)}, "cert_file / key_file"),
                       ({"cert_file": str(a.cert), "key_file": str(b.key)}, "cert_file / key_file"),  # not its key
                       ({"cert_file": str(a.cert), "key_file": str(a.key), "client_ca_file": str(junk)},
                        "client_ca_file")):
        with pytest.raises(ConfigError) as exc:
            load_config(None, {("server", "tls"): tls}, env={})
        assert "server.tls" in str(exc.value) and words in str(exc.value), str(exc.value)
    load_config(None, {("server", "tls"): {"cert_file": str(a.cert), "key_file": str(a.key),
                                           "client_ca_file": str(pki.ca)}}, env={})


def test_an_error_in_a_value_the_environment_set_names_the_variable(tmp_path: Path) -> None:
    # A review: FLOODGATE_LISTEN=garbage reported `server.listen` while the file's was fine.
    p = tmp_path / "p.yaml"
    p.write_text("server: {listen: '127.0.0.1:50051'}\n")
    with pytest.raises(ConfigError, match=r"  server\.listen: .* \(set by FLOODGATE_LISTEN\)"):
        load_config(p, env={"FLOODGATE_LISTEN": "garbage"})
    # a flag wins over the variable, and its error names no variable
    with pytest.raises(ConfigError) as exc:
        load_config(p, {("server", "listen"): "bad"}, env={"FLOODGATE_LISTEN": "127.0.0.1:1"})
    assert "server.listen" in str(exc.value) and "FLOODGATE_LISTEN" not in str(exc.value)


@pytest.mark.parametrize(("var", "value", "field"), [
    ("FLOODGATE_REDIS_URL", "http://x", "redis.url"),
    ("FLOODGATE_CONTROLLER_METRICS_LISTEN", "bad", "metrics_listen"),
    ("FLOODGATE_ENVOY_ADMIN_URL", "localhost:9901", "envoy.admin_url"),
])
def test_a_controller_error_in_a_value_the_environment_set_names_the_variable(var: str, value: str,
                                                                             field: str) -> None:
    # The processor's errors said so; the controller's did not (review user): the file looked fine.
    from floodgate.controller.config import parse_config

    raw = {"pools": [{"name": "a", "actuator": {"kind": "process"}}]}
    with pytest.raises(ConfigError) as exc:
        parse_config(raw, env={var: value})
    line = next(ln for ln in str(exc.value).splitlines() if ln.startswith(f"  {field}"))
    assert line.endswith(f"(set by {var})"), str(exc.value)


def test_an_empty_metrics_listen_variable_turns_metrics_off() -> None:
    # as `--metrics-listen ''` does; other empty variables are unset
    assert load_config(None, env={"FLOODGATE_METRICS_LISTEN": ""}).server.metrics_listen == ""
    assert load_config(None, env={"FLOODGATE_LISTEN": ""}).server.listen == load_config(None, env={}).server.listen
