"""How many concurrent streams one `floodgate sim` process sustains.

For each concurrency level, start a fresh emulator (all streams fit in one batch, KV cache big
enough), open that many streaming completions at once with aiohttp, and compare what the
clients observe with what the engine model says:

* `itl_ratio` = client-observed mean inter-token gap / the model's mean ITL from /metrics.
  Near 1.0 means the process delivers tokens as fast as the model emits them; well above 1.0
  means the event loop is the bottleneck, not the emulated GPU.
* `sim_cpu` = share of one core the emulator used (from /proc), the headroom left.

Run: .venv/bin/python -m floodgate.bench.sim_capacity --levels 100 300 500
     .venv/bin/python -m floodgate.bench.sim_capacity --levels 500 --time-scale 0.2   # stress the process
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable

import aiohttp
from floodgate.bench.overhead import cpu_seconds
from prometheus_client.parser import text_string_to_metric_families

from floodgate.supervisor import Supervisor, free_port, wait_for_port


async def _itl(session: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:inter_token_latency_seconds":
            for s in fam.samples:
                if s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = s.value
    return total, count


async def _one(session: aiohttp.ClientSession, base: str, tokens: int) -> tuple[float, float, int]:
    t0 = time.monotonic()
    stamps: list[float] = []
    body = {"model": "floodgate-sim-8b", "prompt": "x" * 400, "max_tokens": tokens,
            "stream": True}
    async with session.post(base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                stamps.append(time.monotonic())
    gap = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return stamps[0] - t0, gap, len(stamps)


async def _level(base: str, pid: int, concurrency: int, tokens: int) -> dict[str, float]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        sum0, n0 = await _itl(session, base)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        results = await asyncio.gather(*(_one(session, base, tokens)
                                         for _ in range(concurrency)))
        wall = time.monotonic() - t0
        cpu = cpu_seconds(pid) - cpu0
        sum1, n1 = await _itl(session, base)
    model_itl = (sum1 - sum0) / max(1.0, n1 - n0)
    client_itl = statistics.mean(r[1] for r in results)
    return {
        "streams": concurrency,
        "complete": sum(1 for r in results if r[2] == tokens),
        "tokens_per_s": concurrency * tokens / wall,
        "model_itl_ms": model_itl * 1000,
        "client_itl_ms": client_itl * 1000,
        "itl_ratio": client_itl / model_itl,
        "p99_ttft_ms": sorted(r[0] for r in results)[int(0.99 * (concurrency - 1))] * 1000,
        "sim_cpu": cpu / wall,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[100, 300, 500])
    ap.add_argument("--tokens", type=int, default=200, help="output tokens per stream")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="emulator --time-scale; below 1 the model emits tokens faster, to "
                         "find where the process (not the model) becomes the limit")
    args = ap.parse_args(argv)
    loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:  # plain asyncio still works, the client just costs more CPU
        pass
    print(f"{'streams':>7} {'done':>5} {'tok/s':>7} {'model_itl':>9} {'client_itl':>10} "
          f"{'ratio':>6} {'p99_ttft':>8} {'sim_cpu':>7}")
    for n in args.levels:
        with Supervisor() as sup:
            port = free_port()
            kv_blocks = n * (100 + args.tokens + 32) // 16 + 64
            child = sup.start_python("sim", [
                "-m", "floodgate", "sim", "--port", str(port), "--cold-start", "0",
                "--max-num-seqs", str(n), "--kv-blocks", str(kv_blocks),
                "--log-level", "warning", "--time-scale", str(args.time_scale),
            ])
            wait_for_port("127.0.0.1", port, 15, child.proc)
            with asyncio.Runner(loop_factory=loop_factory) as runner:
                r = runner.run(_level(f"http://127.0.0.1:{port}", child.proc.pid, n, args.tokens))
        print(f"{r['streams']:>7} {r['complete']:>5.0f} {r['tokens_per_s']:>7.0f} "
              f"{r['model_itl_ms']:>7.1f}ms {r['client_itl_ms']:>8.1f}ms {r['itl_ratio']:>6.2f} "
              f"{r['p99_ttft_ms']:>6.0f}ms {r['sim_cpu']:>6.0%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
