"""Fixtures that start real processes: Redis-protocol server, processors, Envoy, upstreams."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from floodgate.stack import LocalStack
from floodgate.supervisor import Supervisor, free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    with Supervisor(workdir=tmp_path) as sup:
        yield LocalStack(sup)


@pytest.fixture
def upstream(stack: LocalStack) -> int:
    """tests/upstream.py on a free port; returns the port."""
    port = free_port()
    stack.start_upstream([sys.executable, str(ROOT / "tests" / "upstream.py"), "--port", str(port)],
                         name="upstream", port=port)
    return port
