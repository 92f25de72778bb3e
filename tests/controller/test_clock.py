"""The controller's clock does not step with the wall clock (a review: on `time.time`, a +400 s
NTP step or VM resume force-stopped a draining replica after 3 s of real drain and cut its
stream; a -1 h step held the first scale-down for 3,900 s instead of 300)."""

from __future__ import annotations

import inspect
import time

import pytest
from floodgate.controller.app import STEADY_CLOCK, Controller, PoolController, steady_wall_clock


def test_a_wall_clock_step_moves_no_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = steady_wall_clock()
    start = clock()
    assert abs(start - time.time()) < 1.0  # epoch seconds: the forecast's minute of day holds
    real = time.time
    for step in (400.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda s=step: real() + s)
        assert 0.0 <= clock() - start < 1.0


def test_the_controller_keeps_its_durations_on_the_steady_clock() -> None:
    for cls in (Controller, PoolController):
        assert inspect.signature(cls).parameters["clock"].default is STEADY_CLOCK
