"""Wire the processor together: Redis clients, admitter, gRPC server, health, metrics."""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as aioredis
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from floodgate.extproc.admission import Admitter
from floodgate.extproc.config import Config
from floodgate.extproc.metrics import Metrics
from floodgate.extproc.server import Processor
from floodgate.extproc.state import redis_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

log = logging.getLogger("floodgate.extproc")
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


async def serve(cfg: Config, stop: asyncio.Event) -> None:
    metrics = Metrics()
    client = redis_client(cfg.redis.url, password=cfg.redis.password, op_timeout_s=cfg.redis.op_timeout_s)
    # Pub/sub blocks on reads by design, so it gets its own connection without a read timeout.
    pubsub_client = aioredis.Redis.from_url(cfg.redis.url, password=cfg.redis.password,
                                            socket_connect_timeout=cfg.redis.op_timeout_s)
    admitter = Admitter(cfg, client, metrics=metrics, pubsub_client=pubsub_client)
    await admitter.start()

    server = grpc.aio.server(options=[
        ("grpc.max_concurrent_streams", 100000),
        ("grpc.keepalive_permit_without_calls", 1),
    ])
    pb_grpc.add_ExternalProcessorServicer_to_server(Processor(cfg, admitter), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(cfg.server.listen)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if cfg.server.metrics_listen:
        host, port = _split(cfg.server.metrics_listen)
        start_http_server(port, addr=host, registry=metrics.registry)
    log.info("floodgate extproc %s listening on %s (metrics %s, redis %s, pools %s)",
             admitter.gateway_id, cfg.server.listen, cfg.server.metrics_listen or "off",
             cfg.redis.url.split("@")[-1], [p.name for p in cfg.pools])
    await stop.wait()
    log.info("shutting down: draining streams, releasing permits")
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2)
    await admitter.stop()
    await client.aclose()
    await pubsub_client.aclose()
