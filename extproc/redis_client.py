"""One Redis URL → the right async client: a single server, a Sentinel-managed primary, or a Cluster.

URL forms (`docs/configuration.md`):

    redis://[[user]:password@]host:port[/db]            one server (rediss:// for TLS, unix:// too)
    redis+sentinel://[[user]:password@]h1:p1,h2:p2,.../service[/db][?sentinel_password=...]
    redis+cluster://[[user]:password@]h1:p1,h2:p2,...   seed nodes of a Redis/Valkey Cluster
    (rediss+sentinel:// and rediss+cluster:// use TLS for every connection)

The password in the URL is the data nodes'; a Sentinel with its own password takes
`sentinel_password`. Every client fails fast (one `op_timeout_s` per socket operation): a dead
or failing-over Redis must degrade admission, not hang it. A Sentinel client asks the sentinels
for the primary on every new connection and drops connections to a demoted one, so after a
failover the next call reaches the new primary. A Cluster client routes each script by the
slot of its keys (a pool's keys share one hash tag) and refreshes its slot map on MOVED or a
dead node.

`subscribe()` is the pub/sub half: sharded SSUBSCRIBE (SUBSCRIBE on a Redis 6), and on a Cluster
each channel is subscribed on the primary that owns its slot, so a grant published there
(SPUBLISH from the pool's script) is not broadcast to every node. A gateway's channel is per
pool and carries the pool's hash tag (schema.gateway_channel) so it lives in the pool's slot.
A cluster subscription fails at once when its node dies or a subscribed slot leaves it
(the node says so), and a moved slot it was not told of within about 5 s (it re-reads the
slot map); the caller then subscribes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from floodgate.extproc.cancel import cancel_and_wait
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (
    AuthenticationError,
    ClusterDownError,
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from floodgate.runtime import StartupError

AnyRedis = aioredis.Redis | RedisCluster
Kind = Literal["single", "sentinel", "cluster"]

_SINGLE = ("redis", "rediss", "unix")
_SENTINEL = ("redis+sentinel", "rediss+sentinel")
_CLUSTER = ("redis+cluster", "rediss+cluster")


# The TLS parameters a rediss+sentinel:// or rediss+cluster:// URL takes (as rediss:// does):
# a private CA to verify the servers with, a client certificate, how strictly to verify.
TLS_PARAMETERS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")

log = logging.getLogger("floodgate.redis")

POOL_SIZE = 256  # connections per client (single server), shared by every concurrent call
POOL_SIZE_NONBLOCKING = 2048  # per node (Sentinel primary, Cluster node): a call beyond it fails


# What a Redis outage raises. redis-py's RedisClusterException ("Redis Cluster cannot be
# connected", when no startup node answers) is not a RedisError: catching RedisError alone
# turned a wholly unreachable Cluster into failed requests instead of degraded admission.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (RedisError, RedisClusterException, OSError, TimeoutError)


def answered_with_error(exc: BaseException) -> bool:
    """Did Redis answer (an error reply) rather than fail to answer? A script error on data it
    cannot read (a key of the wrong type, a value written by something else) or an ACL refusal
    is no outage, nor are refused credentials: retrying will not help, and logging it as "unreachable" sent
    operators after the network. Replies that mean the server is not serving now (a replica,
    loading, a busy script, a cluster or primary down) count as outages."""
    if isinstance(exc, AuthenticationError):  # WRONGPASS, NOAUTH: the credentials, not the network
        return True
    # redis-py's reply parser gives READONLY, TRYAGAIN, CLUSTERDOWN and MASTERDOWN classes of
    # their own (stripping the code from the last two; LOADING is a ConnectionError); BUSY and
    # NOREPLICAS arrive as plain ResponseErrors, told by their code.
    if not isinstance(exc, ResponseError) or isinstance(exc, (ReadOnlyError, TryAgainError, ClusterDownError)):
        return False
    return not str(exc).startswith(("BUSY", "NOREPLICAS"))


def outage_hint(exc: BaseException) -> str:
    """What an outage's error means where its text does not say ('' where it does), appended to
    the log line. redis-py ends a Cluster call that was redirected (MOVED, ASK, TRYAGAIN) until
    its retries ran out with "TTL exhausted." and nothing else: an operator review saw a pool on
    local limits, logged as `redis unreachable`, while every node was healthy and the pool's slot
    sat half-way through a migration (its keys on two nodes: TRYAGAIN to every script)."""
    if isinstance(exc, ClusterError) and "TTL exhausted" in str(exc):
        return ("; the Cluster kept redirecting the call (MOVED/ASK/TRYAGAIN): most often the pool's slot is "
                "being migrated (CLUSTER SETSLOT ... MIGRATING/IMPORTING) and the pool's scripts fail until the "
                "slot is on one node: finish or undo the migration (valkey-cli --cluster fix)")
    return ""


def refused_connection_settings(exc: BaseException) -> str | None:
    """What in the connection settings a server refused while a connection was being set up
    (None: anything else). A database index the server does not have, or credentials it
    refuses, fail every call the same way: at start-up that is a configuration error, not an
    outage to serve through degraded (a review: `redis://h:6379/99999` started and served on
    local limits, its first ERROR naming an unreadable key)."""
    text = str(exc)
    if isinstance(exc, AuthenticationError) or text.startswith(("WRONGPASS", "NOAUTH")):
        return f"the server refused the credentials ({text})"
    if isinstance(exc, ResponseError) and "DB index is out of range" in text:
        return "the server has no database with that index (its `databases` setting; 0-15 unless changed)"
    return None


def refused_settings_error(exc: BaseException, url: str) -> StartupError | None:
    """The start-up error naming `redis.url` (password redacted) when `exc` is the server
    refusing the connection settings (`refused_connection_settings`); None otherwise."""
    why = refused_connection_settings(exc)
    if why is None:
        return None
    return StartupError(f"redis.url ({redact_url(url)}): {why}; "
                        "FLOODGATE_REDIS_URL and FLOODGATE_REDIS_PASSWORD set it too")


class RedisURLError(ValueError):
    """A malformed Redis URL; the message says what is wrong (the caller names the field)."""


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL points at, parsed and checked, with the password never in `display`."""

    kind: Kind
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    display: str = field(default="", compare=False)
    # TLS settings from the URL's query (rediss+sentinel://, rediss+cluster://), passed to every
    # connection: sentinels, the primary, cluster nodes and their subscriptions.
    tls_options: tuple[tuple[str, str], ...] = ()


def _host_port(item: str, default_port: int) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise RedisURLError("empty host in the host list")
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port_s = rest.lstrip(":")
    elif item.count(":") == 1:
        host, _, port_s = item.partition(":")
    else:
        host, port_s = item, ""
    try:
        port = int(port_s) if port_s else default_port
    except ValueError:
        raise RedisURLError(f"bad port in {item!r}") from None
    if not host or not 0 < port < 65536:
        raise RedisURLError(f"bad host:port {item!r}")
    return host, port


def parse_redis_url(url: str) -> RedisTarget:
    """Check a Redis URL and say what it points at. Raises RedisURLError naming the problem."""
    if not isinstance(url, str) or "://" not in url:
        raise RedisURLError(f"not a URL: {url!r} (expected redis://, rediss://, redis+sentinel:// or redis+cluster://)")
    scheme = url.split("://", 1)[0].lower()
    if scheme in _SINGLE:
        # redis-py's own parser is the reference for single-server URLs. It passes every query
        # parameter on to the connection, so an unknown one (a typo, or a TLS parameter on a
        # plain scheme) failed only at start-up, with a traceback: building a connection (it
        # does not connect) checks them now, as --check-config runs.
        try:
            pool = aioredis.ConnectionPool.from_url(url)
            pool.make_connection()
        except TypeError as exc:
            bad = re.search(r"unexpected keyword argument '([^']*)'", str(exc))
            if bad and bad[1] in (*TLS_PARAMETERS, "ssl_password") and scheme != "rediss":
                raise RedisURLError(f"{bad[1]} needs TLS: use the rediss:// scheme") from None
            raise RedisURLError(f"unknown URL parameter {bad[1]!r}" if bad else str(exc)) from None
        except (ValueError, RedisError) as exc:
            raise RedisURLError(str(exc)) from None
        # The files as redis-py read them from the query ('+' is a space there)
        _check_tls_files({k: v for k, v in pool.connection_kwargs.items() if isinstance(v, str)})
        return RedisTarget("single", url, tls=scheme == "rediss", display=redact_url(url))
    if scheme not in _SENTINEL + _CLUSTER:
        raise RedisURLError(f"unknown scheme {scheme!r} (expected redis, rediss, unix, redis+sentinel, "
                            "rediss+sentinel, redis+cluster or rediss+cluster)")
    if "@" in url.split("://", 1)[1] and "@" not in urlsplit(url).netloc:
        # A '/', '?' or '#' in the password ends the host part early; saying where would echo
        # part of the password.
        raise RedisURLError("the user or password contains '/', '?' or '#': percent-encode it (%2F, %3F, %23)")
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    # Decoded once, as the userinfo is ('+' stays a plus).
    query = {unquote(k): unquote(v) for k, _, v in (item.partition("=") for item in parts.query.split("&") if item)}
    unknown = set(query) - {"sentinel_password", *TLS_PARAMETERS}
    if unknown:
        raise RedisURLError(f"unknown URL parameter(s) {sorted(unknown)}")
    tls = scheme.startswith("rediss")
    tls_options = tuple(sorted((k, v) for k, v in query.items() if k in TLS_PARAMETERS))
    if tls_options and not tls:
        raise RedisURLError(f"{', '.join(k for k, _ in tls_options)} needs TLS: use the rediss+ scheme")
    if dict(tls_options).get("ssl_cert_reqs", "required") not in ("required", "optional", "none"):
        raise RedisURLError("ssl_cert_reqs must be required, optional or none")
    _check_tls_files(query)
    path = [p for p in parts.path.split("/") if p]
    if scheme in _SENTINEL:
        hosts = tuple(_host_port(h, 26379) for h in hostlist.split(","))
        if not path:
            raise RedisURLError("a sentinel URL needs the service name: redis+sentinel://host:26379,.../mymaster")
        if len(path) > 2:
            raise RedisURLError(f"unexpected path {parts.path!r} (expected /service[/db])")
        try:
            db = int(path[1]) if len(path) == 2 else 0
        except ValueError:
            raise RedisURLError(f"bad database number {path[1]!r}") from None
        return RedisTarget("sentinel", url, hosts, path[0], db, username, password,
                           query.get("sentinel_password"), tls, redact_url(url), tls_options)
    hosts = tuple(_host_port(h, 6379) for h in hostlist.split(","))
    if path and path != ["0"]:
        raise RedisURLError("a cluster has only database 0; drop the path")
    if "sentinel_password" in query:
        raise RedisURLError("sentinel_password is only for redis+sentinel:// URLs")
    return RedisTarget("cluster", url, hosts, "", 0, username, password, None, tls, redact_url(url), tls_options)


def _check_tls_files(query: dict[str, str]) -> None:
    """The TLS files a URL names must be readable here: one that is not failed every connection,
    and the processor ran on local limits for good, logged as an outage ("No such file")."""
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = query.get(name)
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise RedisURLError(f"{name}: {path!r} is not a readable file")


def redact_url(url: str, *, mask_user_only: bool = False) -> str:
    """The URL without its passwords (for logs): the userinfo's, and every `*password` query
    parameter's (`sentinel_password`, a TLS key's `ssl_password`). A user without a password
    stays as written (`redis://floodgate-processor@redis:6379/0`): before, it read
    `floodgate-processor:***@`, a password the URL does not have (`--check-config` printed it
    beside `"password": null`). `mask_user_only` keeps that old form for what was hashed with it
    (controller.config's legacy state_dir)."""
    scheme, _, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        rest = f"{user}:***@{hosts}" if colon or mask_user_only else f"{user}@{hosts}"
    return re.sub(r"([?&][^=&]*password=)[^&]*", r"\1***", f"{scheme}://{rest}")


class _Sentinel(Sentinel):
    """redis-py's Sentinel, which also remembers the last primary the sentinels named. Every new
    connection asks the sentinels, so with none answering (frozen, partitioned, restarting) a
    call that timed out once on a healthy primary left a processor on local limits until a
    sentinel answered again (a review: 9 s instead of 0.8 s; 12 in flight of L 8 when one
    processor of two was hit). Now, when no sentinel answers, that server is used for as long
    as it says it is a primary (its `HELLO` reply: `_says_primary`); a demoted one is not."""

    def __init__(self, sentinels: Sequence[tuple[str, int]], *, sentinel_kwargs: dict[str, Any],
                 check_kwargs: dict[str, Any]) -> None:
        super().__init__(list(sentinels), sentinel_kwargs=sentinel_kwargs)
        self.last_primary: tuple[str, int] | None = None
        self.stragglers: set[asyncio.Task[Any]] = set()  # questions answered by a faster sentinel
        self.check_kwargs = check_kwargs  # how to reach the primary (auth, TLS, timeouts)

    HEDGE_S = 0.05  # how long the first sentinel has alone before the others are asked too

    async def _ask_all(self, service_name: str) -> tuple[str, int]:
        """The primary the sentinels name, in redis-py's order (the first in the list that names
        a primary, moved to the top: the one that answered last time is believed first, so
        during a switchover, while some still name the old primary, the answer does not flip).
        The first is asked alone; when it has not answered within `HEDGE_S` (or refused), the
        others are asked all at once: one timeout in all when none answers, not one per sentinel.
        Asked in turn, three frozen sentinels took 3 × `op_timeout_s` before the fallback below,
        past the processor's `2 × op_timeout_s` per call, so every new connection was cancelled
        before it was made and a processor stayed on local limits for as long as they were away."""
        def name(s: Any) -> str:  # for an operator: which sentinel said what
            kw = getattr(getattr(s, "connection_pool", None), "connection_kwargs", {})
            return f"sentinel {kw.get('host', '?')}:{kw.get('port', '?')}"

        async def ask(s: Any) -> tuple[str, int]:
            state = (await s.sentinel_masters()).get(service_name)
            if state and self.check_master_state(state, service_name):
                return state["ip"], state["port"]
            raise MasterNotFoundError(f"names no primary for {service_name!r}")

        def start(s: Any) -> asyncio.Task[tuple[str, int]]:
            # A question still open when an answer was taken (or this call was cancelled)
            # finishes by itself, within its socket timeout: cancelled mid-read, its connection
            # would be closed and made again at every discovery.
            t = asyncio.ensure_future(ask(s))
            self.stragglers.add(t)
            t.add_done_callback(self._forget)
            return t

        sentinels = list(self.sentinels)
        errors: list[str] = []
        first = start(sentinels[0])
        await asyncio.wait([first], timeout=self.HEDGE_S)
        if first.done():
            try:
                return first.result()  # (the usual case: one question, as redis-py asks)
            except OUTAGE_ERRORS as exc:
                errors.append(f"{name(sentinels[0])}: {type(exc).__name__}: {exc}")
        order = [(i, start(s)) for i, s in enumerate(sentinels[1:], 1)]
        if not first.done():
            order.append((0, first))  # (believed last: it did not answer in time)
        for i, t in order:
            try:
                addr = await asyncio.shield(t)
            except OUTAGE_ERRORS as exc:
                errors.append(f"{name(sentinels[i])}: {type(exc).__name__}: {exc}")
                continue
            if i and self.sentinels[i] is sentinels[i]:
                self.sentinels[0], self.sentinels[i] = self.sentinels[i], self.sentinels[0]
            return addr
        raise MasterNotFoundError(f"No master found for {service_name!r} : {', '.join(errors)}")

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self.stragglers.discard(task)
        if not task.cancelled():
            task.exception()  # (retrieved: a sentinel that did not answer, or not first)

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            addr = await self._ask_all(service_name)
        except MasterNotFoundError:
            last = self.last_primary
            if last is None or not await self._says_primary(last):
                raise
            return last
        self.last_primary = (str(addr[0]), int(addr[1]))
        return addr

    async def _says_primary(self, addr: tuple[str, int]) -> bool:
        """HELLO (no protocol change) names the server's role and is in `@connection`, which the
        shipped ACL users have (floodgate/redis_acl.py); ROLE is `@admin @dangerous`, refused to
        them, and the refusal read as "not a primary" (a review: under floodgate-processor the
        fallback never held). ROLE only where HELLO needs a protocol version (Redis 6.0)."""
        c = aioredis.Redis(host=addr[0], port=addr[1], **self.check_kwargs)
        try:
            try:
                hello = await c.execute_command("HELLO")
            except ResponseError:
                role = await c.execute_command("ROLE")
                return bool(role) and role[0] in (b"master", "master")
            fields = hello if isinstance(hello, dict) else dict(zip(hello[::2], hello[1::2], strict=False))
            return fields.get(b"role", fields.get("role")) in (b"master", "master")
        except OUTAGE_ERRORS:
            return False
        finally:
            with contextlib.suppress(Exception):
                await c.aclose()


class _SentinelManaged(aioredis.Redis):
    """The primary's client, which also closes its sentinel connections."""

    fg_sentinel: Sentinel | None = None  # (`sentinel` is a command method)
    fg_service: str = ""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if isinstance(self.fg_sentinel, _Sentinel):
            await cancel_and_wait(list(self.fg_sentinel.stragglers))
        if self.fg_sentinel is not None:
            for s in self.fg_sentinel.sentinels:
                with contextlib.suppress(Exception):
                    await s.aclose()


def make_client(url: str, *, password: str | None = None, op_timeout_s: float = 0.25,
                blocking: bool = False) -> AnyRedis:
    """An async client for `url`. `blocking=True` is for pub/sub: no read timeout (reads wait
    for messages by design), only the connect timeout."""
    target = parse_redis_url(url)
    # A Cluster client holds no subscription itself (`subscribe` opens its own connection to
    # each slot owner) and only reads slot maps: it keeps the read timeout, so a frozen node
    # cannot stall a refresh.
    read_timeout = None if blocking and target.kind != "cluster" else op_timeout_s
    common: dict[str, Any] = {
        "socket_timeout": read_timeout, "socket_connect_timeout": op_timeout_s,
        "health_check_interval": 0, "decode_responses": False,
    }
    # A call that fails on a broken connection (a stale pooled one after a restart or a
    # failover) is retried once on a fresh one before it counts as an outage; every script op
    # is idempotent. On a Sentinel the fresh connection asks the sentinels for the primary.
    once = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    if target.kind == "single":
        # redis-py's default pool fails a call at once ("Too many connections") beyond 100
        # concurrent calls, which under a burst would degrade a healthy processor. This pool
        # waits (bounded by the op timeout) for one of POOL_SIZE connections instead.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, password=password, max_connections=POOL_SIZE, timeout=op_timeout_s, retry=once, **common)
        return aioredis.Redis(connection_pool=pool)
    pw = target.password if target.password is not None else password
    if target.kind == "sentinel":
        sentinel_kwargs: dict[str, Any] = {"socket_timeout": op_timeout_s, "socket_connect_timeout": op_timeout_s}
        if target.sentinel_password is not None:
            sentinel_kwargs["password"] = target.sentinel_password
        tls_kwargs: dict[str, Any] = dict(target.tls_options)
        if target.tls:
            sentinel_kwargs.update(ssl=True, **tls_kwargs)
        s = _Sentinel(target.hosts, sentinel_kwargs=sentinel_kwargs, check_kwargs={
            "username": target.username, "password": pw, "ssl": target.tls, "db": target.db,
            "socket_timeout": op_timeout_s, "socket_connect_timeout": op_timeout_s, **tls_kwargs})
        # (The Sentinel and Cluster pools do not wait for a free connection: allow many.)
        client = s.master_for(target.service, redis_class=_SentinelManaged, db=target.db,
                              username=target.username, password=pw, ssl=target.tls,
                              retry=once, max_connections=POOL_SIZE_NONBLOCKING, **tls_kwargs, **common)
        client.fg_sentinel = s
        client.fg_service = target.service
        return client
    return _Cluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
        username=target.username, password=pw, ssl=target.tls, **_tls_kwargs(target),
        # A shard that is down must not stop the client from serving the others.
        require_full_coverage=False, max_connections=POOL_SIZE_NONBLOCKING,
        # A couple of quick retries ride over MOVED/failover; the caller's timeout bounds them.
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 2), **common)


async def follow_sentinel_primary(clients: Sequence[object], *, interval_s: float = 0.5,
                                  on_moved: Callable[[], None] | None = None) -> None:
    """Until cancelled: ask the sentinels which server is the primary every `interval_s`, and
    when it moves (a failover, or a planned `SENTINEL FAILOVER` where every server stays up)
    close every connection of `clients`, in use or idle, so that their next calls (a call cut
    mid-air is retried once) and their subscriptions go to the new primary. redis-py asks the
    sentinels only when it opens a connection: after a switchover the old primary stays writable
    until Sentinel reconfigures it (about 10 s), and the processors kept admitting on it while
    new connections (`floodgate status`, a reconnect) used the new one: two admission states at
    once, up to 2 × L in flight. Clients of other kinds are ignored (returns at once).
    `on_moved` is called after the connections are closed: the processor re-asserts its state on
    the new primary at once (a failover may have lost the last writes; the next renewal was up to
    `lease_ttl_s / 3` away, on a loaded box past the CI test's 5 s)."""
    managed = [c for c in clients if isinstance(c, _SentinelManaged) and c.fg_sentinel is not None]
    if not managed:
        return
    sentinel, service = managed[0].fg_sentinel, managed[0].fg_service
    assert sentinel is not None
    known: tuple[str, int] | None = None
    while True:
        try:
            addr = tuple(await sentinel.discover_master(service))
        except OUTAGE_ERRORS:
            addr = None  # no sentinel answers: keep the connections (the primary may be fine)
        if addr is not None:
            if known is not None and addr != known:
                log.warning("sentinel: the primary of %r moved from %s:%s to %s:%s: reconnecting", service,
                            *known, *addr)
                for c in managed:
                    with contextlib.suppress(Exception):
                        await c.connection_pool.disconnect(inuse_connections=True)
                if on_moved is not None:
                    on_moved()
            known = (str(addr[0]), int(addr[1]))
        await asyncio.sleep(interval_s)


def _tls_kwargs(target: RedisTarget) -> dict[str, Any]:
    return dict(target.tls_options)


class _Cluster(RedisCluster):
    """Routes FCALL by its first key, as redis-py routes EVALSHA. redis-py asks a fixed node
    (`COMMAND GETKEYS`) where every FCALL goes: a round trip per call, and a failure while that
    node is down even for pools on other shards. Floodgate's calls declare one pool's keys,
    which share a hash tag (one slot)."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() in ("FCALL", "FCALL_RO") and len(args) > 2 and int(args[1]) > 0:
            return int(self.keyslot(args[2]))
        return int(await super()._determine_slot(command, *args))


def is_cluster(client: AnyRedis) -> bool:
    return isinstance(client, RedisCluster)


# ------------------------------------------------------------------------------------ pub/sub


class Subscription:
    """Messages from a set of channels, one `get_message()` at a time.

    Any connection error surfaces from `get_message()`; the caller closes this subscription,
    waits and subscribes again (which, on a Cluster, also re-resolves the slot owners).
    """

    async def get_message(self, wait_s: float) -> tuple[str, bytes] | None:
        raise NotImplementedError

    def reconnected(self) -> bool:
        """Whether the connection was made again (redis-py re-subscribes by itself when a read
        fails once) since the last call: messages published meanwhile were missed."""
        return False

    async def aclose(self) -> None:
        raise NotImplementedError


def _message(msg: dict[str, Any] | None) -> tuple[str, bytes] | None:
    if not msg or msg.get("type") not in ("message", "smessage"):
        return None
    ch = msg["channel"]
    data = msg["data"]
    return (ch.decode() if isinstance(ch, bytes) else str(ch),
            data if isinstance(data, bytes) else str(data).encode())


class _PlainSubscription(Subscription):
    """A subscription on one connection, which it checks: a connection can die without a word
    (a frozen server, a NAT or firewall dropping the flow) and reads without a timeout would
    then wait for ever, while Redis hears nobody on this gateway's channel and drops its waiters
    at their turns. After `ping_idle_s` without a word from the server it sends a PING; no
    answer within `pong_timeout_s` is a lost connection (the caller subscribes again)."""

    def __init__(self, pubsub: Any, *, ping_idle_s: float = 2.0, pong_timeout_s: float = 2.0) -> None:
        self._ps = pubsub
        self._ping_idle_s = ping_idle_s
        self._pong_timeout_s = pong_timeout_s
        self._heard = asyncio.get_running_loop().time()
        self._pinged: float | None = None
        self._reconnects = 0
        if getattr(pubsub, "connection", None) is not None:  # (a weak reference: kept as long as we are)
            pubsub.connection.register_connect_callback(self._on_reconnect)

    def _on_reconnect(self, _connection: Any) -> None:
        self._reconnects += 1

    def reconnected(self) -> bool:
        got, self._reconnects = self._reconnects > 0, 0
        return got

    async def get_message(self, wait_s: float) -> tuple[str, bytes] | None:
        # An ignored (un)subscribe confirmation also returns None: keep reading until the timeout.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            now = loop.time()
            if self._pinged is not None and now - self._pinged > self._pong_timeout_s:
                raise RedisConnectionError(f"pub/sub connection silent: no answer to a PING in {self._pong_timeout_s:g} s")
            if self._pinged is None and now - self._heard > self._ping_idle_s:
                await asyncio.wait_for(self._ps.ping(), self._pong_timeout_s)  # sent; the PONG is read below
                self._pinged = now
            check_at = (self._pinged + self._pong_timeout_s if self._pinged is not None
                        else self._heard + self._ping_idle_s)
            raw = await self._ps.get_message(ignore_subscribe_messages=False,
                                             timeout=max(0.0, min(deadline, check_at + 0.01) - now))
            if raw is not None:
                self._heard = loop.time()
                kind = raw.get("type")
                if kind == "pong":
                    self._pinged = None
                    continue
                if kind in ("sunsubscribe", "unsubscribe"):
                    # Never asked for: the server ended it. A Cluster node does so the moment a
                    # subscribed slot leaves it (a slot migration); before, this was swallowed as a
                    # confirmation and the processor stayed deaf until the slot-map check 5 s
                    # later (a review: 13-51 waiters dropped at their turns per migration).
                    ch = raw.get("channel")
                    name = ch.decode("utf-8", "replace") if isinstance(ch, bytes) else str(ch)
                    raise RedisConnectionError(f"the server ended the subscription to {name} (its slot moved)")
            got = _message(raw)
            if got is not None or loop.time() >= deadline:
                return got

    async def aclose(self) -> None:
        await self._ps.aclose()


class _ShardedSubscription(Subscription):
    """SSUBSCRIBE each channel on the primary owning its slot: one connection per such node,
    each read by its own task into one queue. A slot that moved (failover) shows as an error
    (the dead node) or as a changed owner in the client's slot map, checked every `recheck_s`;
    a connection gone silent (a frozen node, a dropped flow) fails its PING (`_PlainSubscription`)."""

    def __init__(self, cluster: RedisCluster, channels: Sequence[str], *, connect_timeout_s: float,
                 recheck_s: float = 5.0) -> None:
        self._cluster = cluster
        self._channels = list(channels)
        self._connect_timeout = connect_timeout_s
        self._recheck_s = recheck_s
        self._queue: asyncio.Queue[tuple[str, bytes] | BaseException] = asyncio.Queue()
        self._clients: list[aioredis.Redis] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._owners: dict[str, str] = {}
        self._subs: list[_PlainSubscription] = []

    def _owner_map(self) -> dict[str, ClusterNode]:
        out: dict[str, ClusterNode] = {}
        for ch in self._channels:
            node = self._cluster.get_node_from_key(ch)
            if node is None:
                raise RedisError(f"no cluster node serves the slot of {ch}")
            out[ch] = node
        return out

    async def start(self) -> None:
        owners = self._owner_map()
        self._owners = {ch: n.name for ch, n in owners.items()}
        by_node: dict[str, tuple[ClusterNode, list[str]]] = {}
        for ch, node in owners.items():
            by_node.setdefault(node.name, (node, []))[1].append(ch)
        for node, chans in by_node.values():
            # One reconnect at once, as every other client here (make_client): redis-py's default
            # retry made a lost connection again to a dead node three times with backoffs of up
            # to 2, 4 and 8 s, and the subscription failed only at the slot-map check 5 s later:
            # this processor counted itself subscribed (and its polls did not say it was deaf)
            # while Redis dropped its waiters at their turns on the promoted replica.
            c = aioredis.Redis(host=node.host, port=int(node.port), socket_connect_timeout=self._connect_timeout,
                               retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                               **self._auth())
            self._clients.append(c)
            ps = c.pubsub()
            for ch in chans:  # one SSUBSCRIBE per channel: several at once must share a slot
                await asyncio.wait_for(ps.ssubscribe(ch), self._connect_timeout * 4)
            self._tasks.append(asyncio.create_task(self._read(ps), name=f"fg-ssub-{node.name}"))
        self._tasks.append(asyncio.create_task(self._watch(), name="fg-ssub-watch"))

    def _auth(self) -> dict[str, Any]:
        kw = self._cluster.connection_kwargs
        return {k: kw[k] for k in ("username", "password", "ssl", *TLS_PARAMETERS) if kw.get(k) is not None}

    async def _read(self, ps: Any) -> None:
        # Checked like a single server's: a node that froze, or a flow dropped on the way, must
        # end the subscription (the slot map does not change for either).
        sub = _PlainSubscription(ps)
        self._subs.append(sub)
        try:
            while True:
                got = await sub.get_message(1.0)
                if got is not None:
                    self._queue.put_nowait(got)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._queue.put_nowait(exc)
        finally:
            with contextlib.suppress(Exception):
                await ps.aclose()

    async def _watch(self) -> None:
        """Re-read the slot map every `recheck_s`; a subscribed slot that moved ends the
        subscription. A map that cannot be read now (some node down or frozen) is no reason
        to: a dead owner shows as its reader's error, and another node's trouble is not ours."""
        while True:
            await asyncio.sleep(self._recheck_s)
            try:
                await asyncio.wait_for(self._cluster.nodes_manager.initialize(), self._connect_timeout * 4)
                owners = {ch: n.name for ch, n in self._owner_map().items()}
            except OUTAGE_ERRORS:
                continue
            if owners != self._owners:
                self._queue.put_nowait(RedisError("a subscribed slot moved to another node"))
                return

    def reconnected(self) -> bool:
        return any([s.reconnected() for s in self._subs])  # (each one's flag cleared)

    async def get_message(self, wait_s: float) -> tuple[str, bytes] | None:
        try:
            got = await asyncio.wait_for(self._queue.get(), wait_s)
        except TimeoutError:
            return None
        if isinstance(got, BaseException):
            raise RedisError(f"sharded subscription lost: {got}") from got
        return got

    async def aclose(self) -> None:
        await cancel_and_wait(self._tasks)
        for c in self._clients:
            with contextlib.suppress(Exception):
                await c.aclose()


async def subscribe(client: AnyRedis, channels: Sequence[str], *, connect_timeout_s: float = 0.25,
                    sharded: bool | None = None) -> Subscription:
    """Subscribe to `channels` with SSUBSCRIBE (it receives SPUBLISH, which `leases.lua` uses
    wherever the server has it: Redis/Valkey >= 7), on a Cluster at each channel's slot owner.
    `sharded=None` falls back to SUBSCRIBE on an older single server. `client` should be a
    `blocking=True` client."""
    if isinstance(client, RedisCluster):
        # A fresh slot map: after a failover the subscription must go to the new owners.
        await asyncio.wait_for(client.nodes_manager.initialize(), connect_timeout_s * 4)
        sub = _ShardedSubscription(client, channels, connect_timeout_s=connect_timeout_s)
        try:
            await sub.start()
        except BaseException:
            await sub.aclose()
            raise
        return sub
    ps = client.pubsub()  # confirmations read (and skipped) by _PlainSubscription
    try:
        if sharded is False:
            await ps.subscribe(*channels)
        else:
            try:
                for ch in channels:  # one at a time: a multi-channel SSUBSCRIBE must share a slot
                    await ps.ssubscribe(ch)
            except ResponseError:  # Redis 6: no sharded pub/sub (and leases.lua uses PUBLISH)
                if sharded:
                    raise
                await ps.aclose()
                ps = client.pubsub()  # confirmations read (and skipped) by _PlainSubscription
                await ps.subscribe(*channels)
    except BaseException:
        await ps.aclose()
        raise
    return _PlainSubscription(ps)


async def publish(client: AnyRedis, channel: str, message: str | bytes, *, sharded: bool = True) -> int:
    """SPUBLISH (routed to the channel's slot owner on a Cluster), or PUBLISH."""
    if sharded:
        return int(await client.execute_command("SPUBLISH", channel, message))
    return int(await client.publish(channel, message))
