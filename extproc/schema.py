"""The Redis key schema of Floodgate's shared state: every key name, channel and field, once.

Both the processor (`extproc`) and the controller import this module; nothing else spells a
key. Every key of a pool carries the pool as its hash tag (`fg:{pool}:…`), so a pool is one
Redis Cluster slot and one Lua script (`leases.lua`) sees all of it.

The script's replies are lists of alternating field names and values, parsed here by name
(`parse_fields`), never by position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CLASSES = (0, 1, 2)

# The keys `leases.lua` receives, in KEYS order. The script binds them by these names.
SCRIPT_KEYS = (
    "leases",     # ZSET ticket -> lease expiry (ms)
    "lmeta",      # HASH ticket -> "class|gateway"
    "queue",      # ZSET ticket -> class * 2^32 + seq (strict priority, FIFO within a class)
    "qmeta",      # HASH ticket -> "class|deadline_ms|gateway|tenant"
    "qdl",        # ZSET ticket -> deadline (ms), to reap abandoned waiters
    "counts",     # HASH i0..i2 in-flight, q0..q2 queued, t<class>:<tenant> queued per tenant
    "state",      # HASH limit, rtt_noload, probe_count, probe_jitter, version, seq, event rates, hold
    "gws",        # ZSET gateway -> liveness expiry (ms); refreshed only by `sync`
    "active",     # SET  endpoints that may receive new requests (the registry's active ones)
    "epinf",      # HASH endpoint -> permits held by requests routed to it
    "lep",        # HASH ticket -> endpoint it was routed to
    "creditors",  # SET  gateways holding local credits (told to return them when a queue forms)
    "epfill",     # HASH endpoint -> "tokens|ms": prefill estimate (prefill-aware picking, extproc/prefill.py)
    "settings",   # HASH the pool's admission settings, written once (see PoolSettings)
    "admin_testclock",  # STRING ms; when present the script uses it instead of TIME (tests only;
                        # `a`: the processors' ACL user may not write it, floodgate.redis_acl)
    "qsize",      # HASH ticket -> a waiter's prompt tokens for the prefill estimate (with epfill)
)

# A field `sync` keeps in lmeta, qmeta and state so that the server stores them as hashtables
# (its value is longer than hash-max-listpack-value): not a ticket; readers of those hashes skip it.
PAD_FIELD = "~"

ACTIVE = "active"
EPINF = "epinf"

# What reading a reply this version cannot parse raises (the parsers below, state.py's replies):
# the library under Floodgate's name is not this version's (any holder of the processors' Redis
# credentials may FUNCTION LOAD REPLACE it), or a key holds what no Floodgate wrote. Both halves
# treat it as an outage (a failed scrape; degraded admission), never as a crash or a failed request.
UNREADABLE_REPLY: tuple[type[Exception], ...] = (ValueError, KeyError, IndexError, TypeError)

# Keys outside the script.
ENDPOINTS = "endpoints"  # HASH endpoint -> JSON {state, replica, since_ms, meta} (the registry)
DEMAND = "demand"        # HASH "<class>:<outcome>" -> count (see DEMAND_OUTCOMES)
# STRING "nonce:seq" per processor (`dbatch:<gateway>`, expires in an hour): the last batch of
# its demand counts written (leases.lua add_demand), so a batch sent again after a lost reply
# is not counted twice.
DEMAND_BATCH = "dbatch"
# HASH gateway -> "ms r0 r1 r2 f0 f1 f2": each processor's own arrival rates per class (requests
# per second, the slow and the fast-decaying ones) and when it wrote them (its wall clock, ms),
# written at its status tick. Early drop sums them into the pool's rates (admission.pool_arrivals)
# instead of scaling its own by the live processors.
ARRIVALS = "gwrates"  # (not "a…": the processors ACL may not write keys starting a, e, c: floodgate.redis_acl)
# HASH gateway -> "ms n": the local credits each processor holds idle (leases no request uses),
# and when it wrote that (its wall clock, ms), written with its arrival rates. Redis counts a
# credit as a P1 lease; `floodgate status` and the `floodgate_inflight` gauge leave these out.
IDLE_CREDITS = "gwcredits"


# Past any arrival rate one gateway sees (requests/s of a class): a larger shared value is a
# buggy or hostile writer's, and summed in it would make every peer early-drop everything.
MAX_SHARED_RATE = 1e6


def format_arrivals(ms: float, slow: tuple[float, float, float], fast: tuple[float, float, float]) -> str:
    return " ".join([str(int(ms)), *(f"{r:.6g}" for r in (*slow, *fast))])


def parse_arrivals(v: str) -> tuple[float, tuple[float, float, float], tuple[float, float, float]] | None:
    """(ms, slow, fast) of one `ARRIVALS` field; None for a value that is not one (written by
    something else: ignored, never an error)."""
    parts = v.split()
    if len(parts) != 7:
        return None
    try:
        x = [float(p) for p in parts]
    except ValueError:
        return None
    if not 0 <= x[0] < float("inf") or any(not 0 <= r <= MAX_SHARED_RATE for r in x[1:]):
        return None
    return x[0], (x[1], x[2], x[3]), (x[4], x[5], x[6])


Rates = tuple[float, float, float]


def format_idle_credits(ms: float, n: int) -> str:
    return f"{int(ms)} {int(n)}"


def parse_idle_credits(v: str, limit: int = 1 << 20) -> tuple[int, int] | None:
    """(ms, n) of one `IDLE_CREDITS` field; None for a value that is not "ms n" with
    0 <= n <= `limit` (another writer's: left out, never an error)."""
    parts = v.split()
    if len(parts) != 2 or not all(x.isascii() and x.isdigit() and len(x) <= 15 for x in parts):
        return None
    ms, n = int(parts[0]), int(parts[1])
    return (ms, n) if n <= limit else None


def fresh_idle_credits(shared: Mapping[str, str], wall_ms: float, fresh_s: float) -> dict[str, int]:
    """Gateway -> idle local credits of an `IDLE_CREDITS` hash, for the entries stamped within
    `fresh_s` of `wall_ms` either way."""
    out: dict[str, int] = {}
    for gw, v in shared.items():
        p = parse_idle_credits(v)
        if p is not None and abs(wall_ms - p[0]) <= fresh_s * 1000:
            out[gw] = p[1]
    return out


def peer_arrivals(shared: Mapping[str, str], me: str, wall_ms: float,
                  fresh_s: float) -> tuple[list[Rates], list[Rates]]:
    """The other gateways' (slow, fast) arrival rates of an `ARRIVALS` hash that are fresh: stamped
    within `fresh_s` of `wall_ms` either way (a stamp far ahead is a writer whose clock runs
    ahead: counted as fresh, a dead processor's would add its rates for the whole skew)."""
    slow: list[Rates] = []
    fast: list[Rates] = []
    for gw, v in shared.items():
        p = parse_arrivals(v)
        if gw != me and p is not None and abs(wall_ms - p[0]) <= fresh_s * 1000:
            slow.append(p[1])
            fast.append(p[2])
    return slow, fast
CTL_HISTORY = "ctl:history"  # STRING controller demand history (JSON)
CTL_SEQ = "ctl:seq"          # STRING the next replica id the controller gives (`<pool>-r<seq>`)
# STRING: the last desired active count the leader decided. A new leader (a restart, a
# takeover) starts from it, bounded by the replicas it finds running, so a cold start it adopts
# that was a warm-pool refill is not counted as wanted serving capacity (and refilled again).
CTL_DESIRED = "ctl:desired"
# STRING: the controller's admission ceiling, in concurrent requests per active endpoint (the
# per-replica capacity it sizes the pool with x a headroom); written every tick with a TTL, so a
# controller that stops stops capping. The processors hold their shared limit at or below this
# times the registry's active endpoint count (limit.cap_to_ceiling).
CTL_CEILING = "ctl:ceiling"
# STRING: capacity the controller has on its way (replicas cold-starting or waking that the
# plan will make active), JSON {"ttl_ms": T, "at": [[ms, replicas], ...]}: each entry serves
# `ms` after the write, which was made with a TTL of T (the key's remaining PTTL says how long
# ago that was, on Redis's clock). Written every tick while there is any, with a TTL, so a
# controller that stops stops announcing; only the controller may write `ctl:*` keys
# (floodgate.redis_acl). The processors let a request wait for permits due before its
# deadline (policy.Snapshot.arriving) instead of turning it away.
CTL_ARRIVING = "ctl:arriving"

# Per-class demand counters (cumulative, one hash per pool), written by every processor:
#   admitted       permits handed out (at once, from a credit, or after waiting)
#   queued         requests that entered the queue (each ends admitted, queue_timeout or abandoned)
#   early_drop, queue_full, tenant_cap, queue_timeout, no_endpoints   turned away (429/503)
#   abandoned      the client left while queued
# Offered demand = admitted + queued-then-not-admitted + turned away; with these counters:
#   offered = admitted + early_drop + queue_full + tenant_cap + queue_timeout + no_endpoints + abandoned
TURNED_AWAY = ("early_drop", "queue_full", "tenant_cap", "queue_timeout", "no_endpoints", "abandoned")
# Requests that reached a processor and are no demand (no model work asked or held back):
#   refused        answered by the processor itself as malformed (400 conflicting_tenant, 431
#                  header_limit, a refused engine-priority body): Envoy counts them among its
#                  ext_proc immediate responses, which the controller must not read as turned away
#   unadmitted     passed without a permit (pools[].unadmitted_paths / unadmitted_methods)
#   degraded       turned away while the processor ran on local limits (Redis unreachable, or the
#                  replica registry lost): what it lacked was the shared state, not capacity (an
#                  operator's review: ~2 s of these after a FLUSHALL woke two warm replicas)
#   retried        turned away, and the request said it is a client's retry of one sent before
#                  (`admission.retry_count_header` above 0: OpenAI's SDKs retry a 429 twice by
#                  default): its first attempt was counted, so each retry would count the same
#                  request again (up to 3x the demand admission turned away)
# The controller subtracts them from Envoy's gateway counters (controller/demand.py).
NOT_DEMAND = ("refused", "unadmitted", "degraded", "retried")
# Admitted (and counted in `admitted` too), and the request said it is a client's retry of a
# first attempt of the same class, tenant and caller that this processor turned away and counted
# (extproc/retry_match.py): the controller takes these off its class's turned-away count, so
# a request refused once and then served counts once.
RETRIED_ADMITTED = "retried_admitted"
DEMAND_OUTCOMES = ("admitted", "queued", *TURNED_AWAY, *NOT_DEMAND, RETRIED_ADMITTED)


def key(pool: str, name: str) -> str:
    return f"fg:{{{pool}}}:{name}"


def script_keys(pool: str) -> list[str]:
    return [key(pool, name) for name in SCRIPT_KEYS]


# STRING, written by the processors once they read a non-empty active set (no TTL): an empty
# active set with this key present was emptied on purpose (the controller scaled to 0); without
# it, Redis lost the registry (restarted empty, a failover to a replica without it) and the
# processors keep routing to the endpoints they last saw, on local limits, until the controller
# writes the registry again (extproc/admission.py `_refresh_registry`).
REGISTRY_SEEN = "regseen"


# The message a gateway's channel carries when the registry's active set or the controller's
# ceiling changed (`pool|!registry`; registry.Registry.notify): refresh them now.
REGISTRY_CHANGED = "!registry"

# The message a gateway's channel carries when Redis found it had lost acknowledged writes and
# holds the pool's grants until every live gateway has re-asserted (`pool|!resync|`; leases.lua
# `start_hold`): sync now.
RESYNC = "!resync"


def gateway_channel(gateway_id: str, pool: str) -> str:
    """Pub/sub channel of one processor for one pool: grants (`pool|ticket|endpoint`) and credit
    recalls. It carries the pool's hash tag, so on a Cluster it is in the pool's slot and the
    script's SPUBLISH reaches only that shard (leases.lua `notify`)."""
    return f"{key(pool, 'gw')}:{gateway_id}"


def gateway_claim_key(pool: str, gateway_id: str) -> str:
    """STRING: the instance (a random id per process) that last renewed this gateway id in the
    pool, with a TTL of one lease TTL. Two live processes under one gateway id drop each
    other's permits at every renewal (`sync` makes Redis hold exactly what the caller asserts);
    this key is how they notice (extproc/admission.py `_claim_gateway_id`)."""
    return f"{key(pool, 'gid')}:{gateway_id}"


def controller_leader_key(suffix: str = "") -> str:
    return "fg:controller:leader" + (f":{suffix}" if suffix else "")


def lease_gateway(lmeta: str) -> str:
    """The gateway of a lease, from its `lmeta` value "class|gateway|seq"."""
    parts = lmeta.split("|")
    return parts[1] if len(parts) == 3 else ""


EJECTED_FIELD = "ej"  # in the pool's `state` hash: ejected endpoints (leases.lua `eject`)


def parse_ejections(raw: str | bytes | None) -> dict[str, int]:
    """The `ej` field of a pool's state: endpoint -> until (ms of the script's clock), ended ones
    included (the script drops them at its next `eject`). A malformed entry is skipped."""
    out: dict[str, int] = {}
    for item in _text(raw or "").split():
        ep, sep, until = item.rpartition("|")
        if sep and ep and until.isdigit():
            out[ep] = int(until)
    return out


def demand_field(cls: int, outcome: str) -> str:
    return f"{cls}:{outcome}"


@dataclass(frozen=True)
class PoolSettings:
    """Admission settings every grant of a pool uses, whoever triggers it: stored once in
    Redis by the first processor (`configure`), versioned by `epoch`. A processor whose
    config differs is told (and reports it loudly); a higher epoch replaces the stored ones."""

    initial_limit: int
    shares: tuple[float, float, float]
    always: tuple[bool, bool, bool] = (False, False, False)
    picking: bool = False
    max_queue: tuple[int, int, int] = (1000, 1000, 500)
    tenant_cap: tuple[int, int, int] = (500, 500, 250)
    epoch: int = 0
    headroom: tuple[float, float, float] = (0.0, 0.0, 0.0)  # kept free for each class (policy.kept_free)
    # the onset ramp (policy.ramp_refill): bucket size and refill per second, shares of the limit; 0 = off
    ramp_burst: float = 0.0
    ramp_rate: float = 0.0
    # the ramp's floors (policy.RAMP_MIN_BURST, RAMP_MIN_RATE_S): permits at once, per second
    ramp_min_burst: float = 8.0
    ramp_min_rate: float = 8.0
    # per active endpoint (policy.ramp_floors, RAMP_MIN_*_PER_ENDPOINT); 0 = none (older settings)
    ramp_ep_burst: float = 0.0
    ramp_ep_rate: float = 0.0
    # prefill-aware picking (extproc/prefill.py): tokens per second an endpoint prefills (0 = off),
    # tokens each routed request adds, least estimate above which lower classes wait while P0 runs
    pf_rate: float = 0.0
    pf_size: float = 512.0
    pf_k: float = 512.0
    # the fair order over tenants within a class (leases.lua `fair`); off: arrival order
    fair: bool = True

    def fields(self) -> dict[str, str]:
        out = {"initial": str(self.initial_limit), "picking": "1" if self.picking else "0",
               "epoch": str(self.epoch), "ramp_burst": repr(float(self.ramp_burst)),
               "ramp_rate": repr(float(self.ramp_rate)), "ramp_min_burst": repr(float(self.ramp_min_burst)),
               "ramp_min_rate": repr(float(self.ramp_min_rate)), "ramp_ep_burst": repr(float(self.ramp_ep_burst)),
               "ramp_ep_rate": repr(float(self.ramp_ep_rate)), "pf_rate": repr(float(self.pf_rate)),
               "pf_size": repr(float(self.pf_size)), "pf_k": repr(float(self.pf_k)),
               "fair": "1" if self.fair else "0"}
        for c in CLASSES:
            out[f"share{c}"] = repr(float(self.shares[c]))
            out[f"always{c}"] = "1" if self.always[c] else "0"
            out[f"headroom{c}"] = repr(float(self.headroom[c]))
            out[f"maxq{c}"] = str(self.max_queue[c])
            out[f"tcap{c}"] = str(self.tenant_cap[c])
        return out

    @classmethod
    def from_fields(cls, f: Mapping[str, str]) -> PoolSettings:
        return cls(
            initial_limit=int(f["initial"]),
            shares=(float(f["share0"]), float(f["share1"]), float(f["share2"])),
            always=(f["always0"] == "1", f["always1"] == "1", f["always2"] == "1"),
            picking=f["picking"] == "1",
            # settings stored by a version without headroom have none
            headroom=(float(f.get("headroom0", "0")), float(f.get("headroom1", "0")), float(f.get("headroom2", "0"))),
            max_queue=(int(f["maxq0"]), int(f["maxq1"]), int(f["maxq2"])),
            tenant_cap=(int(f["tcap0"]), int(f["tcap1"]), int(f["tcap2"])),
            epoch=int(f.get("epoch", "0")),
            # settings stored by a version without the ramp have none
            ramp_burst=float(f.get("ramp_burst", "0")), ramp_rate=float(f.get("ramp_rate", "0")),
            ramp_min_burst=float(f.get("ramp_min_burst", "8")), ramp_min_rate=float(f.get("ramp_min_rate", "8")),
            ramp_ep_burst=float(f.get("ramp_ep_burst", "0")), ramp_ep_rate=float(f.get("ramp_ep_rate", "0")),
            # settings stored by a version without prefill-aware picking have it off
            pf_rate=float(f.get("pf_rate", "0")), pf_size=float(f.get("pf_size", "512")),
            pf_k=float(f.get("pf_k", "512")),
            fair=f.get("fair", "0") == "1")  # (absent in older settings: off, as they queued: leases.lua)

    def differences(self, other: PoolSettings) -> list[str]:
        mine, theirs = self.fields(), other.fields()
        return [f"{k}: {mine[k]} here, {theirs[k]} stored" for k in mine if k != "epoch" and mine[k] != theirs[k]]


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def parse_fields(raw: Iterable[Any]) -> dict[str, str]:
    """A script reply of alternating names and values -> {name: value}. The value of `snap` is
    itself space-separated names and values (the script builds a snapshot as one string)."""
    items = [_text(x) for x in raw]
    out = dict(zip(items[::2], items[1::2], strict=True))
    snap = out.pop("snap", None)
    if snap is not None:
        parts = snap.split(" ")
        out.update(zip(parts[::2], parts[1::2], strict=True))
    return out


def expand_snapshots(replies: Iterable[Any]) -> list[Any]:
    """A `batch` reply's per-op replies with every snapshot whole. In one call the script sends
    the first snapshot whole (`snap`) and each later one as the op's own part only (`snapo`:
    in-flight and queued per class at the op's turn, its tenant's waiters, its class's grant
    rate; leases.lua `snapshot`): the rest is the call's whole snapshot's. A reply that is not
    a list (a count) or carries no snapshot passes unchanged."""
    out: list[Any] = []
    whole: dict[str, str] | None = None
    for r in replies:
        if isinstance(r, list) and len(r) > 2:
            items = [_text(x) for x in r]
            names = items[::2]
            if "snap" in names:
                parts = items[2 * names.index("snap") + 1].split(" ")
                whole = dict(zip(parts[::2], parts[1::2], strict=True))
            elif "snapo" in names:
                if whole is None:
                    raise ValueError("a snapshot's own part with no whole snapshot before it in the call")
                i = 2 * names.index("snapo") + 1
                parts = items[i].split(" ")
                merged = {**whole, **dict(zip(parts[::2], parts[1::2], strict=True))}
                items[i - 1], items[i] = "snap", " ".join(f"{k} {v}" for k, v in merged.items())
                r = items
        out.append(r)
    return out


def _per_class(f: dict[str, str], prefix: str) -> tuple[float, float, float] | None:
    """Milliseconds per class in the reply (`hl0`..`hl2`) -> seconds, None when absent."""
    if f"{prefix}0" not in f:
        return None
    return (float(f[f"{prefix}0"]) / 1000, float(f[f"{prefix}1"]) / 1000, float(f[f"{prefix}2"]) / 1000)


@dataclass(frozen=True)
class PoolStatus:
    """One consistent read of a pool's shared state."""

    granted: bool
    limit: int
    inflight: tuple[int, int, int]
    queued: tuple[int, int, int]
    tenant_queued: int = 0
    grant_rate: float = 0.0  # permits freed per second, recent (0 = unknown)
    live_gateways: int = 0
    server_ms: int = 0
    endpoint: str = ""  # where the granted request is routed (endpoint picking), else ""
    active_endpoints: int = 0
    partial: bool = False  # an immediate grant: only `granted`, `endpoint`, `credits` are filled in
    class_rate: float = 0.0  # recent grants per second to the asking request's class
    credits: tuple[str, ...] = ()  # extra leases granted for local admission (see leases.lua)
    rejected: str = ""  # enqueue refused atomically: queue_full | tenant_cap
    enqueued: bool = False  # `admit` queued the request (it waits for a grant)
    gateway_rank: int = -1  # this gateway's place among the live ones (degraded share), -1 unknown
    settings_epoch: int = -1
    release_n: int = 0  # freed permits counted so far (how much `grant_rate` rests on)
    inflight_avg: float = 0.0  # mean in-flight at recent releases (0 = unknown)
    head_left: tuple[float, float, float] | None = None  # s to each class's oldest waiter's deadline
    tail_left: tuple[float, float, float] | None = None  # s to each class's newest waiter's deadline
    pf_wait: float = 0.0  # s until prefill pacing lets a lower class in (while a P0 runs; leases.lua `pfw`)
    pf_backlog: float = 0.0  # prompt tokens above the pace level, summed over the endpoints (`pfb`)
    # The asking request's class's waiters ahead of it in the fair order (leases.lua `fair`;
    # None: not an answer to a request, or a script without it): fewer than the class's queue
    # for a tenant with fewer waiters than others.
    ahead: int | None = None
    named_queued: tuple[int, int, int] | None = None  # waiters with a tenant per class (`n0`..`n2`)
    # `status` only: while Redis holds the pool's grants after lost writes (leases.lua `held`),
    # the seconds it has left at most and the gateways it waits for.
    hold_s: float = 0.0
    hold_waiting: tuple[str, ...] = ()

    @property
    def inflight_total(self) -> int:
        return sum(self.inflight)

    @property
    def queued_total(self) -> int:
        return sum(self.queued)

    @classmethod
    def from_reply(cls, raw: Iterable[Any]) -> PoolStatus:
        f = parse_fields(raw)
        if f.get("granted") == "g":  # the short reply of an immediate grant (the hot path)
            return cls(True, 0, (0, 0, 0), (0, 0, 0), endpoint=f.get("endpoint", ""), partial=True,
                       credits=tuple(c for c in f.get("credits", "").split(",") if c))
        return cls(
            granted=f["granted"] == "1",
            limit=int(f["limit"]),
            inflight=(int(f["i0"]), int(f["i1"]), int(f["i2"])),
            queued=(int(f["q0"]), int(f["q1"]), int(f["q2"])),
            tenant_queued=int(f.get("tenant_queued", 0)),
            grant_rate=float(f.get("rate", 0)),
            live_gateways=int(f.get("gateways", 0)),
            server_ms=int(f.get("now", 0)),
            endpoint=f.get("endpoint", ""),
            active_endpoints=int(f.get("active", 0)),
            class_rate=float(f.get("class_rate", 0)),
            rejected=f.get("rejected", ""),
            enqueued=f.get("queued") == "1",
            gateway_rank=int(f.get("rank", -1)),
            settings_epoch=int(f.get("epoch", -1)),
            release_n=int(float(f.get("rate_n", 0))),
            inflight_avg=float(f.get("lvl", 0)),
            head_left=_per_class(f, "hl"),
            tail_left=_per_class(f, "tl"),
            pf_wait=float(f.get("pfw", 0)) / 1000,
            pf_backlog=float(f.get("pfb", 0)),
            ahead=int(f["ahead"]) if "ahead" in f else None,
            named_queued=(int(f["n0"]), int(f["n1"]), int(f["n2"])) if "n0" in f else None,
            hold_s=int(f.get("hold", 0)) / 1000,
            hold_waiting=tuple(f.get("hold_gws", "").split()),
        )
