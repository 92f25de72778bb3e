"""Instructions one Redis shard executes per contended admission decision, counted by valgrind.

The CPU figures of `floodgate bench scale` move with this shared VM's load (the same work
measured 30 and 69 µs per decision in runs minutes apart). This counts instead: the server runs
under `valgrind --tool=callgrind` (instrumentation switched on only around the measured calls),
and the same workload is run against this checkout's leases.lua and against the one of a git
revision (`--base`; run from an installed package, which has no git revision, give the reference
file as `--base-file`), loaded side by side as two Function libraries
in the same server, alternating. Instruction counts do not depend on the box's load, so the
ratio does not move with the box (it is no time: a cache miss costs more than an instruction).
The pools run on a clock of their own (the script's `admin_testclock`, 2 ms per call), not the
server's: under valgrind a call takes ~100x its real time, and on the real clock what the
script does (the rates' decay, every time-driven branch) would follow the box's speed.
What still varies between runs of the same code: by default every instruction of the shard
is counted while the calls run, including reading commands, writing replies and the event
loop, whose iterations follow the box's timing (the server runs with `--hz 1` to keep its timer
housekeeping small); a fresh-clone CI run on a busy box once read the same library 3.1 % apart.
`--count script` counts only inside FCALL (the library, the commands it calls, its publishes):
the same code then reads within about 1 % (skiplist levels are random and the server's hash
seed differs per start), the figure to compare two versions of leases.lua with.

Workload (the contended decision of the scale bench's direct drive, pipelined so that the
network is left out): G gateways (synced, subscribed to their grant channels), a pool of limit
8·G full, 16·G waiters queued, then every gateway synced once more (as each does every TTL/3 in
service: sync is where the script converts the pool's big ZSETs to skiplists); each `batch` call comes from one gateway picked at random and
carries B `admit`s (each refused and queued behind the others, with its snapshot) and one
`release` of B permits (each granting the queue's head: a SPUBLISH to its gateway, or in the
reply). One decision = one admit + one release + the grant. `--settings shipped` runs the pool on the
shipped defaults' classes and onset ramp (as `bench scale` does) instead of plain shares. With --batch 1 and --batch 6 the
per-call and per-decision parts separate: instructions = a/B + b. `--order mixed` interleaves
them instead (admit, release of one permit, admit, ...), as a processor's batch carries them in
arrival order: each admit's snapshot then follows a grant (queue head, event rates changed).

  floodgate bench script-instr                          # this checkout vs HEAD~1, B = 1, 3, 6
  floodgate bench script-instr --base ef5dd4b --batch 3 # vs a given commit
  floodgate bench script-instr --order mixed            # admits and releases interleaved
  floodgate bench script-instr --count script           # only the instructions inside FCALL
  floodgate bench script-instr --server-arg=--zset-max-listpack-entries --server-arg=16  # a server setting
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SUMMARY = "instructions per contended decision in the shard (callgrind), this leases.lua vs a base revision"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default="HEAD~1", help="git revision whose extproc/leases.lua is the reference (default HEAD~1)")
    p.add_argument("--base-file", metavar="PATH", help="a leases.lua file as the reference instead of --base's")
    p.add_argument("--gateways", type=int, default=16, help="gateways (default 16: the direct drive's)")
    p.add_argument("--batch", default="1,3,6", help="admits (and released permits) per batch call (default 1,3,6)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra server argument (repeat; e.g. --server-arg=--zset-max-listpack-entries --server-arg=16)")
    p.add_argument("--decisions", type=int, default=600, help="measured decisions per library and batch size (default 600)")
    p.add_argument("--order", choices=("grouped", "mixed"), default="grouped",
                   help="a call's ops: B admits then one release of B permits (grouped, default), or "
                        "admit and release of one permit in turn (mixed)")
    p.add_argument("--settings", choices=("plain", "shipped"), default="plain",
                   help="the pool's settings: shares (0.5, 0.3, 0.1) and no onset ramp (plain, default), or the "
                        "shipped defaults' classes and onset ramp (shipped: what `bench scale` runs)")
    p.add_argument("--count", choices=("shard", "script"), default="shard",
                   help="what is counted: every instruction of the shard while the calls run (shard, default: "
                        "includes reading commands, writing replies and the event loop, whose iterations follow "
                        "the box's timing), or only those inside FCALL (script: the library, the commands it "
                        "calls and its publishes; the same on every run of the same code)")
    p.add_argument("--keep", metavar="DIR", help="copy each measured callgrind dump here (cg.<base|here>.<B>: callgrind_annotate reads them)")


class _Pool:
    """One pool driven through one library: setup unmeasured, then `go(n)` pipelined."""

    def __init__(self, r: Any, function: str, gateways: int, batch: int, mixed: bool = False,
                 shipped: bool = False) -> None:
        import dataclasses

        from floodgate.extproc.admission import pool_settings
        from floodgate.extproc.config import PoolConfig
        from floodgate.extproc.schema import SCRIPT_KEYS, PoolSettings, script_keys

        self.r, self.fn, self.batch, self.mixed = r, function, batch, mixed
        self.pool = f"instr-{function}-{batch}"
        self.keys = script_keys(self.pool)
        # The pool runs on a clock of its own that advances 2 ms per call (the script reads
        # `admin_testclock` instead of TIME when it is set; by its place among the keys, which an
        # older library under comparison reads under its older name): under valgrind a call takes ~100x its
        # real time, and on the real clock the rates' decay and every time-driven branch
        # would follow the box's speed instead of the workload.
        # (`call` sets it before each call, the first one included)
        self.clock_key, self.clock = self.keys[SCRIPT_KEYS.index("admin_testclock")], 1_700_000_000_000
        big = (10**6,) * 3
        if shipped:  # the shipped classes and onset ramp, the limit and queue caps as below
            settings = dataclasses.replace(pool_settings(PoolConfig()), initial_limit=8 * gateways, max_queue=big,
                                           tenant_cap=big).fields()
        else:
            settings = PoolSettings(8 * gateways, (0.5, 0.3, 0.1), max_queue=big, tenant_cap=big).fields()
        self.call(r, "configure", self.pool, *[x for kv in settings.items() for x in kv])
        self.gws = [f"d{i % 2}g{i}" for i in range(gateways)]
        for g in self.gws:
            self.call(r, "sync", g, "0", "0")
        self.sub = r.pubsub()
        for g in self.gws:  # grants are published to a subscriber, as in service
            self.sub.ssubscribe(f"fg:{{{self.pool}}}:gw:{g}")
        self.held: collections.deque[str] = collections.deque()
        self.waiting: collections.deque[str] = collections.deque()
        self.seq: collections.Counter[str] = collections.Counter()
        self.rng = random.Random(1)
        for i in range(24 * gateways):
            a = self.admit_args(self.gws[i % gateways])
            self.call(r, "admit", *a)
            (self.held if len(self.held) < 8 * gateways else self.waiting).append(a[0])
        for g in self.gws:  # as in service (every TTL/3): a sync of the pool as it is now
            self.call(r, "sync", g, "0", "0")

    def call(self, p: Any, op: str, *args: str) -> Any:
        self.clock += 2
        p.set(self.clock_key, self.clock)
        # TTL and timeouts far above the run's length: nothing expires on the pool's clock
        return p.fcall(self.fn, len(self.keys), *self.keys, op, "3600000", *args)

    def admit_args(self, g: str) -> list[str]:
        self.seq[g] += 1
        return [f"{g}/{self.seq[g]}", g, str(self.seq[g]), "1", "", "0", "3600000"]

    def go(self, decisions: int) -> None:
        p = self.r.pipeline(transaction=False)
        for _ in range(-(-decisions // self.batch)):
            g = self.rng.choice(self.gws)
            argv = [g]
            for _ in range(self.batch):
                a = self.admit_args(g)
                argv += ["admit", str(len(a)), *a]
                self.waiting.append(a[0])
                if self.mixed:  # the release that grants the queue's head, in turn with the admits
                    argv += ["release", "1", self.held.popleft()]
                    self.held.append(self.waiting.popleft())
            if not self.mixed:
                done = [self.held.popleft() for _ in range(self.batch)]
                argv += ["release", str(len(done)), *done]
                self.held.extend(self.waiting.popleft() for _ in range(self.batch))
            self.call(p, "batch", *argv)
        for reply in p.execute()[1::2]:  # the SETs of the clock in between
            errors = [x for x in reply[0] if isinstance(x, list) and x and x[0] == b"err"]
            if errors:
                raise RuntimeError(f"{self.fn}: {errors[0]}")


def run(args: argparse.Namespace) -> int:
    import redis

    from floodgate.binaries import redis_server_binary
    from floodgate.supervisor import free_port, wait_for_port

    root = Path(__file__).resolve().parent.parent
    # A git checkout of Floodgate (root is its top), or the installed package (no git revision
    # to compare with: the reference must come as --base-file).
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    except OSError:  # no git at all (the image, python:3.11-slim; a minimal host): no checkout to use
        checkout = False
    else:
        checkout = top.returncode == 0 and Path(top.stdout.strip()).resolve() == root
    if not checkout and not args.base_file:
        print(f"floodgate bench script-instr: {root} is not a git checkout (an installed package): give the "
              "reference leases.lua as --base-file PATH", file=sys.stderr)
        return 2
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("valgrind (callgrind) is not installed: apt-get install valgrind")
        return 2
    here = (root / "extproc" / "leases.lua").read_text()
    if args.base_file:
        base_rev, base = str(args.base_file), Path(args.base_file).read_text()
    else:
        base_rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", args.base], check=True,
                                  capture_output=True, text=True).stdout.strip()
        base = subprocess.run(["git", "-C", str(root), "show", f"{base_rev}:extproc/leases.lua"], check=True,
                              capture_output=True, text=True).stdout
    if checkout:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", "extproc/leases.lua"]).returncode
        label_here = f"{head}{'+changes' if dirty else ''}"
    else:
        label_here = "the installed package"
    batches = [int(x) for x in str(args.batch).split(",") if x.strip()]
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"fg-script-instr-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # `script`: collect only while FCALL runs, whatever the event loop did around it
    collect = ["--toggle-collect=fcallCommand"] if args.count == "script" else []
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", *collect, f"--callgrind-out-file={work}/cg.%p",
         redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(work), "--hz", "1", *args.server_arg], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 60, server)
        r = redis.Redis(port=port)
        pid = str(server.pid)

        def control(*a: str) -> None:
            subprocess.run(["callgrind_control", *a, pid], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def measured(pool: _Pool, n: int, label: str) -> int:
            control("-z")
            control("-i", "on")
            pool.go(n)
            control("-d")  # dumps after the pipeline's replies came back: every call is counted
            control("-i", "off")
            dump = max(glob.glob(f"{work}/cg.{pid}.*"), key=os.path.getmtime)
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                shutil.copy(dump, Path(args.keep) / f"cg.{label}.{pool.batch}")
            for line in Path(dump).read_text().splitlines():
                if line.startswith(("totals:", "summary:")):
                    return int(line.split()[1])
            raise RuntimeError(f"no totals in {dump}")

        libs = {}
        for label, source in (("base", base), ("here", here)):
            name = f"fg_instr_{label}"
            r.function_load(f"#!lua name={name}\n{source}\nredis.register_function{{function_name='{name}', callback=main}}\n",
                            replace=True)
            libs[label] = name
        print(f"floodgate bench script-instr: leases.lua of {label_here} vs {base_rev}; {args.gateways} gateways, "
              f"limit {8 * args.gateways}, {16 * args.gateways} waiters; ops {args.order}; {args.settings} settings; {args.decisions} decisions per cell "
              f"(valgrind callgrind: instructions {'inside FCALL' if args.count == 'script' else 'of the shard'}, user space)\n", flush=True)
        head_line = f"{'admits per call':>15} {'base instr/dec':>15} {'here instr/dec':>15} {'here/base':>9}"
        print(head_line)
        print("-" * len(head_line))
        results: dict[tuple[str, int], float] = {}
        t0 = time.monotonic()
        for b in batches:
            pools = {label: _Pool(r, fn, args.gateways, b, args.order == "mixed", args.settings == "shipped") for label, fn in libs.items()}
            for pool in pools.values():
                pool.go(60)  # warm: the library's caches, the hashes' encodings
            for label in ("base", "here", "base", "here"):  # alternate; keep the lower of two
                n = measured(pools[label], args.decisions, label) / args.decisions
                results[(label, b)] = min(results.get((label, b), float("inf")), n)
            for pool in pools.values():
                pool.sub.close()
                r.delete(*pool.keys)
            print(f"{b:>15} {results[('base', b)]:>15,.0f} {results[('here', b)]:>15,.0f} "
                  f"{results[('here', b)] / results[('base', b)]:>9.3f}", flush=True)
        if 1 in batches and len(batches) > 1:
            hi = max(batches)
            for label in ("base", "here"):
                a = (results[(label, 1)] - results[(label, hi)]) / (1 - 1 / hi)
                print(f"{label}: {a:,.0f} instructions per call + {results[(label, 1)] - a:,.0f} per decision "
                      f"(from B = 1 and {hi})")
        print(f"\n({time.monotonic() - t0:.0f} s under valgrind)")
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    return 0
