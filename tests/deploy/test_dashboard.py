"""The Grafana dashboard queries only metrics that the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from floodgate.controller.metrics import ControllerMetrics
from floodgate.extproc.metrics import Metrics
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "floodgate.json"


def exported_names() -> set[str]:
    names: set[str] = set()
    for metrics in (Metrics(CollectorRegistry()), ControllerMetrics()):
        for family in metrics.registry.collect():
            names.add(family.name)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


def queried_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    assert exprs
    return {m for e in exprs for m in re.findall(r"\b(floodgate_[a-z_]+)", e)}


def test_every_queried_metric_is_exported() -> None:
    missing = queried_names() - exported_names()
    assert not missing, f"dashboard queries metrics no code exports: {sorted(missing)}"


def test_dashboard_covers_admission_scaling_and_health() -> None:
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] == "row"]
    assert titles == ["Admission", "Scaling", "Health"]
    q = queried_names()
    for needed in ("floodgate_decisions_total", "floodgate_queue_depth", "floodgate_limit", "floodgate_inflight",
                   "floodgate_ttft_seconds_bucket", "floodgate_tpot_seconds_bucket", "floodgate_replicas",
                   "floodgate_desired_replicas", "floodgate_warm_pool_hits_total", "floodgate_forecast_replicas",
                   "floodgate_degraded", "floodgate_scrape_failures_total"):
        assert needed in q, needed


def test_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))


def _labels_by_name() -> dict[str, set[str]]:
    """Every exported series name -> the labels it carries."""
    out: dict[str, set[str]] = {}
    for metrics in (Metrics(CollectorRegistry()), ControllerMetrics()):
        for m in vars(metrics).values():
            if hasattr(m, "_labelnames"):  # a prometheus_client metric (its _name has no _total)
                for suffix in ("", "_total", "_sum", "_count"):
                    out[m._name + suffix] = set(m._labelnames)
                out[m._name + "_bucket"] = {*m._labelnames, "le"}
    return out


def test_every_label_a_query_matches_on_exists() -> None:
    """A matcher on a label the metric does not have selects nothing: the panel stays empty."""
    labels = _labels_by_name()
    dash = json.loads(DASHBOARD.read_text())
    for p in dash["panels"]:
        for t in p.get("targets", []):
            for metric, matchers in re.findall(r"\b(floodgate_[a-z_]+)\{([^}]*)\}", t["expr"]):
                used = set(re.findall(r"([a-z_]+)\s*(?:=~|!=|!~|=)", matchers))
                assert used <= labels[metric] | {"instance", "job"}, (p["title"], metric, used - labels[metric])
