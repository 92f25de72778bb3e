"""The ext_proc gRPC service: turns Envoy's per-request stream into admit / wait / reject.

Envoy opens one `Process` stream per HTTP request. The shipped filter config sends request
headers and response trailers (bodies NONE), which keeps the stream open until the HTTP
request ends (verified on Envoy 1.40, docs/admission.md): so the end of this stream, for whatever reason, is
where the permit is released. Every request let through asks for its response headers via
`mode_override` (the static mode skips them: see `_mode`); a sampled fraction also asks for the
response body (and, with a body, its request body, whose end the latency counts from), to
measure TTFT and TPOT for the Vegas limit. With a pool's
`engine_priority`, the admitted requests of the listed classes also get their request body
(`mode_override`, BUFFERED) to write vLLM's `priority` field into it (`rewrite_priority`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from floodgate.extproc.admission import PRIORITY_LABELS, Admitter, Permit
from floodgate.extproc.config import TENANT_MAX_CHARS, Config
from floodgate.extproc.ejection import EndpointOutcome, endpoint_outcome, load_signal
from floodgate.extproc.limit import LatencyMeter
from floodgate.extproc.policy import Reject
from floodgate.extproc.prefill import body_encoded, prompt_tokens, unprefilled
from floodgate.extproc.priority import Caller, PriorityResolver, source_ip_of

log = logging.getLogger("floodgate.server")

ATTR_NS = "envoy.filters.http.ext_proc"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
PRIORITY_OUT = "x-floodgate-priority"
QUEUE_MS_OUT = "x-floodgate-queue-ms"
REASON_OUT = "x-floodgate-reject-reason"
# Headers some frameworks read to run a request as another method (a GET carrying one could be a
# POST to the model server): a request with any of them never passes as an unadmitted method.
METHOD_OVERRIDE_HEADERS = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})

# Upstream answers that say the model servers are overloaded or unreachable, the drops a
# limit backs off on: 502/503 (Envoy: connect failure, reset, overflow; a replica that refuses
# work), 504 (a timeout). Another 5xx (500: a request the server failed on, often one a client
# can provoke at will, e.g. a malformed body) says nothing about load either way: it finishes
# as `ignored`, so one client cannot drive the shared limit down for every class.
OVERLOAD_STATUSES = frozenset({502, 503, 504})

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_PM = processing_mode_pb2.ProcessingMode


def _mode(stream_response: bool, buffer_request: bool, time_upload: bool = False) -> processing_mode_pb2.ProcessingMode:
    """The mode of one request the processor lets through, sent as `mode_override` in its
    request-headers reply: request and response headers and response trailers, plus, for this
    request only, the response body streamed (a latency sample) and/or the request body buffered
    (engine priority). The shipped filter's static mode skips the response headers (with them
    on, Envoy 1.40 turns its own codec replies, 426/431/400, into a closed connection), so the
    override is what turns them on; its static response trailers SEND, which keep the stream
    open until the HTTP request ends, hold with or without the override. `time_upload` (a
    sampled request with a body): the request body streamed too, so that the sample's latency
    counts from the body's end, not from admission (`LatencyMeter.uploaded`); its chunks are
    answered at once (about two messages for a prompt of 20-200 KB)."""
    body = _PM.BUFFERED_PARTIAL if buffer_request else _PM.STREAMED if time_upload else _PM.NONE
    return _PM(request_header_mode=_PM.SEND, response_header_mode=_PM.SEND,
               request_body_mode=body,
               response_body_mode=_PM.STREAMED if stream_response else _PM.NONE,
               request_trailer_mode=_PM.SKIP, response_trailer_mode=_PM.SEND)


_MODES = {(s, b): _mode(s, b) for s in (False, True) for b in (False, True)}
_TIMED_UPLOAD = _mode(True, False, True)  # sampled, with a body to time (not one buffered for engine priority)
_REQUEST_BODY_PASS = pb.ProcessingResponse(request_body=pb.BodyResponse())


def rewrite_priority(body: bytes, priority: int, max_bytes: int, complete: bool,
                     encoded: bool = False) -> tuple[bytes | None, str]:
    """vLLM's `priority` written into a JSON request body (pure). Returns (the new body, "set"),
    or (None, why), each refused by the caller (`REFUSED_BODIES`): `partial` (Envoy sent only
    part of it: over its buffer) and `too_large` with 413, `encoded` (`content-encoding` other
    than identity) with 415, `not_json` and `not_object` with 400. Passed unchanged, any of them
    kept whatever `priority` its client wrote where a lenient upstream reads it — a padded body,
    a gzip body to a server that inflates it, a JSON body in another charset — ahead of P0; a
    listed class is one whose every body the gateway rewrites. Never raises."""
    if not complete:
        return None, "partial"
    if len(body) > max_bytes:
        return None, "too_large"
    if encoded:
        return None, "encoded"
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, "not_json"
    if not isinstance(doc, dict):
        return None, "not_object"
    doc["priority"] = priority
    try:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode(), "set"
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800" parses, UTF-8 cannot hold it)
        return json.dumps(doc, separators=(",", ":")).encode(), "set"


# What a listed class's body that cannot be rewritten is answered with (rewrite_priority).
REFUSED_BODIES: dict[str, tuple[int, str]] = {
    "partial": (413, "body_too_large"), "too_large": (413, "body_too_large"),
    "encoded": (415, "body_encoded"), "not_json": (400, "body_not_json"), "not_object": (400, "body_not_json"),
}


def header_map(headers: pb.HttpHeaders, wanted: frozenset[str] | None = None) -> dict[str, list[str]]:
    """Lower-cased name -> every value, in order (Envoy sends raw_value bytes in 1.40).
    With `wanted`, only those names are decoded (the hot path needs a handful). Bytes that are
    not UTF-8 (RFC 9110 allows obs-text) are kept apart as `\\xNN` escapes: replaced by U+FFFD,
    every tenant differing only in them was one tenant for its queue cap and fair order."""
    out: dict[str, list[str]] = {}
    for h in headers.headers.headers:
        key = h.key.lower()
        if wanted is not None and key not in wanted:
            continue
        value = h.raw_value.decode("utf-8", "backslashreplace") if h.raw_value else h.value
        out.setdefault(key, []).append(value)
    return out


def tenant_values(values: list[str] | None) -> list[str]:
    """The distinct tenants a request names, in order: each header value read as a
    comma-separated list (HTTP's combined form: Envoy joins an appended value with a comma,
    `header_value_option.append: true`, so an auth filter's tenant after the client's arrives as
    "vip,bob"), items stripped of surrounding whitespace, empty ones dropped (an empty header
    names no tenant; Envoy's HTTP/1 parser trims the whitespace that its HTTP/2 path keeps, so
    `bob` and `bob ` must be one tenant on both). At most two: a second one refuses the request
    (`conflicting_tenant`), and reading on was quadratic in the items of one header that any
    client sends (a review: ~14k items in 56 KB held the event loop for about a second)."""
    out: list[str] = []
    for value in values or ():
        for v in value.split(","):
            v = v.strip(" \t")
            if v and v not in out:
                out.append(v)
                if len(out) == 2:
                    return out
    return out


def is_retry(values: list[str] | None) -> bool:
    """Does the retry-count header (`admission.retry_count_header`) say the client sent this
    request before? Its first value, read as a whole number above 0; anything else (absent,
    empty, not a number, negative) says nothing: a malformed header changes no decision."""
    if not values:
        return False
    text = values[0].split(",", 1)[0].strip(" \t")
    return text.isascii() and text.isdigit() and text.lstrip("0") != ""  # (no int(): 5,000 digits raise)


def tenant_key(tenant: str) -> str:
    """The name a tenant is resolved and counted by: itself up to `TENANT_MAX_CHARS`, else its
    first 64 characters and a 128-bit digest of the whole. (Cut to the first 128 characters,
    tenants that shared them were one tenant, one queue share, and a long name matched a
    configured tenant by its prefix alone; configured names are at most 128 characters, so a
    digest form never matches one.)"""
    if len(tenant) <= TENANT_MAX_CHARS:
        return tenant
    digest = hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{tenant[:64]}#{digest}"


def request_age(value: object, now: float, limit: float) -> float:
    """Seconds since Envoy took the request in, by its `request.time` attribute (RFC 3339, as
    Envoy 1.40 sends it: "2026-12-07T13:07:13.515499+00:00") and this process's clock `now`
    (`time.time()`). 0 when it says nothing usable: absent, unreadable, in the future, or older
    than `limit` (Envoy's message timeout: no request still waiting for its reply is that old,
    so the clocks disagree). Never raises: an attribute changes no decision it cannot support."""
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        return 0.0
    try:
        at = datetime.fromisoformat(value).timestamp()
    except (ValueError, OverflowError, OSError):
        return 0.0
    age = now - at
    return age if 0 < age <= limit else 0.0


def status_of(headers: pb.HttpHeaders) -> int:
    for h in headers.headers.headers:
        if h.key == ":status":
            value = h.raw_value.decode("ascii", "replace") if h.raw_value else h.value
            return int(value) if value.isdigit() else 0
    return 0


def _attr(attrs: Any, name: str) -> Any:
    if attrs is None or name not in attrs.fields:
        return None
    v = attrs.fields[name]
    kind = v.WhichOneof("kind")
    return getattr(v, kind) if kind else None


@functools.lru_cache(maxsize=4096)
def _set(name: str, value: str) -> base_pb2.HeaderValueOption:
    """An overwrite of one header (cached: most values repeat; protobuf copies on use)."""
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE)


# Envoy refuses a header mutation that leaves more headers than its limit (500 to the client),
# and a request can reach the processor already at the limit (Envoy adds x-forwarded-proto,
# x-request-id, ... after the codec's check). So the informational headers are added only when
# they fit, nothing is removed that is not there, and a request that is at the limit gets no
# mutation at all unless one is required (then a clear 431, never a 500).
INFO_HEADERS = 2  # x-floodgate-priority, x-floodgate-queue-ms


@functools.lru_cache(maxsize=4096)
def _admit_reply(priority: int, queue_ms: str, endpoint: str, remove: tuple[str, ...],
                 sampled: bool, info: bool = True, buffer_body: bool = False,
                 time_upload: bool = False) -> pb.ProcessingResponse:
    """The request-headers reply of an admitted request (cached: replies are only serialized,
    never mutated, and most of them are alike). `remove`: headers present that must go."""
    set_headers = [_set(PRIORITY_OUT, str(priority)), _set(QUEUE_MS_OUT, queue_ms)] if info else []
    if endpoint:
        set_headers.append(_set(DESTINATION_HEADER, endpoint))
    common = pb.CommonResponse()
    if set_headers or remove:
        common.header_mutation.CopyFrom(pb.HeaderMutation(set_headers=set_headers, remove_headers=list(remove)))
    reply = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
    # Always: the response headers (status, endpoint outcome) come only through the override.
    reply.mode_override.CopyFrom(_TIMED_UPLOAD if time_upload and not buffer_body else _MODES[(sampled, buffer_body)])
    return reply


def admit_mutation(count: int, limit: int, endpoint: str, remove: tuple[str, ...],
                   dest_present: bool) -> tuple[bool, bool]:
    """(fits, info): whether the required mutation fits Envoy's header limit, and whether the
    informational headers fit too. A client's destination header is always overwritten or
    removed and an untrusted priority header always removed (`remove`), so a client can never
    choose its upstream host."""
    required = (1 if endpoint and not dest_present else 0) - len(remove)
    if not endpoint and not remove:
        fits = True  # no mutation needed at all
    else:
        fits = count + required <= limit
    return fits, count + required + INFO_HEADERS <= limit


@functools.lru_cache(maxsize=4096)
def _response_headers_reply(priority: int, queue_ms: str) -> pb.ProcessingResponse:
    """Tell the client its priority and queue wait on the response too."""
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[_set(PRIORITY_OUT, str(priority)),
                                                       _set(QUEUE_MS_OUT, queue_ms)]))))


_RESPONSE_HEADERS_PASS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_BODY_REPLY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_TRAILERS_REPLY = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


# Statuses that say the request itself cannot be served as it is (too many headers, a body the
# pool cannot rewrite): no Retry-After, which would have the client send it again at once.
CLIENT_ERRORS = frozenset({400, 413, 415, 431})


def reject_response(reject: Reject, priority: int) -> pb.ProcessingResponse:
    """429 (or 503 for no endpoints) with Retry-After and an OpenAI-style JSON error body; the
    client errors (`CLIENT_ERRORS`) without Retry-After."""
    if reject.status == 503:
        message, etype = "No model endpoints are available for this pool.", "service_unavailable"
    elif reject.status == 431:
        message, etype = "The request has too many headers for Floodgate to route it.", "invalid_request_error"
    elif reject.status == 413:
        message, etype = ("The request body is too large for this pool to set its engine priority "
                          "(engine_priority_max_body_bytes, or Envoy's buffer limit)."), "invalid_request_error"
    elif reject.status == 415:
        message, etype = ("This pool sets the engine priority in the request body, which needs an unencoded "
                          "body (no content-encoding)."), "invalid_request_error"
    elif reject.status == 400 and reject.reason == "conflicting_tenant":
        message, etype = ("The request names more than one tenant (the tenant header repeated with different "
                          "values)."), "invalid_request_error"
    elif reject.status == 400:
        message, etype = ("This pool sets the engine priority in the request body, which must be a JSON object "
                          "in UTF-8."), "invalid_request_error"
    else:
        message = (f"The model pool is at capacity for priority {priority} ({reject.reason}); "
                   f"retry after {reject.retry_after_s} s.")
        etype = "rate_limit_exceeded"
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": reject.reason}})
    # Retry-After only where coming back later helps: not on a request that will fail as it is.
    # `retry-after-ms` (policy.RetryAfter) gives clients that read it the jittered value itself.
    retry: tuple[base_pb2.HeaderValueOption, ...] = ()
    if reject.status not in CLIENT_ERRORS:
        retry = (_set("retry-after", str(int(reject.retry_after_s))),)
        ms = getattr(reject.retry_after_s, "ms", None)
        if ms is not None:
            retry += (base_pb2.HeaderValueOption(  # (not `_set`: these values rarely repeat)
                header=base_pb2.HeaderValue(key="retry-after-ms", raw_value=str(ms).encode()),
                append_action=_OVERWRITE),)
    headers = pb.HeaderMutation(set_headers=[
        *retry,
        _set("content-type", "application/json"),
        _set(REASON_OUT, reject.reason),
        _set(PRIORITY_OUT, str(priority)),
    ])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=reject.status),
        headers=headers, body=body.encode(), details=f"floodgate_{reject.reason}"))


@dataclass
class _Exchange:
    """What one admitted request has shown us so far."""

    permit: Permit
    status: int | None = None
    meter: LatencyMeter | None = None  # sampled: what its body chunks measured
    finished: bool = False
    # no replica answered it: the endpoint refused or dropped the connection, or Envoy replied
    # itself (no healthy upstream, a circuit breaker): its 5xx says nothing of load (ejection.py)
    endpoint_failed: bool = False


class Processor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, cfg: Config, admitter: Admitter) -> None:
        self.cfg = cfg
        self.admitter = admitter
        self.resolver = PriorityResolver(cfg.admission)
        self._by_authority = {p.match_authority.lower(): p.name for p in cfg.pools if p.match_authority}
        self._default_pool = cfg.pools[0].name
        self.streams = 0  # ext_proc streams open now
        self.last_stream_at = -math.inf  # time.monotonic() when the last one opened
        self.opened = 0  # ext_proc streams opened since start
        self.recycle_at: int | None = None  # set when opened reaches it (server.max_requests)
        self.recycle_due = asyncio.Event()
        self._unadmitted = {p.name: frozenset(p.unadmitted_paths) for p in cfg.pools}
        self._unadmitted_methods = {p.name: frozenset(p.unadmitted_methods) for p in cfg.pools}
        self._engine_priority = {p.name: dict(p.engine_priority) for p in cfg.pools}
        self._retry_header = cfg.admission.retry_count_header.lower()  # "" = off
        self._wanted = frozenset({":authority", ":path", ":method", "upgrade", DESTINATION_HEADER,
                                  cfg.admission.priority_header.lower(), cfg.admission.tenant_header.lower(),
                                  "content-length", "content-encoding", *METHOD_OVERRIDE_HEADERS}
                                 | ({self._retry_header} if self._retry_header else set()))
        # Pools whose grants count each request's own prompt size (prefill-aware picking on and
        # the size read): its content-length as prompt tokens (prefill.prompt_tokens).
        self._sized = {p.name: functools.partial(prompt_tokens, bytes_per_token=p.prefill_bytes_per_token,
                                                 default=p.prefill_request_tokens,
                                                 max_tokens=p.prefill_max_request_tokens)
                       for p in cfg.pools
                       if p.endpoint_picking and p.prefill_tokens_per_s > 0 and p.prefill_bytes_per_token > 0}

    def _unadmitted_reason(self, pool: str, path: str, headers: dict[str, list[str]],
                           end_of_stream: bool) -> str | None:
        """Why this request takes no permit ("path", "method"), or None: it is admitted. A
        method of `unadmitted_methods` passes only without a body (`end_of_stream` on its
        headers), a protocol upgrade or a method-override header: each of those could still run
        the model (vLLM's /v1/realtime is a WebSocket opened with GET)."""
        if path in self._unadmitted[pool]:
            return "path"
        method = (headers.get(":method") or [""])[0].upper()
        if (method in self._unadmitted_methods[pool] and end_of_stream and "upgrade" not in headers
                and METHOD_OVERRIDE_HEADERS.isdisjoint(headers)):
            return "method"
        return None

    def _route_only(self, pool: str, count: int, dest_present: bool,
                    remove: tuple[str, ...] = ()) -> tuple[pb.ProcessingResponse, str, Reject | None]:
        """No permit: with endpoint picking, send it to any active endpoint (returned beside the
        reply; '' when none); never let the client's own destination header through. `count`:
        the request's headers, `dest_present`: a client sent the destination header (Envoy
        answers 500 to a mutation past its header limit, so such a request gets 431, as an
        admitted one does); `remove`: headers present that must go (an untrusted priority)."""
        mutation = pb.HeaderMutation(remove_headers=[DESTINATION_HEADER, *remove])
        endpoint = ""
        if self.cfg.pool(pool).endpoint_picking:
            picked = self.admitter.any_active_endpoint(pool)
            refused = None
            if picked is None:  # Retry-After as for an admitted request (retry_after_min_s, jittered)
                refused = self.admitter.no_endpoints(self.admitter.pools[pool], self.cfg.admission.default_priority)
            elif not admit_mutation(count, self.cfg.server.max_headers, picked, (), dest_present)[0]:
                refused = Reject("header_limit", 0, status=431)
            if refused is not None:
                return reject_response(refused, self.cfg.admission.default_priority), "", refused
            assert picked is not None
            endpoint = picked
            mutation = pb.HeaderMutation(set_headers=[_set(DESTINATION_HEADER, endpoint)], remove_headers=list(remove))
        reply = pb.ProcessingResponse(request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation)))
        if endpoint:  # its response headers tell whether the endpoint answered (ejection.py)
            reply.mode_override.CopyFrom(_MODES[(False, False)])
        return reply, endpoint, None

    def _count_refusal(self, pool: str, priority: int, reason: str, headers_in: float) -> None:
        """Count a refusal the server makes itself, before any admission (the admitter counts its
        own): in the decisions and their time, not as turned-away demand (no model work asked)."""
        m, child, label = self.admitter.metrics, self.admitter.child, PRIORITY_LABELS[priority]
        child(m.decisions, (pool, label, "rejected", reason)).inc()
        # Envoy counts it among the processor's immediate responses: the controller subtracts
        # these so that malformed requests read as no demand (schema.NOT_DEMAND).
        self.admitter.count_not_demand(pool, priority, "refused")
        child(m.decision_time, (pool, label, "rejected", reason)).observe(time.perf_counter() - headers_in)

    def _endpoint_outcome(self, pool: str, endpoint: str, msg: pb.ProcessingRequest) -> tuple[EndpointOutcome, bool]:
        """What the response headers say of the request's endpoint (Envoy's
        `response.code_details` attribute: extproc/ejection.py); with a picked `endpoint` the
        admitter is told (ejection). Returns the outcome, and whether a 5xx of it may count as
        overload (`ejection.load_signal`: not Envoy's own reply that never reached a replica)."""
        attrs = msg.attributes[ATTR_NS] if ATTR_NS in msg.attributes else None
        details = _attr(attrs, "response.code_details")
        outcome = endpoint_outcome(details, status_of(msg.response_headers))
        if endpoint:
            self.admitter.endpoint_outcome(pool, endpoint, outcome)
        return outcome, load_signal(details)  # (a failed connection is no answer: never a load signal)

    def _pool_for(self, headers: dict[str, list[str]]) -> str:
        """The pool whose `match_authority` the request's :authority equals (case-insensitive),
        with or without a numeric port; else the first pool."""
        authority = (headers.get(":authority") or [""])[0].lower()
        pool = self._by_authority.get(authority)
        if pool is None:
            host, sep, port = authority.rpartition(":")
            if sep and port.isdigit() and not authority.endswith("]"):  # ("[::1]" has no port)
                pool = self._by_authority.get(host)
        return pool or self._default_pool

    def _caller(self, req: pb.ProcessingRequest, headers: dict[str, list[str]],
                tenants: list[str] | None = None) -> Caller:
        attrs = req.attributes[ATTR_NS] if ATTR_NS in req.attributes else None
        san = _attr(attrs, "connection.uri_san_peer_certificate")
        if tenants is None:
            tenants = tenant_values(headers.get(self.cfg.admission.tenant_header.lower()))
        return Caller(
            source_ip=source_ip_of(_attr(attrs, "source.address")),
            mtls=bool(_attr(attrs, "connection.mtls")),
            peer_uri_sans=(str(san),) if san else (),
            tenant=tenant_key(tenants[0]) if tenants else None,
            priority_values=tuple(headers.get(self.cfg.admission.priority_header.lower(), ())),
        )

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[pb.ProcessingResponse]:
        # Open streams and when the last one opened: a graceful stop waits for both (extproc/drain.py).
        self.streams += 1
        self.opened += 1
        if self.opened == self.recycle_at:
            self.recycle_due.set()
        self.last_stream_at = time.monotonic()
        try:
            async for reply in self._process(request_iterator):
                yield reply
        finally:
            self.streams -= 1

    async def _process(self, request_iterator: AsyncIterator[pb.ProcessingRequest]
                       ) -> AsyncIterator[pb.ProcessingResponse]:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        headers_in = time.perf_counter()
        if first.WhichOneof("request") != "request_headers":
            # Not how the shipped config talks to us; answer without interfering.
            yield _passthrough(first)
            async for msg in it:
                yield _passthrough(msg)
            return
        headers = header_map(first.request_headers, self._wanted)
        pool = self._pool_for(headers)
        path = (headers.get(":path") or ["/"])[0].split("?", 1)[0]
        unadmitted = self._unadmitted_reason(pool, path, headers, first.request_headers.end_of_stream)
        if unadmitted is not None:
            m, child = self.admitter.metrics, self.admitter.child
            # An untrusted caller's priority header goes here too, as on an admitted request.
            prio_header = self.cfg.admission.priority_header.lower()
            strip = (prio_header,) if prio_header in headers and not self.resolver.trusted(
                self._caller(first, headers)) else ()
            if strip:
                child(m.untrusted_priority, (pool,)).inc()
            reply, routed, refused = self._route_only(pool, len(first.request_headers.headers.headers),
                                                      DESTINATION_HEADER in headers, strip)
            if refused is None:
                child(m.unadmitted, (pool, unadmitted)).inc()
                self.admitter.count_not_demand(pool, self.cfg.admission.default_priority, "unadmitted")
            else:  # passed no further (no endpoint, or no room for its header): a refusal like any other
                self._count_refusal(pool, self.cfg.admission.default_priority, refused.reason, headers_in)
            yield reply
            async for msg in it:
                if routed and msg.WhichOneof("request") == "response_headers":
                    self._endpoint_outcome(pool, routed, msg)
                yield _passthrough(msg)
            return
        tenants = tenant_values(headers.get(self.cfg.admission.tenant_header.lower()))
        caller = self._caller(first, headers, tenants)
        m, child = self.admitter.metrics, self.admitter.child
        if len(tenants) > 1:
            # Which one is the caller's own? An auth filter that appends its tenant (Envoy's
            # default append action) leaves the client's first: reading the first, any client
            # took another tenant's priority (tenant_priorities) and queue share. Refused.
            decision = self.resolver.resolve(dataclasses.replace(caller, tenant=None))
            reject = Reject("conflicting_tenant", 0, status=400)
            self._count_refusal(pool, decision.priority, reject.reason, headers_in)
            yield reject_response(reject, decision.priority)
            return
        decision = self.resolver.resolve(caller)
        if decision.invalid_header:
            child(m.invalid_priority, (pool,)).inc()
        if decision.untrusted_header:
            child(m.untrusted_priority, (pool,)).inc()
        strip_priority = decision.source != "header"
        prio_header = self.cfg.admission.priority_header.lower()
        engine_prio = self._engine_priority[pool].get(decision.priority)
        buffer_body = engine_prio is not None and not first.request_headers.end_of_stream
        remove = ((prio_header,) if strip_priority and prio_header in headers else ()) + \
            (("content-length",) if buffer_body and "content-length" in headers else ())
        # (content-length: a rewritten body has another length, and Envoy refuses a body
        # mutation that does not match the request's content-length (500); without it Envoy
        # sends the body upstream chunked, rewritten or not.)
        n_headers = len(first.request_headers.headers.headers)
        dest_present = DESTINATION_HEADER in headers
        # Would the admission headers pass Envoy's limit? Asked before admission, with the
        # destination header a picking pool may add: refused then, the request took no permit and
        # is no admission (counted admitted and then answered 431, any client could swell the
        # admitted count with requests it had refused: a review). Whatever admission returns,
        # its mutation is no larger than this one.
        if not admit_mutation(n_headers, self.cfg.server.max_headers,
                              "-" if self.cfg.pool(pool).endpoint_picking else "", remove, dest_present)[0]:
            self._count_refusal(pool, decision.priority, "header_limit", headers_in)
            yield reject_response(Reject("header_limit", 0, status=431), decision.priority)
            return
        sized = self._sized.get(pool)
        tokens = sized(headers.get("content-length"), headers.get("content-encoding")) if sized else None
        retry = bool(self._retry_header) and is_retry(headers.get(self._retry_header))
        # (a stream Envoy retried here from a processor that died comes with the time it first
        # took the request in: its wait here ends before Envoy's message timeout, admission.queue_timeout)
        attrs = first.attributes[ATTR_NS] if ATTR_NS in first.attributes else None
        age = request_age(_attr(attrs, "request.time"), time.time(), self.cfg.server.envoy_message_timeout_s)
        result = await self.admitter.admit(pool, decision.priority, caller.tenant or "", tokens, retry=retry,
                                           caller=caller.identity, age_s=age)
        if isinstance(result, Reject):
            reply = reject_response(result, decision.priority)
            child(m.decision_time, (pool, PRIORITY_LABELS[decision.priority], "rejected", result.reason)).observe(
                time.perf_counter() - headers_in)
            yield reply
            return
        sampled = self.admitter.sample(pool)
        ex = _Exchange(result, meter=LatencyMeter(result.admitted_at) if sampled else None)
        reason = "cancelled"
        try:
            queue_ms = str(int(result.queue_s * 1000))
            if dest_present and not result.endpoint:
                remove += (DESTINATION_HEADER,)
            _, info = admit_mutation(n_headers, self.cfg.server.max_headers, result.endpoint, remove, dest_present)
            if engine_prio is not None and not buffer_body:
                child(m.engine_priority, (pool, PRIORITY_LABELS[decision.priority], "no_body")).inc()
            # (a sampled request's body end is where its latency starts: LatencyMeter.uploaded)
            time_upload = sampled and not first.request_headers.end_of_stream
            reply = _admit_reply(decision.priority, queue_ms, result.endpoint, remove, sampled, info, buffer_body,
                                 time_upload)
            child(m.decision_time, (pool, PRIORITY_LABELS[decision.priority], "admitted",
                                    "queued" if result.queued else "immediate")).observe(time.perf_counter() - headers_in)
            yield reply
            async for msg in it:
                kind = msg.WhichOneof("request")
                if kind == "response_headers":
                    ex.status = status_of(msg.response_headers)
                    # Picked or not: a connection that failed, or Envoy's own reply that never
                    # reached a replica, is no overload drop (without picking, a restarting model
                    # server's refused connections, or `no_healthy_upstream`, lowered the limit).
                    ex.endpoint_failed = not self._endpoint_outcome(pool, result.endpoint, msg)[1]
                    if len(msg.response_headers.headers.headers) + INFO_HEADERS <= self.cfg.server.max_headers:
                        yield _response_headers_reply(decision.priority, queue_ms)
                    else:
                        yield _RESPONSE_HEADERS_PASS
                    if msg.response_headers.end_of_stream:
                        ex.finished = True
                elif kind == "response_body":
                    child(m.body_chunks, (pool,)).inc()
                    self._on_body(ex, msg.response_body)
                    yield _BODY_REPLY
                elif kind == "request_body":
                    if msg.request_body.end_of_stream and ex.meter is not None:
                        ex.meter.uploaded(self.admitter.clock())
                    if engine_prio is not None:
                        yield self._priority_body(pool, decision.priority, engine_prio, msg.request_body,
                                                  body_encoded(headers.get("content-encoding")))
                    else:
                        yield _REQUEST_BODY_PASS
                elif kind == "response_trailers":
                    ex.finished = True
                    yield _TRAILERS_REPLY
                else:
                    yield _passthrough(msg)
            # Envoy ends the stream when the HTTP request ends, for whatever reason: completion
            # and a client disconnect both arrive as a plain end of stream (EOF), so one label.
            reason = "stream_end"
        except BaseException:
            reason = "cancelled"
            raise
        finally:
            reason = release_reason(reason, status=ex.status, finished=ex.finished)
            result.unprefilled = unprefilled(ex.status)  # (its prompt leaves the prefill estimate: backends)
            if sampled:
                self.admitter.sampled_done(pool)
            self._finish(pool, ex, reason)
            self.admitter.release_soon(result, reason)

    def _priority_body(self, pool: str, cls: int, engine_prio: int, body: pb.HttpBody,
                       encoded: bool) -> pb.ProcessingResponse:
        """The request body with vLLM's `priority` written in (BUFFERED_PARTIAL: the whole body in one
        message, or its first part with end_of_stream false when it is larger than Envoy's buffer,
        which then passes unchanged; BUFFERED would answer 413 instead)."""
        new, outcome = rewrite_priority(body.body, engine_prio, self.cfg.pool(pool).engine_priority_max_body_bytes,
                                        body.end_of_stream, encoded)
        m = self.admitter.metrics
        self.admitter.child(m.engine_priority, (pool, PRIORITY_LABELS[cls], outcome)).inc()
        if new is None:
            status, reason = REFUSED_BODIES[outcome]
            self.admitter.count_not_demand(pool, cls, "refused")
            return reject_response(Reject(reason, 0, status=status), cls)
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(body=new))))

    def _on_body(self, ex: _Exchange, body: pb.HttpBody) -> None:
        """Count a streamed body chunk (LatencyMeter). The whole body comes through here, not
        just the tokens the signal needs: Envoy 1.40 ignores a `mode_override` in the reply to a
        body chunk (only the request- and response-headers replies may change the mode; checked
        with the body switched off in the reply to the 32nd chunk: 101 of each 102 chunks still
        came), and ending the stream early would end it before the request, where the permit is
        released. `limit.max_sampled` bounds how many stream at once."""
        if ex.meter is not None and body.body:
            ex.meter.chunk(self.admitter.clock(), body.body)
        if body.end_of_stream:
            ex.finished = True

    def _finish(self, pool: str, ex: _Exchange, reason: str) -> None:
        """Every admitted request finishes its permit once: an overload 5xx (`OVERLOAD_STATUSES`)
        is a drop, a completed one a success (with its latency when its body was streamed), a
        cancelled one or another 5xx says nothing.
        Which latency signal the limit uses is the limit's business (`limit.signal`)."""
        outcome = permit_outcome(ex.status, reason, sampled=ex.meter is not None, finished=ex.finished,
                                 endpoint_failed=ex.endpoint_failed)
        self.admitter.child(self.admitter.metrics.outcomes, (pool, outcome)).inc()
        latency = ex.meter.latency() if ex.meter is not None and outcome == "success" else None
        if latency is None:
            ex.permit.finish(outcome)
            return
        label = PRIORITY_LABELS[ex.permit.priority]
        m = self.admitter.metrics
        if latency.ttft is not None:
            m.ttft.labels(pool, label).observe(latency.ttft)
        if latency.tpot is not None:
            m.tpot.labels(pool, label).observe(latency.tpot)
        ex.permit.finish("success", latency)


def permit_outcome(status: int | None, reason: str, *, sampled: bool, finished: bool, endpoint_failed: bool) -> str:
    """How an admitted request's permit is finished (pure): "dropped" for an overload 5xx
    (`OVERLOAD_STATUSES`) from a replica that answered, "success" for a request that ended with
    its response, "ignored" for what says nothing about the replicas' load: another 5xx, a dead
    replica (ejection handles it), a request cancelled before its response ended, and a sampled
    response whose body never ended.

    `finished` (the body's end or the trailers came through here) decides before how the
    ext_proc stream closed: Envoy ends a completed request's stream with EOF or, racing its
    own teardown, CANCELLED (1 in 6 sampled requests in a test here), and reading the second
    as "cancelled" threw away a completed request and its latency sample. A sampled stream
    that closed without its body's end was cut mid-body (a replica killed while streaming, a
    client gone): counted as a success, it diluted the window's drop share. An unsampled
    response's body does not pass through here, so a plain end of its stream stays a success."""
    if status is not None and status >= 500:
        return "dropped" if status in OVERLOAD_STATUSES and not endpoint_failed else "ignored"
    if status is None:
        return "ignored"
    if finished:
        return "success"
    if reason != "stream_end" or sampled:
        return "ignored"
    return "success"


def release_reason(ended: str, *, status: int | None, finished: bool) -> str:
    """The `floodgate_releases_total` reason of an admitted request's release (pure):
    "upstream_error" for a 5xx response; "stream_end" for a stream that ended with EOF, and for
    one whose response finished here (its trailers or its end came through) however the stream
    then closed, since Envoy's teardown races its half-close with a reset and a completed
    request arrives as CANCELLED now and then (see `permit_outcome`); else how it ended
    ("cancelled": the client left or Envoy reset the stream before the response ended)."""
    if status is not None and status >= 500:
        return "upstream_error"
    if finished and ended == "cancelled":
        return "stream_end"
    return ended


def _passthrough(msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
    kind = msg.WhichOneof("request")
    if kind in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
    if kind in ("request_body", "response_body"):
        return pb.ProcessingResponse(**{kind: pb.BodyResponse()})
    if kind in ("request_trailers", "response_trailers"):
        return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
    return pb.ProcessingResponse()
