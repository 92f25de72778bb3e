"""The container image runs what compose.yaml and the Kubernetes manifests tell it to run.

There is no Docker engine here, so the test builds the image's install set the way the
Dockerfile does: the same COPY set, taken from the build context `.dockerignore` leaves (as
`docker build` sends it), into a fresh directory, a clean virtualenv (no access to the
repository or the test venv), the same pip command, then the sources are deleted as the
Dockerfile deletes them. Every command is read from compose.yaml (docker compose's own
normalized model) and from deploy/kubernetes (containers of the `floodgate` image, their
ConfigMap mounts written out as files), and run with its real arguments and config files through
the image's entry point. Servers get `--check-config` (it validates and exits); the processor and
the emulator are also started for real and probed with compose's own health checks.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from floodgate.supervisor import Supervisor, free_port, wait_for_port
from tests.deploy.test_compose import services

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES = ROOT / "deploy" / "kubernetes"
IMAGE = "floodgate"  # the image name the manifests use (kustomize sets the tag)


# --- the Dockerfile -------------------------------------------------------------------------

@dataclass
class Build:
    base: str = ""
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[list[str], str]] = field(default_factory=list)
    pip: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def parse_dockerfile(text: str) -> Build:
    b = Build()
    for word, rest in instructions(text):
        if word == "FROM":
            b.base = rest.split()[0]
        elif word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                b.env[k] = v
        elif word == "COPY":
            *srcs, dest = shlex.split(rest)
            assert not any(s.startswith("--") for s in srcs), f"COPY flags not handled: {rest}"
            b.copies.append((srcs, dest))
        elif word == "RUN":
            for step in rest.split("&&"):
                argv = shlex.split(step)
                if argv[:2] == ["pip", "install"]:
                    b.pip = argv
        elif word == "ENTRYPOINT":
            b.entrypoint = json.loads(rest)
    return b


def test_dockerfile_is_parsed_and_pins_its_base_image() -> None:
    b = parse_dockerfile(DOCKERFILE.read_text())
    assert b.pip and b.copies and b.entrypoint == ["floodgate"]
    # A patch version, never a floating `3.11-slim` or `latest`.
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", b.base), b.base
    major_minor = re.match(r"python:(\d+\.\d+)", b.base)
    assert major_minor and major_minor.group(1) == f"{sys.version_info[0]}.{sys.version_info[1]}", (
        "the test builds the install set with this interpreter: keep it at the image's version")


def test_the_image_and_the_suite_install_the_pinned_dependency_versions() -> None:
    """A rebuild ships what the suite ran: the Dockerfile's pip line and `make install` take
    constraints.txt, which pins the whole runtime closure of floodgate[k8s] at the versions
    installed here (a review: with minimum versions only, a rebuild a month later shipped
    versions nobody had run)."""
    from tests.deploy.constraints import render

    b = parse_dockerfile(DOCKERFILE.read_text())
    assert b.pip[:2] == ["pip", "install"] and "-c" in b.pip and b.pip[b.pip.index("-c") + 1] == "constraints.txt"
    assert any("constraints.txt" in srcs for srcs, _ in b.copies), b.copies
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()
    assert (ROOT / "constraints.txt").read_text() == render(), (
        "constraints.txt is not the installed runtime closure: .venv/bin/python -m tests.deploy.constraints > constraints.txt")


def test_copy_set_covers_every_folder_the_distribution_maps() -> None:
    import tomllib

    b = parse_dockerfile(DOCKERFILE.read_text())
    copied = {Path(s).parts[0] for srcs, _ in b.copies for s in srcs}
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(tool["package-dir"].values()) <= copied


# --- the build context, as `docker build` sends it -------------------------------------------

def dockerignore_pattern(pattern: str) -> re.Pattern[str]:
    """One .dockerignore pattern as Docker's patternmatcher reads it: anchored at the context
    root, `*` and `?` within one path segment, `**` across any number of segments."""
    pattern = os.path.normpath(pattern.strip().lstrip("/"))
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        rules.append((keep, dockerignore_pattern(line[1:] if keep else line)))
    return rules


def excluded(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """The last rule that matches the path or one of its parent folders decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for keep, rx in rules:
        if any(rx.match(p) for p in prefixes):
            verdict = not keep
    return verdict


def build_context(root: Path) -> set[str]:
    """Every file `docker build <root>` sends to the daemon, relative to the root."""
    ignore = root / ".dockerignore"
    rules = dockerignore_rules(ignore.read_text()) if ignore.exists() else []
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    return {f for f in files if not excluded(f, rules)}


def test_dockerignore_reading_follows_docker() -> None:
    rules = dockerignore_rules("# c\n.git\n**/__pycache__\n*.egg-info\nruns\n!runs/keep\n/docs\n")
    assert excluded(".git/HEAD", rules)
    assert excluded("floodgate/__pycache__/x.pyc", rules) and excluded("__pycache__/x.pyc", rules)
    assert excluded("floodgate.egg-info/PKG-INFO", rules)
    assert not excluded("floodgate/x.egg-info/PKG-INFO", rules)  # `*` stays in one segment
    assert excluded("runs/a.json", rules) and not excluded("runs/keep", rules)
    assert excluded("docs/a.md", rules)
    assert not excluded("floodgate/runs/a.py", rules)  # anchored at the root, unlike .gitignore
    assert not excluded("bench/overload.py", rules)


def test_every_copy_source_reaches_the_build_context() -> None:
    """A COPY of a path that .dockerignore drops fails `docker build` ("not found")."""
    b = parse_dockerfile(DOCKERFILE.read_text())
    context = build_context(ROOT)
    for srcs, _ in b.copies:
        for s in srcs:
            if (ROOT / s).is_dir():
                sent = {f for f in context if f.startswith(f"{s}/")}
                assert sent, f"COPY {s}: .dockerignore drops the folder"
            else:
                assert s in context, f"COPY {s}: .dockerignore drops the file"


# --- the install set, built as the Dockerfile builds it -------------------------------------

@dataclass
class Image:
    bin: Path
    env: dict[str, str]

    def argv(self, command: list[str]) -> list[str]:
        b = parse_dockerfile(DOCKERFILE.read_text())
        return [str(self.bin / b.entrypoint[0]), *b.entrypoint[1:], *command]

    def python(self) -> str:
        return str(self.bin / "python")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    b = parse_dockerfile(DOCKERFILE.read_text())
    base = tmp_path_factory.mktemp("image")
    src, venv = base / "src", base / "venv"
    src.mkdir()
    # Only what the build context holds (.dockerignore applied), as the daemon sees it.
    context = build_context(ROOT)
    for srcs, dest in b.copies:
        for s in srcs:
            origin = ROOT / s
            if origin.is_dir():
                base_target = src / dest / origin.name if dest.endswith("/") else src / dest
                for f in sorted(context):
                    if f.startswith(f"{s}/"):
                        target = base_target / f[len(s) + 1:]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(ROOT / f, target)
            elif s in context:
                target = src / dest / origin.name if dest.endswith("/") else src / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
    # A clean venv from the base interpreter: nothing of the test venv or the repo is visible.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(b.env)
    # The pip cache changes how fast the set installs, not what it is (the image disables it
    # only to stay small).
    env.pop("PIP_NO_CACHE_DIR", None)
    pip = [str(venv / "bin" / "pip"), *b.pip[1:]]
    r = subprocess.run(pip, cwd=src, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{shlex.join(b.pip)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    shutil.rmtree(src)  # as the Dockerfile does: the install must not need the sources
    run_env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    run_env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    yield Image(venv / "bin", run_env)


def run(image: Image, command: list[str], env: dict[str, str] | None = None,
        cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(image.argv(command), env={**image.env, **(env or {})}, cwd=cwd or Path("/"),
                          capture_output=True, text=True, timeout=timeout)


def test_the_image_installs_under_the_floodgate_namespace_only(image: Image) -> None:
    r = subprocess.run([image.python(), "-c", (
        "import importlib.util as u, json;"
        "print(json.dumps({m: u.find_spec(m) is not None for m in "
        "['floodgate.extproc', 'floodgate.controller', 'floodgate.sim', 'floodgate.bench', "
        "'extproc', 'controller', 'sim', 'bench', 'kubernetes_asyncio', 'numpy']}))")],
        env=image.env, cwd="/", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert found == {"floodgate.extproc": True, "floodgate.controller": True, "floodgate.sim": True,
                     "floodgate.bench": True, "extproc": False, "controller": False, "sim": False,
                     "bench": False, "kubernetes_asyncio": True, "numpy": True}


def test_every_subcommand_starts_in_the_image(image: Image) -> None:
    from floodgate.cli import COMMANDS

    r = run(image, ["--help"])
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        r = run(image, [name, "--help"])
        assert r.returncode == 0, f"floodgate {name} --help:\n{r.stderr}"


def test_envoy_config_renders_from_the_installed_package(image: Image, tmp_path: Path) -> None:
    """`floodgate up` renders envoy/local.yaml and its includes: they ship as package data."""
    r = subprocess.run([image.python(), "-m", "floodgate.envoy_config"], env=image.env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    boot = yaml.safe_load(r.stdout)
    assert boot["static_resources"]["listeners"]


# --- the commands compose.yaml and the Kubernetes manifests run -----------------------------

@dataclass
class Command:
    where: str
    argv: list[str]
    env: dict[str, str]
    files: dict[str, Path]  # path in the container -> file here
    healthcheck: list[str] | None = None

    def local_argv(self) -> list[str]:
        """The argv with every mounted container path replaced by its file here."""
        out = []
        for a in self.argv:
            for target, source in self.files.items():
                if a == target or a.startswith(target + "/"):
                    a = str(source / os.path.relpath(a, target)) if a != target else str(source)
            out.append(a)
        return out


def compose_commands() -> list[Command]:
    seen: dict[str, Command] = {}
    for profile in (None, "gpu"):
        for name, svc in services(profile).items():
            if "build" not in svc:  # third-party images (Redis, Envoy, vLLM, Prometheus, ...)
                continue
            files = {v["target"]: Path(v["source"]) for v in svc.get("volumes") or [] if v["type"] == "bind"}
            test = (svc.get("healthcheck") or {}).get("test")
            seen[name] = Command(f"compose.yaml services.{name}", [str(c) for c in svc["command"]],
                                 {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None},
                                 files, [str(t) for t in test] if test else None)
    return list(seen.values())


def kubernetes_commands(tmp: Path) -> list[Command]:
    docs = [d for p in sorted(KUBERNETES.rglob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}
    out = []
    for d in docs:
        pod = (d.get("spec") or {}).get("template", {}).get("spec")
        if not pod:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            if c["image"].split(":")[0] != IMAGE:
                continue
            files: dict[str, Path] = {}
            for m in c.get("volumeMounts", []):
                cm = volumes[m["name"]].get("configMap")
                if cm:
                    folder = tmp / d["metadata"]["name"] / m["name"]
                    folder.mkdir(parents=True, exist_ok=True)
                    for key, text in config_maps[cm["name"]].items():
                        (folder / key).write_text(text)
                    files[m["mountPath"]] = folder
            env = {e["name"]: e.get("value", f"{d['metadata']['name']}-0") for e in c.get("env", [])}
            out.append(Command(f"{d['kind']}/{d['metadata']['name']} container {c['name']}",
                               [str(a) for a in [*c.get("command", []), *c.get("args", [])]], env, files))
    return out


def offers_check_config(image: Image, subcommand: list[str]) -> bool:
    r = run(image, [*subcommand, "--help"])
    return "--check-config" in r.stdout


def check(image: Image, cmd: Command) -> None:
    argv = cmd.local_argv()
    words = [a for a in argv if not a.startswith("-")][:1]
    if offers_check_config(image, words):
        argv = [*argv, "--check-config"]
    try:
        r = run(image, argv, cmd.env, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{cmd.where}: `floodgate {shlex.join(argv)}` blocks: give the command --check-config")
    assert r.returncode == 0, f"{cmd.where}: `floodgate {shlex.join(argv)}` exited {r.returncode}:\n{r.stderr[-3000:]}"


def test_the_manifests_run_floodgate_commands() -> None:
    """The readers below found what they are meant to find (a test that cannot fail is a defect)."""
    compose = {c.argv[0] for c in compose_commands()}
    assert {"extproc", "controller", "sim"} <= compose
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        kube = kubernetes_commands(Path(tmp))
    assert {c.argv[0] for c in kube} >= {"extproc", "controller"}


def test_every_compose_command_runs_in_the_image(image: Image) -> None:
    for cmd in compose_commands():
        check(image, cmd)


def test_every_kubernetes_command_runs_in_the_image(image: Image, tmp_path: Path) -> None:
    for cmd in kubernetes_commands(tmp_path):
        check(image, cmd)


# --- servers started for real, probed by compose's own health checks ------------------------

def _healthcheck_argv(cmd: Command, port_from: int, port_to: int) -> list[str]:
    assert cmd.healthcheck and cmd.healthcheck[0] in ("CMD", "CMD-SHELL"), cmd.healthcheck
    argv = cmd.healthcheck[1:]
    if cmd.healthcheck[0] == "CMD-SHELL":
        argv = ["sh", "-c", argv[0]]
    return [a.replace(f":{port_from}", f":{port_to}") for a in argv]


def test_compose_servers_start_and_pass_their_healthchecks(image: Image, tmp_path: Path) -> None:
    """The processor and the emulator as compose starts them (listening on a free loopback port
    instead of the container's fixed one), probed with the service's own healthcheck command."""
    cmds = {c.argv[0]: c for c in compose_commands() if c.healthcheck}
    with Supervisor(workdir=tmp_path) as sup:
        _, redis_url = sup.start_redis()
        # Processor: the real command and config; env overrides move it to loopback ports and
        # the test's Redis (the config's Redis has a compose DNS name).
        proc = cmds["extproc"]
        grpc_port, metrics_port = free_port(), free_port()
        env = {**image.env, **proc.env, "FLOODGATE_LISTEN": f"127.0.0.1:{grpc_port}",
               "FLOODGATE_METRICS_LISTEN": f"127.0.0.1:{metrics_port}", "FLOODGATE_REDIS_URL": redis_url}
        env.pop("FLOODGATE_REDIS_PASSWORD", None)  # the test's Redis has none
        child = sup.start("extproc", image.argv(proc.local_argv()), env=env)
        wait_for_port("127.0.0.1", grpc_port, 30, child.proc)
        hc = _healthcheck_argv(proc, 50051, grpc_port)
        assert _probe(hc, image, child), f"processor healthcheck never passed:\n{child.log_tail()}"
        # Emulator: the real arguments with --port moved to a free port.
        sim = cmds["sim"]
        port = free_port()
        argv = list(sim.argv)
        argv[argv.index("--port") + 1] = str(port)
        argv[argv.index("--host") + 1] = "127.0.0.1"
        child = sup.start("sim", image.argv(argv), env={**image.env, **sim.env})
        wait_for_port("127.0.0.1", port, 30, child.proc)
        assert _probe(_healthcheck_argv(sim, 8000, port), image, child, tries=60), (
            f"emulator healthcheck never passed:\n{child.log_tail()}")


def _probe(argv: list[str], image: Image, child: Any, tries: int = 30) -> bool:
    import time

    for _ in range(tries):
        # `python` in a healthcheck is the image's interpreter: the PATH puts the venv first.
        if subprocess.run(argv, env=image.env, capture_output=True, timeout=30).returncode == 0:
            return True
        assert child.alive(), child.log_tail()
        time.sleep(0.5)
    return False


def test_top_level_help_imports_no_component() -> None:
    """`floodgate --help` (and a failing optional import in one component) never drags in the
    others: the CLI imports only the module of the command being run."""
    code = ("import sys; from floodgate.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('floodgate.') and m.count('.') >= 1"
            " and m.split('.')[1] in ('extproc', 'controller', 'sim', 'bench', 'up', 'status')) + "
            "[m for m in ('numpy', 'aiohttp', 'grpc') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_the_benchmarks_write_nothing_into_the_installed_package(image: Image, tmp_path: Path) -> None:
    """`floodgate bench overload|elastic|faults` record their results in docs/ of the checkout
    they run from. Installed, their defaults pointed into the installed package (a review:
    `site-packages/floodgate/docs/benchmarks/overload`, created there, root's in the image, so
    `floodgate bench overload` failed at once as the image's user, and `faults` wrote (or failed
    to write, after the whole run) `site-packages/floodgate/docs/benchmarks.md`). Installed,
    results go under the working directory and no doc is updated unless --doc names one."""
    code = ("import argparse, json, floodgate\n"
            "from pathlib import Path\n"
            "from floodgate.bench import elastic, faults, overload\n"
            "out = {}\n"
            "for m in (overload, elastic, faults):\n"
            "    p = argparse.ArgumentParser(); m.add_arguments(p); a = p.parse_args([])\n"
            "    out[m.__name__] = {k: None if getattr(a, k, None) is None else str(Path(getattr(a, k)).resolve())\n"
            "                       for k in ('out', 'doc') if hasattr(a, k)}\n"
            "print(json.dumps({'package': str(Path(floodgate.__file__).resolve().parent), 'defaults': out}))\n")
    r = subprocess.run([image.python(), "-c", code], env=image.env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    package = Path(found["package"])
    for module, paths in found["defaults"].items():
        for flag, path in paths.items():
            assert path is None or not Path(path).is_relative_to(package), f"{module} --{flag} defaults to {path}"
    assert found["defaults"]["floodgate.bench.overload"]["out"] == str(tmp_path.resolve() / "runs" / "bench" / "overload")
    assert all(paths.get("doc") is None for paths in found["defaults"].values()), found


def test_script_instr_runs_from_the_installed_package(image: Image, tmp_path: Path) -> None:
    """`floodgate bench script-instr` compares this leases.lua with a git revision's. Installed
    (no git checkout around the package) it died with a CalledProcessError traceback from
    `git rev-parse`, even with the reference given as --base-file. Now --base-file runs it, and
    without one it says to give one (exit 2, no traceback)."""
    r = run(image, ["bench", "script-instr"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--base-file" in r.stdout + r.stderr, r.stdout + r.stderr
    if not shutil.which("valgrind"):
        pytest.skip("valgrind is not installed")
    base = tmp_path / "leases.lua"
    shutil.copy(ROOT / "extproc" / "leases.lua", base)
    from floodgate.binaries import redis_server_binary

    # The image has no Redis server (compose runs the official image): the test's, as the docs'
    # FLOODGATE_REDIS_BIN.
    r = run(image, ["bench", "script-instr", "--base-file", str(base), "--gateways", "1", "--batch", "1",
                    "--decisions", "40", "--count", "script"], env={"FLOODGATE_REDIS_BIN": redis_server_binary()},
            cwd=tmp_path, timeout=240)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "leases.lua of the installed package vs" in r.stdout, r.stdout


def test_a_benchmark_without_the_local_binaries_says_what_to_install(image: Image, tmp_path: Path) -> None:
    """The image (and a plain `pip install floodgate`) has neither Envoy nor a Redis server: a
    benchmark that needs them ended in a traceback (BinaryNotFound, whose last line said what to
    install). Now it says so on one line and exits 2, as `floodgate up` does."""
    for bench in ("overhead", "scale"):
        r = run(image, ["bench", bench], cwd=tmp_path, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (bench, r.stderr[-2000:])
        assert f"floodgate bench {bench}: " in r.stderr and "floodgate[local]" in r.stderr, (bench, r.stderr)


def test_the_installed_distribution_carries_its_license(image: Image) -> None:
    # pyproject declares Apache-2.0; the license text ships with what users install (a
    # shipping review found no LICENSE in the repository, the wheel or the image).
    r = subprocess.run([image.python(), "-c", (
        "import importlib.metadata as m; d = m.distribution('floodgate');"
        "fs = [f for f in d.files or [] if f.name == 'LICENSE'];"
        "print(d.metadata.get('License-Expression') or d.metadata.get('License'));"
        "print(fs[0].read_text() if fs else '')")],
        env=image.env, cwd="/", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    expression, _, text = r.stdout.partition("\n")
    assert expression == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_the_installed_package_is_marked_typed(image: Image) -> None:
    # PEP 561: without py.typed a user's mypy treats every floodgate import as untyped
    # (pyproject listed one for floodgate.extproc that did not exist).
    r = subprocess.run([image.python(), "-c", (
        "import importlib.resources as r; print(r.files('floodgate').joinpath('py.typed').is_file())")],
        env=image.env, cwd="/", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_script_instr_without_git_says_what_it_needs(image: Image, tmp_path: Path) -> None:
    """The image has no git (python:3.11-slim), nor has a minimal host: `floodgate bench
    script-instr` asked git whether it runs from a checkout before anything else and died in a
    FileNotFoundError traceback ('git'), where it said valgrind is missing before e295533.
    Without git it is the installed package: without --base-file it asks for one (exit 2)."""
    r = run(image, ["bench", "script-instr"], env={"PATH": str(image.bin)}, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--base-file" in r.stdout + r.stderr, r.stdout + r.stderr
