"""Real replicated and sharded Redis topologies on loopback ports, for tests and benchmarks.

`start_sentinel()`: one primary, its replicas and three sentinels (the `valkey-server` binary
in sentinel mode). `start_cluster()`: N primaries, each with replicas, slots split evenly and
`cluster-require-full-coverage no` so the shards still up keep serving while one is down.
Both return an object that knows the URL a client uses and how to break the topology (SIGKILL
a primary, freeze a shard) and wait until it has healed, so fault tests and `floodgate bench
faults` inject the same faults.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from floodgate.binaries import redis_server_binary
from floodgate.supervisor import Child, Supervisor, free_port, wait_for_port

SLOTS = 16384


@dataclass
class Node:
    child: Child
    port: int
    bus_port: int = 0  # cluster bus

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def alive(self) -> bool:
        return self.child.alive()


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def start_server(sup: Supervisor, name: str, *extra: str) -> Node:
    """One valkey server on a free loopback port, no persistence; `extra`: more server arguments."""
    port = free_port()
    data = sup.workdir / f"{name}-data"
    data.mkdir(exist_ok=True)
    child = sup.start(name, [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(data), *extra])
    wait_for_port("127.0.0.1", port, 10, child.proc)
    return Node(child, port)


# ------------------------------------------------------------------------------------ sentinel


@dataclass
class SentinelTopology:
    sup: Supervisor
    service: str
    servers: list[Node]
    sentinels: list[Node]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def primary_port(self) -> int:
        """The primary the sentinels currently agree on (asks each until one answers)."""
        for s in self.sentinels:
            try:
                _host, port = s.client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                return int(port)
            except (redis.RedisError, OSError, TypeError):
                continue
        raise RuntimeError("no sentinel answered")

    def primary(self) -> Node:
        port = self.primary_port()
        return next(n for n in self.servers if n.port == port)

    def kill_primary(self) -> Node:
        """SIGKILL the current primary; returns it (see `wait_failover`)."""
        node = self.primary()
        node.child.kill(signal.SIGKILL)
        node.child.proc.wait(5)
        return node

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the sentinels promoted another server and it accepts writes."""
        def promoted() -> bool:
            port = self.primary_port()
            if port == old_port:
                return False
            role = next(n for n in self.servers if n.port == port).client().execute_command("ROLE")
            return bool(role[0] == b"master")
        _wait(promoted, timeout, "sentinel failover")
        return self.primary_port()

    def wait_synced(self, timeout: float = 20.0) -> None:
        """Every live replica connected to the primary and caught up."""
        primary = self.primary()

        def synced() -> bool:
            info = primary.client().info("replication")
            live = [n for n in self.servers if n is not primary and n.alive()]
            return int(info.get("connected_slaves", 0)) >= len(live) and all(
                n.client().info("replication").get("master_link_status") == "up" for n in live)
        _wait(synced, timeout, "replicas in sync")


def start_sentinel(sup: Supervisor, *, replicas: int = 1, sentinels: int = 3, service: str = "floodgate",
                   down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> SentinelTopology:
    primary = start_server(sup, f"{service}-primary")
    servers = [primary] + [
        start_server(sup, f"{service}-replica{i}", "--replicaof", "127.0.0.1", str(primary.port))
        for i in range(replicas)]
    sents: list[Node] = []
    quorum = sentinels // 2 + 1
    for i in range(sentinels):
        port = free_port()
        conf = sup.workdir / f"{service}-sentinel{i}.conf"  # sentinels rewrite their config file
        conf.write_text("\n".join([
            f"port {port}", "bind 127.0.0.1", f"dir {sup.workdir}",
            f"sentinel monitor {service} 127.0.0.1 {primary.port} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} 1", ""]))
        child = sup.start(f"{service}-sentinel{i}", [redis_server_binary(), str(conf), "--sentinel"])
        wait_for_port("127.0.0.1", port, 10, child.proc)
        sents.append(Node(child, port))
    topo = SentinelTopology(sup, service, servers, sents)
    # Ready = every sentinel sees the primary, its replicas and the other sentinels.
    def known() -> bool:
        for s in sents:
            info: Any = s.client().sentinel_master(service)  # redis-py parses the reply into a dict
            if int(info["num-slaves"]) < replicas or int(info["num-other-sentinels"]) < sentinels - 1:
                return False
        return True
    _wait(known, 30, "sentinels discovering each other")
    topo.wait_synced()
    return topo


# ------------------------------------------------------------------------------------- cluster


@dataclass
class Shard:
    primary: Node
    replicas: list[Node]
    slots: tuple[int, int]  # first, last (inclusive)


@dataclass
class ClusterTopology:
    sup: Supervisor
    nodes: list[Node]
    shards: list[Shard] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes if n.alive())

    def slot_of(self, key: str) -> int:
        return int(self._any().execute_command("CLUSTER", "KEYSLOT", key))

    def _any(self) -> redis.Redis:
        for n in self.nodes:
            if n.alive():
                try:
                    c = n.client()
                    c.ping()
                    return c
                except (redis.RedisError, OSError):
                    continue
        raise RuntimeError("no cluster node answers")

    def owner(self, key: str) -> Node:
        """The node currently serving `key`'s slot as primary (from the live cluster map)."""
        slot = self.slot_of(key)
        for lo, hi, primary, *_ in self._any().execute_command("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                port = int(primary[1])
                return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"slot {slot} is not served")

    def shard_of(self, key: str) -> int:
        """The index of the shard whose slot range holds `key` (fixed at creation)."""
        slot = self.slot_of(key)
        return next(i for i, s in enumerate(self.shards) if s.slots[0] <= slot <= s.slots[1])

    def kill(self, node: Node) -> None:
        node.child.kill(signal.SIGKILL)
        node.child.proc.wait(5)

    def restart(self, node: Node) -> None:
        """Start a killed node again with the same arguments: it rejoins with the identity,
        role and slots in its nodes.conf (its data is gone: no persistence)."""
        argv: Any = node.child.proc.args  # the list Supervisor.start was given
        node.child = self.sup.start(node.child.name, [str(a) for a in argv])
        wait_for_port("127.0.0.1", node.port, 10, node.child.proc)

    def wait_owner_changes(self, key: str, old_port: int, timeout: float = 30.0) -> Node:
        """Wait until a replica took over `key`'s slot from `old_port` and accepts writes."""
        def moved() -> bool:
            node = self.owner(key)
            return node.port != old_port and node.client().execute_command("ROLE")[0] == b"master"
        _wait(moved, timeout, f"cluster failover of {key}")
        return self.owner(key)

    def wait_ok(self, timeout: float = 30.0) -> None:
        def ok() -> bool:
            return all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO")
                       for n in self.nodes if n.alive())
        _wait(ok, timeout, "cluster_state:ok on every live node")

    def key_on_shard(self, shard: int, prefix: str = "p") -> str:
        """A pool name whose hash tag lands in `shard`'s slots (pools spread over shards)."""
        lo, hi = self.shards[shard].slots
        c = self._any()
        for i in range(100000):
            name = f"{prefix}{i}"
            if lo <= int(c.execute_command("CLUSTER", "KEYSLOT", name)) <= hi:
                return name
        raise RuntimeError("no name found")


def _cluster_node(sup: Supervisor, name: str, extra: tuple[str, ...]) -> Node:
    # The bus port defaults to port + 10000, which overflows for high ephemeral ports: pick one.
    # Each node keeps its nodes.conf in its own data dir (--dir).
    bus = free_port()
    node = start_server(sup, name, *extra, "--cluster-config-file", f"{name}.conf", "--cluster-port", str(bus))
    node.bus_port = bus
    return node


def start_cluster(sup: Supervisor, *, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                  name: str = "cluster") -> ClusterTopology:
    extra = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
             "--cluster-require-full-coverage", "no", "--cluster-replica-validity-factor", "0")
    nodes: list[Node] = []
    shards: list[Shard] = []
    for i in range(primaries):
        p = _cluster_node(sup, f"{name}-p{i}", extra)
        reps = [_cluster_node(sup, f"{name}-p{i}r{j}", extra) for j in range(replicas)]
        lo, hi = i * SLOTS // primaries, (i + 1) * SLOTS // primaries - 1
        p.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        nodes += [p, *reps]
        shards.append(Shard(p, reps, (lo, hi)))
    first = nodes[0]
    for n in nodes[1:]:
        n.client().execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)
    topo = ClusterTopology(sup, nodes, shards)

    def everyone_known() -> bool:
        return all(len(n.client().execute_command("CLUSTER", "NODES").decode().strip().splitlines()) == len(nodes)
                   for n in nodes)
    _wait(everyone_known, 30, "every cluster node knowing the others")
    for shard in shards:
        pid = shard.primary.client().execute_command("CLUSTER", "MYID").decode()
        for r in shard.replicas:
            def replicate(r: Node = r, pid: str = pid) -> bool:
                return r.client().execute_command("CLUSTER", "REPLICATE", pid) is not None
            _wait(replicate, 20, "CLUSTER REPLICATE")
    topo.wait_ok()

    def replicas_up() -> bool:
        return all(r.client().info("replication").get("master_link_status") == "up"
                   for s in shards for r in s.replicas)
    _wait(replicas_up, 30, "cluster replicas in sync")
    return topo
