"""One gateway id, one live process (extproc/gateway_claim.py): a second processor started
under a live one's id refuses to start; one restarted after a crash takes the id over; two
that run under one id anyway (started together) say so at every renewal."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp
import pytest
from floodgate.extproc import gateway_claim
from floodgate.extproc.admission import Admitter
from floodgate.extproc.config import Config
from floodgate.extproc.gateway_claim import Observation, conflict, renewed_by_other, watch_for
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.schema import gateway_claim_key
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from tests.helpers import get_json, metrics, pool_status, post, wait_until
from tests.test_admission_e2e import classes, hdr, static

# ---------------------------------------------------------------- the pure rules


def test_a_renewal_by_another_instance_grows_the_remaining_time_or_changes_the_value() -> None:
    a = Observation("other", 9_000)
    assert renewed_by_other(a, Observation("other", 14_900), "me")
    assert renewed_by_other(a, Observation("third", 8_000), "me")
    assert not renewed_by_other(a, Observation("other", 8_700), "me")  # only ageing
    assert not renewed_by_other(a, Observation(None, -2), "me")  # expired
    assert not renewed_by_other(a, Observation("me", 15_000), "me")


def test_only_a_claim_replaced_after_the_first_renewal_is_a_conflict() -> None:
    assert not conflict(None, "me", first=False)
    assert not conflict("me", "me", first=False)
    assert not conflict("dead-predecessor", "me", first=True)
    assert conflict("other", "me", first=False)


def test_a_claim_is_watched_until_one_renewal_period_after_it_was_made() -> None:
    assert watch_for(15_000, 15_000, 5.0) == pytest.approx(6.0)  # just renewed: a full period
    assert watch_for(15_000, 12_000, 5.0) == pytest.approx(3.0)
    assert watch_for(15_000, 8_000, 5.0) == 0.0  # 7 s old: its holder missed a renewal


# ---------------------------------------------------------------- real processes


async def test_a_second_processor_under_a_live_gateway_id_refuses_to_start(stack: LocalStack, upstream: int) -> None:
    """A copied config with `server.gateway_id` (or a compose service with a fixed
    FLOODGATE_GATEWAY_ID scaled to 2): before, the second process started without a word and
    every renewal of either dropped the other's permits ("Redis had lost 2 permits ...: leased
    again" every 5 s). Now it exits 2 naming the setting while the first serves requests that
    hold their permits, and the first loses nothing."""
    stack.start_redis()
    cfg = static(2, classes=classes(p1=30))
    first = stack.start_processor(cfg, name="gw-a")
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processors=[first])
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        held = [asyncio.create_task(post(s, envoy.url, headers=hdr(1, chunks="40", delay_ms="200")))
                for _ in range(4)]
        assert await wait_until(lambda: _inflight_queued(stack.redis_url, (2, 2)), 10)
        with pytest.raises(RuntimeError, match="exited with 2"):
            stack.start_processor(cfg, name="gw-a")
        second = stack.sup.children[-1]
        assert "server.gateway_id 'gw-a' is in use by another live processor" in second.log_tail()
        replies = await asyncio.gather(*held)
        seen = await metrics(s, f"http://127.0.0.1:{first.metrics_port}/metrics")
        stats = await get_json(s, f"http://127.0.0.1:{upstream}/stats")
    assert [r.status for r in replies] == [200] * 4
    assert stats["max_inflight"] <= 2
    assert seen.get('floodgate_lost_leases_total{pool="default"}', 0) == 0
    assert seen.get('floodgate_gateway_id_conflicts_total{pool="default"}', 0) == 0


async def test_a_processor_restarted_after_a_crash_takes_its_gateway_id_over(stack: LocalStack, upstream: int) -> None:
    """The predecessor's claim is not renewed after its SIGKILL: the restart waits at most
    until one renewal period after that claim (lease_ttl_s / 3 + 1 s), then serves."""
    stack.start_redis()
    cfg = static(2, classes=classes(p1=30))
    old = stack.start_processor(cfg, name="gw-r")
    envoy = stack.start_envoy([("127.0.0.1", upstream)], processors=[old])
    old.child.kill(signal.SIGKILL)
    new = stack.start_processor(cfg, name="gw-r", port=old.port)
    assert "which stopped renewing it" in new.child.log_tail()
    async with aiohttp.ClientSession() as s:
        assert await wait_until(lambda: _served(s, envoy.url), 15)


async def test_two_processors_started_together_under_one_id_report_the_conflict(stack: LocalStack) -> None:
    """Neither saw the other at start-up (both claims absent): their renewals find each other's
    claim and both count and log it."""
    url = stack.start_redis()
    cfg = Config.model_validate({"redis": {"url": url, "lease_ttl_s": 1.5, "poll_interval_s": 60},
                                 "pools": [{"name": "p", "limit": {"mode": "static", "initial": 4}}]})
    clients = [redis_client(url, op_timeout_s=2) for _ in range(2)]
    ms = [Metrics(), Metrics()]
    a, b = (Admitter(cfg, c, metrics=m, gateway_id="same") for c, m in zip(clients, ms, strict=True))
    try:
        await asyncio.gather(a.start(), b.start())
        assert await wait_until(lambda: all(_conflicts(m) >= 1 for m in ms), 10)
    finally:
        for x in (a, b):
            await x.stop()
        for c in clients:
            await c.aclose()


async def test_a_clean_stop_hands_the_id_over_at_once(stack: LocalStack) -> None:
    url = stack.start_redis()
    cfg = Config.model_validate({"redis": {"url": url, "lease_ttl_s": 60, "poll_interval_s": 60},
                                 "pools": [{"name": "p", "limit": {"mode": "static", "initial": 4}}]})
    client = redis_client(url, op_timeout_s=2)
    try:
        a = Admitter(cfg, client, gateway_id="same")
        await a.start()
        key = gateway_claim_key("p", "same")
        assert await gateway_claim.read_instance(client, key) == a.instance
        await a.stop()
        assert await gateway_claim.read_instance(client, key) is None
        b = Admitter(cfg, client, gateway_id="same")
        # No claim left: no watch (with a 60 s TTL a left claim would hold the start for 21 s).
        await asyncio.wait_for(b.start(), 5)
        await b.stop()
    finally:
        await client.aclose()


def _conflicts(m: Metrics) -> float:
    return m.gateway_id_conflicts.labels("p")._value.get()


async def _inflight_queued(url: str, want: tuple[int, int]) -> bool:
    st = await pool_status(url)
    return (st.inflight_total, st.queued_total) == want


async def _served(s: aiohttp.ClientSession, url: str) -> bool:
    return (await post(s, url, headers=hdr(1))).status == 200


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
