"""`engine_priority`: the pure body rewrite and its settings (the real-Envoy path is in
tests/test_admission_e2e.py::test_engine_priority_writes_the_body_of_listed_classes_only)."""

from __future__ import annotations

import json

import pytest
from floodgate.extproc.config import PoolConfig
from floodgate.extproc.server import (
    _MODES,
    REFUSED_BODIES,
    _admit_reply,
    body_encoded,
    rewrite_priority,
)
from pydantic import ValidationError


def test_rewrite_sets_priority_and_keeps_the_rest() -> None:
    doc = {"model": "m", "messages": [{"role": "user", "content": "héllo \u2603"}], "stream": True}
    new, outcome = rewrite_priority(json.dumps(doc).encode(), -1, 1 << 20, True)
    assert outcome == "set" and new is not None
    assert json.loads(new) == {**doc, "priority": -1}


def test_a_client_priority_is_overwritten() -> None:
    new, outcome = rewrite_priority(b'{"prompt": "x", "priority": -100}', 2, 1 << 20, True)
    assert outcome == "set" and new is not None and json.loads(new)["priority"] == 2


@pytest.mark.parametrize(("body", "complete", "outcome"), [  # (max_bytes 1 MiB but for too_large)
    (b"not json {", True, "not_json"),
    (b"\xff\xfe\x00", True, "not_json"),
    (b"[1, 2]", True, "not_object"),
    (b'"a string"', True, "not_object"),
    (b"", True, "not_json"),
    (b"[" * 100_000 + b"]" * 100_000, True, "not_json"),  # too deep for the parser: refused, never raises
    (b'{"prompt": "x"}', False, "partial"),  # Envoy's buffer held only part of it (refused: 413)
    (b'{"prompt": "' + b"x" * (1 << 20) + b'"}', True, "too_large"),  # (refused: 413)
])
def test_bodies_that_cannot_be_rewritten(body: bytes, complete: bool, outcome: str) -> None:
    assert rewrite_priority(body, -1, 1 << 20, complete) == (None, outcome)
    assert outcome in REFUSED_BODIES  # refused, never passed on with the priority its client wrote


def test_an_encoded_body_is_refused_even_when_its_bytes_parse() -> None:
    # a server that inflates gzip would read the inner body's priority, not the one written here
    assert rewrite_priority(b'{"prompt": "x"}', -1, 1 << 20, True, encoded=True) == (None, "encoded")
    assert REFUSED_BODIES["encoded"][0] == 415
    assert {REFUSED_BODIES[o][0] for o in ("not_json", "not_object")} == {400}
    assert {REFUSED_BODIES[o][0] for o in ("partial", "too_large")} == {413}


@pytest.mark.parametrize(("values", "encoded"), [
    (None, False), ([], False), (["identity"], False), ([" Identity "], False), ([""], False),
    (["gzip"], True), (["identity, gzip"], True), (["br"], True), (["identity", "deflate"], True),
])
def test_body_encoded(values: list[str] | None, encoded: bool) -> None:
    assert body_encoded(values) is encoded


def test_a_lone_surrogate_is_rewritten_not_raised() -> None:
    # JSON may escape a lone surrogate, which UTF-8 cannot encode: written back as an escape.
    new, outcome = rewrite_priority(b'{"prompt": "\\ud800", "priority": -100}', 2, 1 << 20, True)
    assert outcome == "set" and new is not None
    assert json.loads(new) == {"prompt": "\ud800", "priority": 2}


def test_buffered_partial_only_for_requests_that_need_it() -> None:
    plain = _admit_reply(1, "0", "", (), False, True, False)
    # every admitted reply turns the response headers on (the static mode skips them), no body
    assert plain.mode_override == _MODES[(False, False)]
    assert plain.mode_override.request_body_mode == plain.mode_override.NONE
    assert plain.mode_override.response_body_mode == plain.mode_override.NONE
    both = _admit_reply(0, "0", "", ("content-length",), True, True, True)
    assert both.mode_override == _MODES[(True, True)]
    mode = both.mode_override
    assert mode.request_body_mode == mode.BUFFERED_PARTIAL and mode.response_body_mode == mode.STREAMED
    assert mode.response_trailer_mode == mode.SEND  # the stream still ends with the request
    assert [h for h in both.request_headers.response.header_mutation.remove_headers] == ["content-length"]


def test_engine_priority_setting() -> None:
    assert PoolConfig().engine_priority == {}  # off: vLLM's default fcfs policy rejects a priority
    assert PoolConfig(engine_priority={0: -1}).engine_priority == {0: -1}
    with pytest.raises(ValidationError):
        PoolConfig(engine_priority={3: -1})
