"""Local processes as replicas: `floodgate sim` (or any command template) on free ports.

The table of started replicas (id -> pid, port, role) is `state_dir/replicas.json`, so a
restarted controller (or a standby taking over on the same host) finds the processes its
predecessor started (they run in their own process groups and outlive it) instead of starting
duplicates. Every call reads the table afresh and every change is a read-modify-write under an
exclusive lock on `state_dir/replicas.lock`: two controllers sharing a `state_dir` (a leader
and its standby) never act on a stale copy or drop each other's entries. The table names its
owner (the Redis it registers replicas in, the leader key and the pool): a table written for
another deployment whose processes still run is refused, never adopted. Every call is
idempotent.

A start is recorded before the process exists: its entry, with no pid yet and a token that the
process gets in its environment (`FLOODGATE_REPLICA_TOKEN`), is on disk first; the pid is added
once it runs. A controller that dies in between (SIGKILL, OOM, its host's reboot) leaves an
entry whose process the next reader finds by that token and adopts (or, if it never ran,
forgets), instead of a model server nothing tracks or stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psutil
from floodgate.controller.actuators.base import ReplicaHandle, Role

from floodgate.supervisor import Supervisor, free_port

Table = dict[str, dict[str, Any]]
TOKEN_ENV = "FLOODGATE_REPLICA_TOKEN"  # names a start in its process's environment (see above)
# Logs of stopped replicas kept (the newest), for a look after the fact. Every cold start gets a
# new replica id and so a new `replica-<id>.log`; kept all, a controller scaling for weeks filled
# its directory with one file per start ever made (an unbounded-growth review).
KEEP_STOPPED_LOGS = 32
STOPPED_LOGS = "stopped-logs.json"  # in state_dir: the stopped replicas' logs, oldest first


def retire_log(ledger: Sequence[str], log: str | None, in_use: Sequence[str],
               keep: int = KEEP_STOPPED_LOGS) -> tuple[list[str], list[str]]:
    """(ledger, to delete) once a stopped replica's `log` joins the `ledger` of stopped ones:
    the newest `keep` stay; none that a listed replica writes to (`in_use`) is deleted."""
    out = [p for p in ledger if p != log and p not in in_use]
    if log and log not in in_use:
        out.append(log)
    return out[-keep:] if keep > 0 else [], out[:-keep] if keep > 0 else out


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


def read_table(state_dir: Path) -> tuple[str | None, Table]:
    """(owner, replicas) of the table in `state_dir`; (None, {}) when there is none. A table
    written before tables named their owner (a bare id -> entry mapping) has owner None."""
    try:
        data = json.loads((Path(state_dir) / "replicas.json").read_text())
    except (OSError, ValueError):
        return None, {}
    if not isinstance(data, dict):
        return None, {}
    if "replicas" in data and isinstance(data["replicas"], dict):
        owner = data.get("owner")
        return (owner if isinstance(owner, str) else None), data["replicas"]
    return None, {k: v for k, v in data.items() if isinstance(v, dict)}


def find_token(token: str) -> tuple[int, float] | None:
    """(pid, create time) of the running process started with this replica token, if any."""
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(TOKEN_ENV) == token and p.status() != psutil.STATUS_ZOMBIE:
                return p.pid, p.create_time()
    return None


def resolve_pending(table: Table) -> bool:
    """Fill in the pid of each entry recorded without one (a start its controller did not live
    to finish recording) whose process runs; True if any changed. Entries whose process is not
    found stay pending (not alive) until stopped."""
    changed = False
    for e in table.values():
        if e.get("pid") is None and isinstance(e.get("token"), str):
            found = find_token(e["token"])
            if found is not None:
                e["pid"], e["created"] = found
                changed = True
    return changed


def live_entries(table: Table) -> dict[str, int]:
    """The table's replicas whose processes still run: id -> pid (a pending entry's process
    found by its token)."""
    table = {rid: dict(e) for rid, e in table.items()}  # (resolved here, not in the caller's)
    resolve_pending(table)
    out = {}
    for rid, e in table.items():
        if e.get("pid") is None:
            continue  # a start whose process was not found
        with contextlib.suppress(KeyError, ValueError, TypeError):
            if pid_alive(int(e["pid"]), e.get("created")):
                out[rid] = int(e["pid"])
    return out


def fill_placeholders(arg: str, **values: object) -> str:
    """`arg` with `{port}`, `{replica_id}` and `{host}` replaced, and nothing else touched:
    model servers take JSON arguments (vLLM's `--compilation-config '{"level": 3}'`), which
    `str.format` read as placeholders and failed every start on (a review)."""
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", str(value))
    return arg


class TableOwnedElsewhere(ValueError):
    """The state_dir holds running replicas of another deployment."""


def redis_deployment(url: str) -> str:
    """The Redis a deployment registers its replicas in, as a table's owner names it: scheme,
    hosts and path, without who logs in and how (user, password) or the connection options.
    An operator changes those on a running deployment (moving the password from the URL to
    FLOODGATE_REDIS_PASSWORD, switching to the shipped `floodgate-controller` ACL user, adding
    `?socket_timeout=`): with them in the owner, the restarted controller refused its own
    table while its replicas ran ("another deployment"), or, with the default state_dir,
    looked in another directory and left them running unmanaged (an operator review)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def owner_key(owner: str) -> str:
    """`owner` (`config.table_owner`: `redis <url> leader <key> pool <name>`) with its URL
    reduced to `redis_deployment`, so a table written by an earlier version (whose owner
    kept the user and a masked password) still reads as this deployment's."""
    head, sep, rest = owner.partition(" ")
    if head != "redis" or not sep:
        return owner
    url, sep, tail = rest.partition(" ")
    return f"redis {redis_deployment(url)}{sep}{tail}"


def check_owner(state_dir: Path, owner: str | None) -> None:
    """Raise TableOwnedElsewhere if `state_dir`'s table belongs to another owner and lists
    processes that still run (a table whose processes are all gone is simply taken over)."""
    theirs, table = read_table(state_dir)
    if owner is None or theirs is None or owner_key(theirs) == owner_key(owner):
        return
    live = live_entries(table)
    if live:
        pids = ", ".join(f"{rid} (pid {pid})" for rid, pid in sorted(live.items()))
        raise TableOwnedElsewhere(
            f"{Path(state_dir) / 'replicas.json'} lists running replicas of another deployment "
            f"({theirs}; this one is {owner}): {pids}. Give this pool a state_dir of its own "
            "(or stop those replicas and remove the file).")


class ProcessActuator:
    name = "process"
    capacity: int | None = None

    def __init__(self, command: Sequence[str], state_dir: Path, *, host: str = "127.0.0.1",
                 supervisor: Supervisor | None = None, env: Mapping[str, str] | None = None,
                 stop_grace_s: float = 5.0, owner: str | None = None) -> None:
        if not any("{port}" in a for a in command):
            raise ValueError("process actuator command needs a {port} placeholder")
        self.command = list(command)
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.sup = supervisor or Supervisor(workdir=self.state_dir)
        self.env = dict(env or {})
        self.stop_grace_s = stop_grace_s
        self.owner = owner
        check_owner(self.state_dir, owner)
        self._procs: dict[str, subprocess.Popen[bytes]] = {}  # the ones this instance started
        self._owner_seen: str | None = None  # the table's owner as last read under the lock

    @property
    def _path(self) -> Path:
        return self.state_dir / "replicas.json"

    def _table(self) -> Table:
        return read_table(self.state_dir)[1]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Table]:
        """The table, read under the exclusive lock and written back (atomically) on exit."""
        with open(self.state_dir / "replicas.lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                theirs, table = read_table(self.state_dir)
                self._owner_seen = theirs
                yield table
                self._write(table)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, table: Table) -> None:
        """Write the table (call with the lock held): atomically, and flushed to disk, so a
        crash or a power loss never leaves half a table nor loses a start recorded before it."""
        data = {"owner": self.owner if self.owner is not None else self._owner_seen, "replicas": table}
        tmp = self._path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(data, indent=1))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self._path)

    def _update(self, change: Callable[[Table], Any]) -> Any:
        with self._locked() as table:
            return change(table)

    def _retire_log(self, table: Table, log: str | None) -> None:
        """(With the table's lock held.) A forgotten replica's log joins the stopped ones kept;
        the oldest beyond `KEEP_STOPPED_LOGS` are deleted."""
        path = self.state_dir / STOPPED_LOGS
        try:
            ledger = [str(p) for p in json.loads(path.read_text())]
        except (OSError, ValueError, TypeError):
            ledger = []
        in_use = [str(e.get("log")) for e in table.values() if e.get("log")]
        ledger, drop = retire_log(ledger, log, in_use, KEEP_STOPPED_LOGS)
        for p in drop:
            with contextlib.suppress(OSError):
                Path(p).unlink()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(ledger))
            tmp.replace(path)

    def _alive(self, rid: str, e: Mapping[str, Any]) -> bool:
        p = self._procs.get(rid)
        if p is not None:
            return p.poll() is None
        if e.get("pid") is None:
            return False  # a start whose process was not found (`resolve_pending`)
        return pid_alive(int(e["pid"]), e.get("created"))

    def _handle(self, rid: str, e: Mapping[str, Any]) -> ReplicaHandle:
        labels = {"pid": str(e["pid"]), "log": e.get("log", "")}
        # Started with another command than the configured one (a restart with a new model or
        # flags adopts the old processes): the controller replaces it (`ReplicaView.outdated`).
        # An entry without one (a table of an older version) is taken as current.
        if e.get("command") is not None and e["command"] != self.command:
            labels["outdated"] = "1"
        # Being stopped (SIGTERM sent, in its grace): not running (`ReplicaHandle.running`: "not
        # terminating"), so a controller that finds it after the one stopping it died (SIGKILL in
        # the grace) stops it too instead of adopting it out of the registry: not answering, it
        # was brought up again, then failed when it exited (start backoff); still answering
        # /health with its role `active` (a drained replica), it would have been routed to.
        running = self._alive(rid, e) and not e.get("stopping")
        return ReplicaHandle(rid, e["endpoint"], running, e.get("role"), labels)

    def _list_sync(self) -> Table:
        table = self._table()
        if any(e.get("pid") is None for e in table.values()):
            self._update(resolve_pending)
            table = self._table()
        return table

    async def list(self) -> list[ReplicaHandle]:
        table = await asyncio.to_thread(self._list_sync)
        return [self._handle(rid, table[rid]) for rid in sorted(table)]

    def _start_sync(self, replica_id: str) -> ReplicaHandle:
        # One thread call: spawning and recording cannot be separated by a cancellation
        # (a process started but in no table would be an orphan nothing ever stops).
        with self._locked() as table:
            e = table.get(replica_id)
            if e is not None and self._alive(replica_id, e):
                return self._handle(replica_id, e)  # idempotent: already running
            if e is not None and e.get("pid") is None and resolve_pending({replica_id: e}):
                return self._handle(replica_id, e)  # a start its controller did not finish recording
            port = free_port(self.host)
            argv = [fill_placeholders(a, port=port, replica_id=replica_id, host=self.host) for a in self.command]
            name = f"replica-{replica_id}"
            token = f"{replica_id}/{uuid.uuid4().hex}"
            e = table[replica_id] = {
                "pid": None, "token": token, "command": self.command, "port": port, "endpoint": f"{self.host}:{port}",
                "log": str(self.sup.workdir / f"{name}.log"), "started": time.time(), "role": None,
                "created": None}
            self._write(table)  # on disk before the process exists (module docstring)
            child = self.sup.start(name, argv, {**self.env, TOKEN_ENV: token})
            self._procs[replica_id] = child.proc
            e.update(pid=child.proc.pid, created=_created(child.proc.pid), log=str(child.log_path))
            return self._handle(replica_id, e)

    async def start(self, replica_id: str) -> ReplicaHandle | None:
        return await asyncio.to_thread(self._start_sync, replica_id)

    async def stop(self, replica_id: str) -> None:
        e = (await asyncio.to_thread(self._list_sync)).get(replica_id)
        if e is None:
            return
        if e.get("pid") is None:  # its process never ran (or is gone): only forget the start
            token = e.get("token")

            def forget_pending(table: Table) -> None:
                if table.get(replica_id, {}).get("token") == token and table[replica_id].get("pid") is None:
                    self._retire_log(table, table.pop(replica_id).get("log"))

            await asyncio.to_thread(self._update, forget_pending)
            return
        pid = int(e["pid"])
        proc = self._procs.pop(replica_id, None)
        if proc is not None or self._alive(replica_id, e):

            def mark_stopping(table: Table) -> None:
                if table.get(replica_id, {}).get("pid") == pid:
                    table[replica_id]["stopping"] = True

            await asyncio.to_thread(self._update, mark_stopping)  # on disk before the signal (`_handle`)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            try:
                while time.monotonic() < deadline:
                    if (proc.poll() is not None) if proc is not None else not pid_alive(pid):
                        break
                    await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                # Cancelled in the grace (the controller steps down or exits): the stop was
                # decided, so it ends now rather than leaving a process that ignores SIGTERM
                # running out of the registry with no one to stop it (its entry stays: the next
                # leader's list sees it dead and forgets it).
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                raise
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # stragglers in the group, or a hung process
            if proc is not None:
                await asyncio.to_thread(proc.wait, 5)
            self.sup.children = [c for c in self.sup.children if c.proc.pid != pid]
        # Dead already (or its pid now belongs to another process): only forget it.

        def forget(table: Table) -> None:
            if table.get(replica_id, {}).get("pid") == pid:  # not a newer start under the same id
                self._retire_log(table, table.pop(replica_id).get("log"))

        await asyncio.to_thread(self._update, forget)

    async def set_role(self, replica_id: str, role: Role) -> None:
        def record(table: Table) -> None:
            if replica_id in table:
                table[replica_id]["role"] = role

        await asyncio.to_thread(self._update, record)

    async def stop_all(self) -> None:
        """Stop every replica in the table (the leader's `--stop-replicas-on-exit`, tests)."""
        for rid in sorted(await asyncio.to_thread(self._table)):
            await self.stop(rid)

    async def close(self) -> None:
        return None
