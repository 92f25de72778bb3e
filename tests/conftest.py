"""Fixtures that start real processes: Redis-protocol server, processors, Envoy, upstreams."""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from floodgate.extproc.state import redis_client

from floodgate.stack import LocalStack
from floodgate.supervisor import Supervisor, default_port_range, free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers) each worker, and every process it
    starts, picks free ports from a range of its own (floodgate.supervisor.free_port)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit() and int(count) > 1:
        lo, hi = default_port_range()
        size = (hi - lo) // int(count)
        start = lo + int(worker[2:]) * size
        os.environ["FLOODGATE_PORT_RANGE"] = f"{start}-{start + size}"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    with Supervisor(workdir=tmp_path) as sup:
        yield LocalStack(sup)


@pytest.fixture
async def client(stack: LocalStack) -> AsyncIterator[aioredis.Redis]:
    """A redis.asyncio client of a fresh Redis-protocol server started for the test."""
    c = redis_client(stack.start_redis(), op_timeout_s=5)
    yield c
    await c.aclose()


@pytest.fixture
def upstream(stack: LocalStack) -> int:
    """tests/upstream.py on a free port; returns the port."""
    port = free_port()
    stack.start_upstream([sys.executable, str(ROOT / "tests" / "upstream.py"), "--port", str(port)],
                         name="upstream", port=port)
    return port
