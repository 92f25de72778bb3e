"""A no-op Envoy ext_proc processor: the ceiling the admission path is measured against.

It answers every message of a `Process` stream at once with an empty response of the matching
kind (headers -> HeadersResponse, body -> BodyResponse, trailers -> TrailersResponse), so Envoy
pays exactly the gRPC round trips of the shipped filter config and nothing else. It serves the
standard gRPC health service too, because the shipped processor cluster health-checks it.

    python -m floodgate.bench.noop_processor --port 50051
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from floodgate.runtime import run_until_signalled

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"

# Built once: an empty reply carries no per-request state, and reusing the message keeps the
# ceiling as high as Python allows (serialization of an empty oneof is a few bytes).
_REPLIES: dict[str, pb.ProcessingResponse] = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}
_EMPTY = pb.ProcessingResponse()


class NoopProcessor(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.ProcessingResponse]:
        async for msg in request_iterator:
            yield _REPLIES.get(msg.WhichOneof("request") or "", _EMPTY)


async def serve(host: str, port: int, stop: asyncio.Event) -> None:
    # Same server options as the real processor, so the comparison is of handlers only.
    server = grpc.aio.server(options=[
        ("grpc.max_concurrent_streams", 100000),
        ("grpc.keepalive_permit_without_calls", 1),
    ])
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await stop.wait()
    await server.stop(grace=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    args = parser.parse_args(argv)
    # The real processor runs on uvloop too; keep the loops equal for a fair ceiling.
    run_until_signalled(lambda stop: serve(args.host, args.port, stop), use_uvloop=not args.no_uvloop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
