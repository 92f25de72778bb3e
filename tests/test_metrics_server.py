"""The processor's metrics listener bounds what idle connections hold (an attacker review:
prometheus_client's own server kept one thread per connection for good, 500 connections that
sent nothing = 500 threads)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from floodgate.extproc import metrics as metrics_mod
from floodgate.extproc.metrics import Metrics, serve_metrics

from floodgate.supervisor import free_port


def _threads() -> int:
    """Threads other than the per-connection deadline timers (one per served connection)."""
    return sum(1 for t in threading.enumerate() if not isinstance(t, threading.Timer))


def _wait(cond: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _listener(monkeypatch: pytest.MonkeyPatch, max_connections: int,
              read_timeout_s: float | None = None) -> Iterator[int]:
    """The processor's metrics listener on a free port, with the bounds given; shut down after."""
    monkeypatch.setattr(metrics_mod, "METRICS_MAX_CONNECTIONS", max_connections)
    if read_timeout_s is not None:
        monkeypatch.setattr(metrics_mod, "METRICS_READ_TIMEOUT_S", read_timeout_s)
    port = free_port()
    httpd = serve_metrics("127.0.0.1", port, Metrics().registry)
    try:
        yield port
    finally:
        httpd.shutdown()
        httpd.server_close()


def _scrape(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200 and b"floodgate_decisions" in r.read()


def test_idle_connections_are_bounded_and_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    with _listener(monkeypatch, 4, read_timeout_s=1.0) as port:
        _idle_connections_bounded_and_closed(port)


def _idle_connections_bounded_and_closed(port: int) -> None:
    base = _threads()
    idle = []
    try:
        for _ in range(3 * metrics_mod.METRICS_MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metr")  # a request that never completes
            idle.append(s)
        # Every connection was accepted; past the bound they are closed unanswered, so the
        # threads they hold are at most the bound.
        time.sleep(0.5)
        assert _threads() - base <= metrics_mod.METRICS_MAX_CONNECTIONS
        assert sum(isinstance(t, threading.Timer) for t in threading.enumerate()) <= metrics_mod.METRICS_MAX_CONNECTIONS
        # Each idle connection is closed by the server after the read timeout, not held for good.
        for s in idle:
            s.settimeout(10)
            try:
                got = s.recv(1024)
            except ConnectionResetError:
                got = b""
            assert got == b""  # closed by the server, unanswered (over the bound, or timed out)
        assert _wait(lambda: _threads() <= base)
        # A connection that trickles one byte at a time (each read within the timeout) is cut
        # at the same deadline: under a per-read timeout alone it kept its slot for good.
        drip = socket.create_connection(("127.0.0.1", port))
        drip.settimeout(10)
        t0 = time.monotonic()
        closed = False
        for ch in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 40:
            try:
                drip.sendall(bytes([ch]))
            except OSError:
                closed = True
                break
            time.sleep(0.3)  # each read within the 1 s timeout
            if time.monotonic() - t0 > 4:  # 4x the deadline
                break
        if not closed:  # already closed by now (not merely after the dripping stops)?
            drip.settimeout(0.2)
            try:
                closed = drip.recv(1024) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False  # still open: the deadline did not cut it
        drip.close()
        assert closed
        _scrape(port)  # ...and a scrape is served again
    finally:
        for s in idle:
            s.close()


def test_a_connection_whose_thread_cannot_start_gives_its_slot_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection the server could not start a thread for (the process is out of threads)
    is closed, and its slot comes back: it used to stay taken, so METRICS_MAX_CONNECTIONS such
    failures left the listener closing every scrape unanswered for good."""
    real_start = threading.Thread.start
    failed: list[threading.Thread] = []

    def start(self: threading.Thread) -> None:
        if "process_request" in getattr(getattr(self, "_target", None), "__name__", "") and not failed:
            failed.append(self)
            raise RuntimeError("can't start new thread")
        real_start(self)

    with _listener(monkeypatch, 1) as port:
        monkeypatch.setattr(threading.Thread, "start", start)
        try:
            with pytest.raises(OSError):  # the first: closed unanswered (its thread could not start)
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            assert failed
            _scrape(port)
        finally:
            monkeypatch.setattr(threading.Thread, "start", real_start)


def test_idle_connections_at_the_bound_do_not_keep_a_scrape_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that have not sent a whole request give way to a new one at the bound (the
    oldest first): METRICS_MAX_CONNECTIONS connections that sent nothing (or a request line
    never finished), opened again as each is cut at its deadline, kept every scrape out, and
    with KEDA (whose trigger reads the controller's floodgate_desired_replicas through
    Prometheus) the pool's scaling with it. A review: 4 such connections at a bound of 4, the
    scrape closed unanswered."""
    with _listener(monkeypatch, 4, read_timeout_s=60.0) as port:  # the idle ones outlive the test
        base = _threads()
        idle = []
        try:
            for i in range(2 * metrics_mod.METRICS_MAX_CONNECTIONS):
                s = socket.create_connection(("127.0.0.1", port))
                if i % 2:
                    s.sendall(b"GET /metr")  # a request that never completes
                idle.append(s)
            assert _wait(lambda: _threads() - base >= metrics_mod.METRICS_MAX_CONNECTIONS)
            for _ in range(3):
                _scrape(port)
            # Still bounded: the idle ones made room, no more threads than the bound.
            assert _threads() - base <= metrics_mod.METRICS_MAX_CONNECTIONS
        finally:
            for s in idle:
                s.close()
