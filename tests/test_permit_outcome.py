"""How an admitted request's ending is told to the pool's limit (`server.permit_outcome`)."""

from __future__ import annotations

import pytest
from floodgate.extproc.server import permit_outcome


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("reason", ["stream_end", "cancelled"])
def test_a_response_that_ended_is_a_success_however_the_stream_closed(sampled: bool, reason: str) -> None:
    assert permit_outcome(200, reason, sampled=sampled, finished=True, endpoint_failed=False) == "success"


def test_a_sampled_stream_cut_before_its_body_ended_says_nothing() -> None:
    assert permit_outcome(200, "stream_end", sampled=True, finished=False, endpoint_failed=False) == "ignored"
    assert permit_outcome(200, "cancelled", sampled=True, finished=False, endpoint_failed=False) == "ignored"


def test_an_unsampled_response_is_a_success_when_its_stream_ends_plainly() -> None:
    # its body does not pass through the processor: a plain end is all there is to go on
    assert permit_outcome(200, "stream_end", sampled=False, finished=False, endpoint_failed=False) == "success"
    assert permit_outcome(200, "cancelled", sampled=False, finished=False, endpoint_failed=False) == "ignored"


@pytest.mark.parametrize("status", [502, 503, 504])
def test_overload_statuses_are_drops_unless_the_endpoint_is_dead(status: int) -> None:
    assert permit_outcome(status, "stream_end", sampled=False, finished=True, endpoint_failed=False) == "dropped"
    assert permit_outcome(status, "stream_end", sampled=False, finished=True, endpoint_failed=True) == "ignored"


@pytest.mark.parametrize("status", [500, 501, 505])
def test_other_5xx_say_nothing(status: int) -> None:
    assert permit_outcome(status, "stream_end", sampled=True, finished=True, endpoint_failed=False) == "ignored"


def test_no_response_says_nothing() -> None:
    assert permit_outcome(None, "stream_end", sampled=False, finished=False, endpoint_failed=False) == "ignored"
    assert permit_outcome(None, "cancelled", sampled=True, finished=False, endpoint_failed=False) == "ignored"
