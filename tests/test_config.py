"""Config loading: defaults, env and flag overrides, and errors that name the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from floodgate.extproc.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_are_valid() -> None:
    cfg = load_config(None, env={})
    assert cfg.pools[0].name == "default"
    assert cfg.pools[0].classes[2].queue_timeout_s == 1.0  # derived: 0.5 x its 2 s TTFT SLO
    assert cfg.redis.url.startswith("redis://")


def test_env_and_flag_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, "redis: {url: 'redis://file:1/0'}\n")
    assert load_config(p, env={}).redis.url == "redis://file:1/0"
    assert load_config(p, env={"FLOODGATE_REDIS_URL": "redis://env:2/0"}).redis.url == "redis://env:2/0"
    cfg = load_config(p, {("redis", "url"): "redis://flag:3/0"}, env={"FLOODGATE_REDIS_URL": "redis://env:2/0"})
    assert cfg.redis.url == "redis://flag:3/0"


@pytest.mark.parametrize(("text", "field"), [
    ("pools: [{name: a, limit: {min: 10, max: 2}}]", "pools.0.limit"),
    ("pools: [{name: a, limit: {initial: 0}}]", "pools.0.limit.initial"),
    ("redis: {urll: x}", "redis.urll"),
    ("admission: {trust: {cidrs: ['not-a-cidr']}}", "admission.trust.cidrs"),
    ("pools: [{name: 'bad name'}]", "pools.0.name"),
    # a class left out is the shipped one: P0's share 0.9 and the shipped P1 0.1 make 1.0 + P2 0
    ("pools: [{name: a, classes: {0: {queue_timeout_s: 1, max_queue: 1, share: 0.95}}}]", "pools.0.classes"),
    ("pools: [{name: a, classes: {0: {queue_timeout_s: 1, max_queue: 1, share: 0.9}, "
     "1: {queue_timeout_s: 1, max_queue: 1, share: 0.9}, 2: {queue_timeout_s: 1, max_queue: 1, share: 0.9}}}]",
     "pools.0.classes"),
    ("admission: {default_priority: 7}", "admission.default_priority"),
    ("pools: []", "pools"),
    # accepted silently before, and never matched anything (a review)
    ("admission: {trust: {spiffe_ids: ['not-a-uri']}}", "admission.trust.spiffe_ids"),
    ("admission: {trust: {spiffe_priorities: {'ns/a/sa/b': 0}}}", "admission.trust.spiffe_priorities"),
    ("pools: [{name: a, match_authority: ''}]", "pools.0.match_authority"),
])
def test_bad_field_is_named(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    assert f"  {field}:" in str(err.value)


@pytest.mark.parametrize("text", ["[1, 2]", "a: [unclosed", "just a string"])
def test_malformed_yaml(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, text), env={})


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config("/nonexistent/floodgate.yaml", env={})


def test_cli_exits_nonzero_naming_the_field(tmp_path: Path) -> None:
    p = write(tmp_path, "pools: [{name: a, limit: {max: -3}}]\n")
    r = subprocess.run([sys.executable, "-m", "floodgate", "extproc", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "pools.0.limit.max" in r.stderr and "Traceback" not in r.stderr


def test_cli_check_config_prints_effective_config(tmp_path: Path) -> None:
    p = write(tmp_path, "pools: [{name: chat}]\n")
    r = subprocess.run([sys.executable, "-m", "floodgate", "extproc", "--config", str(p), "--check-config",
                        "--redis-url", "redis://x:1/0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert '"chat"' in r.stdout and "redis://x:1/0" in r.stdout


def test_a_class_left_out_is_the_shipped_one_and_a_defined_class_says_what_it_drops() -> None:
    from floodgate.extproc.config import PoolConfig

    shipped = PoolConfig().classes
    pool = load_config(None, {("pools",): [{"name": "a", "classes": {2: {"max_queue": 100, "share": 0.0,
                                                                          "slo_reject_s": 0.01}}}]},
                       env={}).pools[0]
    assert pool.classes[0] == shipped[0] and pool.classes[1] == shipped[1]
    assert pool.classes[2].max_queue == 100 and pool.classes[2].queue_timeout_s == 1.5  # generic 0.75 x 2 s
    (warning,) = pool.class_warnings()
    assert "classes.2 leaves out queue_wait_slo_share" in warning and "0.5" in warning
    assert PoolConfig().class_warnings() == []
    from floodgate.extproc.config import SHIPPED_CLASSES

    written_out = {c: dict(v) for c, v in SHIPPED_CLASSES.items()}  # the shipped classes, written out
    assert load_config(None, {("pools",): [{"name": "a", "classes": written_out}]},
                       env={}).pools[0].class_warnings() == []


def test_engine_priority_that_leaves_a_class_out_warns_that_its_callers_pick_their_own() -> None:
    # A review: `{0: -1}` (the docs' old example) passes P1/P2 bodies untouched, so a P1 caller
    # could write `"priority": -5` and run ahead of P0 in the engines.
    def warns(ep: dict[int, int]) -> list[str]:
        return load_config(None, {("pools",): [{"name": "a", "engine_priority": ep}]}, env={}).pools[0].class_warnings()

    (warning,) = warns({0: -1})
    assert "engine_priority lists classes [0] only" in warning and "classes 1, 2 pass untouched" in warning
    assert "class 2 pass untouched" in warns({0: -1, 1: 0})[0]
    assert warns({0: -1, 1: 0, 2: 1}) == [] and warns({}) == []


def test_check_config_warns_of_a_class_that_drops_shipped_values(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = write(tmp_path, "pools: [{name: a, classes: {0: {max_queue: 10, share: 0.5}}}]")
    r = subprocess.run([sys.executable, "-m", "floodgate", "extproc", "--check-config", "--config", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pools[a].classes.0 leaves out headroom, queue_wait_slo_share" in r.stderr, r.stderr


@pytest.mark.parametrize("text", [
    "pools: [{name: a, classes: {0: {queue_timeout_s: 60, max_queue: 100, share: 0.5}}}]",
    # derived: 5 s TTFT SLO x 10 = 50 s
    "pools: [{name: a, classes: {0: {slo_ttft_s: 5, queue_wait_slo_share: 10, max_queue: 100, share: 0.5}}}]",
    "pools: [{name: a, classes: {0: {queue_timeout_s: 34.5, max_queue: 100, share: 0.5}}}]",
])
def test_a_queue_timeout_past_envoys_message_timeout_is_refused(tmp_path: Path, text: str) -> None:
    """Envoy answers 504 ("no processor answered", Retry-After 1) to a request still queued at
    the ext_proc filter's message_timeout (35 s shipped): a review's P0 with a 60 s queue
    timeout got that after 35 s. The config names the class and the setting to raise with it."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    assert "pools.0.classes.0.queue_timeout_s" in str(err.value)
    assert "server.envoy_message_timeout_s" in str(err.value)
    raised = load_config(write(tmp_path, text + "\nserver: {envoy_message_timeout_s: 70}"), env={})
    assert raised.pools[0].classes[0].queue_timeout_s > 34
    assert load_config(write(tmp_path, text.replace("34.5", "34").replace("60", "34")
                             .replace("queue_wait_slo_share: 10", "queue_wait_slo_share: 6")), env={})


@pytest.mark.parametrize(("text", "ok"), [
    ("server: {listen: '127.0.0.1:9464'}", False),  # the shipped metrics address
    ("server: {listen: '0.0.0.0:9464'}", False),  # a wildcard takes the port on every address
    ("server: {listen: '127.0.0.1:50051', metrics_listen: '[::]:50051'}", False),
    ("server: {listen: '127.0.0.1:50051', health_listen: '127.0.0.1:50051'}", False),
    ("server: {listen: '127.0.0.1:50051', metrics_listen: '127.0.0.2:50051'}", True),
    ("server: {listen: '0.0.0.0:50051', metrics_listen: '0.0.0.0:9464', health_listen: '0.0.0.0:50052'}", True),
])
def test_two_listeners_that_cannot_both_bind_are_refused(tmp_path: Path, text: str, ok: bool) -> None:
    """The runtime failed with "Address already in use"; the config now names both."""
    if ok:
        load_config(write(tmp_path, text), env={})
        return
    with pytest.raises(ConfigError, match="cannot both bind"):
        load_config(write(tmp_path, text), env={})


def test_a_yaml_error_does_not_print_the_line(tmp_path: Path) -> None:
    """PyYAML's own message quotes the offending line, which may hold a password (a review saw
    one in the log); the error says where, not what."""
    for text in ("redis:\n  password: [hunter2secret\n", 'redis: {url: "redis://u:hunter2secret@h: 1\n',
                 "redis:\n  password: *hunter2secret\n", "redis:\n  password: !hunter2secret x\n"):
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, text), env={})
        assert "hunter2secret" not in str(err.value) and "line " in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="unacceptable character #x0007 at position 20"):
        load_config(write(tmp_path, "redis:\n  password: a\x07b\n"), env={})


def test_settings_that_turn_admission_off_or_do_nothing_warn(tmp_path: Path) -> None:
    # An operator review: a model route in unadmitted_paths (every request there passes without
    # a permit) and an allowlist without endpoint picking (it does nothing) were accepted silently.
    import subprocess
    import sys

    def warns(**pool: object) -> list[str]:
        return load_config(None, {("pools",): [{"name": "a", **pool}]}, env={}).pools[0].class_warnings()

    (w,) = warns(unadmitted_paths=["/health", "/v1/chat/completions"])
    assert "unadmitted_paths lists /v1/chat/completions" in w and "without admission" in w
    (w,) = warns(allowed_endpoints=["127.0.0.1/32"])
    assert "allowed_endpoints has no effect without endpoint_picking" in w
    assert warns(allowed_endpoints=["127.0.0.1/32"], endpoint_picking=True) == []
    assert warns(unadmitted_paths=["/v1/models", "/health", "/metrics"]) == []
    # --check-config says so too, and still exits 0 (a warning, not an error)
    cfg = tmp_path / "p.yaml"
    cfg.write_text("pools: [{name: a, unadmitted_paths: [/v1/completions]}]\n")
    r = subprocess.run([sys.executable, "-m", "floodgate", "extproc", "--check-config", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "unadmitted_paths lists /v1/completions" in r.stderr, r.stderr
