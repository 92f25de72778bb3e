"""The endpoint allowlist (extproc/endpoint_guard.py): pure rules, and the config that uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
from floodgate.extproc.config import ConfigError, load_config
from floodgate.extproc.endpoint_guard import (
    endpoint_allowed,
    make_guard,
    parse_endpoint,
    parse_rule,
)
from floodgate.extproc.picking import Picker

RULES = [parse_rule(r) for r in ("10.0.0.0/8:8000", "192.168.1.0/24", "172.16.0.0/12:8000-8003", "[fd00::/8]:8000")]


@pytest.mark.parametrize("endpoint,ok", [
    ("10.1.2.3:8000", True),
    ("10.1.2.3:8001", False),          # wrong port
    ("11.1.2.3:8000", False),          # outside the CIDR
    ("192.168.1.77:22", True),         # any port in that range
    ("192.168.2.1:80", False),
    ("172.16.5.5:8003", True),
    ("172.16.5.5:8004", False),
    ("[fd00::1]:8000", True),
    ("[fe80::1]:8000", False),
    ("fd00::1:8000", False),           # ambiguous v6 without brackets: refused
    ("evil.example.com:8000", False),  # names could resolve anywhere
    ("10.1.2.3", False),               # no port
    ("10.1.2.3:0", False),
    ("10.1.2.3:70000", False),
    ("", False),
    ("10.1.2.3:8000\r\nx: y", False),
])
def test_endpoint_allowed(endpoint: str, ok: bool) -> None:
    assert endpoint_allowed(endpoint, RULES) is ok


def test_an_ipv4_rule_never_matches_an_ipv6_endpoint() -> None:
    assert not endpoint_allowed("[::ffff:10.0.0.1]:8000", [parse_rule("10.0.0.0/8")])


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "nonsense", "10.0.0.0/8:0", "10.0.0.0/8:9-1", "[fd00::/8", "10.0.0.0/8:x"])
def test_bad_rules_are_refused_with_the_entry_named(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_rule(bad)
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides={("pools",): [{"name": "p", "allowed_endpoints": [bad]}]}, env={})
    assert "allowed_endpoints" in str(err.value)


def test_parse_endpoint() -> None:
    assert parse_endpoint("127.0.0.1:8000") is not None
    assert parse_endpoint("[::1]:8000") is not None
    assert parse_endpoint("localhost:8000") is None


def test_picker_refuses_and_never_lists_endpoints_outside_the_allowlist() -> None:
    guard = make_guard("p", ["10.0.0.0/8:8000"])
    assert guard is not None and make_guard("p", []) is None
    picker = Picker(True, guard)
    picker.update(["10.0.0.5:8000", "203.0.113.7:22", "10.0.0.6:9999"])
    assert picker.active == ["10.0.0.5:8000"]  # degraded picks and unadmitted routes use this
    assert picker.accept("10.0.0.5:8000")
    assert not picker.accept("203.0.113.7:22")  # what the shared grant (Redis) may hand back
    assert picker.pick_local([]) == "10.0.0.5:8000"
    assert picker.any_active(0.9) == "10.0.0.5:8000"


def test_startup_names_what_the_config_leaves_open(tmp_path: Path) -> None:
    from floodgate.extproc.app import security_warnings

    from tests.certs import make_pki

    server = make_pki(tmp_path / "pki").issue("extproc")

    assert security_warnings(load_config(None, env={})) == []  # loopback, no picking
    open_cfg = load_config(None, overrides={("server", "listen"): "0.0.0.0:50051",
                                            ("pools",): [{"name": "p", "endpoint_picking": True}]}, env={})
    warnings = security_warnings(open_cfg)
    assert len(warnings) == 2 and "server.tls" in warnings[0] and "allowed_endpoints" in warnings[1]
    closed = load_config(None, overrides={("pools",): [{"name": "p", "endpoint_picking": True,
                                                        "allowed_endpoints": ["10.0.0.0/8:8000"]}]}, env={})
    assert security_warnings(closed) == []
    one_way = load_config(None, overrides={("server", "listen"): "0.0.0.0:50051",
                                           ("server", "tls"): {"cert_file": str(server.cert), "key_file": str(server.key)}}, env={})
    (w,) = security_warnings(one_way)
    assert "client_ca_file" in w
    gold = load_config(None, overrides={("admission", "tenant_priorities"): {"gold": 0, "silver": 1}}, env={})
    (w,) = security_warnings(gold)
    assert "gold to P0" in w and "x-tenant-id" in w
