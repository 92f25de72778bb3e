"""Reading a YAML config file and phrasing validation errors: shared by every component.

Both the processor (`extproc/config.py`) and the controller (`controller/config.py`) validate
with pydantic and must stop start-up with a message that names the bad field, never a
traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A config problem, already phrased for the operator."""


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML file's top-level mapping (an empty file is an empty mapping)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def format_errors(exc: ValidationError, title: str = "invalid config") -> str:
    """One line per error, each starting with the field's dotted path."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"  {loc}: {err['msg']}")
    return f"{title}:\n" + "\n".join(lines)
