"""Local processes as replicas: `floodgate sim` (or any command template) on free ports.

The table of started replicas (id -> pid, port) is written to `state_dir/replicas.json`, so a
restarted controller finds the processes its predecessor started (they run in their own
process groups and outlive it) instead of starting duplicates. Every call is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
from floodgate.controller.actuators.base import ReplicaHandle, Role

from floodgate.supervisor import Supervisor, free_port


def sim_command(*extra: str) -> list[str]:
    """The default template: an emulated vLLM replica with sleep mode."""
    return [sys.executable, "-m", "floodgate", "sim", "--host", "127.0.0.1", "--port", "{port}",
            "--enable-sleep-mode", *extra]


def pid_alive(pid: int, created: float | None = None) -> bool:
    """Is the process we started still running under `pid`? A zombie still has a pid but is
    dead; a pid the system handed to another process since (its start time differs from the
    `created` we recorded) is not ours: killing its group would hit a stranger."""
    try:
        p = psutil.Process(pid)
        if created is not None and abs(p.create_time() - created) > 0.02:  # clock ticks, 10 ms
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # exists, but we may not look at it
        return True


def _created(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class ProcessActuator:
    name = "process"

    def __init__(self, command: Sequence[str], state_dir: Path, *, host: str = "127.0.0.1",
                 supervisor: Supervisor | None = None, env: Mapping[str, str] | None = None,
                 stop_grace_s: float = 5.0) -> None:
        if not any("{port}" in a for a in command):
            raise ValueError("process actuator command needs a {port} placeholder")
        self.command = list(command)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.sup = supervisor or Supervisor(workdir=self.state_dir)
        self.env = dict(env or {})
        self.stop_grace_s = stop_grace_s
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # the ones this instance started
        self._table: dict[str, dict[str, Any]] = self._load()

    @property
    def _path(self) -> Path:
        return self.state_dir / "replicas.json"

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self) -> None:
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._table, indent=1))
        tmp.replace(self._path)  # atomic: a crash never leaves half a table

    def _alive(self, rid: str) -> bool:
        p = self._procs.get(rid)
        if p is not None:
            return p.poll() is None
        e = self._table[rid]
        return pid_alive(int(e["pid"]), e.get("created"))

    def _handle(self, rid: str) -> ReplicaHandle:
        e = self._table[rid]
        return ReplicaHandle(rid, e["endpoint"], self._alive(rid), e.get("role"),
                             {"pid": str(e["pid"]), "log": e.get("log", "")})

    async def list(self) -> list[ReplicaHandle]:
        return [self._handle(rid) for rid in sorted(self._table)]

    async def start(self, replica_id: str) -> ReplicaHandle | None:
        if replica_id in self._table and self._alive(replica_id):
            return self._handle(replica_id)  # idempotent: already running
        port = free_port(self.host)
        argv = [a.format(port=port, replica_id=replica_id, host=self.host) for a in self.command]
        child = await asyncio.to_thread(self.sup.start, f"replica-{replica_id}", argv, self.env or None)
        self._procs[replica_id] = child.proc
        self._table[replica_id] = {"pid": child.proc.pid, "port": port, "endpoint": f"{self.host}:{port}",
                                   "log": str(child.log_path), "started": time.time(), "role": None,
                                   "created": _created(child.proc.pid)}
        self._save()
        return self._handle(replica_id)

    async def stop(self, replica_id: str) -> None:
        e = self._table.get(replica_id)
        if e is None:
            return
        pid = int(e["pid"])
        proc = self._procs.pop(replica_id, None)
        if proc is None and not self._alive(replica_id):
            # Dead already (or its pid now belongs to another process): only forget it.
            del self._table[replica_id]
            self._save()
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        while time.monotonic() < deadline:
            if (proc.poll() is not None) if proc is not None else not pid_alive(pid):
                break
            await asyncio.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # stragglers in the group, or a hung process
        if proc is not None:
            await asyncio.to_thread(proc.wait, 5)
        self.sup.children = [c for c in self.sup.children if c.proc.pid != pid]
        del self._table[replica_id]
        self._save()

    async def set_role(self, replica_id: str, role: Role) -> None:
        if replica_id in self._table:
            self._table[replica_id]["role"] = role
            self._save()

    async def stop_all(self) -> None:
        """Stop every replica in the table (tests, `floodgate up` shutdown)."""
        for rid in list(self._table):
            await self.stop(rid)

    async def close(self) -> None:
        return None
