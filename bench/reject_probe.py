"""A low-rate P2 probe in its own process: how fast a P2 rejection reaches a client that is not busy.

The overload bench's load generator is one Python event loop sending ~60 requests/s and reading
hundreds of streams; at p99 it sends 6-25 ms late, and the same loop reads the 429s, so its
"P2 reject p99" includes its own lag. This probe runs beside it, in its own process with its own
event loop and nothing else to do: it sends small P2 completions through the same Envoy on its
own fixed schedule (`rate` per second over a window), times each one from send to the last byte
of the response with the monotonic clock, and reports how late it sent each one (its own send
lag), so a reader can tell whether a slow answer was the gateway or the client. `--nice -10`
(the overload bench's default) runs it ahead of the box's other processes: a real client does
not share its CPU with the gateway, and on a 2-core box shared by the bench and other jobs the
probe's own scheduling delay would otherwise land in every time it measures (its send lag says
how much did anyway).

The probes are real requests: a rejected one is a real P2 decision of the processor; an admitted
one runs on the pool (a short prompt and 2 output tokens: negligible next to the bench's load).

    python -m floodgate.bench.reject_probe --url http://127.0.0.1:10000 --start-unix T \\
        --duration 60 --rate 8 --out probes.json

Writes a JSON object: {"probes": [{"t_unix_planned", "t_unix_sent", "lag_s", "latency_s",
"status", "reason"}...], "rate", "duration_s"}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROBE_TENANT = "reject-probe"
PROBE_PROMPT_TOKENS = 32
PROBE_OUTPUT_TOKENS = 2


def schedule(start_unix: float, duration_s: float, rate: float) -> list[float]:
    """Planned send times (unix seconds): evenly spaced, `rate` per second over the window."""
    if rate <= 0 or duration_s <= 0:
        return []
    n = int(duration_s * rate)
    return [start_unix + i / rate for i in range(n)]


async def _one(session: Any, url: str, model: str, planned_mono: float, mono_to_unix: float,
               timeout_s: float, probe_id: int = 0) -> dict[str, Any]:
    import aiohttp

    body = {"model": model, "prompt": "probe " * (PROBE_PROMPT_TOKENS - 1), "max_tokens": PROBE_OUTPUT_TOKENS,
            "stream": False}
    headers = {"x-request-priority": "2", "x-tenant-id": PROBE_TENANT,
               "x-sim-prompt-tokens": str(PROBE_PROMPT_TOKENS), "x-sim-output-tokens": str(PROBE_OUTPUT_TOKENS),
               # joins the probe to Envoy's access-log line (envoy_config.ACCESS_LOG_FORMAT)
               "x-probe-id": str(probe_id)}
    sent = time.monotonic()
    out: dict[str, Any] = {"id": probe_id, "t_unix_planned": planned_mono + mono_to_unix, "t_unix_sent": sent + mono_to_unix,
                           "lag_s": sent - planned_mono, "latency_s": None, "status": None, "reason": None}
    try:
        async with session.post(url, json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            await r.read()
            out["latency_s"] = time.monotonic() - sent
            out["status"] = r.status
            out["reason"] = r.headers.get("x-floodgate-reject-reason")
    except (aiohttp.ClientError, TimeoutError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


async def run_probe(url: str, start_unix: float, duration_s: float, rate: float, *,
                    timeout_s: float = 5.0) -> list[dict[str, Any]]:
    import aiohttp
    from floodgate.sim.loadgen import resolve_model

    target = url.rstrip("/") + "/v1/completions"
    # One fixed offset between the two clocks: sends are scheduled and timed on the monotonic one.
    mono_to_unix = time.time() - time.monotonic()
    tasks: list[asyncio.Task[dict[str, Any]]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        model = await resolve_model(session, url)
        for i, t_unix in enumerate(schedule(start_unix, duration_s, rate)):
            planned = t_unix - mono_to_unix
            delay = planned - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, target, model, planned, mono_to_unix, timeout_s, i)))
        return list(await asyncio.gather(*tasks))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="Envoy's listener, e.g. http://127.0.0.1:10000")
    ap.add_argument("--start-unix", type=float, required=True, help="unix time of the first probe")
    ap.add_argument("--duration", type=float, required=True, help="seconds of probing")
    ap.add_argument("--rate", type=float, default=8.0, help="probes per second")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--nice", type=int, default=0,
                    help="change this process's niceness first (negative needs privileges; "
                         "the niceness in effect is written to the output)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.nice:
        try:
            os.nice(args.nice)
        except PermissionError:
            pass  # not privileged: run at the niceness we have, and say so in the output
    probes = asyncio.run(run_probe(args.url, args.start_unix, args.duration, args.rate, timeout_s=args.timeout))
    args.out.write_text(json.dumps({"rate": args.rate, "duration_s": args.duration, "nice": os.nice(0),
                                    "probes": probes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
