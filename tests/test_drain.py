"""The graceful-stop rule (extproc/drain.py) on a fake clock."""

from __future__ import annotations

import math

from floodgate.extproc.drain import Drain, drain_step


def test_an_idle_processor_stops_at_once() -> None:
    assert drain_step(100.0, 100.0, 0, -math.inf, 30.0, 2.0) is Drain.DONE
    assert drain_step(100.0, 100.0, 0, 90.0, 30.0, 2.0) is Drain.DONE


def test_streams_in_flight_are_waited_for_until_the_grace_is_over() -> None:
    assert drain_step(101.0, 100.0, 3, 99.0, 30.0, 2.0) is Drain.WAIT
    assert drain_step(129.9, 100.0, 1, 99.0, 30.0, 2.0) is Drain.WAIT
    assert drain_step(130.0, 100.0, 1, 99.0, 30.0, 2.0) is Drain.CUT


def test_new_streams_keep_it_serving_until_envoy_has_moved_away() -> None:
    # Nothing in flight this instant, but a stream opened 0.5 s ago: Envoy may still send more.
    assert drain_step(101.0, 100.0, 0, 100.5, 30.0, 2.0) is Drain.WAIT
    assert drain_step(102.5, 100.0, 0, 100.5, 30.0, 2.0) is Drain.DONE


def test_the_last_streams_end_exactly_at_the_grace() -> None:
    # Done wins over cut: nothing is left to cut.
    assert drain_step(130.0, 100.0, 0, 110.0, 30.0, 2.0) is Drain.DONE


def test_zero_grace_cuts_at_once() -> None:
    assert drain_step(100.0, 100.0, 2, 99.9, 0.0, 2.0) is Drain.CUT
