"""A thin async client for one vLLM (or emulated) replica, and the pure `/metrics` parser.

The parser is pure (text in, values out) so histogram-delta arithmetic is unit-testable; the
client only does HTTP. Every call has a timeout: a hung replica must not stall the tick loop.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from floodgate.controller.signals import ReplicaMetrics
from prometheus_client.parser import text_string_to_metric_families

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
# The KV gauge was renamed in vLLM 0.10 (`gpu_cache_usage_perc` -> `kv_cache_usage_perc`);
# either name is accepted, the new one wins when a page exports both.
KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# A `/metrics` page larger than this is a failed scrape (vLLM's is ~100 KB; parsing runs ~0.5 s
# per MB, and the body is foreign input).
MAX_METRICS_BYTES = 4 << 20
# Any other reply (health, sleep state, models, the warm-up completion) is a few hundred bytes;
# read whole, a replica streaming one (compromised, or a buggy server) grew the controller's memory
# for as long as the call's timeout (the warm-up's 60 s, a wake's 120 s; a review: past the
# shipped pod's 512 MiB limit). A longer reply is a failed call.
MAX_REPLY_BYTES = 1 << 20
MAX_MODELS_BYTES = 16 << 20  # /v1/models: one entry per served LoRA adapter too
# More requests running or waiting on one replica than this is no engine's real queue (a review's
# `num_requests_waiting 1e12` scaled an idle pool to its maximum): a failed scrape.
MAX_PLAUSIBLE_REQUESTS = 100_000.0


class VllmError(RuntimeError):
    """A replica call failed (connection, timeout or unexpected status)."""


class MetricsError(VllmError, ValueError):
    """A `/metrics` page the parser cannot turn into finite, sane numbers: unparseable text, a
    gauge the policy reads missing, NaN, infinite or negative (or a KV usage outside 0..1), a
    histogram bucket without a numeric `le`. The scrape is a failed one (ok=False), never 0.
    (A ValueError too, which is what the parser raised before.)"""


def _sane(what: str, value: float, *, upper: float = math.inf) -> float:
    """`value` if it is a finite number in [0, upper], else MetricsError naming `what`."""
    if not math.isfinite(value) or value < 0 or value > upper:
        raise MetricsError(f"{what} is {value!r}: not a finite number in [0, {upper:g}]")
    return value


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative histogram (summed over label sets): upper bound -> count, plus sum/count."""

    buckets: tuple[tuple[float, float], ...] = ()
    total: float = 0.0
    count: float = 0.0

    def delta(self, prev: Histogram | None) -> Histogram:
        """Observations since `prev`. A counter reset (replica restarted) returns `self`."""
        if prev is None or self.count < prev.count:
            return self
        pb = dict(prev.buckets)
        return Histogram(
            tuple((le, c - pb.get(le, 0.0)) for le, c in self.buckets),
            self.total - prev.total,
            self.count - prev.count,
        )

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile q (coarse, like `histogram_quantile`
        without interpolation); None without observations."""
        if self.count <= 0:
            return None
        rank = q * self.count
        for le, c in self.buckets:
            if c >= rank:
                return le
        return math.inf

    def interpolated(self, q: float) -> float | None:
        """Quantile q with linear interpolation inside its bucket (`histogram_quantile`);
        None without observations; the highest finite bound when q falls in `+Inf`."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lo_le, lo_c = 0.0, 0.0
        for le, c in self.buckets:
            if c >= rank:
                if math.isinf(le):
                    return lo_le
                span = c - lo_c
                return lo_le + (le - lo_le) * ((rank - lo_c) / span if span > 0 else 1.0)
            lo_le, lo_c = le, c
        return lo_le


@dataclass(frozen=True, slots=True)
class VllmSample:
    """Everything one scrape yields: the policy's inputs plus latency histograms."""

    metrics: ReplicaMetrics
    ttft: Histogram = field(default_factory=Histogram)  # cumulative
    itl: Histogram = field(default_factory=Histogram)
    ttft_delta: Histogram = field(default_factory=Histogram)  # since the previous scrape
    itl_delta: Histogram = field(default_factory=Histogram)
    asleep: bool | None = None  # from vllm:engine_sleep_state; None when not exported
    error: str = ""
    # `ttft`/`itl` are a good scrape's (this one's, or for a failed one the last good one's):
    # the next good scrape's delta is taken from them. False: no good scrape yet.
    baseline: bool = True


def _hist_add(acc: dict[str, dict[float, float]], sums: dict[str, float], counts: dict[str, float],
              name: str, sample_name: str, labels: dict[str, str], value: float) -> None:
    if sample_name not in (name + "_bucket", name + "_sum", name + "_count"):
        return
    _sane(sample_name, value)  # counts and a sum of durations: never NaN, infinite or negative
    if sample_name == name + "_bucket":
        raw = labels.get("le")
        try:
            le = float(raw) if raw is not None else math.nan
        except ValueError:
            le = math.nan
        if math.isnan(le):
            raise MetricsError(f"{sample_name}: bucket without a numeric le label ({labels})")
        acc.setdefault(name, {})
        acc[name][le] = acc[name].get(le, 0.0) + value
    elif sample_name == name + "_sum":
        sums[name] = sums.get(name, 0.0) + value
    else:
        counts[name] = counts.get(name, 0.0) + value


def parse_metrics(
    text: str,
    replica_id: str,
    now: float,
    prev: VllmSample | None = None,
) -> VllmSample:
    """Parse a vLLM `/metrics` page. Gauges are summed over label sets (one engine per model).

    Raises MetricsError (a VllmError and a ValueError) on a page it cannot turn into finite,
    sane numbers: unparseable text (whatever the text parser raises), any of the gauges the
    policy reads (`num_requests_running`, `num_requests_waiting`, the KV gauge under either of
    its names) missing, NaN, infinite or negative (the KV gauge also above 1), a latency
    histogram's bucket, sum or count NaN, infinite or negative, or a bucket without a numeric
    `le`, or one of those series twice. Each is a failed scrape, never 0 (an idle-looking replica would invite a scale-down
    exactly when something is wrong) and never a crash of the tick. Metrics the controller does
    not read are not checked.
    """
    waiting = running = 0.0
    kv: dict[str, float] = {}
    seen: set[str] = set()
    awake: float | None = None
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    try:  # foreign text: whatever the parser raises on it is a bad page, not a bug of ours
        families = list(text_string_to_metric_families(text))
    except Exception as exc:
        raise MetricsError(f"unparseable page: {type(exc).__name__}: {exc}") from exc
    series: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for fam in families:
        for s in fam.samples:
            n = s.name
            if n in (WAITING, RUNNING) or n in KV_NAMES or n.startswith((TTFT, ITL)):
                # One series twice on a page is no page a server writes: summed, a page that
                # repeated its series 20 times read as 20x the requests (a review).
                key = (n, frozenset(s.labels.items()))
                if key in series:
                    raise MetricsError(f"{n}{s.labels} appears twice on the page")
                series.add(key)
            if n == WAITING:
                waiting += _sane(n, s.value, upper=MAX_PLAUSIBLE_REQUESTS)
                seen.add(n)
            elif n == RUNNING:
                running += _sane(n, s.value, upper=MAX_PLAUSIBLE_REQUESTS)
                seen.add(n)
            elif n in KV_NAMES:
                kv[n] = max(kv.get(n, 0.0), _sane(n, s.value, upper=1.0))
            elif n == "vllm:engine_sleep_state" and s.labels.get("sleep_state") == "awake":
                awake = _sane(n, s.value)
            elif n.startswith(TTFT):
                _hist_add(buckets, sums, counts, TTFT, n, s.labels, s.value)
            elif n.startswith(ITL):
                _hist_add(buckets, sums, counts, ITL, n, s.labels, s.value)
    missing = [n for n in (RUNNING, WAITING) if n not in seen]
    if not kv:
        missing.append(" or ".join(KV_NAMES))
    if missing:
        raise MetricsError("missing from the page: " + ", ".join(missing))
    kv_usage = next(kv[n] for n in KV_NAMES if n in kv)
    _sane(WAITING, waiting)  # summed over label sets: finite parts can still overflow
    _sane(RUNNING, running)

    def hist(name: str) -> Histogram:
        h = Histogram(tuple(sorted(buckets.get(name, {}).items())), sums.get(name, 0.0), counts.get(name, 0.0))
        for v in (h.total, h.count, *(c for _, c in h.buckets)):
            _sane(name, v)  # summed over label sets: finite parts can still overflow
        return h

    ttft, itl = hist(TTFT), hist(ITL)
    # Without a previous sample the cumulative histograms hold the replica's whole life, not
    # this tick: a pool replica is not scraped while it sleeps, so when it is promoted again
    # its first page still holds everything it served before — in the elastic benchmark the
    # queued TTFTs of the first burst (5 s and more), which the learned capacity read as the
    # SLO missed at light load (7 -> 5 per replica at the second burst's onset, which then
    # sized 8 replicas for a load 5 carry). The first sample is a baseline.
    return VllmSample(
        metrics=ReplicaMetrics(replica_id, now, True, waiting, running, kv_usage),
        ttft=ttft,
        itl=itl,
        # After a failed scrape, from the last good one's histograms that the failed sample
        # kept (before: from nothing, the replica's whole life — a review's good scrape after
        # one failure carried 54 TTFTs where 1 request had been served, and the learned
        # capacity fell 7.00 -> 4.54 on a light load that met the SLO).
        ttft_delta=Histogram() if prev is None or not prev.baseline else ttft.delta(prev.ttft),
        itl_delta=Histogram() if prev is None or not prev.baseline else itl.delta(prev.itl),
        asleep=None if awake is None else awake < 0.5,
    )


def failed_sample(replica_id: str, now: float, error: str, prev: VllmSample | None = None) -> VllmSample:
    """A marked failure: ok=False, and the cumulative histograms of `prev` kept so the next
    good scrape's delta covers the gap instead of double counting."""
    return VllmSample(
        metrics=ReplicaMetrics(replica_id, now, ok=False),
        ttft=prev.ttft if prev else Histogram(),
        itl=prev.itl if prev else Histogram(),
        error=error,
        baseline=prev is not None and prev.baseline,
    )


def merge_histograms(hs: Iterable[Histogram]) -> Histogram:
    buckets: dict[float, float] = {}
    total = count = 0.0
    for h in hs:
        for le, c in h.buckets:
            buckets[le] = buckets.get(le, 0.0) + c
        total += h.total
        count += h.count
    return Histogram(tuple(sorted(buckets.items())), total, count)


class VllmClient:
    """HTTP calls to one replica at `endpoint` ("host:port")."""

    def __init__(self, session: aiohttp.ClientSession, endpoint: str, *, timeout_s: float = 2.0,
                 model: str | None = None) -> None:
        self.session = session
        self.endpoint = endpoint
        self.base = f"http://{endpoint}"
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.model = model

    async def _call(self, method: str, path: str, *, limit: aiohttp.ClientTimeout | None = None,
                    json: object = None, ok: tuple[int, ...] = (200,),
                    max_bytes: int = MAX_REPLY_BYTES) -> tuple[int, bytes]:
        """`max_bytes`: a longer body is a VllmError, read no further (foreign input)."""
        try:
            async with self.session.request(method, self.base + path, json=json,
                                            timeout=limit or self.timeout) as r:
                chunks: list[bytes] = []
                size = 0
                async for chunk in r.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > max_bytes:
                        raise VllmError(f"{method} {self.endpoint}{path}: a page over {max_bytes >> 20} MiB")
                    chunks.append(chunk)
                body = b"".join(chunks)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise VllmError(f"{method} {self.endpoint}{path}: {type(exc).__name__}: {exc}") from exc
        if r.status not in ok:
            raise VllmError(f"{method} {self.endpoint}{path}: HTTP {r.status} {body[:200]!r}")
        return r.status, body

    async def health(self) -> bool:
        try:
            status, _ = await self._call("GET", "/health", ok=(200, 503))
        except VllmError:
            return False
        return status == 200

    async def metrics_text(self) -> str:
        """The `/metrics` page, at most MAX_METRICS_BYTES (a larger one is a failed scrape)."""
        _, body = await self._call("GET", "/metrics", max_bytes=MAX_METRICS_BYTES)
        return body.decode("utf-8", errors="replace")

    async def scrape(self, replica_id: str, now: float, prev: VllmSample | None = None) -> VllmSample:
        """One `/metrics` scrape; failures (no answer, an error status, a page over the size cap,
        a page `parse_metrics` rejects: MetricsError) come back marked (ok=False), never as zeros.
        Parsed in a worker thread: a review's 22 MB page (valid text) held the controller's loop
        for 12 s, past its leader lease."""
        try:
            text = await self.metrics_text()
            return await asyncio.to_thread(parse_metrics, text, replica_id, now, prev)
        except VllmError as exc:
            return failed_sample(replica_id, now, str(exc), prev)

    async def sleep(self, level: int = 1, timeout_s: float = 120.0) -> bool:
        """Sleep after in-flight requests finish (mode=wait). False when sleep mode is off (404)."""
        status, _ = await self._call("POST", f"/sleep?level={level}&mode=wait", ok=(200, 404),
                                     limit=aiohttp.ClientTimeout(total=timeout_s))
        return status == 200

    async def wake(self, timeout_s: float = 120.0) -> bool:
        status, _ = await self._call("POST", "/wake_up", ok=(200, 404),
                                     limit=aiohttp.ClientTimeout(total=timeout_s))
        return status == 200

    async def is_sleeping(self) -> bool | None:
        """True/False, or None when the replica has no sleep mode. An answer other than vLLM's
        `{"is_sleeping": <bool>}` is a VllmError: read with `.get`, a JSON list, `null` or a bare
        `true` raised AttributeError, which stopped the controller in its rebuild's look at a
        replica found without a registry entry, at every restart (a review); `bool()` of a
        string read `"no"` as asleep."""
        import json as _json

        status, body = await self._call("GET", "/is_sleeping", ok=(200, 404))
        if status == 404:
            return None
        try:
            doc = _json.loads(body)
        except ValueError as exc:
            raise VllmError(f"GET {self.endpoint}/is_sleeping: not JSON: {body[:200]!r}") from exc
        value = doc.get("is_sleeping") if isinstance(doc, dict) else None
        if not isinstance(value, bool):
            raise VllmError(f"GET {self.endpoint}/is_sleeping: no is_sleeping true/false: {body[:200]!r}")
        return value

    async def model_name(self) -> str:
        if self.model is None:
            import json as _json

            # (vLLM lists every LoRA adapter it serves here, ~500 bytes each: a review's 2,000
            # adapters passed 1 MiB and no replica could warm up)
            _, body = await self._call("GET", "/v1/models", max_bytes=MAX_MODELS_BYTES)
            self.model = str(_json.loads(body)["data"][0]["id"])
        return self.model

    async def warmup(self, timeout_s: float = 60.0) -> None:
        """One one-token completion: proves the engine serves before traffic is routed here."""
        body = {"model": await self.model_name(), "prompt": "warm-up", "max_tokens": 1, "stream": False}
        await self._call("POST", "/v1/completions", json=body, limit=aiohttp.ClientTimeout(total=timeout_s))
