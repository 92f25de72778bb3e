"""The admission policy: partitions, early drop, tenant caps, Retry-After (pure)."""

from __future__ import annotations

import pytest
from floodgate.extproc.config import AdmissionConfig, ClassConfig
from floodgate.extproc.policy import (
    Enqueue,
    Reject,
    Snapshot,
    eligible,
    predicted_wait,
    queue_decision,
    reservations,
    retry_after,
    timeout_reject,
)

SHARES = (0.5, 0.3, 0.1)
CLASSES = {
    0: ClassConfig(queue_timeout_s=30, max_queue=100, share=0.5),
    1: ClassConfig(queue_timeout_s=15, max_queue=100, share=0.3),
    2: ClassConfig(queue_timeout_s=5, max_queue=10, share=0.1, tenant_queue_share=0.5),
}
ADM = AdmissionConfig(retry_after_min_s=1, retry_after_max_s=60, retry_after_jitter=0.2)


def snap(limit: int = 10, inflight: tuple[int, int, int] = (0, 0, 0), queued: tuple[int, int, int] = (0, 0, 0),
         tenant: int = 0, rate: float = 0.0) -> Snapshot:
    return Snapshot(limit, inflight, queued, tenant, rate)


def test_reservations_never_exceed_limit() -> None:
    for limit in range(1, 200):
        assert sum(reservations(limit, SHARES)) <= limit
    assert reservations(10, SHARES) == [5, 3, 1]


def test_any_class_uses_spare_capacity_without_contention() -> None:
    # no waiters anywhere: P2 may take the last permit even though P0 reserves 5
    assert eligible(2, 10, [0, 9, 0], [0, 0, 0], SHARES)
    assert eligible(1, 2, [0, 1, 0], [0, 0, 0], SHARES)


def test_full_pool_admits_nobody() -> None:
    assert not any(eligible(c, 10, [5, 3, 2], [1, 1, 1], SHARES) for c in range(3))


def test_waiting_class_keeps_its_reservation() -> None:
    # P0 has waiters and only 1 of its 5 reserved permits: P1 may not take the last free one
    assert not eligible(1, 10, [1, 8, 0], [3, 0, 0], SHARES)
    assert eligible(0, 10, [1, 8, 0], [3, 0, 0], SHARES)


def test_class_inside_its_reservation_always_may() -> None:
    # P2 (reservation 1) gets a permit even though P0 waits and is over its share
    assert eligible(2, 10, [6, 3, 0], [4, 0, 1], SHARES)
    assert not eligible(0, 10, [6, 3, 0], [4, 0, 1], SHARES)


def test_borrowing_allowed_when_other_reservations_covered() -> None:
    # P1 is over its 3 but 6 stay free: taking one leaves 5, enough for P0's waiting reservation
    assert eligible(1, 10, [0, 4, 0], [1, 0, 0], SHARES)
    assert not eligible(1, 10, [0, 5, 0], [1, 0, 0], SHARES)  # would leave 4 < 5
    assert not eligible(1, 10, [0, 4, 0], [1, 0, 0], (0.6, 0.3, 0.1))


def test_predicted_wait_counts_waiters_ahead() -> None:
    assert predicted_wait(1, snap(queued=(0, 3, 50), rate=2.0)) == pytest.approx(2.0)  # (0+3+1)/2
    assert predicted_wait(0, snap(queued=(2, 3, 50), rate=2.0)) == pytest.approx(1.5)
    assert predicted_wait(2, snap(queued=(0, 0, 0), rate=0.0)) is None


def test_predicted_wait_uses_the_class_grant_rate() -> None:
    s = Snapshot(10, (5, 3, 2), (4, 9, 3), 0, grant_rate=10.0, class_rate=0.5)
    assert predicted_wait(2, s) == pytest.approx(8.0)  # (3 + 1) / 0.5: P2's own share of grants


def test_class_starved_behind_higher_classes_waits_forever() -> None:
    s = Snapshot(10, (5, 5, 0), (4, 9, 0), 0, grant_rate=10.0, class_rate=0.0)
    assert predicted_wait(2, s) == float("inf")
    d = queue_decision(2, s, CLASSES, ADM, rand=0.0)
    assert isinstance(d, Reject) and d.reason == "early_drop" and d.retry_after_s == 60


def test_queue_full() -> None:
    d = queue_decision(2, snap(queued=(0, 0, 10), rate=10), CLASSES, ADM, rand=0.0)
    assert isinstance(d, Reject) and d.reason == "queue_full" and d.status == 429


def test_tenant_cap() -> None:
    d = queue_decision(2, snap(queued=(0, 0, 5), tenant=5), CLASSES, ADM, rand=0.0)
    assert isinstance(d, Reject) and d.reason == "tenant_cap"
    assert isinstance(queue_decision(2, snap(queued=(0, 0, 5), tenant=4), CLASSES, ADM, 0.0), Enqueue)


def test_early_drop_when_predicted_wait_exceeds_timeout() -> None:
    d = queue_decision(2, snap(queued=(0, 0, 9), rate=1.0), CLASSES, ADM, rand=0.0)  # wait 10 s > 5 s
    assert isinstance(d, Reject) and d.reason == "early_drop" and d.retry_after_s == 10
    # the same queue is fine for P0, which waits behind nobody
    assert isinstance(queue_decision(0, snap(queued=(0, 0, 9), rate=1.0), CLASSES, ADM, 0.0), Enqueue)


def test_unknown_rate_never_early_drops() -> None:
    d = queue_decision(1, snap(queued=(0, 99, 0), rate=0.0), CLASSES, ADM, 0.0)
    assert isinstance(d, Enqueue) and d.predicted_wait_s is None


def test_retry_after_clamped_and_jittered() -> None:
    c = CLASSES[2]
    assert retry_after(0.1, c, ADM, rand=0.0) == 1
    assert retry_after(1000, c, ADM, rand=0.9) == 60
    assert retry_after(10, c, ADM, rand=0.0) == 10
    assert retry_after(10, c, ADM, rand=0.99) == 12  # ceil(10 * 1.198)
    assert retry_after(None, c, ADM, rand=0.0) == 5  # unknown: the class timeout


def test_timeout_reject() -> None:
    r = timeout_reject(1, snap(queued=(0, 3, 0), rate=1.0), CLASSES, ADM, 0.0)
    assert r.reason == "queue_timeout" and r.retry_after_s == 4
    assert timeout_reject(1, None, CLASSES, ADM, 0.0).retry_after_s == 15


def test_reservation_kept_always_even_without_waiters() -> None:
    # P0 keeps its 5 permits free although nothing waits: P1 may not take the 5th free one
    assert eligible(1, 10, [0, 5, 0], [0, 0, 0], SHARES)  # when_waiting: spare capacity is shared
    assert not eligible(1, 10, [0, 5, 0], [0, 0, 0], SHARES, (True, False, False))
    assert eligible(1, 10, [0, 4, 0], [0, 0, 0], SHARES, (True, False, False))  # 6 free, 5 kept
    assert eligible(0, 10, [0, 9, 0], [0, 0, 0], SHARES, (True, False, False))  # P0 itself may
