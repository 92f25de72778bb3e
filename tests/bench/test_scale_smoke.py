"""`floodgate bench scale` at tiny scale: real Redis, two real processors, real ext_proc streams.

The modes must be what they claim: under contention every decision runs the per-request
script path (acquire-or-enqueue, then a release that grants), while uncontended with
the shipped credits most decisions never reach Redis.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from floodgate.bench import scale

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_scale_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    out = tmp_path / "scale.json"
    args = parser.parse_args(["--processors", "2", "--duration", "1.5", "--warm", "1", "--per-processor", "12", "--sharded", "0",
                              "--limit-per-processor", "3", "--loaders", "1", "--json", str(out),
                              "--saturate", "state:10,admitter:10", "--saturate-gateways", "2"])
    assert scale.run(args) == 0
    text = capsys.readouterr().out
    assert "goal >= 20,000 decisions/s per shard under contention" in text
    points = {p["mode"]: p for p in json.loads(out.read_text())["points"]}
    assert set(points) == set(scale.MODES)
    for p in points.values():
        assert p["decisions"] > 0 and p["errors"] == 0 and p["rejected"] == 0
        assert p["redis_cpu_s"] >= 0
    contended, credits, plain = points["contended"], points["uncontended"], points["no-credits"]
    # Contended: at most one call per request (acquire-or-enqueue, the releases and admits made
    # while a call is in the air share one batch call), not the two calls (acquire refused,
    # then enqueue) plus a release it took before.
    assert 0 < contended["script_calls"] < 2 * contended["decisions"]
    assert contended["commands"] > 5 * contended["decisions"]  # every request ran the script path
    assert contended["queued"] >= 0.9 * (contended["queued"] + contended["immediate"])  # a queue always formed
    assert plain["queued"] == 0 and credits["queued"] == 0 and plain["immediate"] > 0
    # No credits: an acquire and a release each (batched); with the shipped credits, far fewer calls.
    assert plain["script_calls"] > credits["script_calls"]
    assert plain["commands"] > 5 * plain["decisions"]
    assert credits["script_calls"] < 0.5 * credits["decisions"]
    assert contended["cpu_us"] > plain["cpu_us"] > credits["cpu_us"]
    # The direct drive (no gRPC): both layers ran the contended sequence on one shard, every
    # decision waited in the queue, and the ops went as batch calls of at least one op each.
    sat = {p["layer"]: p for p in json.loads(out.read_text())["saturate"]}
    assert set(sat) == {"state", "admitter"}
    for p in sat.values():
        assert p["decisions"] > 0 and p["errors"] == 0 and p["rejected"] == 0 and p["degraded"] == 0
        assert p["queued"] >= 0.9 * p["decisions"]
        assert p["batches"] > 0 and p["ops"] >= p["batches"] and p["busy"] > 0
        assert p["commands"] > 5 * p["decisions"]  # every decision ran the script path
    assert "highest load measured" in text
