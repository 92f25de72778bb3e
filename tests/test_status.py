"""`floodgate status` against a real Redis holding leases, waiters and a registry."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from floodgate.extproc.registry import Registry
from floodgate.extproc.schema import PoolSettings
from floodgate.extproc.state import PoolState, redis_client

from floodgate.status import as_json, collect, render
from floodgate.supervisor import Supervisor
from tests.helpers import listening


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    with Supervisor(workdir=tmp_path) as sup:
        _, url = sup.start_redis()
        yield url


async def _fill(url: str) -> None:
    c = redis_client(url, op_timeout_s=2)
    try:
        st = PoolState(c, "chat", lease_ttl_s=15, settings=PoolSettings(3, (0.5, 0.3, 0.1)))
        assert (await st.acquire("gw-a/1", "gw-a", 1, 0, "t")).granted
        assert (await st.acquire("gw-a/2", "gw-a", 2, 1, "t")).granted
        assert (await st.acquire("gw-b/1", "gw-b", 1, 1, "t")).granted
        assert not (await st.enqueue("gw-b/2", "gw-b", 2, 2, "t", 30)).granted  # the limit (3) is full
        await st.sync("gw-a", 3, {"gw-a/1": (0, 1, ""), "gw-a/2": (1, 2, "")}, {})
        # A gateway whose liveness ran out (a processor that lost Redis, or died).
        short = PoolState(c, "chat", lease_ttl_s=0.4)
        await short.sync("gw-gone", 1, {}, {})
        reg = Registry(c, "chat")
        await reg.set("127.0.0.1:8001", "active", "chat-r1")
        await reg.set("127.0.0.1:8002", "warm", "chat-r2")
        await reg.set("127.0.0.1:8003", "draining", "chat-r3")
        await asyncio.sleep(0.6)
    finally:
        await c.aclose()


async def test_status_reports_limit_classes_leases_degraded_gateways_and_registry(redis_url: str) -> None:
    await _fill(redis_url)
    [r] = (await collect(redis_url)).reports
    assert r.pool == "chat" and r.limit == 3
    assert r.inflight == {"P0": 1, "P1": 2, "P2": 0}
    assert r.queued == {"P0": 0, "P1": 0, "P2": 1}
    by_gw = {g.gateway: g for g in r.gateways}
    assert by_gw["gw-a"].leases == 2 and by_gw["gw-a"].live
    assert by_gw["gw-b"].leases == 1 and by_gw["gw-b"].live
    assert r.degraded == ["gw-gone"] and by_gw["gw-gone"].silent_s > 0
    assert {s: [e.endpoint for e in eps] for s, eps in r.registry.items() if eps} == {
        "active": ["127.0.0.1:8001"], "warm": ["127.0.0.1:8002"], "draining": ["127.0.0.1:8003"]}
    text = render([r])
    assert "pool chat: limit 3, in-flight 3 (P0 1 / P1 2 / P2 0), queued 1" in text
    assert "DEGRADED or gone: gw-gone" in text
    assert "registry: loading 0, warm 1, active 1, draining 1, sleeping 0" in text
    # No process subscribes for these gateways: live, but not heard (leases.lua drops their
    # waiters at their turn). gw-b's processor subscribing makes it heard.
    assert by_gw["gw-a"].heard is False and by_gw["gw-b"].heard is False
    assert "NOT HEARD: gw-a" in text and "NOT HEARD: gw-gone" not in text  # a silent one is listed as such
    c = redis_client(redis_url, op_timeout_s=2)
    try:
        async with listening(c, "chat", "gw-b"):
            [r] = (await collect(redis_url)).reports
    finally:
        await c.aclose()
    by_gw = {g.gateway: g for g in r.gateways}
    assert by_gw["gw-b"].heard is True and by_gw["gw-a"].heard is False
    assert "NOT HEARD: gw-b" not in render([r])
    # gw-a says it cannot subscribe: heard by its polls
    c = redis_client(redis_url, op_timeout_s=2)
    try:
        await PoolState(c, "chat", lease_ttl_s=15).waiting_among([], deaf="gw-a", deaf_ms=5000)
    finally:
        await c.aclose()
    [r] = (await collect(redis_url)).reports
    by_gw = {g.gateway: g for g in r.gateways}
    assert by_gw["gw-a"].heard is True and by_gw["gw-a"].by_poll and not by_gw["gw-b"].by_poll
    assert "BY POLL: gw-a" in render([r]) and "NOT HEARD: gw-a" not in render([r])
    gws = json.loads(as_json([r]))["pools"][0]["gateways"]
    assert (gws[0]["gateway"], gws[0]["heard"], gws[0]["by_poll"]) == ("gw-a", True, True)


def test_status_cli_json_and_errors(redis_url: str) -> None:
    asyncio.run(_fill(redis_url))
    r = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", redis_url, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    [pool] = doc["pools"]
    assert pool["pool"] == "chat" and pool["degraded_gateways"] == ["gw-gone"]
    assert [e["replica"] for e in pool["registry"]["active"]] == ["chat-r1"]
    # A bad URL names the flag; an unreachable Redis says so and exits 1 (no traceback, no hang).
    r = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", "http://x:1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--redis-url" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", "redis://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "cannot read" in r.stderr and "Traceback" not in r.stderr


async def _idle_pools(url: str) -> None:
    """A pool whose processor only synced (no request yet) and one the controller only wrote its
    replica id sequence for (min_replicas 0, nothing registered): both exist, both idle."""
    c = redis_client(url, op_timeout_s=2)
    try:
        await PoolState(c, "idle", lease_ttl_s=15, settings=PoolSettings(4, (0.5, 0.3, 0.1))).sync("gw-i", 0, {}, {})
        from floodgate.extproc import schema

        await c.set(schema.key("ctl-only", schema.CTL_SEQ), 3)
    finally:
        await c.aclose()


def test_status_pool_unknown_is_an_error_naming_the_known_pools(redis_url: str) -> None:
    asyncio.run(_fill(redis_url))
    asyncio.run(_idle_pools(redis_url))

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", redis_url, *args],
                              capture_output=True, text=True, timeout=30)

    r = status("--pool", "nosuch")
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert "no pool 'nosuch'" in r.stderr and "known pools: chat, ctl-only, idle" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = status("--pool", "chat", "--pool", "nosuch", "--json")  # one unknown among known ones: still an error
    assert r.returncode == 2 and "'nosuch'" in r.stderr and "'chat'" not in r.stderr, r.stderr
    # Idle pools exist: they print, with an empty registry and nothing in flight.
    r = status("--pool", "idle", "--pool", "ctl-only")
    assert r.returncode == 0, r.stderr
    assert "pool idle: limit 4, in-flight 0" in r.stdout and "pool ctl-only: " in r.stdout, r.stdout
    # A pool no processor has configured has no limit: not "limit 1" (the script's fallback).
    assert "pool ctl-only: limit not set (no processor has configured this pool)" in r.stdout, r.stdout
    r = status("--pool", "ctl-only", "--json")
    assert json.loads(r.stdout)["pools"][0]["limit"] is None, r.stdout
    r = status()
    assert r.returncode == 0 and all(f"pool {p}:" in r.stdout for p in ("chat", "ctl-only", "idle")), r.stdout


def test_status_pool_on_an_empty_redis_says_no_pools_yet(redis_url: str) -> None:
    r = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", redis_url, "--pool", "default"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "no pool 'default'" in r.stderr and "known pools: none yet" in r.stderr, r.stderr


async def _purged_gateway(url: str) -> None:
    """In pool `solo`: gw-dead acquired two permits (15 s leases), renewed once with a 0.4 s
    liveness and stopped; a later script call purged it from `gws` (leases.lua `reclaim`), its
    leases left to their own expiry. gw-new acquired and has not renewed yet (no `gws` entry)."""
    c = redis_client(url, op_timeout_s=2)
    try:
        st = PoolState(c, "solo", lease_ttl_s=15, settings=PoolSettings(4, (0.5, 0.3, 0.1)))
        assert (await st.acquire("gw-dead/5", "gw-dead", 5, 1, "t")).granted
        assert (await st.acquire("gw-dead/6", "gw-dead", 6, 2, "t")).granted
        await PoolState(c, "solo", lease_ttl_s=0.4).sync("gw-dead", 5, {}, {})  # keeps seq 5 and 6
        await asyncio.sleep(0.6)
        [r] = (await collect(url, pools=["solo"])).reports
        assert [(g.gateway, g.live, g.gone) for g in r.gateways] == [("gw-dead", False, False)]  # silent, listed
        assert (await st.acquire("gw-new/1", "gw-new", 1, 0, "t")).granted  # reclaims: gw-dead leaves `gws`
        from floodgate.extproc import schema

        assert await c.zrange(schema.key("solo", "gws"), 0, -1) == []
    finally:
        await c.aclose()


def test_a_gateway_purged_from_gws_is_listed_gone_while_its_leases_remain(redis_url: str) -> None:
    asyncio.run(_purged_gateway(redis_url))
    [r] = asyncio.run(collect(redis_url, pools=["solo"])).reports
    by_gw = {g.gateway: g for g in r.gateways}
    dead, new = by_gw["gw-dead"], by_gw["gw-new"]
    assert (dead.live, dead.gone, dead.leases, dead.waiters) == (False, True, 2, 0)
    assert 10 < dead.leases_expire_s <= 15
    assert new.live and not new.gone and new.leases == 1  # acquired, not renewed yet: live, not gone
    assert r.degraded == ["gw-dead"]
    text = render([r])
    assert "gateways: 1 live, 1 DEGRADED or gone" in text, text
    assert "DEGRADED or gone: gw-dead gone (holding 2 permits, 0 waiters; its leases expire in 1" in text, text
    p = subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", redis_url, "--json"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    [pool] = [x for x in json.loads(p.stdout)["pools"] if x["pool"] == "solo"]
    assert pool["degraded_gateways"] == ["gw-dead"]
    [gw] = [g for g in pool["gateways"] if g["gateway"] == "gw-dead"]
    assert gw["gone"] and gw["leases"] == 2 and gw["waiters"] == 0 and not gw["live"]


def _status(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("FLOODGATE_REDIS")}
    return subprocess.run([sys.executable, "-m", "floodgate", "status", *args], capture_output=True, text=True,
                          timeout=60, env={**full, **(env or {})})


def test_status_unreachable_sentinel_says_so_in_short_and_json_gets_an_error_object() -> None:
    r = _status("--redis-url", "redis+sentinel://:hunter2@127.0.0.1:1,127.0.0.1:2/mymaster")
    assert r.returncode == 1 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert "cannot read redis+sentinel://:***@127.0.0.1:1,127.0.0.1:2/mymaster" in r.stderr, r.stderr
    assert "sentinel 127.0.0.1:1" in r.stderr and "sentinel 127.0.0.1:2" in r.stderr, r.stderr
    assert "<redis." not in r.stderr and "ConnectionPool" not in r.stderr and "hunter2" not in r.stderr, r.stderr
    assert len(r.stderr) < 800, r.stderr
    r = _status("--redis-url", "redis://:hunter2@127.0.0.1:1/0", "--json")
    assert r.returncode == 1 and "cannot read" in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert list(doc) == ["error"] and "cannot read redis://:***@127.0.0.1:1/0" in doc["error"], doc
    assert "hunter2" not in r.stdout + r.stderr


def test_status_bad_url_names_where_it_came_from_and_a_database_must_be_a_number() -> None:
    r = _status(env={"FLOODGATE_REDIS_URL": "http://x:1"})
    assert r.returncode == 2 and "FLOODGATE_REDIS_URL" in r.stderr and "--redis-url" not in r.stderr, r.stderr
    for bad in ("redis://127.0.0.1:1/abc", "redis://127.0.0.1:1/0/1", "rediss://127.0.0.1:1/x",
                "redis://127.0.0.1:1/?db=abc"):
        r = _status("--redis-url", bad)
        assert r.returncode == 2 and "--redis-url" in r.stderr and "Traceback" not in r.stderr, (bad, r.stderr)
        assert "cannot read" not in r.stderr, (bad, r.stderr)  # refused before any connection
    r = _status("--redis-url", "redis://:hunter2@127.0.0.1:1/abc")
    assert r.returncode == 2 and "'/abc' is not a database number" in r.stderr and "hunter2" not in r.stderr


@pytest.mark.parametrize("good", ["redis://h:6379", "redis://h:6379/", "redis://h/15", "rediss://u:p@h:6380/1",
                                  "unix:///run/redis.sock?db=2"])
def test_check_redis_url_keeps_taking_database_numbers(good: str) -> None:
    from floodgate.validators import check_redis_url

    assert check_redis_url(good) == good


def test_status_names_the_controller_holding_the_leader_lease(redis_url: str) -> None:
    """Which controller acts (an HA pair: the leader, not its standby) was nowhere to be seen."""
    from floodgate.controller.leader import LeaderLease

    def status(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "floodgate", "status", "--redis-url", redis_url, *extra],
                              capture_output=True, text=True, timeout=30)

    async def lead(key: str) -> None:
        c = redis_client(redis_url, op_timeout_s=2)
        try:
            assert await LeaderLease(c, key, holder="ctl-a", ttl_s=30).try_acquire_or_renew()
        finally:
            await c.aclose()

    r = status()
    assert r.returncode == 0 and r.stdout.startswith("controller: no leader (nothing holds fg:controller:leader")
    asyncio.run(lead("fg:controller:leader"))
    r = status()
    assert r.stdout.splitlines()[0].startswith("controller: leader ctl-a (lease "), r.stdout
    doc = json.loads(status("--json").stdout)
    assert doc["controller"]["leader"]["holder"] == "ctl-a" and 0 < doc["controller"]["leader"]["expires_s"] <= 30
    asyncio.run(lead("fg:other:leader"))  # a deployment with its own leader.key
    assert json.loads(status("--json", "--leader-key", "fg:other:leader").stdout)["controller"]["leader"]["key"] \
        == "fg:other:leader"


def test_status_runs_as_the_processors_redis_user_from_the_shipped_config(tmp_path: Path) -> None:
    """`floodgate status --config` takes Redis URL and password from a processor config: with the
    shipped one (deploy/compose/processor.yaml) that is the ACL user floodgate-processor, which
    may read every pool key but not the controllers' leader lease (fg:controller:leader is no pool
    key). Status read the lease after the pools and failed whole ("cannot read ...:
    NoPermissionError", exit 1, no pool shown). Now the pools are shown, and the leader line says
    this user may not read the lease."""
    import os

    import yaml

    from floodgate.redis_acl import acl_lines

    acl = tmp_path / "users.acl"
    acl.write_text("\n".join(acl_lines(admin_password="a", processor_password="p", controller_password="c")) + "\n")
    cfg = yaml.safe_load((Path(__file__).resolve().parents[1] / "deploy" / "compose" / "processor.yaml").read_text())
    with Supervisor(workdir=tmp_path) as sup:
        _, url = sup.start_redis(extra=["--aclfile", str(acl)])
        port = url.rsplit(":", 1)[1].split("/")[0]
        asyncio.run(_fill(f"redis://:a@127.0.0.1:{port}/0"))
        cfg["redis"]["url"] = cfg["redis"]["url"].replace("@redis:6379", f"@127.0.0.1:{port}")
        assert cfg["redis"]["url"].startswith("redis://floodgate-processor@"), cfg["redis"]["url"]
        path = tmp_path / "processor.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "FLOODGATE_REDIS_PASSWORD": "p"}

        def status(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "floodgate", "status", "--config", str(path), *extra],
                                  env=env, capture_output=True, text=True, timeout=30)

        r = status()
        assert r.returncode == 0, r.stderr
        first, *rest = r.stdout.splitlines()
        assert first.startswith("controller: NOT SHOWN (Redis user floodgate-processor may not read "
                                "fg:controller:leader"), first
        assert any("chat" in line for line in rest), r.stdout
        r = status("--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [p["pool"] for p in doc["pools"]] == ["chat"]
        assert doc["controller"]["leader"]["readable"] is False and doc["controller"]["leader"]["holder"] is None


async def test_status_shows_the_stored_settings_epoch_a_rollout_raises(redis_url: str) -> None:
    # An operator raising pools[].settings_epoch to roll out changed admission settings: status
    # says which epoch every grant uses now (the first processor on the new config stores it).
    c = redis_client(redis_url, op_timeout_s=2)
    try:
        await PoolState(c, "chat", lease_ttl_s=15, settings=PoolSettings(3, (0.5, 0.3, 0.1))).configure()
        [r] = (await collect(redis_url)).reports
        assert r.settings_epoch == 0 and ", settings epoch 0" in render([r])
        await PoolState(c, "chat", lease_ttl_s=15, settings=PoolSettings(5, (0.5, 0.3, 0.1), epoch=2)).configure()
        [r] = (await collect(redis_url)).reports
        assert (r.limit, r.settings_epoch) == (5, 2) and ", settings epoch 2" in render([r])
        assert json.loads(as_json([r]))["pools"][0]["settings_epoch"] == 2
        # A pool only the controller wrote (its registry) has no settings: none shown.
        await Registry(c, "other").set("127.0.0.1:8001", "active", "other-r1")
        reports = {x.pool: x for x in (await collect(redis_url)).reports}
        assert reports["other"].settings_epoch is None and "settings epoch" not in render([reports["other"]])
    finally:
        await c.aclose()
