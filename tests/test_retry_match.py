"""extproc/retry_match.py: an admitted retry takes back a first attempt of its own class and
tenant that this processor turned away, within the window, once."""

from __future__ import annotations

from floodgate.extproc.retry_match import MAX_PER_KEY, WINDOW_S, RetryMatch, window_for


def test_a_retry_takes_back_one_first_attempt_of_its_class_and_tenant() -> None:
    m = RetryMatch(window_s=60.0)
    m.turned_away(1, "a", 0.0)
    m.turned_away(1, "a", 1.0)
    assert not m.admitted_retry(1, "b", 2.0)  # another tenant's rejections are not its own
    assert not m.admitted_retry(2, "a", 2.0)  # nor another class's
    assert not m.admitted_retry(1, "", 2.0)  # the tenant-less requests are one key of their own
    assert m.admitted_retry(1, "a", 2.0) and m.admitted_retry(1, "a", 3.0)
    assert not m.admitted_retry(1, "a", 4.0)  # two turned away, two taken back: no more
    assert len(m) == 0


def test_first_attempts_expire_a_window_after_the_last_one() -> None:
    m = RetryMatch(window_s=60.0)
    m.turned_away(0, "a", 0.0)
    m.turned_away(0, "a", 50.0)  # the window runs from the last one
    assert m.admitted_retry(0, "a", 109.0) and m.admitted_retry(0, "a", 109.5)
    m.turned_away(0, "b", 0.0)
    assert not m.admitted_retry(0, "b", 60.0)  # too late: counted as demand again, as before
    assert len(m) == 0
    m.turned_away(0, "c", 0.0)
    m.turned_away(0, "c", 70.0)  # the one before it ran out: starts again at 1
    assert m.admitted_retry(0, "c", 71.0) and not m.admitted_retry(0, "c", 72.0)


def test_memory_is_bounded() -> None:
    m = RetryMatch(window_s=60.0, max_keys=3)
    for i, t in enumerate("abcd"):
        m.turned_away(1, t, float(i))
    assert len(m) == 3
    assert not m.admitted_retry(1, "a", 5.0)  # the least recently turned away went first
    assert m.admitted_retry(1, "d", 5.0)
    for _ in range(MAX_PER_KEY + 5):
        m.turned_away(2, "x", 6.0)
    taken = 0
    while m.admitted_retry(2, "x", 7.0):
        taken += 1
    assert taken == MAX_PER_KEY


def test_only_the_same_caller_takes_a_first_attempt_back() -> None:
    """A review marked admitted requests as retries under another tenant's name (or none) and
    hid that tenant's refusals: the caller (mTLS peer or source address) is part of the key."""
    m = RetryMatch(window_s=60.0)
    m.turned_away(1, "acme", 0.0, "10.0.0.1")
    m.turned_away(1, "", 0.0, "10.0.0.1")
    assert not m.admitted_retry(1, "acme", 1.0, "10.0.0.9")
    assert not m.admitted_retry(1, "", 1.0, "10.0.0.9")
    assert m.admitted_retry(1, "acme", 1.0, "10.0.0.1") and m.admitted_retry(1, "", 1.0, "10.0.0.1")


def test_the_window_covers_the_longest_retry_after_told() -> None:
    assert window_for(60.0) == WINDOW_S and window_for(300.0) == 330.0
