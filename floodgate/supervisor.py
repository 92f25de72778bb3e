"""Start and stop the local processes of a stack (Redis, Envoy, processors, emulators).

Used by `floodgate up`, the benchmarks and the integration tests, so every one of them
starts real processes the same way and leaves none behind: each child gets its own process
group, and `stop()` terminates the group, escalating to SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from floodgate.binaries import envoy_binary, redis_server_binary

_HANDED_OUT: set[int] = set()  # ports free_port returned in this process (a child may not have bound one yet)
_PORTS = random.SystemRandom()  # independent of any seeding of `random` by the caller


def _ephemeral_low() -> int:
    """Start of the kernel's range for the source ports of outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS starts at 49152


def default_port_range() -> tuple[int, int]:
    """[lo, hi) free_port picks from without `FLOODGATE_PORT_RANGE`: 20000 up to the ephemeral range."""
    return 20000, min(_ephemeral_low(), 32768)


def port_range_error(raw: str) -> str | None:
    """Why `FLOODGATE_PORT_RANGE=raw` is not a range free_port can use (None: it is, or unset).
    The CLI stops on it (exit 2) before anything starts: ignored, it left a user's range
    unapplied without a word (review user)."""
    if raw == "":
        return None
    try:
        lo, hi = (int(x) for x in raw.split("-"))
    except ValueError:
        return f"FLOODGATE_PORT_RANGE={raw!r}: expected LO-HI, e.g. 40000-41000"
    if not 1024 <= lo < hi <= 65536:
        return f"FLOODGATE_PORT_RANGE={raw!r}: expected 1024 <= LO < HI <= 65536"
    return None


def _port_range() -> tuple[int, int]:
    """[lo, hi) that free_port picks from: `FLOODGATE_PORT_RANGE=lo-hi` (inherited by child
    processes: test workers running side by side each take a range of their own, so none picks
    a port another has picked and not bound yet), else `default_port_range()` (also for a value
    `port_range_error` refuses: the CLI has said so already)."""
    raw = os.environ.get("FLOODGATE_PORT_RANGE", "")
    if port_range_error(raw) is not None or raw == "":
        return default_port_range()
    lo, hi = (int(x) for x in raw.split("-"))
    return lo, hi


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a child process to bind. Chosen below the ephemeral range:
    a port that bind(0) hands out lies in it, where the kernel also picks the source port of
    every outgoing connection, so a client socket could take it before the child bound it (a
    fresh-clone CI run lost an Envoy to `Address already in use` that way)."""
    lo, hi = _port_range()
    for _ in range(200 if hi - lo >= 1000 else 0):
        port = _PORTS.randrange(lo, hi)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def wait_healthy(url: str, timeout: float, interval: float = 0.2) -> None:
    """Poll `url` (an HTTP health endpoint) until it answers 200; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(interval)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(5)
        # Reap anything left in the group (e.g. a shell's children).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def _die_with(parent: int) -> None:
    """In a forked child before exec (Linux): SIGTERM when the thread that started it dies, and
    exit at once if that already happened (the parent died between fork and here)."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


@dataclass
class Supervisor:
    """Owns a set of child processes and a scratch directory for their logs and configs.

    `die_with_parent` (`floodgate up`): each child gets SIGTERM when this process dies, however
    it dies (SIGKILL, a closed terminal's SIGHUP it did not handle), so a killed `up` leaves no
    Redis, processors or controller behind; a child in its own session is not reached by the
    terminal's signals otherwise. Linux only (prctl PR_SET_PDEATHSIG), and the signal follows the
    *thread* that started the child: start children from the main thread, as `up` does."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="floodgate-")))
    children: list[Child] = field(default_factory=list)
    die_with_parent: bool = False

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.workdir / f"{name}.log"
        log = log_path.open("ab")
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
            preexec_fn=functools.partial(_die_with, os.getpid()) if self.die_with_parent and sys.platform == "linux" else None,
        )
        log.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def start_redis(self, port: int | None = None, name: str = "redis",
                    password: str | None = None, extra: Sequence[str] = ()) -> tuple[Child, str]:
        """A Redis-protocol server on 127.0.0.1; returns it and its URL (without the password).
        `extra`: more server arguments (e.g. `--rename-command X '""'` to emulate an older server)."""
        port = port or free_port()
        data = self.workdir / f"{name}-data"
        data.mkdir(exist_ok=True)
        child = self.start(
            name,
            [
                redis_server_binary(),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(data),
                *(["--requirepass", password] if password else []),
                *extra,
            ],
        )
        wait_for_port("127.0.0.1", port, 10, child.proc)
        return child, f"redis://127.0.0.1:{port}/0"

    def start_envoy(self, config_path: Path, admin_port: int, name: str = "envoy",
                    concurrency: int = 1, extra: Sequence[str] = ()) -> Child:
        child = self.start(
            name,
            [
                envoy_binary(), "-c", str(config_path),
                "--concurrency", str(concurrency),
                "--base-id", str(admin_port),  # unique shared-memory id per instance
                "--log-level", "warn",
                *extra,
            ],
        )
        wait_for_port("127.0.0.1", admin_port, 20, child.proc)
        return child

    def start_python(self, name: str, args: Sequence[str], env: dict[str, str] | None = None) -> Child:
        return self.start(name, [sys.executable, *args], env)

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
