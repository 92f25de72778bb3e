"""Which pool a request's `:authority` selects (`Processor._pool_for`), as Envoy's virtual
hosts would: the exact host, case-insensitive, with or without a numeric port."""

from __future__ import annotations

import pytest
from floodgate.extproc.config import Config
from floodgate.extproc.server import Processor


def _processor() -> Processor:
    cfg = Config.model_validate({"pools": [{"name": "default"},
                                           {"name": "premium", "match_authority": "Premium.Example.com"},
                                           {"name": "v6", "match_authority": "[fd00::1]"}]})
    return Processor(cfg, admitter=None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("authority", "pool"), [
    ("premium.example.com", "premium"),
    ("PREMIUM.example.COM", "premium"),  # both sides compared lower-cased
    ("premium.example.com:8443", "premium"),
    ("premium.example.com:evil", "default"),  # not a port: not that host
    ("premium.example.com:", "default"),
    ("premium.example.com.attacker", "default"),
    ("[fd00::1]", "v6"),
    ("[fd00::1]:80", "v6"),
    ("", "default"),
])
def test_authority_selects_the_pool(authority: str, pool: str) -> None:
    assert _processor()._pool_for({":authority": [authority]}) == pool
