"""The distribution installs every component under the one `floodgate` namespace."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_under_the_floodgate_namespace() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = tool["package-dir"]
    listed = set(tool["packages"])
    found: set[str] = set()
    for name, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    # Data-only packages (no __init__.py, e.g. floodgate.envoy = envoy/, floodgate.sim.data =
    # sim/data/) must ship their files; listed, setuptools installs them without warnings.
    def folder_of(pkg: str) -> Path:
        base = max((n for n in package_dir if pkg == n or pkg.startswith(n + ".")), key=len)
        return ROOT / package_dir[base] / Path(*pkg[len(base):].split(".")[1:]) if pkg != base else ROOT / package_dir[base]

    data_only = {name for name in listed if not (folder_of(name) / "__init__.py").exists()}
    assert data_only <= set(tool.get("package-data", {})), f"data-only packages without package-data: {data_only}"
    for name in data_only:
        assert all(any(folder_of(name).glob(pat)) for pat in tool["package-data"][name]), name
    listed -= data_only
    assert found == listed, f"pyproject [tool.setuptools] packages differ: missing {found - listed}, extra {listed - found}"
    assert all(p == "floodgate" or p.startswith("floodgate.") for p in listed)



def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    # `... | head -1` where the reader has gone before the first write: no traceback on stderr.
    import subprocess
    import sys

    ctl = tmp_path / "c.yaml"
    ctl.write_text("pools: [{name: a, actuator: {kind: process}}]\n")
    for argv in (["-m", "floodgate", "extproc", "--check-config"], ["-m", "floodgate.envoy_config"],
                 ["-m", "floodgate", "controller", "--config", str(ctl), "--check-config"]):
        p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # before the child has written anything
        err = p.stderr.read().decode()
        p.wait(60)
        assert "Traceback" not in err and "BrokenPipe" not in err, (argv, err)
