"""A tiny OpenAI-style upstream for the admission tests (not the emulator: no batching model).

Streams `x-test-chunks` SSE chunks `x-test-delay-ms` apart (dropping the connection after
`x-test-cut-after` of them when set), answers `x-test-status` instead when set, and counts concurrent requests so tests can check the limit at the model's door:
`GET /stats` -> {"inflight", "max_inflight", "total"}, `POST /stats/reset`.

    python tests/upstream.py --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from aiohttp import web


class Upstream:
    def __init__(self) -> None:
        self.inflight = 0
        self.max_inflight = 0
        self.total = 0
        self.status = 0  # --status: every completion answered with it
        self.seen: list[dict[str, str]] = []
        self.paths: list[str] = []  # every path requested, in order
        # the last request bodies as received: content-length header, bytes read, text (truncated)
        self.bodies: list[dict[str, Any]] = []

    @web.middleware
    async def record_path(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in ("/stats", "/stats/reset"):
            self.paths.append(request.path_qs)
            del self.paths[:-500]
            # The x- headers every request arrived with (security tests check what got through).
            self.seen.append({k.lower(): v for k, v in request.headers.items() if k.lower().startswith(("x-", "x_"))})
            del self.seen[:-200]
        return await handler(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.total += 1
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            raw = await request.read()
            self.bodies.append({"content_length": request.headers.get("content-length"), "len": len(raw),
                                "chunked": "chunked" in request.headers.get("transfer-encoding", ""),
                                "text": raw[:4096].decode("utf-8", "replace")})
            del self.bodies[:-50]
            h = request.headers
            status = self.status or int(h.get("x-test-status", "200"))
            chunks = int(h.get("x-test-chunks", "4"))
            delay = float(h.get("x-test-delay-ms", "5")) / 1000
            if status != 200:
                await asyncio.sleep(delay)
                return web.json_response({"error": {"message": "test failure", "type": "server_error",
                                                    "code": None}}, status=status)
            try:
                streamed = json.loads(raw).get("stream") is not False
            except (ValueError, AttributeError):
                streamed = True
            if not streamed:  # "stream": false, said outright: one JSON body with usage at its end
                await asyncio.sleep(delay * chunks)
                return web.json_response({"id": "t", "object": "text_completion",
                                          "choices": [{"index": 0, "text": "".join(f" t{i}" for i in range(chunks))}],
                                          "usage": {"prompt_tokens": 4, "completion_tokens": chunks,
                                                    "total_tokens": chunks + 4}})
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            cut = int(h.get("x-test-cut-after", "-1"))
            for i in range(chunks):
                await asyncio.sleep(delay)
                if i == cut:  # a replica dying mid-stream: the connection drops, no end of body
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                chunk = {"id": "t", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"id": "t", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": chunks,
                                                          "total_tokens": chunks + 4}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"inflight": self.inflight, "max_inflight": self.max_inflight,
                                  "total": self.total, "seen": self.seen[-20:], "paths": self.paths,
                                  "bodies": self.bodies[-20:]})

    async def reset(self, request: web.Request) -> web.Response:
        self.max_inflight = self.inflight
        self.total = 0
        self.seen.clear()
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "test-model", "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--status", type=int, default=0, help="answer every completion with this status (a broken engine)")
    args = ap.parse_args()
    up = Upstream()
    up.status = args.status
    app = web.Application(middlewares=[up.record_path])
    app.router.add_post("/v1/completions", up.completions)
    app.router.add_post("/v1/chat/completions", up.completions)
    app.router.add_get("/stats", up.stats)
    app.router.add_post("/stats/reset", up.reset)
    app.router.add_get("/health", up.health)
    app.router.add_get("/v1/models", up.models)
    for admin in ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache", "/metrics",
                  "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/server_info", "/pause"):
        app.router.add_route("*", admin, up.health)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
