"""The emulated vLLM server: OpenAI-compatible HTTP API, vLLM metrics and sleep API.

One asyncio task (the engine loop) advances the pure `Engine` step by step, sleeping until the
next step ends, and pushes the sampled tokens to per-request queues; request handlers only
wait on their queue and write SSE chunks. There is no timer per token or per request, which is
what lets one process drive hundreds of concurrent streams.

Behaviour chosen to match vLLM (see docs/emulator.md):
* `/health` is 503 until the cold-start delay (counted from process spawn) has passed, then
  200, also while asleep.
* While the engine sleeps (or drains to sleep, or wakes), the completion endpoints answer 503.
* The sleep endpoints exist only with `enable_sleep_mode` (404 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from floodgate.sim.engine import (
    Engine,
    EngineConfig,
    EngineNotAwake,
    PriorityNotEnabled,
    RequestTooLong,
    Sequence,
    SleepState,
    TokenEvent,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from floodgate.runtime import ListenError

log = logging.getLogger("floodgate.sim")

OUTPUT_TOKENS_HEADER = "x-sim-output-tokens"
PROMPT_TOKENS_HEADER = "x-sim-prompt-tokens"

# Plain words: nothing to JSON-escape, so chunks are built by string concatenation.
_WORDS = (
    " the", " flood", " gate", " holds", " back", " water", " until", " the", " river",
    " can", " carry", " it", " and", " then", " opens", " again", ".",
)

# Bucket boundaries as in vLLM's PrometheusStatLogger, so dashboards and the controller's
# histogram deltas behave the same against the emulator and the real server.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class EmulatorConfig:
    model: str = "floodgate-sim-8b"
    engine: EngineConfig = field(default_factory=EngineConfig)
    cold_start_s: float = 10.0
    enable_sleep_mode: bool = False
    # Chat requests without max_tokens and without the output-length header stop ("EOS")
    # after this many tokens. Completions default to 16 tokens, like vLLM and OpenAI.
    default_output_tokens: int = 256


class _Abort:
    """Queue sentinel: the engine dropped the request (sleep with mode=abort)."""


_ABORT = _Abort()


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


class _Metrics:
    def __init__(self, model: str, engine: Engine, state: Callable[[], str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        lv = {"model_name": model, "engine": "0"}
        self._lv = lv
        r = self.registry

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=r).labels(**lv).set_function(fn)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              lambda: engine.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              lambda: engine.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              lambda: engine.kv_cache_usage)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            (*labels, "sleep_state"), registry=r)
        for s in ("awake", "weights_offloaded", "discard_all"):
            sleep.labels(**lv, sleep_state=s).set_function(
                lambda s=s: 1.0 if state() == s else 0.0)  # type: ignore[misc]
        cfg = engine.config
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ("model_name", "engine", "block_size", "num_gpu_blocks"),
              registry=r).labels(**lv, block_size=str(cfg.block_size),
                                 num_gpu_blocks=str(cfg.num_kv_blocks)).set(1)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*labels, "finished_reason"), registry=r)
        self._success_children = {
            reason: self.success.labels(**lv, finished_reason=reason)
            for reason in ("stop", "length", "abort")
        }
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(**lv)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.",
                                         labels, registry=r).labels(**lv)
        self.preemptions = Counter("vllm:num_preemptions",
                                   "Cumulative number of preemption from the engine.",
                                   labels, registry=r).labels(**lv)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.",
                              labels, buckets=_TTFT_BUCKETS, registry=r).labels(**lv)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             labels, buckets=_ITL_BUCKETS, registry=r).labels(**lv)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             labels, buckets=_E2E_BUCKETS, registry=r).labels(**lv)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    labels, buckets=_E2E_BUCKETS, registry=r).labels(**lv)
        self._preemptions_seen = 0

    def observe(self, events: list[TokenEvent], engine: Engine) -> None:
        prompt = 0
        for ev in events:
            seq = ev.seq
            if ev.gap is None:
                self.ttft.observe(ev.time - seq.arrival)
                if seq.scheduled_at is not None:
                    self.queue_time.observe(seq.scheduled_at - seq.arrival)
                prompt += seq.prompt_tokens
            else:
                self.itl.observe(ev.gap)
            if ev.finished:
                self.e2e.observe(ev.time - seq.arrival)
                self._success(seq.finish_reason).inc()
        if events:
            self.generation_tokens.inc(len(events))
        if prompt:
            self.prompt_tokens.inc(prompt)
        if engine.stats.preemptions != self._preemptions_seen:
            self.preemptions.inc(engine.stats.preemptions - self._preemptions_seen)
            self._preemptions_seen = engine.stats.preemptions

    def _success(self, reason: str) -> Any:
        child = self._success_children.get(reason)
        if child is None:
            child = self._success_children[reason] = self.success.labels(
                **self._lv, finished_reason=reason)
        return child

    def count_abort(self) -> None:
        self._success("abort").inc()


def _estimate_tokens(text: str) -> int:
    # ~4 characters per token for English text with Llama-style tokenizers.
    return max(1, round(len(text) / 4))


def _int_header(request: web.Request, name: str) -> int | None:
    raw = request.headers.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"header {name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ApiError(400, f"header {name} must be >= 1")
    return value


def _opt_int(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"{name} must be a positive integer", param=name)
        return value
    return None


def process_age() -> float:
    """Seconds since this process was spawned (Linux: /proc/self/stat starttime against
    CLOCK_BOOTTIME, the clock it is counted on); 0.0 where that cannot be read. Not psutil:
    its create_time() adds the boot time, which /proc/stat gives in whole seconds (up to 1 s off)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@dataclass
class _Request:
    """What a handler needs about one parsed completion request."""

    chat: bool
    stream: bool
    include_usage: bool
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    model: str
    priority: int = 0  # vLLM's request field: lower is scheduled first (priority policy)



@web.middleware
async def _fastapi_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Routing errors as vLLM's FastAPI server gives them: JSON `{"detail": ...}` (aiohttp's own
    are text/plain), with the Allow header of a 405 kept."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPMethodNotAllowed as exc:
        return web.json_response({"detail": "Method Not Allowed"}, status=405,
                                 headers={"Allow": ", ".join(sorted(exc.allowed_methods))})
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)

class Emulator:
    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.engine = Engine(config.engine)
        self.metrics = _Metrics(config.model, self.engine, self._sleep_label)
        self._streams: dict[str, asyncio.Queue[TokenEvent | _Abort]] = {}
        self._wake = asyncio.Event()
        self._state_changed = asyncio.Event()  # replaced after each sleep-state transition
        self._loop_task: asyncio.Task[None] | None = None
        self._ready_at = 0.0
        self._created = int(time.time())
        self._model_json = json.dumps(config.model)

    # ---- lifecycle ------------------------------------------------------------------------

    def app(self) -> web.Application:
        # vLLM's server sets no body limit (long contexts, base64 images); aiohttp's default 1 MiB would
        # answer 413 where vLLM serves.
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_fastapi_errors])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/sleep", self._sleep)
        app.router.add_post("/wake_up", self._wake_up)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        # The cold start counts from process spawn, as a real replica's does (the interpreter's
        # own start-up is part of it, not added on top).
        self._ready_at = self._now() + max(0.0, self.config.cold_start_s - process_age())
        self._loop_task = asyncio.create_task(self._engine_loop(), name="sim-engine-loop")

    async def _on_cleanup(self, _app: web.Application) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _sleep_label(self) -> str:
        if not self.engine.is_sleeping:
            return "awake"
        return "discard_all" if self.engine.sleep_level >= 2 else "weights_offloaded"

    def _ready(self) -> bool:
        return self._now() >= self._ready_at

    # ---- engine loop ----------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        state = self.engine.sleep_state
        while True:
            self._wake.clear()
            events = self.engine.advance(loop.time())
            if self.engine.sleep_state is not state:
                state = self.engine.sleep_state
                self._notify_state()
            if events:
                self.metrics.observe(events, self.engine)
                streams = self._streams
                for ev in events:
                    q = streams.get(ev.seq.request_id)
                    if q is not None:
                        q.put_nowait(ev)
            nxt = self.engine.next_event_time()
            if nxt is None:
                # Idle: only a new request (or a sleep/wake call) can create work.
                await self._wake.wait()
                continue
            delay = nxt - loop.time()
            if delay <= 0:
                await asyncio.sleep(0)  # the clock moved on while advancing: go again
                continue
            if self.engine.step_in_flight:
                # Arrivals cannot change a step already running: sleep through them.
                await asyncio.sleep(delay)
            else:
                # Waiting for a wake-up to complete: a sleep/wake call may change the plan.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)

    def _kick(self) -> None:
        self._wake.set()

    def _notify_state(self) -> None:
        self._state_changed.set()
        self._state_changed = asyncio.Event()

    async def _wait_while(self, state: SleepState) -> None:
        while self.engine.sleep_state is state:
            await self._state_changed.wait()

    # ---- request parsing ------------------------------------------------------------------

    async def _parse(self, request: web.Request, chat: bool) -> _Request:
        if not self._ready():
            raise ApiError(503, "the model is still loading", "ServiceUnavailableError")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if body.get("n", 1) not in (1, None):
            raise ApiError(400, "the emulator only supports n=1", param="n")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "messages must be a non-empty list", param="messages")
            chars = 0
            for msg in messages:
                content = msg.get("content") if isinstance(msg, dict) else None
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
            # Chat template overhead: a few tokens per message plus the assistant header.
            counted = _estimate_tokens("x" * chars) + 4 * len(messages) + 3
            max_tokens = _opt_int(body, "max_completion_tokens", "max_tokens")
            default_out = self.config.default_output_tokens
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                counted = _estimate_tokens(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                counted = len(prompt)  # token ids
            elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                counted = _estimate_tokens(prompt[0])
            else:
                raise ApiError(400, "prompt must be a string, a one-element list of strings or "
                                    "a list of token ids", param="prompt")
            max_tokens = _opt_int(body, "max_tokens")
            default_out = 16  # the OpenAI/vLLM default for legacy completions
        prompt_tokens = _int_header(request, PROMPT_TOKENS_HEADER) or counted
        trace_out = _int_header(request, OUTPUT_TOKENS_HEADER)
        if trace_out is not None:
            # The trace says when the model emits EOS; max_tokens still cuts it short.
            if max_tokens is not None and max_tokens < trace_out:
                output, reason = max_tokens, "length"
            else:
                output, reason = trace_out, "stop"
        elif max_tokens is not None:
            output, reason = max_tokens, "length"
        else:
            output, reason = default_out, ("stop" if chat else "length")
        priority = body.get("priority", 0)
        if priority is None:
            priority = 0
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ApiError(400, "priority must be an integer", param="priority")
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        include_usage = stream and isinstance(opts, dict) and bool(opts.get("include_usage"))
        return _Request(chat, stream, include_usage, prompt_tokens, output, reason,
                        self.config.model, priority)

    # ---- completion handlers --------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req = await self._parse(request, chat)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            queue: asyncio.Queue[TokenEvent | _Abort] = asyncio.Queue()
            try:
                self.engine.add_request(rid, req.prompt_tokens, req.output_tokens, self._now(),
                                        req.finish_reason, priority=req.priority)
            except EngineNotAwake:
                raise ApiError(503, "The model is sleeping. Wake it up via /wake_up first.",
                               "ServiceUnavailableError") from None
            except (RequestTooLong, PriorityNotEnabled) as exc:
                raise ApiError(400, str(exc)) from None
        except ApiError as err:
            return err.response()
        self._streams[rid] = queue
        self._kick()
        try:
            if req.stream:
                return await self._stream(request, req, rid, queue)
            return await self._unary(req, rid, queue)
        finally:
            # Normal end, client disconnect (handler cancelled) or write error: the sequence
            # and its KV blocks must not outlive the handler.
            del self._streams[rid]
            if self.engine.abort(rid, self._now()) is not None:
                self.metrics.count_abort()

    def _usage(self, req: _Request, completion: int) -> dict[str, int]:
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": completion,
                "total_tokens": req.prompt_tokens + completion}

    async def _unary(self, req: _Request, rid: str,
                     queue: asyncio.Queue[TokenEvent | _Abort]) -> web.StreamResponse:
        words: list[str] = []
        finish_reason = "abort"
        while True:
            ev = await queue.get()
            if isinstance(ev, _Abort):
                break
            words.append(_WORDS[ev.index % len(_WORDS)])
            if ev.finished:
                finish_reason = ev.seq.finish_reason
                break
        text = "".join(words)
        choice: dict[str, Any]
        if req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason}
        body = {
            "id": rid,
            "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [choice],
            "usage": self._usage(req, len(words)),
        }
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: _Request, rid: str,
                      queue: asyncio.Queue[TokenEvent | _Abort]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = str(int(time.time()))
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        head = (f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                f'"model":{self._model_json},"choices":[')
        if req.chat:
            tok_open, tok_close = '{"index":0,"delta":{"content":"', '"},"logprobs":null,'
        else:
            tok_open, tok_close = '{"index":0,"text":"', '","logprobs":null,'
        mid = '"finish_reason":null}]}\n\n'
        sent = 0
        done = False
        while not done:
            ev = await queue.get()
            batch = [ev]
            while not queue.empty():  # coalesce tokens that arrived together into one write
                batch.append(queue.get_nowait())
            parts: list[str] = []
            if sent == 0 and req.chat:
                parts.append(head + '{"index":0,"delta":{"role":"assistant","content":""},'
                             '"logprobs":null,"finish_reason":null}]}\n\n')
            for item in batch:
                if isinstance(item, _Abort):
                    parts.append(head + tok_open + tok_close + '"finish_reason":"abort"}]}\n\n')
                    done = True
                    break
                word = _WORDS[item.index % len(_WORDS)]
                sent += 1
                if item.finished:
                    parts.append(head + tok_open + word + tok_close + '"finish_reason":"'
                                 + item.seq.finish_reason + '"}]}\n\n')
                    done = True
                    break
                parts.append(head + tok_open + word + tok_close + mid)
            if done and req.include_usage:
                parts.append(f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                             f'"model":{self._model_json},"choices":[],'
                             f'"usage":{json.dumps(self._usage(req, sent))}}}\n\n')
            if done:
                parts.append("data: [DONE]\n\n")
            await resp.write("".join(parts).encode())
        await resp.write_eof()
        return resp

    # ---- other endpoints ------------------------------------------------------------------

    async def _models(self, _request: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response({"object": "list", "data": [{
            "id": cfg.model, "object": "model", "created": self._created, "owned_by": "vllm",
            "root": cfg.model, "parent": None, "max_model_len": cfg.engine.max_model_len,
            "permission": [],
        }]})

    async def _health(self, _request: web.Request) -> web.Response:
        # Like vLLM, health reports a live engine; sleeping is visible on /is_sleeping.
        return web.Response(status=200 if self._ready() else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _require_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise web.HTTPNotFound(text="sleep mode is not enabled (--enable-sleep-mode)")

    async def _sleep(self, request: web.Request) -> web.Response:
        self._require_sleep_mode()
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            return ApiError(400, "level must be 1 or 2", param="level").response()
        mode = request.query.get("mode", "abort")
        try:
            aborted = self.engine.sleep(level, mode, self._now())
        except ValueError as exc:
            return ApiError(400, str(exc)).response()
        for seq in aborted:
            self._notify_abort(seq)
        self._notify_state()
        self._kick()
        await self._wait_while(SleepState.DRAINING)  # mode=wait: in-flight requests finish
        if self.engine.sleep_state is SleepState.ASLEEP:
            await asyncio.sleep(self.config.engine.sleep_s)  # time to offload the weights
        return web.Response(status=200)

    def _notify_abort(self, seq: Sequence) -> None:
        q = self._streams.get(seq.request_id)
        if q is not None:
            q.put_nowait(_ABORT)
        self.metrics.count_abort()

    async def _wake_up(self, _request: web.Request) -> web.Response:
        self._require_sleep_mode()
        self.engine.wake_up(self._now())
        self._notify_state()
        self._kick()
        await self._wait_while(SleepState.WAKING)  # the engine loop completes it on time
        return web.Response(status=200)

    async def _is_sleeping(self, _request: web.Request) -> web.Response:
        self._require_sleep_mode()
        return web.json_response({"is_sleeping": self.engine.is_sleeping})


def _listen_error(host: str, port: int, exc: OSError) -> ListenError:
    """One line naming the option at fault (exit 2 via run_until_signalled), not a traceback."""
    if isinstance(exc, socket.gaierror):
        return ListenError(f"--host {host}: not a known host name or address ({exc.strerror or exc})")
    # uvloop's strerror is a whole sentence; the errno's own text is the reason.
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        return ListenError(f"--port {port}: cannot listen on {host}:{port}: {reason}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ListenError(f"--host {host}: not an address of this host ({reason})")
    return ListenError(f"--host {host} --port {port}: cannot listen: {reason}")


async def serve(config: EmulatorConfig, host: str, port: int,
                stop: asyncio.Event | None = None) -> None:
    """Run the emulator until `stop` is set (or forever)."""
    emulator = Emulator(config)
    # handler_cancellation: a client disconnect cancels its handler, which aborts the sequence.
    runner = web.AppRunner(emulator.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=2048)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise _listen_error(host, port, exc) from None
    log.info("floodgate sim serving model %s on http://%s:%d (ready in %.1fs)",
             config.model, host, port, config.cold_start_s)
    try:
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
