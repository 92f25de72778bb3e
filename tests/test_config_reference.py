"""docs/configuration.md is generated from the schemas; it must match the code."""

from __future__ import annotations

from pathlib import Path

from floodgate.config_reference import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_reference_matches_the_schemas() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is out of date: run `python -m floodgate.config_reference > docs/configuration.md`")


def test_reference_names_every_processor_field() -> None:
    text = DOC.read_text()
    for key in ("pools[].limit.signal", "pools[].classes.<key>.queue_timeout_s", "admission.trust.spiffe_ids",
                "redis.lease_ttl_s", "pools[].endpoint_picking"):
        assert f"`{key}`" in text, key
