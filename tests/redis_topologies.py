"""Fixtures: a Sentinel-managed primary + replica + 3 sentinels, and a 3-primary Cluster with one
replica each, all real `valkey-server` processes on loopback ports (floodgate/redis_topology.py).
Import the fixtures into a test module with `from tests.redis_topologies import sentinel, cluster`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from floodgate.redis_topology import (
    ClusterTopology,
    SentinelTopology,
    start_cluster,
    start_sentinel,
)
from floodgate.supervisor import Supervisor


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelTopology]:
    with Supervisor(workdir=tmp_path) as sup:
        yield start_sentinel(sup, replicas=1, sentinels=3)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterTopology]:
    with Supervisor(workdir=tmp_path) as sup:
        yield start_cluster(sup, primaries=3, replicas=1)
