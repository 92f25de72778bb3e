"""Helpers for the live controller tests: configs, a controller running in the test's loop,
and a small streaming client that checks every stream completed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from floodgate.controller.actuators.process import ProcessActuator, sim_command
from floodgate.controller.app import Controller
from floodgate.controller.config import ControllerConfig, parse_config
from floodgate.extproc.registry import Registry
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack

# Fast emulator timings: sub-second cold start, sleep and wake; few slots so a handful of
# concurrent streams builds a waiting queue (the scale-up trigger).
SIM_ARGS = ("--cold-start", "0.5", "--wake-delay-level1", "0.3", "--sleep-delay", "0.1",
            "--max-num-seqs", "2", "--log-level", "warning")


def emulator_pods(kube: Any, stack: LocalStack, port: int, *, first_ip: int,
                  stop_signal: signal.Signals = signal.SIGTERM) -> None:
    """Make the fake API server's pods real (tests/controller/fake_kube.py): each pod that turns
    Running is an emulator (`floodgate sim`) on its own loopback address, from 127.0.0.`first_ip`
    on (distinct per test file, so two files' pods never share an address), and a deleted pod's
    emulator gets `stop_signal` (SIGKILL: the pod is gone with everything it was serving;
    SIGTERM: it shuts down as a pod's container is told to). The hooks run inside the fake's
    loop, so they only start and signal, never wait."""
    ips = (f"127.0.0.{n}" for n in itertools.count(first_ip))

    def start_emulator(pod: dict[str, Any]) -> None:
        ip = pod["status"]["podIP"]
        stack.sup.start(pod["metadata"]["name"], [sys.executable, "-m", "floodgate", "sim", "--host", ip,
                                                  "--port", str(port), "--enable-sleep-mode", *SIM_ARGS])

    def stop_emulator(pod: dict[str, Any]) -> None:
        child = next((c for c in stack.sup.children if c.name == pod["metadata"]["name"]), None)
        if child is not None:
            child.kill(stop_signal)

    kube.ip_allocator = lambda: next(ips)
    kube.on_running = start_emulator
    kube.on_deleted = stop_emulator


def controller_config(redis_url: str, *, policy: dict[str, Any] | None = None,
                      warm_pool: dict[str, Any] | None = None, tick: float = 0.25,
                      leader: dict[str, Any] | None = None, pool: str = "default",
                      timeouts: dict[str, Any] | None = None,
                      actuator: dict[str, Any] | None = None) -> ControllerConfig:
    return parse_config({
        "redis": {"url": redis_url},
        "tick_interval_s": tick,
        "metrics_listen": None,
        "leader": leader or {"ttl_s": 3},
        "pools": [{
            "name": pool,
            "policy": {"stabilization_window_s": 0, "scale_down_interval_s": 0, "panic_window_s": 0,
                       **(policy or {})},
            "forecast": {"enabled": False},
            "warm_pool": {"burst_fraction": 0, **(warm_pool or {})},
            "timeouts": {"health_s": 30, "warmup_s": 10, "wake_s": 10, "sleep_s": 30, "adopt_grace_s": 5,
                         **(timeouts or {})},
            "actuator": actuator or {"kind": "process"},
        }],
    }, env={})


def process_actuator(stack: LocalStack, state_dir: Path, *extra: str) -> ProcessActuator:
    return ProcessActuator(sim_command(*SIM_ARGS, *extra), state_dir, supervisor=stack.sup)


@contextlib.asynccontextmanager
async def running(cfg: ControllerConfig, actuator: ProcessActuator, holder: str = "test",
                  wait_ready: bool = True, stop_replicas_on_exit: bool = False,
                  clock_skew_s: float = 0.0) -> AsyncIterator[Controller]:
    """A controller ticking in the background; on exit it stops gracefully (replicas stay,
    unless `stop_replicas_on_exit` and it leads then). `clock_skew_s`: its clock runs that far
    ahead of this host's (a standby on a host whose clock is off, or a step)."""
    from floodgate.controller.app import STEADY_CLOCK

    kw = {"clock": lambda: STEADY_CLOCK() + clock_skew_s} if clock_skew_s else {}
    ctl = Controller(cfg, {cfg.pools[0].name: actuator}, holder=holder, stop_replicas_on_exit=stop_replicas_on_exit,
                     **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(ctl.run(stop))
    try:
        if wait_ready:
            await asyncio.wait_for(ctl.ready.wait(), 15)
        yield ctl
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def registry_states(redis_url: str, pool: str = "default") -> dict[str, str]:
    """replica id -> registry state."""
    c = redis_client(redis_url, op_timeout_s=2)
    try:
        return {e.replica_id: e.state for e in (await Registry(c, pool).endpoints()).values()}
    finally:
        await c.aclose()


async def wait_for(pred: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = await pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met after {timeout} s")
        await asyncio.sleep(interval)


def count(states: dict[str, str], state: str) -> int:
    return sum(1 for s in states.values() if s == state)


@dataclass
class StreamStats:
    ok: int = 0
    failed: list[str] = field(default_factory=list)


async def stream_once(session: aiohttp.ClientSession, url: str, tokens: int, stats: StreamStats) -> None:
    body = {"model": "floodgate-sim-8b", "prompt": "hello", "stream": True, "max_tokens": tokens}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                headers={"x-sim-output-tokens": str(tokens)},
                                timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.read()
            if r.status == 200 and b"[DONE]" in data:
                stats.ok += 1
            else:
                stats.failed.append(f"{r.status} {r.headers.get('x-floodgate-reject-reason')} {data[-120:]!r}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        stats.failed.append(f"{type(exc).__name__}: {exc}")


async def stream_loop(session: aiohttp.ClientSession, url: str, tokens: int, stats: StreamStats,
                      stop: asyncio.Event) -> None:
    while not stop.is_set():
        await stream_once(session, url, tokens, stats)


def picking_config() -> dict[str, Any]:
    return {"admission": {"trust": {"cidrs": ["127.0.0.0/8"]}},
            "pools": [{"name": "default", "endpoint_picking": True, "limit": {"mode": "static", "initial": 64}}]}
