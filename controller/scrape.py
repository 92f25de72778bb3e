"""Scrapers: vLLM per replica, Envoy admin, Floodgate's queue/limit in Redis.

Every result carries `ok` and the time it was taken. A failed scrape is returned marked
(ok=False), never as zeros: the policy must see "unknown", because an outage that read as an
idle pool would trigger a scale-down exactly when things are breaking.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
import redis.asyncio as aioredis
from floodgate.controller.demand import ClassCounters, FloodgateCounters, GatewayCounters
from floodgate.controller.signals import QueueSignal
from floodgate.controller.vllm import VllmClient, VllmSample, failed_sample
from floodgate.extproc.redis_client import OUTAGE_ERRORS
from floodgate.extproc.schema import UNREADABLE_REPLY
from floodgate.extproc.state import read_demand, read_pool_status
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("floodgate.controller.scrape")


@dataclass(frozen=True, slots=True)
class EnvoySample:
    """Envoy's view of the upstream cluster(s): summed over `clusters`."""

    scraped_at: float
    ok: bool = True
    rq_active: float = 0.0
    rq_pending: float = 0.0
    rq_429: float = 0.0  # cumulative counters
    rq_5xx: float = 0.0
    error: str = ""
    # The gateway listener (HTTP connection manager `gateway_prefix`): the offered-demand source.
    gateway: GatewayCounters | None = None  # None: not configured, or missing from the page


@dataclass(frozen=True, slots=True)
class FloodgateSample:
    """Floodgate's shared admission state for one pool (from Redis)."""

    signal: QueueSignal
    queued: tuple[int, int, int] = (0, 0, 0)
    inflight: int = 0
    limit: int = 0
    error: str = ""
    counters: FloodgateCounters | None = None  # per-class demand counters (offered demand)


def demand_counters(per_class: Mapping[int, Mapping[str, int]], now: float,
                    queued: tuple[int, ...]) -> FloodgateCounters:
    """`extproc.state.read_demand`'s {class: {outcome: count}} plus the queue depth per class."""
    return FloodgateCounters(now, True, {c: ClassCounters.from_mapping(dict(m)) for c, m in per_class.items()},
                             {c: float(q) for c, q in enumerate(queued)})


# Envoy's counters and gauges are unsigned 64-bit integers: a value a float cannot hold exactly
# is no count a real Envoy reached, and a NaN, infinite or negative one is no count at all.
ENVOY_MAX_VALUE = float(2**53)


def _envoy_value(name: str, labels: Mapping[str, str], value: float) -> float:
    """`value` if it is a finite count in [0, ENVOY_MAX_VALUE], else ValueError (the scrape
    fails: unknown, never an infinite rate, which stopped the controller in `policy`)."""
    if not math.isfinite(value) or value < 0 or value > ENVOY_MAX_VALUE:
        raise ValueError(f"{name}{dict(labels)} is {value!r}: not a count Envoy exports")
    return value


GW_TOTAL = "envoy_http_downstream_rq_total"
# Requests that reached admission: each opens one ext_proc stream. Envoy answers some without
# the processor (a 404 path, an admin path's 404, the routes around the filter: `/health`,
# `/v1/models`; its own 400/408/431), and downstream_rq_total counts those too: a client's
# flood of them read as arrivals, a step the burst estimate sized a scale-up for (an attacker
# review: 60 404s/s beside 2 real requests/s read as a burst of ~30 concurrent).
GW_STREAMS = "envoy_http_ext_proc_streams_started"
GW_REJECTED = "envoy_http_ext_proc_immediate_responses_sent"


def parse_envoy(text: str, clusters: frozenset[str] | None, now: float,
                gateway_prefix: str | None = "gateway") -> EnvoySample:
    """Parse `/stats/prometheus`; `clusters=None` sums every cluster except Floodgate's own.

    `gateway_prefix`: stat prefix of the gateway's HTTP connection manager; its arrivals
    (`ext_proc_streams_started`: the requests that reached the processor, `GW_STREAMS`; its
    `downstream_rq_total` when the page has no ext_proc stats, else held to it: `GatewayCounters.downstream`) and
    `ext_proc_immediate_responses_sent` (requests the processor answered itself: 429/503)
    become `gateway`. A page without the prefix's
    `downstream_rq_total` gives `gateway=None` (missing is unknown, never 0); a missing ext_proc
    counter (no ext_proc filter on that listener: nothing is turned away there) reads 0.
    A value no Envoy exports (NaN, infinite, negative, past 2^53) raises ValueError: the scrape
    fails, as a vLLM page with one does (`vllm._sane`).
    """
    active = pending = r429 = r5xx = 0.0
    gw_total: float | None = None
    gw_streams: float | None = None
    gw_rejected = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if gateway_prefix is not None and \
                    s.labels.get("envoy_http_conn_manager_prefix") == gateway_prefix and \
                    "envoy_listener_address" not in s.labels:
                if s.name == GW_TOTAL:
                    gw_total = (gw_total or 0.0) + _envoy_value(s.name, s.labels, s.value)
                elif s.name in (GW_STREAMS, GW_STREAMS + "_total"):  # the parser may add _total
                    gw_streams = (gw_streams or 0.0) + _envoy_value(s.name, s.labels, s.value)
                elif s.name in (GW_REJECTED, GW_REJECTED + "_total"):  # the parser may add _total
                    gw_rejected += _envoy_value(s.name, s.labels, s.value)
                continue
            c = s.labels.get("envoy_cluster_name")
            if c is None or (clusters is not None and c not in clusters):
                continue
            if clusters is None and c.startswith("floodgate_"):
                continue
            if s.name == "envoy_cluster_upstream_rq_active":
                active += _envoy_value(s.name, s.labels, s.value)
            elif s.name == "envoy_cluster_upstream_rq_pending_active":
                pending += _envoy_value(s.name, s.labels, s.value)
            elif s.name in ("envoy_cluster_upstream_rq", "envoy_cluster_upstream_rq_total") and \
                    s.labels.get("envoy_response_code") == "429":
                r429 += _envoy_value(s.name, s.labels, s.value)
            elif s.name in ("envoy_cluster_upstream_rq_xx", "envoy_cluster_upstream_rq_xx_total") and \
                    s.labels.get("envoy_response_code_class") == "5":
                r5xx += _envoy_value(s.name, s.labels, s.value)
    # (with the streams counter as arrivals, downstream_rq_total bounds them: every ext_proc
    # filter on the listener counts its streams in that one counter, `gateway_arrivals`)
    gw = None if gw_total is None else GatewayCounters(now, True, gw_total if gw_streams is None else gw_streams,
                                                       gw_rejected, None if gw_streams is None else gw_total)
    return EnvoySample(now, True, active, pending, r429, r5xx, gateway=gw)


async def scrape_envoy(session: aiohttp.ClientSession, admin_url: str, clusters: frozenset[str] | None,
                       now: float, timeout_s: float = 1.0, gateway_prefix: str | None = "gateway") -> EnvoySample:
    try:
        async with session.get(admin_url.rstrip("/") + "/stats/prometheus",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return EnvoySample(now, ok=False, error=f"HTTP {r.status}")
            text = await r.text()
        # (in a worker thread: a mesh's stats page can run to megabytes, and the loop renews the lease)
        return await asyncio.to_thread(parse_envoy, text, clusters, now, gateway_prefix)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return EnvoySample(now, ok=False, error=f"{type(exc).__name__}: {exc}")


async def scrape_floodgate(client: aioredis.Redis, pool: str, now: float, timeout_s: float = 1.0) -> FloodgateSample:
    """Queue depth, in-flight and limit, and the demand counters, of one pool. A failed read
    is marked (ok=False) for both: counters are never read as zeros."""
    # asyncio.timeout, not wait_for around a gather: on Python 3.11 wait_for can lose a
    # cancellation that arrives as the gather completes (the controller's stop then waited on a
    # tick that scraped on), and a gather it cancelled logged "exception was never retrieved".
    try:
        async with asyncio.timeout(timeout_s):
            st, raw = await asyncio.gather(read_pool_status(client, pool), read_demand(client, pool))
        counters = demand_counters(raw, now, st.queued)
    except OUTAGE_ERRORS as exc:
        return FloodgateSample(QueueSignal(0.0, now, ok=False), error=f"{type(exc).__name__}: {exc}",
                               counters=FloodgateCounters(now, ok=False))
    except UNREADABLE_REPLY as exc:  # a library under our name that is not ours (schema.UNREADABLE_REPLY)
        return FloodgateSample(QueueSignal(0.0, now, ok=False), error=f"unreadable reply: {type(exc).__name__}: {exc}",
                               counters=FloodgateCounters(now, ok=False))
    return FloodgateSample(QueueSignal(float(st.queued_total), now), st.queued, st.inflight_total, st.limit,
                           counters=counters)


@dataclass
class ReplicaScraper:
    """Scrapes replicas concurrently and keeps each one's previous sample (histogram deltas)."""

    session: aiohttp.ClientSession
    timeout_s: float = 1.0
    model: str | None = None
    on_failure: Callable[[str], None] | None = None  # called with the source name per failure
    last: dict[str, VllmSample] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)  # replicas whose unexpected error is logged

    async def scrape(self, endpoints: Mapping[str, str], now: float) -> dict[str, VllmSample]:
        """`endpoints`: replica id -> "host:port". Returns a sample (maybe failed) for each.

        An unexpected exception while scraping one replica (anything `VllmClient.scrape` did
        not turn into a marked failure itself: a bug, or input nobody foresaw) is that
        replica's failed scrape, logged with its traceback (once per run of such failures), not
        an exception out of the pool's tick: one replica's page must not stop the controller."""
        async def one(rid: str, ep: str) -> VllmSample:
            try:
                client = VllmClient(self.session, ep, timeout_s=self.timeout_s, model=self.model)
                sample = await client.scrape(rid, now, self.last.get(rid))
            except Exception as exc:
                if rid not in self._logged:
                    self._logged.add(rid)
                    log.exception("replica %s (%s): unexpected error in its scrape, counted as a failed scrape",
                                  rid, ep)
                return failed_sample(rid, now, f"unexpected {type(exc).__name__}: {exc}", self.last.get(rid))
            self._logged.discard(rid)
            return sample

        ids = list(endpoints)
        results = await asyncio.gather(*(one(rid, endpoints[rid]) for rid in ids))
        out = dict(zip(ids, results, strict=True))
        for s in out.values():
            if not s.metrics.ok and self.on_failure is not None:
                self.on_failure("vllm")
        self.last = out  # replicas that are gone are forgotten
        self._logged.intersection_update(endpoints)  # and so are their logged errors
        return out
