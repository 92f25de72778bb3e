"""Redis URL → client: the parsing rules (pure) and a bad URL naming the config field."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.config import load_config
from floodgate.extproc.redis_client import POOL_SIZE, RedisURLError, make_client, parse_redis_url
from redis.asyncio.cluster import RedisCluster

from floodgate.stack import LocalStack
from floodgate.yamlconfig import ConfigError


def test_single_server_urls_pass_through() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://:pw@host:6380/2", "unix:///tmp/redis.sock"):
        t = parse_redis_url(url)
        assert t.kind == "single" and t.url == url
    assert parse_redis_url("rediss://h:1").tls


def test_sentinel_url() -> None:
    t = parse_redis_url("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/3"
                        "?sentinel_password=other")
    assert t.kind == "sentinel"
    assert t.hosts == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert (t.service, t.db, t.password, t.sentinel_password) == ("mymaster", 3, "s3cret", "other")
    assert "s3cret" not in t.display and "other" not in t.display
    assert parse_redis_url("rediss+sentinel://h/svc").tls


def test_cluster_url() -> None:
    t = parse_redis_url("redis+cluster://user:pw@a:7000,b:7001")
    assert t.kind == "cluster" and t.hosts == (("a", 7000), ("b", 7001))
    assert (t.username, t.password, t.db) == ("user", "pw", 0)
    assert "pw" not in t.display


@pytest.mark.parametrize(("url", "says"), [
    ("localhost:6379", "not a URL"),
    ("http://h:1", "unknown scheme"),
    ("redis+sentinel://h:26379", "service name"),
    ("redis+sentinel://h:26379/svc/x", "database number"),
    ("redis+sentinel://h:notaport/svc", "bad port"),
    ("redis+sentinel://h:1,,h:2/svc", "empty host"),
    ("redis+cluster://a:1/3", "only database 0"),
    ("redis+cluster://a:1?sentinel_password=x", r"only for redis\+sentinel"),
    ("redis+cluster://a:1?tls=1", "unknown URL parameter"),
    ("redis+cluster://a:70000", "bad host:port"),
])
def test_bad_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(RedisURLError, match=says):
        parse_redis_url(url)


def test_query_values_are_percent_decoded_once() -> None:
    # A sentinel password holding a literal '%41' and a '+', encoded as a URL needs them.
    t = parse_redis_url("redis+sentinel://h/svc?sentinel_password=a%2541b+c")
    assert t.sentinel_password == "a%41b+c"
    assert parse_redis_url("redis+sentinel://:a%2541b+c@h/svc").password == t.sentinel_password


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    """A CA bundle, a client certificate and its key (contents unread: the URL check needs
    files it can read)."""
    files = {}
    for name, param in (("ca.crt", "ssl_ca_certs"), ("c.crt", "ssl_certfile"), ("c.key", "ssl_keyfile")):
        (tmp_path / name).write_text("x")
        files[param] = str(tmp_path / name)
    return files


@pytest.mark.parametrize("url", ["rediss+sentinel://h:26379/svc", "rediss+cluster://h:7000"])
def test_ha_tls_urls_take_a_ca_bundle_and_client_certificate(url: str, tls_files: dict[str, str]) -> None:
    query = "&".join(f"{k}={v}" for k, v in tls_files.items())
    t = parse_redis_url(f"{url}?{query}&ssl_cert_reqs=required")
    assert dict(t.tls_options) == {**tls_files, "ssl_cert_reqs": "required"}
    with pytest.raises(RedisURLError, match="needs TLS"):
        parse_redis_url(url.replace("rediss", "redis") + f"?ssl_ca_certs={tls_files['ssl_ca_certs']}")
    with pytest.raises(RedisURLError, match="ssl_cert_reqs"):
        parse_redis_url(f"{url}?ssl_cert_reqs=maybe")
    with pytest.raises(RedisURLError, match=r"ssl_ca_certs: '/nonexistent/ca\.crt' is not a readable file"):
        parse_redis_url(f"{url}?ssl_ca_certs=/nonexistent/ca.crt")


@pytest.mark.parametrize(("url", "says"), [
    # A review: each passed --check-config, then the process died with a TypeError traceback
    # (the first two), or ran on local limits for good, logged as an outage (the last two).
    ("rediss://127.0.0.1:1/0?ssl_ca_cert=/x", "unknown URL parameter 'ssl_ca_cert'"),
    ("redis://127.0.0.1:1/0?ssl_ca_certs=/x", r"ssl_ca_certs needs TLS: use the rediss:// scheme"),
    ("redis://127.0.0.1:1/0?tls=1", "unknown URL parameter 'tls'"),
    ("rediss://127.0.0.1:1/0?ssl_cert_reqs=bogus", "Invalid SSL Certificate Requirements Flag"),
    ("rediss://127.0.0.1:1/0?ssl_ca_certs=/nonexistent/ca.crt", "is not a readable file"),
    ("redis://127.0.0.1:1/0?socket_timeout=abc", "Invalid value for 'socket_timeout'"),
])
def test_a_bad_single_server_url_parameter_is_a_config_error(url: str, says: str) -> None:
    with pytest.raises(RedisURLError, match=says):
        parse_redis_url(url)
    with pytest.raises(ConfigError, match=r"redis\.url"):
        load_config(None, {("redis", "url"): url})


def test_single_server_urls_take_their_connection_parameters(tls_files: dict[str, str]) -> None:
    assert parse_redis_url("redis://h:1/0?socket_timeout=3&health_check_interval=5").kind == "single"
    t = parse_redis_url(f"rediss://u:pw@h:6380/0?ssl_ca_certs={tls_files['ssl_ca_certs']}&ssl_password=KEYPASS"
                        "&ssl_cert_reqs=none")
    assert t.tls and "KEYPASS" not in t.display and "pw@" not in t.display  # the key's passphrase too


async def test_ha_clients_pass_the_tls_settings_to_every_connection(tls_files: dict[str, str]) -> None:
    ca = {"ssl_ca_certs": tls_files["ssl_ca_certs"]}
    sentinel = make_client(f"rediss+sentinel://127.0.0.1:1/svc?ssl_ca_certs={ca['ssl_ca_certs']}")
    cluster = make_client(f"rediss+cluster://127.0.0.1:1?ssl_ca_certs={ca['ssl_ca_certs']}")
    try:
        assert ca.items() <= sentinel.connection_pool.connection_kwargs.items()
        assert all(ca.items() <= s.connection_pool.connection_kwargs.items()
                   for s in sentinel.fg_sentinel.sentinels)  # type: ignore[attr-defined]
        assert ca.items() <= cluster.connection_kwargs.items()
    finally:
        for c in (sentinel, cluster):
            await c.aclose()


@pytest.mark.parametrize("url", ["redis+sentinel://user:pa#ss@h:26379/svc", "redis+cluster://user:pa?ss@h:7000",
                                 "redis+sentinel://user:pa/ss@h:26379/svc"])
def test_a_reserved_character_in_the_password_is_named_not_echoed(url: str) -> None:
    with pytest.raises(RedisURLError, match="percent-encode") as info:
        parse_redis_url(url)
    assert "pa" not in str(info.value).replace("password", "")


def test_status_never_prints_a_password() -> None:
    import subprocess
    import sys

    url = "redis+sentinel://:Secret1@127.0.0.1:1,127.0.0.1:2/svc?sentinel_password=TopSecret2"
    r = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", url],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot read" in r.stderr, r.stderr
    assert "Secret1" not in r.stderr and "TopSecret2" not in r.stderr, r.stderr


def test_bad_url_names_the_config_field() -> None:
    with pytest.raises(ConfigError, match=r"redis\.url.*service name"):
        load_config(None, {("redis", "url"): "redis+sentinel://h:26379"})


async def test_client_kind_follows_the_url() -> None:
    # Constructing a client does not connect, so no server is needed to check the kind.
    single = make_client("redis://127.0.0.1:1/0")
    sentinel = make_client("redis+sentinel://127.0.0.1:1/svc")
    cluster = make_client("redis+cluster://127.0.0.1:1")
    try:
        assert type(single) is aioredis.Redis
        assert isinstance(sentinel, aioredis.Redis) and sentinel.connection_pool.service_name == "svc"
        assert isinstance(cluster, RedisCluster)
    finally:
        for c in (single, sentinel, cluster):
            await c.aclose()


@pytest.mark.integration
async def test_a_burst_of_concurrent_calls_waits_for_a_connection(stack: LocalStack) -> None:
    """Beyond redis-py's default 100 connections a call failed at once, which degraded a
    healthy processor under a burst; now calls wait for one of the pool's connections."""
    url = stack.start_redis()
    client = make_client(url, op_timeout_s=2)
    try:
        n = POOL_SIZE + 100
        got = await asyncio.gather(*(client.incr("burst") for _ in range(n)))
        assert sorted(got) == list(range(1, n + 1))
        pool: Any = client.connection_pool
        assert len(pool._available_connections) + len(pool._in_use_connections) <= POOL_SIZE
    finally:
        await client.aclose()


async def test_a_subscription_on_a_connection_that_went_silent_fails_instead_of_waiting_for_ever(
        stack: LocalStack) -> None:
    # A connection can die without a word (a NAT or firewall drops the flow, a frozen server):
    # the subscription read, which has no timeout by design, waited for ever while Redis heard
    # nobody on the channel and dropped this gateway's waiters at their turns (a review: still
    # deaf 44 s later, 440 waiters dropped). It pings when idle and fails without an answer.
    from floodgate.bench.faults import RedisProxy
    from floodgate.extproc.redis_client import publish, subscribe
    from redis.exceptions import ConnectionError as RedisConnectionError

    url = stack.start_redis()
    proxy = RedisProxy(int(url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    sub_client = make_client(f"redis://127.0.0.1:{proxy.port}/0", op_timeout_s=0.5, blocking=True)
    client = make_client(url, op_timeout_s=0.5)
    try:
        sub = await subscribe(sub_client, ["fg:{s}:gw:a"])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while loop.time() - t0 < 5:  # idle but alive: its PINGs are answered, no error
            assert await sub.get_message(0.5) is None
        await publish(client, "fg:{s}:gw:a", "alive")
        assert await sub.get_message(2) == ("fg:{s}:gw:a", b"alive")
        proxy.set("blackhole")  # the flow stays open and carries nothing
        with pytest.raises(RedisConnectionError, match="silent"):
            while loop.time() - t0 < 30:
                await sub.get_message(0.5)
        await sub.aclose()
    finally:
        await proxy.stop()
        await client.aclose()
        await sub_client.aclose()


async def test_a_sharded_subscription_to_a_frozen_node_fails_instead_of_waiting_for_ever(
        stack: LocalStack) -> None:
    # The Cluster form of the test above: a frozen node (or a dropped flow) changes no slot map,
    # so only a PING finds it. Before, each node's reader read with a 1 s timeout for ever and
    # the processor stayed deaf to its grants while the node's other clients timed out.
    import signal

    from floodgate.extproc.redis_client import subscribe
    from redis.exceptions import RedisError

    from floodgate.redis_topology import start_cluster

    topo = start_cluster(stack.sup, primaries=1, replicas=0, node_timeout_ms=60_000)
    sub_client = make_client(topo.url, op_timeout_s=0.5, blocking=True)
    try:
        sub = await subscribe(sub_client, ["fg:{s}:gw:a"])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while loop.time() - t0 < 5:  # idle but alive: no error
            assert await sub.get_message(0.5) is None
        topo.nodes[0].child.kill(signal.SIGSTOP)
        try:
            with pytest.raises(RedisError, match="silent"):
                while loop.time() - t0 < 30:
                    await sub.get_message(0.5)
        finally:
            topo.nodes[0].child.kill(signal.SIGCONT)
        await sub.aclose()
    finally:
        await sub_client.aclose()


@pytest.mark.parametrize(("reply", "answered"), [
    # Redis is up and refused the call: bad data, an ACL rule, credentials, memory
    ("WRONGTYPE Operation against a key holding the wrong kind of value", True),
    ("ERR user_function:173: attempt to perform arithmetic on a string value", True),
    ("NOPERM User x has no permissions to access the 'fg:{a}:x' key", True),
    ("WRONGPASS invalid username-password pair", True),
    ("NOAUTH Authentication required.", True),
    ("OOM command not allowed when used memory > 'maxmemory'.", True),
    # the server is not serving now: outages (redis-py strips the code from some)
    ("LOADING Redis is loading the dataset in memory", False),
    ("BUSY Redis is busy running a script.", False),
    ("READONLY You can't write against a read only replica.", False),
    ("TRYAGAIN Multiple keys request during rehashing of slot", False),
    ("CLUSTERDOWN The cluster is down", False),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", False),
    ("NOREPLICAS Not enough good replicas to write.", False),
])
def test_an_error_reply_is_told_from_an_outage(reply: str, answered: bool) -> None:
    # A review: every script error from bad data was logged "redis unreachable"; then CLUSTERDOWN
    # and MASTERDOWN came out as "not an outage" (redis-py turns them into classes of their own).
    from floodgate.extproc.redis_client import answered_with_error
    from redis._parsers.base import BaseParser

    assert answered_with_error(BaseParser.parse_error(reply)) is answered
    assert answered_with_error(ConnectionError("refused")) is False
    assert answered_with_error(TimeoutError()) is False


@pytest.mark.integration
@pytest.mark.parametrize("server", ["extproc", "controller"])
def test_a_database_or_credentials_the_server_refuses_stop_start_up_naming_the_url(
        stack: LocalStack, tmp_path: Path, server: str) -> None:
    """Not an outage to serve through on local limits: every call would fail the same way. Before,
    `redis://h:6379/99999` started and served degraded, its first ERROR naming an unreadable key."""
    import subprocess
    import sys

    from floodgate.supervisor import free_port

    url = stack.start_redis()
    base = url.rsplit("/", 1)[0]

    def start(redis_url: str) -> subprocess.CompletedProcess[str]:
        cfg = tmp_path / "c.yaml"
        if server == "extproc":
            cfg.write_text(f"server: {{listen: '127.0.0.1:{free_port()}', metrics_listen: ''}}\n"
                           f"redis: {{url: '{redis_url}'}}\npools: [{{name: default}}]\n")
        else:
            cfg.write_text(f"metrics_listen: ''\nredis: {{url: '{redis_url}'}}\n"
                           "pools: [{name: default, actuator: {kind: static, endpoints: ['127.0.0.1:9']}}]\n")
        return subprocess.run([sys.executable, "-m", "floodgate", server, "--config", str(cfg)],
                              capture_output=True, text=True, timeout=60)

    r = start(f"{base}/99999")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "redis.url" in r.stderr and "no database with that index" in r.stderr

    async def require_password() -> None:
        c = aioredis.from_url(url)
        await c.config_set("requirepass", "s3cret")
        await c.aclose()

    asyncio.run(require_password())
    r = start(url.replace("redis://", "redis://:wrong@"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "redis.url" in r.stderr and "refused the credentials" in r.stderr and "wrong" not in r.stderr


def test_an_exhausted_cluster_redirect_says_a_slot_may_be_migrating() -> None:
    """redis-py's "TTL exhausted." names no cause: the log line adds the likely one (a slot
    half-way through a migration); errors that say what they are get nothing added."""
    from floodgate.extproc.redis_client import outage_hint
    from redis.exceptions import ClusterError, ConnectionError, TryAgainError

    assert "slot is being migrated" in outage_hint(ClusterError("TTL exhausted."))
    for exc in (ConnectionError("Connection refused"), TryAgainError("Multiple keys"), TimeoutError(),
                ClusterError("Redis Cluster cannot be connected")):
        assert outage_hint(exc) == ""
