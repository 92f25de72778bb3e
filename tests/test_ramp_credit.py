"""The onset ramp's credit for endpoints that turned active (policy.ramp_credit): their slots
are empty, so the growth of the limit they bring is taken at once instead of at the ramp's rate.
The reference model here with a fake clock; leases.lua against the model in tests/test_state.py
(`test_lua_matches_reference_model` draws credits); the processor end to end below, on a real
Redis with the script's clock held still."""

from __future__ import annotations

from typing import Any

from floodgate.extproc.permits import PermitTable
from floodgate.extproc.policy import RAMP_MIN_RATE_S, Reject, ramp_credit
from floodgate.extproc.registry import Registry
from floodgate.extproc.schema import key
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.helpers import activate, picking_admitter
from tests.test_ramp import arrive


def test_credit_only_for_endpoints_that_turned_active() -> None:
    assert ramp_credit(42.0, 63.0, 4, 6) == 21  # the elastic bench's ceiling: 10.5 per endpoint
    assert ramp_credit(57.0, 76.0, 3, 4) == 19  # Vegas's limit scaled by follow_endpoints
    assert ramp_credit(40.0, 50.0, 4, 4) == 0  # Vegas raised it: paced as before
    assert ramp_credit(63.0, 42.0, 6, 4) == 0  # endpoints went away
    assert ramp_credit(16.0, 32.0, 0, 2) == 0  # the first count: nothing to compare with
    assert ramp_credit(63.0, 42.0, 4, 6) == 0  # more endpoints, a lower limit (a ceiling came)


def test_credit_is_taken_at_once_first_never_given_back_and_expires() -> None:
    t = PermitTable(limit=40, shares=(0.5, 0.1, 0.0), ramp_burst=0.08, ramp_rate=0.1, ramp_min_rate=RAMP_MIN_RATE_S)
    assert arrive(t, 1, 0, 0.0, "p0-") == ["p0-0"]
    assert len(arrive(t, 7, 2, 0.0, "a")) == 7  # the bucket (8) is spent
    assert arrive(t, 1, 2, 0.0, "b") == []  # paced: it waits
    # 20 more permits from new endpoints: the waiter and 19 more go in at once, not 8 per second
    assert t.set_limit(60, 0.0, credit=20, credit_for=2.0) == ["b0"]
    assert len(arrive(t, 25, 2, 0.0, "c")) == 19
    assert t.extra == 0.0 and t.tokens is not None and t.tokens <= 0
    # a completion gives its token to the bucket, not to the credit
    t.release_many(["a0"], 0.0)
    assert t.extra == 0.0
    # an unused credit ends with its lifetime: after it, the bucket's rate again
    t2 = PermitTable(limit=40, shares=(0.5, 0.1, 0.0), ramp_burst=0.08, ramp_rate=0.1, ramp_min_rate=RAMP_MIN_RATE_S)
    arrive(t2, 1, 0, 0.0, "p0-")
    arrive(t2, 7, 2, 0.0, "a")
    t2.set_limit(60, 0.0, credit=20, credit_for=2.0)
    assert len(arrive(t2, 30, 2, 2.0, "late")) == 8  # the full bucket only (its cap, 8), then paced
    # with the ramp off there is nothing to credit
    t3 = PermitTable(limit=40, shares=(0.5, 0.1, 0.0))
    t3.set_limit(60, 0.0, credit=20, credit_for=2.0)
    assert t3.extra == 0.0


async def test_processor_credits_new_endpoints_to_the_ramp(stack: LocalStack) -> None:
    """Two active endpoints, a P0 in flight, the ramp's bucket spent by sheddable requests (the
    next one is turned away at once: paced, and it would rather be told than wait). Two more
    endpoints turn active: the processor scales the limit with them (16 -> 32) and the 16
    permits they bring are admitted at once, with no time passing on the script's clock."""
    from floodgate.extproc.admission import Permit

    url = stack.start_redis()
    c = redis_client(url, op_timeout_s=5)
    reg = Registry(c, "f")
    await c.set(key("f", "admin_testclock"), 1_000_000)  # the ramp's bucket accrues nothing meanwhile
    a = picking_admitter(url, c, 16)
    held: list[Any] = []
    try:
        await activate(reg, 1, 2)
        await a.start()
        ra = a.pools["f"]
        await a._tick(ra)
        assert (await ra.state.get_limit()).state.endpoints == 2
        held.append(await a.admit("f", 0, "t"))
        got = [await a.admit("f", 2, "t") for _ in range(8)]
        held += [p for p in got if isinstance(p, Permit)]
        assert len(held) == 8 and isinstance(got[-1], Reject)  # 1 P0 + 7 of the bucket's 8
        await activate(reg, 3, 4)
        await a._tick(ra)
        assert (await ra.state.get_limit()).state.limit == 32.0
        got = [await a.admit("f", 2, "t") for _ in range(20)]
        held += [p for p in got if isinstance(p, Permit)]
        assert sum(isinstance(p, Permit) for p in got) == 16, [type(p).__name__ for p in got]
    finally:
        for p in held:
            if isinstance(p, Permit):
                await a.release(p)
        await a.stop()
        await c.aclose()
