"""Field types shared by the processor's and the controller's configs: listen addresses and URLs.

Each is a pydantic `Annotated` type, so a bad value fails at `--check-config` and at start with
the field's dotted path (`server.listen: ...`) instead of a traceback from the socket or client
library that would have received it later.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

# Labels of letters, digits, '-' and '_' (not DNS's rule, but what Docker and compose name
# services and containers, e.g. `vllm_1`).
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")


def _host(host: str) -> None:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError as exc:
            raise ValueError(f"{host!r} is not an IPv6 address") from exc
        return
    if ":" in host:
        raise ValueError(f"IPv6 host {host!r} must be in brackets, e.g. [::1]:50051")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError as exc:
            raise ValueError(f"{host!r} is not an IPv4 address") from exc
        return
    if not _HOSTNAME.match(host):
        raise ValueError(f"{host!r} is not a host name or IP address")


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{what} {text!r} is not a port number 1-65535")
    return int(text)


def check_listen(v: str) -> str:
    """HOST:PORT with an IPv4 address, [IPv6] address or host name, and a port 1-65535."""
    host, sep, port = v.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{v!r} is not HOST:PORT (e.g. 127.0.0.1:9464, 0.0.0.0:50051, [::]:50051)")
    _host(host)
    _port(port, "port")
    return v


def listeners_clash(a: str, b: str) -> bool:
    """Two valid listen addresses that cannot both bind: the same port, and the same host or
    either one a wildcard (`0.0.0.0`, `[::]`), which takes the port on every address."""
    ha, _, pa = a.rpartition(":")
    hb, _, pb = b.rpartition(":")
    if pa != pb:
        return False
    wild = {"0.0.0.0", "[::]", "*", ""}
    return ha.lower() == hb.lower() or ha in wild or hb in wild


def check_optional_listen(v: str | None) -> str | None:
    """A listen address, or empty/None to disable."""
    return check_listen(v) if v else v


def _check_url(v: str, schemes: tuple[str, ...]) -> str:
    try:
        parts = urlsplit(v)
        port = parts.port  # raises on a non-numeric or out-of-range port
    except ValueError as exc:
        raise ValueError(f"{v!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in schemes:
        raise ValueError(f"URL scheme must be one of {', '.join(s + '://' for s in schemes)}; got {v!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"{v!r} has no host")
    if port == 0:
        raise ValueError(f"{v!r}: port 0")
    return v


def check_redis_url(v: str) -> str:
    if "+" in v.partition("://")[0]:  # redis+sentinel://, redis+cluster:// (several hosts)
        from floodgate.extproc.redis_client import (  # lazy: redis is heavy
            RedisURLError,
            parse_redis_url,
        )
        try:
            parse_redis_url(v)
        except RedisURLError as exc:
            raise ValueError(str(exc)) from None
        return v
    _check_url(v, ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster"))
    parts = urlsplit(v)
    if v.startswith("unix") and not parts.path:
        raise ValueError(f"{v!r}: a unix:// URL needs a socket path")
    # redis-py reads a path that is not a number as database 0, silently (redis://host/abc).
    if parts.scheme in ("redis", "rediss") and parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]+", parts.path):
        raise ValueError(f"the URL's path {parts.path!r} is not a database number (redis://host:port/DB, e.g. /0)")
    from floodgate.extproc.redis_client import RedisURLError, parse_redis_url

    try:  # redis-py's own checks (the query: ?db=abc, ?socket_timeout=x)
        parse_redis_url(v)
    except RedisURLError as exc:
        raise ValueError(str(exc)) from None
    return v


def check_http_url(v: str) -> str:
    return _check_url(v, ("http", "https"))


def check_optional_http_url(v: str | None) -> str | None:
    return check_http_url(v) if v is not None else v


ListenAddress = Annotated[str, AfterValidator(check_listen)]
OptionalListenAddress = Annotated[str | None, AfterValidator(check_optional_listen)]
RedisURL = Annotated[str, AfterValidator(check_redis_url)]
HttpURL = Annotated[str, AfterValidator(check_http_url)]
OptionalHttpURL = Annotated[str | None, AfterValidator(check_optional_http_url)]


def out_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be the output directory of a run (None: it exists as a writable
    directory, or can be created as one). Checked before the run: the reports are written at
    its end, and a path that could not take them was a traceback after the whole run (the
    load's or the demo's results lost)."""
    p = path.absolute()
    if p.exists():
        if not p.is_dir():
            return f"{path} exists and is not a directory"
        return None if os.access(p, os.W_OK | os.X_OK) else f"{path} is not writable"
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{path}: {parent} is not a directory"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{path}: cannot create it in {parent} (not writable)"


def out_dir(text: str) -> Path:
    """argparse type of an output directory (`out_dir_problem`)."""
    path = Path(text)
    if (problem := out_dir_problem(path)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return path
