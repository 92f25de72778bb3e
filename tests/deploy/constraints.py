"""The runtime dependency closure of `floodgate[k8s]` as installed, as pip constraints: what
constraints.txt pins for the image and for `make install` (ship what the suite ran).

    .venv/bin/python -m tests.deploy.constraints > constraints.txt
"""

from __future__ import annotations

import re
from importlib import metadata

from packaging.requirements import Requirement

HEADER = """\
# The exact versions of floodgate[k8s]'s runtime dependencies (and theirs) the test suite runs:
# the Dockerfile and `make install` install with `-c constraints.txt`, so a rebuilt image ships
# what the suite ran, not whatever is newest that day. Regenerate after changing a dependency in
# pyproject.toml:  .venv/bin/python -m tests.deploy.constraints > constraints.txt
# (tests/deploy/test_image.py checks this file against the installed closure)."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(root: str = "floodgate", extras: frozenset[str] = frozenset({"k8s"})) -> dict[str, str]:
    """{normalized name: installed version} of every distribution `root[extras]` needs at run
    time (environment markers evaluated here), `root` itself left out."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, extras)]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, want = todo.pop()
        if (_norm(name), want) in done:
            continue
        done.add((_norm(name), want))
        dist = metadata.distribution(name)
        if _norm(dist.metadata["Name"]) != _norm(root):
            seen[_norm(dist.metadata["Name"])] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            envs = [{"extra": e} for e in (want or {""})]
            if req.marker is not None and not any(req.marker.evaluate(env) for env in envs):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return seen


def render() -> str:
    return HEADER + "\n" + "".join(f"{k}=={v}\n" for k, v in sorted(runtime_closure().items()))


if __name__ == "__main__":
    print(render(), end="")
