"""Redis URL → client: the parsing rules (pure) and a bad URL naming the config field."""

from __future__ import annotations

import asyncio
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
