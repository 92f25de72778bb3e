"""Bring up real Floodgate stacks on this machine: Redis, processors, Envoy, upstreams.

One place that knows how to start each part and wait until it is really ready, shared by
`floodgate up`, the benchmarks and the integration tests (which run the real binaries).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from floodgate.envoy_config import render_local, write_config
from floodgate.supervisor import Child, Supervisor, free_port, wait_for_port


@dataclass
class Processor:
    child: Child
    port: int
    metrics_port: int
    config_path: Path

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass
class Envoy:
    child: Child
    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stat(self, name: str) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?filter=^{name}$&format=json",
                                    timeout=2) as r:
            stats = json.load(r)["stats"]
        return int(stats[0]["value"]) if stats else 0


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return bytes(r.read())


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class LocalStack:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.redis_url = ""
        self.redis_child: Child | None = None
        self.processors: list[Processor] = []
        self.envoys: list[Envoy] = []

    def start_redis(self, port: int | None = None) -> str:
        self.redis_child, self.redis_url = self.sup.start_redis(port)
        return self.redis_url

    def start_processor(self, config: dict[str, Any] | None = None, *, name: str | None = None,
                        port: int | None = None, metrics_port: int | None = None) -> Processor:
        name = name or f"extproc{len(self.processors)}"
        port = port or free_port()
        metrics_port = metrics_port or free_port()
        cfg = merge(config or {}, {"server": {"listen": f"127.0.0.1:{port}",
                                              "metrics_listen": f"127.0.0.1:{metrics_port}",
                                              "gateway_id": name},
                                   "redis": {"url": self.redis_url}})
        path = self.sup.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        child = self.sup.start_python(name, ["-m", "floodgate", "extproc", "--config", str(path),
                                             "--log-level", "info"])
        wait_for_port("127.0.0.1", port, 20, child.proc)
        wait_for_port("127.0.0.1", metrics_port, 10, child.proc)
        proc = Processor(child, port, metrics_port, path)
        self.processors.append(proc)
        return proc

    def start_envoy(self, upstreams: Sequence[tuple[str, int]], *, processors: Sequence[Processor] | None = None,
                    name: str | None = None, port: int | None = None, admin_port: int | None = None,
                    **render: Any) -> Envoy:
        name = name or f"envoy{len(self.envoys)}"
        port, admin = port or free_port(), admin_port or free_port()
        procs = self.processors if processors is None else processors
        cfg = render_local(listen_port=port, admin_port=admin,
                           processors=[("127.0.0.1", p.port) for p in procs] or [("127.0.0.1", 1)],
                           upstreams=upstreams, **render)
        path = write_config(cfg, self.sup.workdir / f"{name}.json")
        child = self.sup.start_envoy(path, admin, name=name)
        wait_for_port("127.0.0.1", port, 20, child.proc)
        env = Envoy(child, port, admin)
        if render.get("admission", True) and procs:
            deadline = time.monotonic() + 20
            while env.stat("cluster.floodgate_extproc.membership_healthy") < len(procs):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: processors never became healthy\n{child.log_tail()}")
                time.sleep(0.1)
        self.envoys.append(env)
        return env

    def start_upstream(self, argv: Sequence[str], *, name: str, port: int) -> Child:
        child = self.sup.start(name, argv)
        wait_for_port("127.0.0.1", port, 20, child.proc)
        return child


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
