"""Graceful shutdown of a processor (pure): what to do while draining after SIGTERM.

The shipped filter keeps a request's ext_proc stream open until the HTTP request ends
(response trailers SEND), so stopping the gRPC server cuts every response still streaming
through this processor. After SIGTERM the processor reports NOT_SERVING to health checks
(Envoy moves new requests to the other processors within its check interval × unhealthy
threshold, 2 s × 2 with envoy/floodgate-cluster.yaml) and keeps serving everything, new
streams included, until nothing is in flight and no stream has started for `quiet_s`, or
`grace_s` has passed (then what is left is cut and its permits are released at once).

`server.max_requests` starts the same drain after that many requests, and the processor then
exits 0 for its platform to start it again (a bound on memory grpcio leaks per cancelled call).
"""

from __future__ import annotations

from enum import StrEnum


class Drain(StrEnum):
    WAIT = "wait"  # streams still in flight, or Envoy may still send new ones
    DONE = "done"  # nothing in flight and no new stream for quiet_s: stop without cutting anything
    CUT = "cut"  # the grace is over: stop now, cutting what is still in flight


def drain_step(now: float, since: float, streams: int, last_stream_at: float,
               grace_s: float, quiet_s: float) -> Drain:
    """`since`: when draining began (SIGTERM); `streams`: ext_proc streams open now;
    `last_stream_at`: when the last one opened (-inf: never)."""
    if streams == 0 and now - last_stream_at >= quiet_s:
        return Drain.DONE
    if now - since >= grace_s:
        return Drain.CUT
    return Drain.WAIT


# A processor recycles itself after a number of requests drawn from [n, n x (1 + this)): the
# processors of one rollout start together and would otherwise all drain at the same moment.
RECYCLE_SPREAD = 0.25


def recycle_after(max_requests: int, draw: float) -> int | None:
    """How many ext_proc streams this processor serves before it drains and exits
    (`server.max_requests`; None: never). `draw` is uniform in [0, 1)."""
    if max_requests <= 0:
        return None
    return max_requests + int(max_requests * RECYCLE_SPREAD * draw)
