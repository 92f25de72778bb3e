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
    # Data-only packages (no __init__.py, e.g. floodgate.envoy = envoy/) must ship their files.
    data_only = {name for name, folder in package_dir.items() if not (ROOT / folder / "__init__.py").exists()}
    assert data_only <= set(tool.get("package-data", {})), f"data-only packages without package-data: {data_only}"
    listed -= data_only
    assert found == listed, f"pyproject [tool.setuptools] packages differ: missing {found - listed}, extra {listed - found}"
    assert all(p == "floodgate" or p.startswith("floodgate.") for p in listed)
