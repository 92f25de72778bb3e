"""`floodgate bench faults`: the fast subset runs in the suite, on real processes.

A short lease TTL (2 s, so a renewal period of 0.67 s, with a 0.2 s reconnect interval) keeps
it quick; the committed table (docs/benchmarks.md) uses the
shipped 15 s. Each fault must meet the issue's targets: concurrency at the upstream never
above L (a partition: its documented bound), no 5xx from Floodgate's path, nobody waiting past
their class timeout + 1 s, no phantom leases or waiters one TTL after recovery, and the pool
serving at its limit again within one TTL of a crash / one renewal period of Redis returning.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from floodgate.bench.faults import (
    FAULTS,
    Options,
    Rec,
    Result,
    bucket_means,
    count_hung,
    merge_section,
    run_fault,
    serving_again,
)

# The suite runs at TTL 2 s, so "one renewal period" is 0.67 s, and on a loaded 2-core CI box
# scheduling delays of a few hundred ms are a large share of it (seen: redis-sigstop back at L
# after 1.19 s at load 1.1; 0.2-0.6 s when quiet). The suite allows one more renewal period on
# top of each target; the committed run (shipped TTL 15 s, docs/benchmarks.md "Faults") is
# judged on the target itself. Never back, or back only a lease TTL late, still fails.
SUITE_TTL_S = 2.0


def explain(r: Result, workdir: Path) -> str:
    """The result, and what the processes logged of the fault: a failure in a loaded CI run
    must be readable after its work directory is gone."""
    marks = ("WARNING", "ERROR", "+try-failover", "send-slaveof-noone", "+promoted-slave", "+switch-master")
    lines: list[str] = []
    try:
        # the sentinels' steps first, then at most 15 lines of each other process
        for log in sorted(workdir.rglob("*.log"), key=lambda p: ("sentinel" not in p.stem, p.stem)):
            kept = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                    if any(m in ln for m in marks) and "overcommit" not in ln]
            lines += [f"{log.stem}: {ln}"[:300] for ln in kept[:15]]
    except OSError as exc:
        lines.append(f"(logs unreadable: {exc})")
    return f"{r}\ninjected at {r.injected_at} UTC; the processes logged (local time):\n" + "\n".join(lines)


def back_in_time(r: Result) -> bool:
    return r.serving_again_s is not None and r.serving_again_s <= r.target_s + SUITE_TTL_S / 3


def test_bucket_means_and_serving_again() -> None:
    series = [(0.05, 8), (1.0, 4), (2.0, 8)]
    assert [round(x, 2) for x in bucket_means(series, 0, 3, 0.5)] == [7.2, 8.0, 4.0, 4.0, 8.0, 8.0]
    assert serving_again(series, 1.0, 8, 0, 3, 0.5) == 1.0  # from the drop
    assert serving_again(series, 0.5, 8, 0, 3, 0.5) == 1.5
    assert serving_again([(0.1, 8), (1.0, 3)], 0.5, 8, 0, 3, 0.5) is None  # never back
    assert serving_again([(0.0, 8)], 1.0, 8, 0, 3, 0.5) == 0.0  # never dipped
    assert serving_again([(0.0, 8), (2.6, 3)], 0.5, 8, 0, 3, 0.5) == 0.0  # a late lull is not the fault


def test_count_hung() -> None:
    ok = Rec(0.0, 0, 2, 5.0, status=200, first_byte=5.9, done=6.0)
    late = Rec(0.0, 0, 2, 5.0, status=429, first_byte=6.5, done=6.5)
    never = Rec(0.0, 0, 1, 10.0, error="TimeoutError")
    left = Rec(0.0, 0, 1, 10.0, disconnected=True)
    assert count_hung([ok, late, never, left], end=30.0) == 2


def test_merge_section_replaces_only_the_rerun_faults() -> None:
    old = ("```\nfloodgate bench faults\n```\n\nL = 8.\n\n| fault | a | ok |\n|---|---|---|\n"
           "| none | 1 | yes |\n| cluster-shard-down | 9 | NO |\n| sigkill | 2 | yes |\n")
    body = ("L = 8.\n\n| fault | a | b | ok |\n|---|---|---|---|\n"
            "| cluster-shard-down: live | 8 | 0 | yes |\n| cluster-shard-down: dead | 8 | 4 | yes |")
    cmd = "floodgate bench faults --faults cluster-shard-down"
    merged = merge_section(old, body, cmd, {"cluster-shard-down"})
    rows = [ln for ln in merged.splitlines() if ln.startswith("| ") and not ln.startswith("| fault")]
    assert rows == ["| none | 1 | – | yes |", "| sigkill | 2 | – | yes |",  # FAULTS order, old column
                    "| cluster-shard-down: live | 8 | 0 | yes |", "| cluster-shard-down: dead | 8 | 4 | yes |"]
    assert "floodgate bench faults\n" in merged and cmd + "  # rows: cluster-shard-down" in merged
    assert merge_section(merged, body, cmd, {"cluster-shard-down"}) == merged  # a second rerun


@pytest.mark.integration
@pytest.mark.parametrize("name", ["sigkill", "sigkill-shared", "redis-sigstop", "redis-restart", "partition", "redis-clock-step"])
def test_fault_meets_targets(name: str, tmp_path: Path) -> None:
    fault = next(f for f in FAULTS if f.name == name)
    opts = Options(ttl_s=SUITE_TTL_S, reconnect_s=0.2, before_s=3.0, workdir=tmp_path)
    (r,) = asyncio.run(run_fault(fault, opts))
    assert r.ok > 50, explain(r, tmp_path)  # it really ran under load
    assert r.max_concurrency <= r.bound, explain(r, tmp_path)
    assert r.fivexx == 0 and r.hung == 0, explain(r, tmp_path)
    assert r.phantom_leases == 0 and r.phantom_waiters == 0, explain(r, tmp_path)
    assert fault.measure_from == "" or back_in_time(r), explain(r, tmp_path)  # (a fault with no outage: nothing to come back from)
    if name.startswith("sigkill"):
        assert r.fivexx_killed >= 1, explain(r, tmp_path)  # the victim really was carrying requests


@pytest.mark.integration
@pytest.mark.parametrize("name", ["sentinel-failover", "sentinel-switchover", "cluster-failover"])
def test_failover_meets_targets(name: str, tmp_path: Path) -> None:
    """SIGKILL the primary (Sentinel-managed; or the Cluster primary of the pool's slot), or a
    planned SENTINEL FAILOVER (every server up, the old primary writable for ~10 s), under
    load: within the failover bound, no 5xx, nobody hung, no phantoms, serving at L again."""
    fault = next(f for f in FAULTS if f.name == name)
    opts = Options(ttl_s=SUITE_TTL_S, reconnect_s=0.2, before_s=3.0, workdir=tmp_path)
    (r,) = asyncio.run(run_fault(fault, opts))
    assert r.ok > 50, explain(r, tmp_path)
    assert r.max_concurrency <= r.bound, explain(r, tmp_path)
    assert r.fivexx == 0 and r.hung == 0, explain(r, tmp_path)
    assert r.phantom_leases == 0 and r.phantom_waiters == 0, explain(r, tmp_path)
    assert fault.measure_from == "" or back_in_time(r), explain(r, tmp_path)  # (a fault with no outage: nothing to come back from)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["cluster-shard-down", "cluster-shard-freeze"])
def test_a_dead_shard_leaves_the_pools_on_the_other_shards_alone(name: str, tmp_path: Path) -> None:
    """Three loaded pools, one per shard, waiters queued and streams open on all of them; one
    shard dies (SIGKILL) or freezes (SIGSTOP: calls hang until they time out), primary and
    replica (nothing to fail over to), and comes back. The pools on the
    live shards stay on shared state: <= L, never dipping, no 5xx, nobody hung, no phantoms.
    The dead shard's pool runs on local shares (<= L + L/2), then shared again, no phantoms."""
    fault = next(f for f in FAULTS if f.name == name)
    opts = Options(ttl_s=SUITE_TTL_S, reconnect_s=0.2, before_s=3.0, workdir=tmp_path)
    live, dead = asyncio.run(run_fault(fault, opts))
    assert "live shards" in live.fault and "dead shard" in dead.fault
    for r in (live, dead):
        assert r.ok > 50, r
        assert r.max_concurrency <= r.bound, r
        assert r.fivexx == 0 and r.hung == 0, r
        assert r.phantom_leases == 0 and r.phantom_waiters == 0, r
    assert back_in_time(dead), dead
    assert live.bound == opts.limit and live.local_entries == 0, live  # never left shared state
    # Under a loaded suite the live pools were seen to dip below L for up to ~1 s, 1-2 s after
    # the kill (around when the cluster marks the node failed; no switch to local limits), and
    # 2.77 s once in a full suite beside two benchmarks: allow half the outage, never the
    # outage's length (6 s here).
    assert live.serving_again_s is not None and live.serving_again_s <= 3.0, live
    assert dead.local_entries >= 2  # both processors ran the dead shard's pool locally...
    assert dead.local_at_end == 0  # ...and are back on shared state
