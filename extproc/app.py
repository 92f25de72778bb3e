"""Wire the processor together: Redis clients, admitter, gRPC server, health, metrics."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc
import redis.asyncio as aioredis
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from floodgate.extproc.admission import Admitter
from floodgate.extproc.config import Config, TlsConfig
from floodgate.extproc.drain import Drain, drain_step, recycle_after
from floodgate.extproc.loopwatch import GcPauses, LoopLagProbe, tune_runtime
from floodgate.extproc.metrics import Metrics, serve_metrics
from floodgate.extproc.redis_client import AnyRedis, make_client, parse_redis_url
from floodgate.extproc.server import Processor
from floodgate.extproc.state import redis_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import disable_created_metrics

from floodgate.runtime import ListenError

log = logging.getLogger("floodgate.extproc")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS for the ext_proc port; with a client CA, a client without a certificate it signed
    cannot complete the handshake, let alone open a stream."""
    with open(tls.cert_file, "rb") as f:
        cert = f.read()
    with open(tls.key_file, "rb") as f:
        key = f.read()
    ca = None
    if tls.client_ca_file:
        with open(tls.client_ca_file, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def security_warnings(cfg: Config) -> list[str]:
    """What a config leaves open that docs/operations.md's threat model says to close."""
    out = []
    host = _split(cfg.server.listen)[0]
    beyond_loopback = host not in ("127.0.0.1", "::1", "localhost")
    if cfg.server.tls is None and beyond_loopback:
        out.append(f"server.listen {cfg.server.listen} is beyond loopback without server.tls: whoever reaches "
                   "it can open ext_proc streams claiming any caller (restrict it with a NetworkPolicy or mesh mTLS)")
    elif cfg.server.tls is not None and not cfg.server.tls.client_ca_file and beyond_loopback:
        out.append(f"server.listen {cfg.server.listen} is beyond loopback with server.tls but no client_ca_file: "
                   "the channel is encrypted, yet any client that reaches it can open ext_proc streams claiming "
                   "any caller (set client_ca_file to Envoy's CA, or restrict the port)")
    p0 = sorted(t for t, prio in cfg.admission.tenant_priorities.items() if prio == 0)
    if p0:
        out.append(f"admission.tenant_priorities maps {', '.join(p0)} to P0 from the {cfg.admission.tenant_header} "
                   "header: without an authentication filter that overwrites that header before the ext_proc "
                   "filter, any client can claim it (docs/operations.md, threat model)")
    for p in cfg.pools:
        if p.endpoint_picking and not p.allowed_endpoints:
            out.append(f"pool {p.name}: endpoint picking without allowed_endpoints routes wherever the Redis "
                       "registry says")
    return out


def make_pool_clients(cfg: Config) -> dict[str, tuple[aioredis.Redis, AnyRedis]]:
    """On a Cluster, each pool its own (client, pub/sub client): a cluster client that saw a node
    fail refreshes its slot map before its next call, which must not delay the pools on the
    other shards. Elsewhere every pool shares the processor's clients (one server: they fail
    together anyway)."""
    if parse_redis_url(cfg.redis.url).kind != "cluster":
        return {}
    r = cfg.redis
    return {p.name: (redis_client(r.url, password=r.password, op_timeout_s=r.op_timeout_s),
                     make_client(r.url, password=r.password, op_timeout_s=r.op_timeout_s, blocking=True))
            for p in cfg.pools}


async def drain(processor: Processor, stop: asyncio.Event, grace_s: float, quiet_s: float) -> None:
    """Keep serving after SIGTERM until the drain rule says stop (extproc/drain.py): health
    already reads NOT_SERVING, so Envoy moves new requests elsewhere while the streams in
    flight finish. A second SIGTERM (or Ctrl-C) cuts at once."""
    since = time.monotonic()
    stop.clear()
    log.info("shutting down: health NOT_SERVING, draining %d streams (at most %.0f s)", processor.streams, grace_s)
    while True:
        step = drain_step(time.monotonic(), since, processor.streams, processor.last_stream_at, grace_s, quiet_s)
        if step is Drain.DONE:
            log.info("drained in %.1f s", time.monotonic() - since)
            return
        if step is Drain.CUT:
            log.warning("shutdown grace of %.0f s over: cutting %d streams", grace_s, processor.streams)
            return
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            continue
        log.warning("second signal: cutting %d streams", processor.streams)
        return


async def recycle(processor: Processor, stop: asyncio.Event) -> None:
    """Once `processor.recycle_at` streams have opened (`server.max_requests`), stop as SIGTERM
    does: the drain that follows lets what is in flight finish, and the process exits 0."""
    await processor.recycle_due.wait()
    log.warning("recycling after %d requests (server.max_requests): draining as on SIGTERM, then exiting 0 for "
                "the platform to start this processor again", processor.opened)
    stop.set()


async def serve(cfg: Config, stop: asyncio.Event) -> None:
    for warning in security_warnings(cfg):
        log.warning("%s", warning)
    metrics = Metrics()
    client = redis_client(cfg.redis.url, password=cfg.redis.password, op_timeout_s=cfg.redis.op_timeout_s)
    # Pub/sub blocks on reads by design, so it gets its own connection without a read timeout.
    pubsub_client = make_client(cfg.redis.url, password=cfg.redis.password,
                                op_timeout_s=cfg.redis.op_timeout_s, blocking=True)
    pool_clients = make_pool_clients(cfg)
    admitter = Admitter(cfg, client, metrics=metrics, pubsub_client=pubsub_client, pool_clients=pool_clients)
    await admitter.check()

    server = grpc.aio.server(options=[
        # gRPC turns SO_REUSEPORT on by default: a second processor (a stale one, a unit started
        # twice) on the same port then bound too and logged "listening", and Envoy's connections
        # were split between the two. A port in use is a start-up error (exit 2), as for metrics.
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", 100000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Envoy pings each connection every 10 s (envoy/floodgate-cluster.yaml), and an admitted
        # request's stream sends nothing until its response starts, or for a whole response when
        # the body is not streamed here. gRPC's defaults (one ping per 5 min without data, 2
        # strikes) then closed the connection at the third ping, with every stream on it
        # ("too many pings"), cutting responses mid-stream. Accept pings this often, never strike.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
        # Our own pings: an admitted request's permit is released when its stream ends, and only
        # Envoy ends it. An Envoy that froze or was cut off (a partition that drops, not closes)
        # held its permits for good and, alive to Redis through us, drew every freed permit to its
        # queued requests: the pool stopped serving until gRPC's 2 h default noticed (a fault
        # review: 8 of 8 permits held, every other client 429, until gRPC's 1-minute ping-ack
        # timeout). Unanswered for 5 s after a ping (sent every 5 s, with data or without), the
        # connection closes and its streams release. (gRPC 1.85 closes a transport on a missing
        # ack after `ping_timeout_ms`, not `keepalive_timeout_ms`: both are set.)
        ("grpc.keepalive_time_ms", 5000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.http2.ping_timeout_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
    ])
    processor = Processor(cfg, admitter)
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        if cfg.server.tls is None:
            server.add_insecure_port(cfg.server.listen)
        else:
            server.add_secure_port(cfg.server.listen, server_credentials(cfg.server.tls))
    except RuntimeError:
        raise ListenError(f"server.listen {cfg.server.listen}: cannot listen (in use, or not an address of "
                          "this host)") from None
    health_server = None
    if cfg.server.health_listen:
        # Health only: nothing on this port can open an ext_proc stream.
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        try:
            health_server.add_insecure_port(cfg.server.health_listen)
        except RuntimeError:
            raise ListenError(f"server.health_listen {cfg.server.health_listen}: cannot listen (in use, or not an "
                              "address of this host)") from None
    if cfg.server.metrics_listen:
        host, port = _split(cfg.server.metrics_listen)
        # No `*_created` samples (one per counter and histogram label set; Prometheus ingests
        # them as series of their own unless its created-timestamps feature is on): a scrape
        # formats every line in the metrics thread, taking the interpreter from the messages
        # arriving meanwhile (`floodgate bench scrape`: 18 % fewer lines, ~0.86x the time).
        disable_created_metrics()
        try:
            serve_metrics(host, port, metrics.registry)
        except OSError as exc:
            raise ListenError(f"server.metrics_listen {cfg.server.metrics_listen}: cannot listen: "
                              f"{exc.strerror or exc}") from None
    # Only with every port ours: start() writes the pool's shared settings (settings_epoch, the
    # limit), and a processor that then exits 2 on a busy port had rolled them out to the running
    # fleet (an operator review: a new epoch's limit 5 in force on the others, 40 before).
    await admitter.start()
    if health_server is not None:
        await health_server.start()
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("floodgate extproc %s listening on %s (%s; metrics %s, redis %s, pools %s)",
             admitter.gateway_id, cfg.server.listen,
             "plaintext" if cfg.server.tls is None else "mTLS" if cfg.server.tls.client_ca_file else "TLS",
             cfg.server.metrics_listen or "off",
             parse_redis_url(cfg.redis.url).display, [p.name for p in cfg.pools])
    tune_runtime(gc_freeze=cfg.server.gc_freeze, gc_threshold=cfg.server.gc_threshold,
                 switch_interval_s=cfg.server.switch_interval_s)
    gc_children = {g: metrics.gc_pause.labels(str(g)) for g in range(3)}
    gc_pauses = GcPauses(lambda gen, s: gc_children[gen].observe(s) if gen in gc_children else None)
    gc_pauses.install()
    lag_task = asyncio.create_task(LoopLagProbe(metrics.loop_lag.observe).run(), name="loop-lag-probe")
    processor.recycle_at = recycle_after(cfg.server.max_requests, random.random())
    recycle_task = asyncio.create_task(recycle(processor, stop), name="recycle")
    await stop.wait()
    lag_task.cancel()
    recycle_task.cancel()
    gc_pauses.uninstall()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await drain(processor, stop, cfg.server.shutdown_grace_s, cfg.server.shutdown_quiet_s)
    log.info("shutting down: releasing permits")
    await server.stop(grace=0)
    if health_server is not None:
        await health_server.stop(grace=0)
    await admitter.stop()
    await client.aclose()
    await pubsub_client.aclose()
    for pc, ps in pool_clients.values():
        await pc.aclose()
        await ps.aclose()
