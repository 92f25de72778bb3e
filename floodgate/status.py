"""`floodgate status`: the shared state in Redis, for a person or (`--json`) a script.

Per pool: the limit, in-flight and queued requests by class, the leases each gateway (processor)
holds, the gateways that stopped refreshing their liveness (degraded: cannot reach Redis, or
gone), and the replica registry by state. Key names come from `extproc/schema.py`; the
registry and the pool's counters are read through the state API (`extproc/state.py`,
`extproc/registry.py`).

A gateway whose liveness ran out stays in `gws` only until the next script call that reclaims
(leases.lua `reclaim` drops it, its waiters and its `hw:`/`bx:` fields of the pool's state),
while the leases it holds run to their own expiry. So a gateway that holds leases or waiters
and has no `gws` entry is listed as gone until they are reclaimed, unless the state still has
its `hw:` field: then it is one that has called the script since the last purge (a processor
that has acquired but not yet renewed: `gws` is written by its first `sync`), and live.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

HELP = """\
Show what every processor and the controller share in Redis: per pool the limit, in-flight and
queued requests per priority class, leases per gateway, degraded gateways (silent, or gone while
Redis still holds their permits or waiters), live gateways whose grant channel nobody hears (NOT
HEARD: a pub/sub connection just broke; BY POLL: it cannot subscribe and finds its grants by
polling) and the replica registry by state; first, which controller holds the leader lease
(the one that acts) and for how long: NOT SHOWN under a Redis user that may not read the lease,
as the processors' ACL user that `--config processor.yaml` takes (the pools are shown). `--json`
prints the same as one JSON document (`{"error": ...}` when Redis cannot be read).

  floodgate status --redis-url redis://127.0.0.1:6379/0
  floodgate status --config processor.yaml --json
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show the shared state: pools, limits, queues, leases, replicas",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis-url", metavar="URL",
                   help="Redis of the Floodgate deployment (default: $FLOODGATE_REDIS_URL, the --config's, "
                        "or redis://127.0.0.1:6379/0)")
    p.add_argument("--config", "-c", metavar="FILE", help="take Redis URL and password from this processor config")
    p.add_argument("--pool", action="append", default=[], metavar="NAME",
                   help="only this pool (repeatable; a pool not found in Redis is an error naming the "
                        "known ones; default: every pool found in Redis)")
    p.add_argument("--leader-key", metavar="KEY", default=None,
                   help="the controllers' leader lease key (their leader.key; default fg:controller:leader)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text (exit status 1 if a Redis Cluster "
                   "node or pool could not be read: the others are shown, the unreachable ones listed)")
    p.set_defaults(handler=run)


@dataclass
class GatewayStatus:
    gateway: str
    live: bool
    silent_s: float  # how long since its liveness expired (0 while live, or gone: not known any more)
    leases: int
    waiters: int = 0
    # not live and its liveness record already purged (leases.lua `reclaim`): what it holds is
    # left until its leases expire and are reclaimed
    gone: bool = False
    leases_expire_s: float = 0.0  # seconds until the last of its leases expires (0: none, or all expired)
    # someone subscribes to its grant channel (leases.lua `hears`): False for a live gateway means
    # its pub/sub connection is down, and Redis drops its waiters at their turn; None: not known
    heard: bool | None = None
    # it told Redis it cannot subscribe (leases.lua `hears`, `pl:<gateway>`): heard by its polls
    by_poll: bool = False
    idle_credits: int = 0  # of its leases, local credits no request uses (as it last shared them)


@dataclass
class EndpointStatus:
    endpoint: str
    state: str
    replica: str
    inflight: int
    since_s: float
    ejected_s: float = 0.0  # seconds its ejection from the picks has left (docs/admission.md, "Dead endpoints")


@dataclass
class PoolReport:
    pool: str
    limit: int | None  # None: no processor has configured the pool (only the controller wrote it)
    inflight: dict[str, int]
    queued: dict[str, int]
    gateways: list[GatewayStatus] = field(default_factory=list)
    registry: dict[str, list[EndpointStatus]] = field(default_factory=dict)
    # While Redis holds the pool's grants after lost writes: seconds left at most, and the
    # gateways it waits for (docs/admission.md, "After lost writes, no grant ...").
    hold_s: float = 0.0
    hold_waiting: list[str] = field(default_factory=list)
    # Local credits the processors hold idle (schema.IDLE_CREDITS): P1 leases no request uses,
    # left out of `inflight` (a pool at 0.5 requests in flight read 31: a review).
    idle_credits: int = 0
    # The epoch of the admission settings stored for the pool (`pools[].settings_epoch`; every
    # grant uses the stored ones): a rollout of changed settings is stored once this reads the
    # new epoch. None: none stored (no processor has configured the pool).
    settings_epoch: int | None = None

    @property
    def degraded(self) -> list[str]:
        return [g.gateway for g in self.gateways if not g.live]


# A processor shares its idle credits every second: an entry older than this (by Redis's
# clock; processors stamp theirs) is one of a processor that stopped, whose leases count again.
IDLE_CREDITS_FRESH_S = 5.0


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _durable() -> tuple[str, ...]:
    from floodgate.extproc import schema

    # Keys without a TTL that a pool keeps once written, idle or not: its settings, limit and
    # demand counters (processors), its registry, replica id sequence and demand history (controller).
    return ("settings", "state", schema.DEMAND, schema.ENDPOINTS, schema.CTL_SEQ, schema.CTL_HISTORY,
            schema.CTL_DESIRED)


async def pools_in(client: Any) -> tuple[list[str], list[str]]:
    """Pools with shared state (every `fg:{pool}:` hash tag that has a key we know), and the
    Cluster nodes that could not be scanned: a shard that is down hides only its own pools."""
    from floodgate.extproc import schema
    from floodgate.extproc.redis_client import OUTAGE_ERRORS, is_cluster

    durable = set(_durable())
    found: set[str] = set()
    unreachable: list[str] = []

    async def scan(node: Any, keys: Any) -> None:
        try:
            async for k in keys:
                key = _text(k)
                pool, _, name = key[key.index("{") + 1:].rpartition("}:")
                if name in durable:
                    found.add(pool)
        except OUTAGE_ERRORS as exc:
            if node is None:
                raise
            unreachable.append(f"{node.name} ({type(exc).__name__})")

    if is_cluster(client):
        await client.initialize()
        for node in client.get_primaries():
            await scan(node, _scan_node(client, node, schema.key("*", "*")))
    else:
        await scan(None, client.scan_iter(match=schema.key("*", "*"), count=500))
    return sorted(found), unreachable


async def _scan_node(client: Any, node: Any, match: str) -> Any:
    """SCAN one Cluster node, on a connection of its own with the cluster client's settings."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from floodgate.extproc.redis_client import TLS_PARAMETERS

    ckw = client.connection_kwargs
    kw = {k: ckw[k] for k in ("username", "password", "socket_timeout", "socket_connect_timeout", *TLS_PARAMETERS)
          if ckw.get(k) is not None}
    if any(k in kw for k in TLS_PARAMETERS) or issubclass(ckw.get("connection_class", object),
                                                          aioredis.SSLConnection):
        kw["ssl"] = True
    # No retries: a frozen node is reported unreachable after one timeout, not after redis-py's
    # default retries and backoff (an HA review: 27 s with one shard frozen, past a probe's timeout).
    one = aioredis.Redis(host=node.host, port=node.port, retry=Retry(NoBackoff(), 0), **kw)
    try:
        async for k in one.scan_iter(match=match, count=500):
            yield k
    finally:
        await one.aclose()


async def pool_exists(client: Any, pool: str) -> bool:
    from floodgate.extproc import schema

    return bool(await client.exists(*(schema.key(pool, name) for name in _durable())))


# The state hash field leases.lua keeps per gateway that has called the script (`is_new`: its
# ticket watermark) and deletes with its liveness record when the gateway is purged as dead.
_HW = "hw:"
# ... and the time (ms) until which a gateway that cannot subscribe is heard by its polls.
_PL = "pl:"


def _waiter_gateway(qmeta: str) -> str:
    """The gateway of a waiter, from its `qmeta` value "class|deadline|gateway|seq|tenant" (the
    tenant, last, may contain '|')."""
    parts = qmeta.split("|", 4)
    return parts[2] if len(parts) == 5 else ""


class UnknownPool(LookupError):
    """`--pool` named a pool no processor or controller has written to this Redis."""


class UnreadablePool(RuntimeError):
    """Redis answered a pool's status read with a reply this version cannot read
    (schema.UNREADABLE_REPLY): the library under Floodgate's name is not this version's, or a
    pool key holds what no Floodgate wrote."""


async def read_pool(client: Any, pool: str) -> PoolReport:
    from floodgate.extproc import schema
    from floodgate.extproc.registry import STATES, Registry
    from floodgate.extproc.schema import UNREADABLE_REPLY
    from floodgate.extproc.state import FUNCTION, read_pool_status

    try:
        st = await read_pool_status(client, pool)
    except UNREADABLE_REPLY as exc:
        raise UnreadablePool(
            f"pool {pool}: Redis answered a reply this version cannot read ({type(exc).__name__}: {exc}): the "
            f"function library {FUNCTION} there is not this version's (a processor of this version loads its "
            f"own again), or a pool key holds what no Floodgate wrote") from None
    now_s, now_us = await client.time()
    now_ms = int(now_s) * 1000 + int(now_us) // 1000
    leases: dict[str, int] = {}
    lease_end: dict[str, float] = {}  # gateway -> expiry (ms) of its last lease
    expiry = {_text(t): float(ms) for t, ms in await client.zrange(schema.key(pool, "leases"), 0, -1,
                                                                    withscores=True)}
    for ticket, meta in (await client.hgetall(schema.key(pool, "lmeta"))).items():
        if _text(ticket) == schema.PAD_FIELD:
            continue
        gw = schema.lease_gateway(_text(meta)) or "?"
        leases[gw] = leases.get(gw, 0) + 1
        lease_end[gw] = max(lease_end.get(gw, 0.0), expiry.get(_text(ticket), 0.0))
    waiters: dict[str, int] = {}
    for ticket, meta in (await client.hgetall(schema.key(pool, "qmeta"))).items():
        if _text(ticket) == schema.PAD_FIELD:
            continue
        gw = _waiter_gateway(_text(meta)) or "?"
        waiters[gw] = waiters.get(gw, 0) + 1
    gateways: dict[str, GatewayStatus] = {}
    for gw_raw, live_until in await client.zrange(schema.key(pool, "gws"), 0, -1, withscores=True):
        gw = _text(gw_raw)
        gateways[gw] = GatewayStatus(gw, live_until > now_ms, max(0.0, (now_ms - live_until) / 1000),
                                     leases.get(gw, 0), waiters.get(gw, 0))
    # Leases or waiters of a gateway with no liveness record: one that called the script since
    # the last purge (its `hw:` field is in the state: acquired, not renewed yet) is live; one
    # without it was purged as dead and is gone, what it holds left until reclaimed.
    unlisted = sorted((leases.keys() | waiters.keys()) - gateways.keys())
    marks = await client.hmget(schema.key(pool, "state"), [_HW + gw for gw in unlisted]) if unlisted else []
    for gw, mark in zip(unlisted, marks, strict=True):
        gone = mark is None
        gateways[gw] = GatewayStatus(gw, not gone, 0.0, leases.get(gw, 0), waiters.get(gw, 0), gone)
    heard = await _heard(client, pool, list(gateways))
    names = list(gateways)
    polls = await client.hmget(schema.key(pool, "state"), [_PL + gw for gw in names]) if names else []
    for g, poll_until in zip(gateways.values(), polls, strict=True):
        g.leases_expire_s = max(0.0, (lease_end.get(g.gateway, 0.0) - now_ms) / 1000)
        g.by_poll = poll_until is not None and float(poll_until) > now_ms and not heard.get(g.gateway)
        g.heard = True if g.by_poll else heard.get(g.gateway)
    registry: dict[str, list[EndpointStatus]] = {s: [] for s in STATES}
    ejected = schema.parse_ejections(await client.hget(schema.key(pool, "state"), schema.EJECTED_FIELD))
    for ep in (await Registry(client, pool).endpoints()).values():
        registry.setdefault(ep.state, []).append(
            EndpointStatus(ep.endpoint, ep.state, ep.replica_id, ep.inflight, max(0.0, (now_ms - ep.since_ms) / 1000),
                           max(0.0, (ejected.get(ep.endpoint, 0) - now_ms) / 1000)))
    for eps in registry.values():
        eps.sort(key=lambda e: e.endpoint)
    # The script answers a limit for a pool without one (its fallback, 1): a pool only the
    # controller wrote (registry, replica ids) has none, and "limit 1" read as a real one.
    configured = await client.hexists(schema.key(pool, "state"), "limit") or \
        await client.exists(schema.key(pool, "settings"))
    limit = st.limit if configured else None
    shared = {_text(k): _text(v) for k, v in (await client.hgetall(schema.key(pool, schema.IDLE_CREDITS))).items()}
    idle = {gw: min(n, gateways[gw].leases) for gw, n in schema.fresh_idle_credits(
        shared, now_ms, IDLE_CREDITS_FRESH_S).items() if gw in gateways and gateways[gw].live}
    for gw, n in idle.items():
        gateways[gw].idle_credits = n
    inflight = list(st.inflight)
    inflight[1] = max(0, inflight[1] - sum(idle.values()))
    return PoolReport(pool, limit, {f"P{c}": n for c, n in enumerate(inflight)},
                      {f"P{c}": n for c, n in enumerate(st.queued)},
                      sorted(gateways.values(), key=lambda g: g.gateway), registry, st.hold_s, list(st.hold_waiting),
                      sum(idle.values()), st.settings_epoch if st.settings_epoch >= 0 and configured else None)


async def _heard(client: Any, pool: str, gateways: list[str]) -> dict[str, bool]:
    """Gateway -> whether its grant channel has a subscriber, asked where the script asks it
    (on a Cluster, the node owning the pool's slot); {} where the server cannot say."""
    from redis.asyncio.cluster import RedisCluster
    from redis.exceptions import ResponseError

    from floodgate.extproc import schema

    if not gateways:
        return {}
    chans = [schema.gateway_channel(gw, pool) for gw in gateways]
    # on a Cluster, the slot owner itself (the cluster client would merge replies of all nodes)
    target = client.get_node_from_key(chans[0]) if isinstance(client, RedisCluster) else client
    if target is None:  # no owner known for the slot
        return {}
    raw: Any = None
    for sub in ("SHARDNUMSUB", "NUMSUB"):  # the channels the script publishes on (Redis 6: plain)
        try:
            raw = await target.execute_command("PUBSUB", sub, *chans)
            break
        except ResponseError:
            continue
    if raw is None:
        return {}
    flat = [x for pair in raw for x in pair] if raw and isinstance(raw[0], (list, tuple)) else list(raw)
    counts = {_text(ch): int(n) for ch, n in zip(flat[::2], flat[1::2], strict=True)}
    return {gw: counts.get(ch, 0) > 0 for gw, ch in zip(gateways, chans, strict=True)}


async def collect(redis_url: str, password: str | None = None, pools: list[str] | None = None,
                  op_timeout_s: float = 2.0, leader_key: str | None = None) -> Collected:
    from redis.exceptions import NoPermissionError

    from floodgate.extproc.redis_client import OUTAGE_ERRORS
    from floodgate.extproc.schema import controller_leader_key
    from floodgate.extproc.state import redis_client

    client = redis_client(redis_url, password=password, op_timeout_s=op_timeout_s)
    key = leader_key or controller_leader_key()
    try:
        got = await _collect_pools(client, pools)
        try:
            # Bounded: on a Cluster the client retries a frozen node's slot several times over.
            got.leader = await asyncio.wait_for(read_leader(client, key), 2 * op_timeout_s)
        except NoPermissionError:
            # The processors' ACL user (floodgate/redis_acl.py) reads the pool keys only, and
            # `--config` takes a processor config's user: the pools are shown without the lease.
            user = unquote(urlsplit(redis_url).username or "") or "default"
            got.leader = LeaderStatus(key, None, 0.0, readable=False, user=user)
        except OUTAGE_ERRORS as exc:
            if not got.unreachable:  # one server: it answered the pools a moment ago; say what failed
                raise
            got.unreachable.append(f"leader lease ({type(exc).__name__})")
        return got
    finally:
        await client.aclose()


async def _collect_pools(client: Any, pools: list[str] | None) -> Collected:
    from floodgate.extproc.redis_client import OUTAGE_ERRORS

    if pools:  # read where each named pool lives, no scan: other shards may be down
        unknown = [p for p in pools if not await pool_exists(client, p)]
        if unknown:
            known, _ = await pools_in(client)
            raise UnknownPool(f"no pool {', '.join(repr(p) for p in unknown)} in this Redis (no processor or "
                              f"controller has written it); known pools: {', '.join(known) or 'none yet'}")
        return Collected([await read_pool(client, p) for p in pools])
    known, unreachable = await pools_in(client)
    reports: list[PoolReport] = []
    for p in known:
        try:
            reports.append(await read_pool(client, p))
        except OUTAGE_ERRORS as exc:  # its shard went away since the scan
            unreachable.append(f"pool {p} ({type(exc).__name__})")
    return Collected(reports, unreachable)


@dataclass
class LeaderStatus:
    """The controllers' leader lease: who holds it (None: nobody) and for how much longer."""

    key: str
    holder: str | None
    expires_s: float
    readable: bool = True  # False: this Redis user may not read the key (a processor's ACL user)
    user: str | None = None  # the Redis user, when not readable


@dataclass
class Collected:
    reports: list[PoolReport]
    unreachable: list[str] = field(default_factory=list)  # Cluster nodes or pools that could not be read
    leader: LeaderStatus | None = None  # None: not read (its node unreachable)


async def read_leader(client: Any, key: str) -> LeaderStatus:
    holder = await client.get(key)
    pttl = int(await client.pttl(key)) if holder is not None else -2
    return LeaderStatus(key, None if holder is None else _text(holder), max(0.0, pttl / 1000))


def render_leader(leader: LeaderStatus | None) -> str:
    if leader is None:
        return "controller: UNKNOWN (the node holding the leader lease could not be read)"
    if not leader.readable:
        return (f"controller: NOT SHOWN (Redis user {leader.user} may not read {leader.key}: the processors' user "
                "reads pool keys only; use the controller's user or `default` to see the leader)")
    if leader.holder is None:
        return (f"controller: no leader (nothing holds {leader.key}: no controller runs, or it runs without "
                "leader election, or it cannot reach Redis)")
    return f"controller: leader {leader.holder} (lease {leader.expires_s:.1f} s left, renewed every third of its TTL)"


def _leases(g: GatewayStatus) -> str:
    return f"{g.gateway} {g.leases}" + (f" ({g.idle_credits} idle credits)" if g.idle_credits else "")


def render(reports: list[PoolReport]) -> str:
    if not reports:
        return "no pools in Redis yet (no processor has admitted a request, no controller registered a replica)"
    lines: list[str] = []
    for r in reports:
        inflight = sum(r.inflight.values())
        limit = r.limit if r.limit is not None else "not set (no processor has configured this pool)"
        lines.append(f"pool {r.pool}: limit {limit}, in-flight {inflight} "
                     f"({' / '.join(f'{k} {v}' for k, v in r.inflight.items())}"
                     + (f"; and {r.idle_credits} idle local credits held by processors" if r.idle_credits else "")
                     + f"), queued {sum(r.queued.values())} ({' / '.join(f'{k} {v}' for k, v in r.queued.items())})"
                     + (f", settings epoch {r.settings_epoch}" if r.settings_epoch is not None else ""))
        if r.hold_s > 0:
            lines.append(f"  GRANTS HELD: Redis lost acknowledged writes (a failover); no permit is granted until "
                         f"{', '.join(r.hold_waiting)} re-assert (at most {r.hold_s:.1f} s more)")
        live = [g for g in r.gateways if g.live]
        down = len(r.gateways) - len(live)
        lines.append(f"  gateways: {len(live)} live" + (f", {down} DEGRADED or gone" if down else "")
                     + (f"; leases {', '.join(_leases(g) for g in r.gateways if g.leases)}"
                        if any(g.leases for g in r.gateways) else ""))
        for g in r.gateways:
            if g.gone:
                until = (f"its leases expire in {g.leases_expire_s:.1f} s" if g.leases_expire_s
                         else "the next admission call reclaims them")
                lines.append(f"  DEGRADED or gone: {g.gateway} gone (holding {g.leases} permits, {g.waiters} "
                             f"waiters; {until})")
            elif not g.live:
                lines.append(f"  DEGRADED or gone: {g.gateway} (silent {g.silent_s:.1f} s, {g.leases} leases "
                             f"until they expire, {g.waiters} waiters)")
            elif g.by_poll:
                lines.append(f"  BY POLL: {g.gateway} (cannot subscribe to its grant channel: its grants are found "
                             f"by its polls, every redis.poll_interval_s)")
            elif g.heard is False:
                lines.append(f"  NOT HEARD: {g.gateway} (live, but nothing subscribes to its grant channel: its "
                             f"pub/sub connection broke a moment ago, or it died; Redis drops its waiters at their turn)")
        counts = ", ".join(f"{s} {len(eps)}" for s, eps in r.registry.items())
        lines.append(f"  registry: {counts}")
        for state, eps in r.registry.items():
            for e in eps:
                lines.append(f"    {state:<9} {e.endpoint:<22} {e.replica:<24} in-flight {e.inflight:>3}  "
                             f"for {e.since_s:.0f} s"
                             + (f"  EJECTED (connections failed) for {e.ejected_s:.0f} s more" if e.ejected_s else ""))
    return "\n".join(lines)


def as_json(reports: list[PoolReport], unreachable: list[str] | None = None,
            leader: LeaderStatus | None = None) -> str:
    return json.dumps({"controller": {"leader": asdict(leader) if leader else None},
                       "pools": [{**asdict(r), "degraded_gateways": r.degraded} for r in reports],
                       "unreachable": unreachable or []}, indent=2)


def run(args: argparse.Namespace) -> int:
    from floodgate.extproc.redis_client import OUTAGE_ERRORS

    url, password = args.redis_url, os.environ.get("FLOODGATE_REDIS_PASSWORD") or None
    source = "--redis-url"
    if args.config:
        from floodgate.extproc.config import ConfigError, load_config

        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            print(f"floodgate status: {exc}", file=sys.stderr)
            return 2
        if not url:
            source = f"{args.config}: redis.url"
        url, password = url or cfg.redis.url, cfg.redis.password
    if not url and os.environ.get("FLOODGATE_REDIS_URL"):
        url, source = os.environ["FLOODGATE_REDIS_URL"], "FLOODGATE_REDIS_URL"
    url = url or "redis://127.0.0.1:6379/0"
    from floodgate.validators import check_redis_url

    try:
        check_redis_url(url)
    except ValueError as exc:
        print(f"floodgate status: {source}: {exc}", file=sys.stderr)
        return 2
    from floodgate.extproc.redis_client import parse_redis_url

    try:
        got = asyncio.run(collect(url, password, args.pool, leader_key=args.leader_key))
    except OUTAGE_ERRORS as exc:
        msg = f"cannot read {parse_redis_url(url).display}: {type(exc).__name__}: {short_error(exc)}"
        if args.json:
            print(json.dumps({"error": msg}))
        print(f"floodgate status: {msg}", file=sys.stderr)
        if not (args.redis_url or args.config or os.environ.get("FLOODGATE_REDIS_URL")):
            print("  (no --redis-url given: `floodgate up` prints the URL of the Redis it started; pass it with "
                  "--redis-url or FLOODGATE_REDIS_URL)", file=sys.stderr)
        return 1
    except UnknownPool as exc:
        print(f"floodgate status: --pool: {exc}", file=sys.stderr)
        return 2
    except UnreadablePool as exc:
        if args.json:
            print(json.dumps({"error": str(exc)}))
        print(f"floodgate status: {exc}", file=sys.stderr)
        return 1
    print(as_json(got.reports, got.unreachable, got.leader) if args.json
          else render_leader(got.leader) + "\n" + render(got.reports))
    for what in got.unreachable:
        print(f"floodgate status: UNREACHABLE {what}: the pools on it are not shown", file=sys.stderr)
    return 1 if got.unreachable else 0


_CLIENT_REPR = re.compile(r"<redis\.")
_HOST_PORT = re.compile(r"\bhost=([^,>]+),port=(\d+)")


def short_error(exc: BaseException, limit: int = 400) -> str:
    """The error's text without the client reprs redis-py puts in some (a Sentinel's
    MasterNotFoundError names each sentinel by its whole client: connection settings, object
    addresses): each becomes `sentinel HOST:PORT` (or `client`), and the text is cut at `limit`."""
    text, out, i = str(exc), [], 0
    while (m := _CLIENT_REPR.search(text, i)) is not None:
        out.append(text[i:m.start()])
        depth, j = 0, m.start()
        while j < len(text):  # the repr's closing '>' (it nests <...> of its own)
            depth += {"<": 1, ">": -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                break
        hp = _HOST_PORT.search(text, m.start(), j)
        out.append(f"sentinel {hp[1]}:{hp[2]}" if hp else "client")
        i = j
    out.append(text[i:])
    short = "".join(out)
    return short if len(short) <= limit else short[:limit - 3] + "..."
