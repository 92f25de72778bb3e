"""Open-loop streaming HTTP load generator (`floodgate load`).

Each planned request is sent at its planned time whether or not earlier requests finished:
overload must show up as queueing and rejections at the gateway, not as a client that
politely slows down. Requests stream (`stream: true`) so TTFT and TPOT are measured the way a
user sees them. Floodgate's rejection shape (docs/admission.md: 429, `retry-after`,
`x-floodgate-reject-reason`, OpenAI-style JSON error) is parsed and recorded per request.

Time base: every time in a `Record` or `Sample` is seconds after the run start (monotonic
clock), the same axis as `PlannedRequest.t_offset`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import aiohttp
from floodgate.sim.arrivals import PlannedRequest
from prometheus_client.parser import text_string_to_metric_families

DEFAULT_TARGET = "http://127.0.0.1:10000"
DEFAULT_METRICS: tuple[str, ...] = ("floodgate_queue_depth", "floodgate_limit", "floodgate_inflight")
DEFAULT_MODEL = "floodgate-sim"

OK = "ok"
REJECTED = "rejected"
ERROR = "error"
# A request in flight when `floodgate load` was interrupted (Ctrl-C): its outcome is unknown.
INTERRUPTED = "interrupted: the run was stopped with the request in flight"
Outcome = Literal["ok", "rejected", "error"]
Api = Literal["completions", "chat"]

REJECT_REASON_HEADER = "x-floodgate-reject-reason"
QUEUE_MS_HEADER = "x-floodgate-queue-ms"
PRIORITY_HEADER = "x-floodgate-priority"


@dataclass(slots=True)
class Record:
    """What happened to one planned request (times in seconds after run start)."""

    id: int
    t_planned: float
    priority: int
    tenant: str
    prompt_tokens: int
    output_tokens: int  # requested (max_tokens / x-sim-output-tokens)
    outcome: str = ERROR  # ok | rejected | error; offered = ok + rejected + error
    status: int | None = None  # HTTP status of the last attempt; None if no response
    t_sent: float | None = None  # first attempt
    t_done: float | None = None
    reject_reason: str | None = None  # x-floodgate-reject-reason of the last rejection
    retry_after: float | None = None  # retry-after of the last rejection, seconds
    queue_ms: float | None = None  # x-floodgate-queue-ms of the admitted attempt
    # x-floodgate-priority: the class the gateway applied (differs from `priority` when the
    # caller is untrusted and its tenant's mapping wins, docs/admission.md).
    gateway_priority: int | None = None
    ttft_s: float | None = None  # first content chunk - first send (includes retry waits)
    tpot_s: float | None = None  # mean gap between content chunks after the first
    e2e_s: float | None = None  # last byte - first send
    tokens: int = 0  # generated: usage.completion_tokens, else content chunk count
    retries: int = 0
    error: str | None = None

    @property
    def admitted(self) -> bool:
        return self.outcome == OK

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(slots=True)
class Sample:
    """One scrape of the metrics endpoint: metric name -> value summed across label sets."""

    t: float
    values: dict[str, float]


@dataclass
class LoadResult:
    records: list[Record]
    samples: list[Sample] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- helpers

_VOCAB = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
    "boxing matches in foggy harbours near old stone bridges"
).split()


def make_prompt(n_words: int, request_id: int) -> str:
    """About `n_words` words; the id leads so real vLLM prefix caching cannot share prompts."""
    n = max(1, n_words - 2)
    words = (_VOCAB * (n // len(_VOCAB) + 1))[:n]
    return f"req{request_id}: " + " ".join(words)


def request_body(req: PlannedRequest, request_id: int, model: str, api: Api) -> tuple[str, dict[str, Any]]:
    """The path and JSON body `send_one` posts for `req` (aiohttp serializes it with json.dumps:
    its `content-length` is len(json.dumps(body)))."""
    prompt = make_prompt(req.prompt_tokens, request_id)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # The emulator takes lengths from the headers; a real server stops on its own EOS,
        # so ask it not to, keeping output lengths as planned.
        "ignore_eos": True,
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _float_header(headers: Any, name: str) -> float | None:
    v = headers.get(name)
    if v is None:
        return None
    try:
        return float(v)
    except ValueError:
        return None


def parse_metrics(text: str, wanted: Sequence[str]) -> dict[str, float]:
    """Sum every sample named in `wanted` across its label sets; absent metrics stay absent."""
    want = set(wanted)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # Gauges' sample name equals the family name; counters' carries `_total`. Accept both.
            name = s.name if s.name in want else (fam.name if fam.name in want and s.name == fam.name else None)
            if name is not None:
                out[name] = out.get(name, 0.0) + float(s.value)
    return out


class MetricsSampler:
    """Scrapes a Prometheus endpoint every `interval` seconds while the run lasts."""

    def __init__(self, url: str, metrics: Sequence[str] = DEFAULT_METRICS, interval: float = 1.0) -> None:
        self.url = url
        self.metrics = tuple(metrics)
        self.interval = interval
        self.samples: list[Sample] = []
        self.scrapes = 0
        self.errors = 0
        self.last_error: str | None = None

    async def scrape_once(self, session: aiohttp.ClientSession, t: float) -> None:
        self.scrapes += 1
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=max(self.interval, 1.0))) as r:
                text = await r.text()
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
            self.samples.append(Sample(t, parse_metrics(text, self.metrics)))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            # A missed scrape leaves a gap in the series; it must never stop the load run.
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"

    async def run(self, session: aiohttp.ClientSession, t0: float, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        k = 0
        while not stop.is_set():
            await self.scrape_once(session, loop.time() - t0)
            k += 1
            # Fixed grid (t0 + k*interval) so slow scrapes do not drift the series.
            delay = t0 + k * self.interval - loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(delay, 0.0))


# --------------------------------------------------------------------------- one request


@dataclass
class _Attempt:
    status: int | None = None
    reject_reason: str | None = None
    retry_after: float | None = None
    queue_ms: float | None = None
    gateway_priority: int | None = None
    t_first: float | None = None
    t_last_chunk: float | None = None
    t_end: float | None = None
    chunks: int = 0
    usage_tokens: int | None = None
    done: bool = False
    error: str | None = None


def _content_of(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return str(c.get("text") or "")
    delta = c.get("delta") or {}
    return str(delta.get("content") or "")


async def _attempt(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    request_timeout: float,
    loop: asyncio.AbstractEventLoop,
    t0: float,
) -> _Attempt:
    a = _Attempt()
    try:
        async with session.post(url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=request_timeout)) as resp:
            a.status = resp.status
            a.reject_reason = resp.headers.get(REJECT_REASON_HEADER)
            a.retry_after = _float_header(resp.headers, "retry-after")
            a.queue_ms = _float_header(resp.headers, QUEUE_MS_HEADER)
            gp = _float_header(resp.headers, PRIORITY_HEADER)
            a.gateway_priority = int(gp) if gp is not None else None
            if resp.status != 200:
                text = await resp.text(errors="replace")
                a.t_end = loop.time() - t0
                a.error = _error_text(resp.status, text)
                return a
            finish_seen = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    a.done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if _content_of(event):
                    now = loop.time() - t0
                    if a.t_first is None:
                        a.t_first = now
                    a.t_last_chunk = now
                    a.chunks += 1
                choices = event.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    finish_seen = True
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    a.usage_tokens = int(usage["completion_tokens"])
            a.t_end = loop.time() - t0
            # Some servers omit [DONE]; a finish_reason still marks a complete response.
            a.done = a.done or finish_seen
            if not a.done:
                a.error = "stream ended before [DONE]"
    except TimeoutError:
        a.t_end = loop.time() - t0
        a.error = f"timeout after {request_timeout:g}s"
    except aiohttp.ClientError as exc:
        a.t_end = loop.time() - t0
        a.error = f"{type(exc).__name__}: {exc}"[:300]
    return a


def _error_message(body: Any) -> str | None:
    """The human message in a JSON error body, for the shapes servers use: OpenAI's
    {"error": {"message"}} (Floodgate's 429s, vLLM), {"error": "..."}, vLLM's top-level
    {"object": "error", "message"} and FastAPI's {"detail": "..."}; None for anything else."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return str(err["message"])
    for value in (err, body.get("message"), body.get("detail")):
        if isinstance(value, str):
            return value
    return None


def _error_text(status: int, text: str) -> str:
    # Keep the message, not the JSON; a body of another shape is kept as it came. Never raises:
    # a failure here would lose the status and read as a loadgen bug (it did, for {"detail"}).
    message = None
    with contextlib.suppress(ValueError):
        message = _error_message(json.loads(text))
    return f"HTTP {status}: {message if message is not None else text.strip()}"[:300]


def _is_rejection(a: _Attempt) -> bool:
    # 429 is always a rejection; 503 only when Floodgate says why (else it is an upstream error).
    return a.status == 429 or (a.status == 503 and a.reject_reason is not None)


async def send_one(
    session: aiohttp.ClientSession,
    req: PlannedRequest,
    rec: Record,
    *,
    target: str,
    model: str,
    api: Api,
    request_timeout: float,
    retry: int,
    retry_max_wait: float,
    extra_headers: dict[str, str] | None,
    loop: asyncio.AbstractEventLoop,
    t0: float,
) -> Record:
    path, body = request_body(req, rec.id, model, api)
    url = target.rstrip("/") + path
    headers = {
        "x-request-priority": str(req.priority),
        "x-tenant-id": req.tenant,
        "x-sim-output-tokens": str(req.output_tokens),
        "x-sim-prompt-tokens": str(req.prompt_tokens),
        **(extra_headers or {}),
    }
    rec.t_sent = loop.time() - t0
    while True:
        a = await _attempt(session, url, body, headers, request_timeout, loop, t0)
        rec.status = a.status
        rec.t_done = a.t_end
        rec.gateway_priority = a.gateway_priority
        if _is_rejection(a):
            rec.outcome = REJECTED
            rec.reject_reason = a.reject_reason or f"http_{a.status}"
            rec.retry_after = a.retry_after
            rec.error = a.error
            if rec.retries < retry:
                rec.retries += 1
                # Honour Retry-After (bounded); without one, back off a second.
                wait = a.retry_after if a.retry_after is not None else 1.0
                await asyncio.sleep(min(max(wait, 0.0), retry_max_wait))
                # As OpenAI's SDKs say it (Floodgate counts a retry turned away again as no demand).
                headers = {**headers, "x-stainless-retry-count": str(rec.retries)}
                continue
            break
        rec.queue_ms = a.queue_ms
        if a.status == 200 and a.done:
            rec.outcome = OK
            rec.error = None
        else:
            rec.outcome = ERROR
            rec.error = a.error
        rec.tokens = a.usage_tokens if a.usage_tokens is not None else a.chunks
        if a.t_first is not None:
            rec.ttft_s = a.t_first - rec.t_sent
            if a.chunks > 1 and a.t_last_chunk is not None:
                rec.tpot_s = (a.t_last_chunk - a.t_first) / (a.chunks - 1)
        break
    if rec.t_done is not None:
        rec.e2e_s = rec.t_done - rec.t_sent
    return rec


# --------------------------------------------------------------------------- the run


async def resolve_model(session: aiohttp.ClientSession, target: str) -> str:
    """The first model the target lists at /v1/models, else DEFAULT_MODEL with a warning on
    stderr saying why (a real server serves no model of that name: every request would fail)."""
    url = target.rstrip("/") + "/v1/models"
    why: str
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                why = f"it answered HTTP {r.status}"
            else:
                try:
                    return str((await r.json(content_type=None))["data"][0]["id"])
                except (ValueError, KeyError, IndexError, TypeError):
                    why = "its answer lists no model"
    except (aiohttp.ClientError, TimeoutError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    print(f"floodgate load: warning: no model from {url} ({why}); sending model {DEFAULT_MODEL!r} "
          "(pass --model NAME)", file=sys.stderr)
    return DEFAULT_MODEL


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, disable=not enabled, dynamic_ncols=True, leave=False)


async def run_load_detailed(
    plan: Sequence[PlannedRequest],
    target: str = DEFAULT_TARGET,
    *,
    model: str | None = None,
    api: Api = "completions",
    request_timeout: float = 120.0,
    retry: int = 0,
    retry_max_wait: float = 30.0,
    metrics_url: str | None = None,
    metrics: Sequence[str] = DEFAULT_METRICS,
    sample_interval: float = 1.0,
    extra_headers: dict[str, str] | None = None,
    progress: bool = False,
    on_record: Callable[[Record], None] | None = None,
    stop_on_cancel: bool = False,
) -> LoadResult:
    """Send `plan` open-loop to `target`; return records, metric samples and run metadata.

    With `stop_on_cancel` (`floodgate load`, run under `asyncio.Runner`, which turns Ctrl-C
    into one cancel of this task), a cancel ends the run early instead of raising: requests in
    flight are cancelled and recorded as errors (`INTERRUPTED`), requests never sent are left
    out, and `meta["interrupted"]` is true."""
    loop = asyncio.get_running_loop()
    plan = sorted(plan, key=lambda p: p.t_offset)
    records = [
        Record(i, p.t_offset, p.priority, p.tenant, p.prompt_tokens, p.output_tokens)
        for i, p in enumerate(plan)
    ]
    sampler = MetricsSampler(metrics_url, metrics, sample_interval) if metrics_url else None
    counts = {OK: 0, REJECTED: 0, ERROR: 0}
    bar = _progress(len(plan), progress)
    started_wall = datetime.now(UTC)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)  # open loop: never queue client-side
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        model = model or await resolve_model(session, target)
        # A small lead so the first requests are not already late when the loop gets to them.
        t0 = loop.time() + 0.05
        stop = asyncio.Event()
        sampler_task = asyncio.create_task(sampler.run(session, t0, stop)) if sampler else None
        tasks: list[asyncio.Task[Record]] = []

        def done(task: asyncio.Task[Record]) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            rec = task.result()
            counts[rec.outcome] += 1
            bar.update(1)
            if bar.n % 20 == 0:
                bar.set_postfix(ok=counts[OK], rej=counts[REJECTED], err=counts[ERROR], refresh=False)
            if on_record is not None:
                on_record(rec)

        interrupted = False
        try:
            try:
                for p, rec in zip(plan, records, strict=True):
                    delay = t0 + p.t_offset - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    task = asyncio.create_task(
                        send_one(
                            session, p, rec, target=target, model=model, api=api, request_timeout=request_timeout,
                            retry=retry, retry_max_wait=retry_max_wait, extra_headers=extra_headers,
                            loop=loop, t0=t0,
                        )
                    )
                    task.add_done_callback(done)
                    tasks.append(task)
                if tasks:
                    await asyncio.gather(*tasks, return_exceptions=True)
            except asyncio.CancelledError:
                # Ctrl-C: asyncio.Runner cancels this task once (a second Ctrl-C raises
                # KeyboardInterrupt at once). Stop sending and report what was sent, as wrk, hey
                # and k6 do: a long run stopped early used to lose everything. With
                # `stop_on_cancel` the first cancel of any origin is taken this way (a caller's
                # wait_for timeout too: it would get a short result, not TimeoutError), so only
                # the CLI, whose task nothing else cancels, sets it; a second cancel is passed on.
                me = asyncio.current_task()
                if not stop_on_cancel or me is None or me.uncancel() > 0:
                    raise
                interrupted = True
        finally:
            for t in tasks:
                t.cancel()
            if interrupted and tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            stop.set()
            if sampler_task is not None:
                await sampler_task
            bar.close()
        wall = loop.time() - t0
    for task, rec in zip(tasks, records, strict=False):
        # A bug in send_one must show up in the record, not vanish.
        if not task.cancelled() and task.exception() is not None:
            rec.outcome = ERROR
            rec.error = f"loadgen: {task.exception()!r}"[:300]
        elif task.cancelled() and rec.t_sent is not None:
            rec.outcome = ERROR
            rec.error = INTERRUPTED
    if interrupted:
        # What was never sent was never offered: the report covers the requests sent.
        records = [r for r in records if r.t_sent is not None]
    lags = sorted((r.t_sent - r.t_planned) for r in records if r.t_sent is not None)
    meta: dict[str, Any] = {
        "target": target,
        "model": model,
        "api": api,
        "started_at": started_wall.isoformat(),
        "wall_s": wall,
        "planned_duration_s": plan[-1].t_offset if plan else 0.0,
        "requests": len(plan),
        "timeout_s": request_timeout,
        "retry": retry,
        "metrics_url": metrics_url,
        "metrics": list(metrics) if metrics_url else [],
        "scrapes": sampler.scrapes if sampler else 0,
        "scrape_errors": sampler.errors if sampler else 0,
        "scrape_last_error": sampler.last_error if sampler else None,
        # How late the client sent requests; a large value means the generator itself saturated.
        "send_lag_p99_s": lags[int(0.99 * (len(lags) - 1))] if lags else None,
        "send_lag_max_s": lags[-1] if lags else None,
        "unix_time_at_t0": time.time() - (loop.time() - t0),
        "interrupted": interrupted,
    }
    return LoadResult(records, sampler.samples if sampler else [], meta)


async def run_load(
    plan: Sequence[PlannedRequest],
    target: str = DEFAULT_TARGET,
    *,
    model: str | None = None,
    api: Api = "completions",
    request_timeout: float = 120.0,
    retry: int = 0,
    retry_max_wait: float = 30.0,
    extra_headers: dict[str, str] | None = None,
    progress: bool = False,
) -> list[Record]:
    """Send `plan` open-loop to `target` and return one `Record` per planned request."""
    result = await run_load_detailed(
        plan, target, model=model, api=api, request_timeout=request_timeout, retry=retry,
        retry_max_wait=retry_max_wait, extra_headers=extra_headers, progress=progress,
    )
    return result.records
