"""Prometheus metrics of the processor (`floodgate_` prefix, labelled by pool and priority)."""

from __future__ import annotations

from typing import Any, get_args

from floodgate.extproc.limit import Outcome
from floodgate.extproc.schema import TURNED_AWAY
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Fine below 25 ms (a rejection's decision time is judged against a 10 ms target) and around
# the shipped queue timeouts (a timed-out waiter's 429 comes just after its timeout).
_DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5,
                     0.75, 1, 1.1, 1.25, 1.5, 2, 2.5, 5, 10, 20, 30, 60)
# How long the event loop (or a GC pass) holds back a message that arrives: fine from 0.1 ms,
# since a reply's whole budget is a few milliseconds.
_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1,
                  0.25, 1)
_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1)


# The closed label sets whose counters are created at 0 (`Metrics.prepare`): the Redis calls the
# admitter names (`Admitter.call`), the rejection reasons, how a permit is released.
REDIS_OPS = ("acquire", "admit", "arrivals", "arriving", "cancel", "ceiling", "configure", "credit_done", "demand",
             "eject", "ejections", "enqueue", "gateways", "get_limit", "leave", "mine", "refund", "registry",
             "release", "repair", "return_credits", "set_limit", "status", "sync", "uneject")
# (every turned-away outcome but `abandoned`, which is no rejection, and the server's refusals)
REJECT_REASONS = (*(r for r in TURNED_AWAY if r != "abandoned"), "header_limit", "conflicting_tenant")
RELEASE_REASONS = ("stream_end", "cancelled", "upstream_error", "abandoned_grant", "no_endpoints")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "floodgate_decisions", "Admission decisions by outcome (admitted|rejected|abandoned) and reason "
            "(abandoned/client_gone: the client left while queued, so admitted + rejected + abandoned = requests decided).",
            ["pool", "priority", "outcome", "reason"], registry=r)
        self.decision_time = Histogram(
            "floodgate_decision_seconds",
            "Time from a request's headers arriving at the processor to its reply leaving it (admit "
            "after any queue wait, or the immediate 429/503), by outcome and reason.",
            ["pool", "priority", "outcome", "reason"], buckets=_DECISION_BUCKETS, registry=r)
        self.unadmitted = Counter(
            "floodgate_unadmitted",
            "Requests passed without a permit (no admission decision): reason `path` (pools[].unadmitted_paths) "
            "or `method` (pools[].unadmitted_methods: a body-less GET, HEAD, OPTIONS, ...).",
            ["pool", "reason"], registry=r)
        self.local_rejections = Counter(
            "floodgate_local_rejections",
            "Early drops decided from the last seen pool state, without a Redis round trip (also "
            "counted in floodgate_decisions_total).", ["pool", "priority"], registry=r)
        self.budget_waits = Counter(
            "floodgate_budget_waits",
            "Requests of a class with a time-to-429 target (slo_reject_s) that waited on its slow-rejection "
            "budget: let in at the budget's chance where the class's own would have turned them away, by how "
            "the wait ended (served, timed_out: a slow 429; gone: the client left or Redis failed).",
            ["pool", "priority", "outcome"], registry=r)
        self.queue_depth = Gauge(
            "floodgate_queue_depth", "Requests waiting in the cluster-wide queue (last seen by this process).",
            ["pool", "priority"], registry=r)
        self.inflight = Gauge(
            "floodgate_inflight", "Cluster-wide requests holding a permit (last seen by this process; the "
            "local credits processors hold idle, P1 leases no request uses, are left out).",
            ["pool", "priority"], registry=r)
        self.local_inflight = Gauge(
            "floodgate_process_inflight", "Permits held by requests passing through this process.",
            ["pool"], registry=r)
        self.limit = Gauge("floodgate_limit", "Current concurrency limit of the pool; while the pool is degraded "
                           "(floodgate_pool_degraded 1) this processor's local share of it.", ["pool"], registry=r)
        self.queue_wait = Histogram(
            "floodgate_queue_wait_seconds", "Time admitted requests waited in the queue.",
            ["pool", "priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "floodgate_ttft_seconds", "Time to first response byte after admission and the request body's "
            "end (sampled requests: limit.sample_rate with an adaptive limit; a static limit samples none).",
            ["pool", "priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "floodgate_tpot_seconds", "Time per output token after the first (sampled requests: "
            "limit.sample_rate with an adaptive limit; a static limit samples none).",
            ["pool", "priority"], buckets=_TOKEN_BUCKETS, registry=r)
        self.body_chunks = Counter(
            "floodgate_sampled_body_chunks", "Response body chunks of sampled requests that reached the processor "
            "(one ext_proc message each; streaming stops once the latency is measured).",
            ["pool"], registry=r)
        self.ejections = Counter(
            "floodgate_endpoint_ejections", "Endpoints this processor ejected from the pool's picks after connection "
            "failures or 5xx answers in a row (pool.eject_after_failures, pool.eject_after_5xx).", ["pool"], registry=r)
        self.grants_confirmed = Counter(
            "floodgate_grants_confirmed", "Grants read after this process may have lapsed in Redis (a stall past "
            "a third of the lease TTL), checked with Redis before starting the request: held (started) or "
            "taken_back (Redis had given the permit away; the request waits on).", ["pool", "outcome"], registry=r)
        self.outcomes = Counter(
            "floodgate_permit_outcomes", "Admitted requests by what their ending told the pool's limit: success, "
            "dropped (an overload 502/503/504), ignored (cancelled, another 5xx, a dead endpoint, a sampled "
            "stream cut before its end).", ["pool", "outcome"], registry=r)
        self.releases = Counter(
            "floodgate_releases", "Permits released, by how the request ended (stream_end; cancelled: the stream "
            "was reset; a client that leaves an unsampled response usually ends it as stream_end, "
            "indistinguishable from a completion: Envoy's downstream_rq_rx_reset counts client cancels; "
            "upstream_error: a 5xx), or given back undecided: abandoned_grant (its waiter was gone), no_endpoints "
            "(granted for an endpoint the processor would not send to; the request answered 503). So releases = "
            "admitted + abandoned_grant + no_endpoints.",
            ["pool", "reason"], registry=r)
        self.invalid_priority = Counter(
            "floodgate_invalid_priority_header", "Requests whose priority header was unparseable or conflicting.",
            ["pool"], registry=r)
        self.engine_priority = Counter(
            "floodgate_engine_priority", "Admitted requests of a class with engine_priority, by what happened to "
            "the body: set (priority written); no_body (nothing to write it into, passed); or refused, since a "
            "body passed unchanged would run at the engine's default priority: too_large (over "
            "engine_priority_max_body_bytes) and partial (over Envoy's buffer) 413, encoded (content-encoding) "
            "415, not_json and not_object 400.",
            ["pool", "priority", "outcome"], registry=r)
        self.unregistered_grants = Counter(
            "floodgate_unregistered_grants", "Grants that named an endpoint the controller has not registered "
            "(not in the pool's replica registry): refused, the request answered 503 no_endpoints. A forged grant "
            "message or a tampered script from someone with the processors' Redis credentials; never in normal "
            "operation.", ["pool"], registry=r)
        self.untrusted_priority = Counter(
            "floodgate_untrusted_priority_header", "Priority headers ignored because the caller is not trusted.",
            ["pool"], registry=r)
        self.degraded = Gauge(
            "floodgate_degraded", "1 while some pool's Redis is unreachable and that pool admits on the local "
            "limiter (floodgate_pool_degraded says which).", registry=r)
        self.pool_degraded = Gauge(
            "floodgate_pool_degraded", "1 while the pool's Redis (on a Cluster: the shard of its slot) is "
            "unreachable and the pool admits on this processor's local share.", ["pool"], registry=r)
        self.grants_held = Gauge(
            "floodgate_grants_held", "1 while Redis grants no permit of the pool after losing acknowledged "
            "writes (a failover), until every processor has re-asserted there (read at each 1 s status tick: "
            "a shorter hold may not show; floodgate_resync_requests_total and floodgate_state_rollbacks_total "
            "count them).", ["pool"], registry=r)
        self.resync_requests = Counter(
            "floodgate_resync_requests", "Times Redis asked this processor to re-assert its permits at once: "
            "another processor found that Redis had lost acknowledged writes (a failover), and the pool's "
            "grants are held until every processor has.", ["pool"], registry=r)
        self.degraded_transitions = Counter(
            "floodgate_degraded_transitions", "Entries of a pool into degraded mode.", ["pool"], registry=r)
        self.redis_errors = Counter("floodgate_redis_errors", "Failed or timed-out Redis calls.", ["op"], registry=r)
        self.redis_error_replies = Counter(
            "floodgate_redis_error_replies",
            "Of floodgate_redis_errors, the calls Redis answered with an error reply (a script error "
            "on data it cannot read, an ACL refusal): not an outage; the pool degrades as for one.",
            ["op"], registry=r)
        self.loop_restarts = Counter(
            "floodgate_background_loop_restarts", "Background loops (sync, poll, pub/sub) restarted after an "
            "unexpected error (logged with its traceback).", ["loop"], registry=r)
        self.lost_leases = Counter(
            "floodgate_lost_leases", "Leases Redis had lost while a live request held them (process paused "
            "past the TTL, Redis restarted); the next sync leased them again.", ["pool"], registry=r)
        self.waiters_dropped = Counter(
            "floodgate_waiters_dropped",
            "Waiters of this processor that Redis had dropped (no subscriber on its grant channel when "
            "their turn came: its pub/sub connection was down; or lost in a failover), found by the "
            "poll and re-queued at once by a sync.", ["pool"], registry=r)
        self.state_rollbacks = Counter(
            "floodgate_state_rollbacks",
            "Times Redis answered without writes of this processor it had already acknowledged (a "
            "failover to a replica that had not received them, a restart): it re-asserted its "
            "permits and waiters at once.", ["pool"], registry=r)
        self.reconciled = Counter(
            "floodgate_reconciled",
            "Corrections a sync made in Redis: reasserted (permits live requests hold that Redis had "
            "lost), requeued (waiters it had lost), dropped (entries this process no longer holds), "
            "recounted (shared counts that disagreed with the permits and waiters they count: a key "
            "deleted, evicted or written by something else), repaired_keys (pool keys of the wrong "
            "type, deleted: every call failed with WRONGTYPE).",
            ["pool", "kind"], registry=r)
        self.gateway_id_conflicts = Counter(
            "floodgate_gateway_id_conflicts",
            "Renewals that found this processor's gateway id claimed by another live process: the two "
            "drop each other's permits at every renewal (logged as an error; give each its own "
            "server.gateway_id).", ["pool"], registry=r)
        self.settings_mismatch = Gauge(
            "floodgate_settings_mismatch",
            "1 when this processor's pool settings differ from the ones stored in Redis (which every grant uses).",
            ["pool"], registry=r)
        self.limit_updates = Counter(
            "floodgate_limit_updates", "Vegas window samples applied to the shared limit.", ["pool"], registry=r)
        self.loop_lag = Histogram(
            "floodgate_event_loop_lag_seconds",
            "How much later than asked a periodic timer ran on the processor's event loop (every 50 ms): "
            "the wait a message arriving at a random moment has before the loop can handle it.",
            buckets=_PAUSE_BUCKETS, registry=r)
        self.gc_pause = Histogram(
            "floodgate_gc_pause_seconds",
            "Duration of each Python garbage collection in the processor (the event loop stops meanwhile), "
            "by generation.", ["generation"], buckets=_PAUSE_BUCKETS, registry=r)
        for op in REDIS_OPS:
            self.redis_errors.labels(op)
            self.redis_error_replies.labels(op)

    def prepare(self, pool: str) -> None:
        """Create the pool's label sets of the counters at 0, so that the first event of a kind
        is an increase: Prometheus's rate() and increase() need two samples of a series, and a
        series first seen at 1 adds nothing (a processor's first degraded spell, first lost
        lease or first queue_full never showed on the dashboard)."""
        for prio in ("0", "1", "2"):
            self.decisions.labels(pool, prio, "admitted", "immediate")
            self.decisions.labels(pool, prio, "admitted", "queued")
            self.decisions.labels(pool, prio, "abandoned", "client_gone")
            for reason in REJECT_REASONS:
                self.decisions.labels(pool, prio, "rejected", reason)
            self.local_rejections.labels(pool, prio)
        for reason in RELEASE_REASONS:
            self.releases.labels(pool, reason)
        for outcome in get_args(Outcome):
            self.outcomes.labels(pool, outcome)
        for kind in ("reasserted", "requeued", "dropped", "recounted", "repaired_keys"):
            self.reconciled.labels(pool, kind)
        for outcome in ("held", "taken_back"):
            self.grants_confirmed.labels(pool, outcome)
        for reason in ("path", "method"):
            self.unadmitted.labels(pool, reason)
        self.grants_held.labels(pool)
        # Every pool's own background loops (admission.Admitter.start runs them, after Redis
        # answered its start-up calls: a scrape before that, in a loaded CI run, found no series).
        for loop in ("sync", "poll"):
            self.loop_restarts.labels(f"fg-{loop}-{pool}")
        for prio in ("0", "1", "2"):
            for outcome in ("served", "timed_out", "gone"):
                self.budget_waits.labels(pool, prio, outcome)
        for c in (self.degraded_transitions, self.lost_leases, self.waiters_dropped, self.state_rollbacks,
                  self.resync_requests, self.gateway_id_conflicts, self.unregistered_grants, self.ejections,
                  self.invalid_priority, self.untrusted_priority, self.limit_updates):
            c.labels(pool)


# The metrics listener: prometheus_client's WSGI server (a thread per connection, none on the
# event loop) with a read timeout and a bound on connections. Its own had neither: a review's 500
# connections that sent nothing kept 500 threads for good.
METRICS_READ_TIMEOUT_S = 10.0
METRICS_MAX_CONNECTIONS = 32


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> Any:
    """Serve `registry` on host:port from daemon threads: a connection not done within
    METRICS_READ_TIMEOUT_S is closed (however it trickles), and at METRICS_MAX_CONNECTIONS at once
    a new one takes the place of the oldest that has not sent a whole request yet (closed); with
    none such (all serving a request), it is closed unanswered (a scraper retries; Prometheus
    scrapes one at a time). Returns the server (`shutdown()` stops it). OSError when it cannot
    listen."""
    import contextlib
    import socket
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family

    slots = threading.BoundedSemaphore(METRICS_MAX_CONNECTIONS)
    # Connections holding a slot that have not sent a whole request yet, oldest first: at the
    # bound a new connection takes the oldest one's place. Closing new ones alone let the bound's
    # worth of connections that sent nothing (opened again as each was cut at its deadline) keep
    # every scrape out (a review: with KEDA, the pool's scaling too). A scraper sends its request
    # at once, so it is not the oldest for long. Shut down under the lock only (never closed
    # here): a connection leaves the list under it before its own thread closes it.
    unsent: dict[Any, None] = {}
    unsent_lock = threading.Lock()

    def sent(conn: Any) -> None:
        with unsent_lock:
            unsent.pop(conn, None)

    def evict_oldest_unsent() -> bool:
        with unsent_lock:
            if not unsent:
                return False
            conn = next(iter(unsent))
            del unsent[conn]
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # its read ends: its thread gives the slot back
            return True

    class Handler(WSGIRequestHandler):
        timeout = METRICS_READ_TIMEOUT_S  # socket timeout on every read and write (StreamRequestHandler)

        def parse_request(self) -> bool:
            ok = bool(super().parse_request())  # (reads the headers: a trickle of them can still be cut)
            sent(self.connection)  # a whole request is in: its place is not given up any more
            return ok

        def setup(self) -> None:
            super().setup()
            # A deadline on the whole exchange, not only on each read: one byte every 5 s kept a
            # connection (and its slot) for good under the per-read timeout (a review).
            self._deadline = threading.Timer(METRICS_READ_TIMEOUT_S, self._cut)
            self._deadline.daemon = True
            self._deadline.start()

        def _cut(self) -> None:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def finish(self) -> None:
            sent(self.connection)  # (before the socket is closed)
            self._deadline.cancel()
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingWSGIServer):
        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False) and \
                    not (evict_oldest_unsent() and slots.acquire(timeout=1.0)):
                self.shutdown_request(request)
                return
            with unsent_lock:
                unsent[request] = None
            try:
                super().process_request(request, client_address)  # starts the connection's thread
            except BaseException:
                sent(request)
                slots.release()  # no thread to release it (the server closes the connection)
                raise

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # (a read timed out, or the client went away: nothing to print to stderr)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                sent(request)  # (its handler could not be made: not done in its finish())
                slots.release()

    Server.address_family, addr = _get_best_family(host, port)
    httpd = make_server(addr, port, make_wsgi_app(registry), Server, handler_class=Handler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd
