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
    ("pools: [{name: a, classes: {0: {queue_timeout_s: 1, max_queue: 1, share: 0.1}}}]", "pools.0.classes"),
    ("pools: [{name: a, classes: {0: {queue_timeout_s: 1, max_queue: 1, share: 0.9}, "
     "1: {queue_timeout_s: 1, max_queue: 1, share: 0.9}, 2: {queue_timeout_s: 1, max_queue: 1, share: 0.9}}}]",
     "pools.0.classes"),
    ("admission: {default_priority: 7}", "admission.default_priority"),
    ("pools: []", "pools"),
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
