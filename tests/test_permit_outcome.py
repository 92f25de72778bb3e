"""How an admitted request's ending is told to the pool's limit (`server.permit_outcome`) and
labelled in `floodgate_releases_total` (`server.release_reason`)."""

from __future__ import annotations

import pytest
from floodgate.extproc.server import permit_outcome, release_reason


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


@pytest.mark.parametrize("ended", ["stream_end", "cancelled"])
def test_a_finished_response_releases_as_stream_end_however_the_stream_closed(ended: str) -> None:
    # Envoy resets a completed request's stream now and then (its teardown races the half-close):
    # the release is still a completion, as the permit's outcome is a success.
    assert release_reason(ended, status=200, finished=True) == "stream_end"


def test_a_stream_reset_before_the_response_ended_is_cancelled() -> None:
    assert release_reason("cancelled", status=200, finished=False) == "cancelled"
    assert release_reason("cancelled", status=None, finished=False) == "cancelled"
    assert release_reason("stream_end", status=None, finished=False) == "stream_end"


@pytest.mark.parametrize("ended", ["stream_end", "cancelled"])
@pytest.mark.parametrize("finished", [True, False])
def test_a_5xx_response_releases_as_upstream_error(ended: str, finished: bool) -> None:
    assert release_reason(ended, status=503, finished=finished) == "upstream_error"
    assert release_reason(ended, status=500, finished=finished) == "upstream_error"


def test_other_reasons_pass_unchanged() -> None:
    assert release_reason("stream_end", status=None, finished=False) == "stream_end"
    assert release_reason("cancelled", status=None, finished=False) == "cancelled"
