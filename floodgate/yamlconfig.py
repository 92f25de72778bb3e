"""Reading a YAML config file and phrasing validation errors: shared by every component.

Both the processor (`extproc/config.py`) and the controller (`controller/config.py`) validate
with pydantic and must stop start-up with a message that names the bad field, never a
traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A config problem, already phrased for the operator."""


class DuplicateKey(ValueError):
    """A mapping of the YAML document holds the same key twice."""


# Every config model's settings (processor and controller): an unknown key is an error, a config
# is frozen once read, and inf/NaN are refused (.inf passed every lower bound, printed as null by
# --check-config and then crashed start-up converting a TTL to milliseconds).
STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

def load_unique(text: str) -> Any:
    """`yaml.safe_load`, except that a key given twice in one mapping is an error naming it
    (`pools.0.policy`): plain YAML keeps the last one and silently drops the first. Keys merged
    in with `<<: *anchor` may be overridden, as YAML intends."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_unique_keys(loader, node, (), set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_unique_keys(loader: yaml.SafeLoader, node: yaml.Node, path: tuple[str, ...], seen: set[int]) -> None:
    if id(node) in seen:  # an alias of a node already checked (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(loader, item, (*path, str(i)), seen)
    elif isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`: merged keys may be overridden
                continue
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            if isinstance(key_node, yaml.ScalarNode):
                key = loader.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in first:
                        raise DuplicateKey(
                            f"duplicate key {'.'.join((*path, name))} (line {line}; first on line {first[key]}): "
                            "YAML would keep only the last one; give it once")
                    first[key] = line
                except TypeError:  # an unhashable key: the constructor reports it
                    pass
            _check_unique_keys(loader, value_node, (*path, name), seen)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What the parser found and where (line, column), without the snippet of the file that
    PyYAML's own message quotes: the line may hold a password (a review saw
    `password: [hunter2secret` printed to the log)."""
    if isinstance(exc, yaml.reader.ReaderError):
        return f"unacceptable character #x{exc.character:04x} at position {exc.position}" \
            if isinstance(exc.character, int) else f"unreadable input at position {exc.position}"
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__

    def at(mark: Any) -> str:
        return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""

    def said(text: str) -> str:
        # An alias or tag the parser names is the file's own text (`password: *hunter2`): not
        # repeated. Scanner and parser messages quote only tokens (',', '<stream end>').
        if isinstance(exc, yaml.composer.ComposerError | yaml.constructor.ConstructorError):
            return re.sub(r"'[^']*'", "'…'", text)
        return text

    parts = []
    if exc.context:
        parts.append(f"{said(exc.context)}{at(exc.context_mark)}")
    if exc.problem:
        parts.append(f"{said(exc.problem)}{at(exc.problem_mark)}")
    return ": ".join(parts) or type(exc).__name__


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The YAML file's top-level mapping (an empty file is an empty mapping)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path} is not UTF-8 text: byte {exc.object[exc.start]:#04x} "
                          f"at offset {exc.start}") from None
    try:
        loaded = load_unique(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {yaml_problem(exc)}") from None
    except DuplicateKey as exc:
        raise ConfigError(f"config {path}: {exc}") from None
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


def name_env_sources(text: str, from_env: dict[tuple[str, ...], str]) -> str:
    """`format_errors` text with each error in a value an environment variable set ending in
    "(set by VAR)": the file may be fine, and the user reading it would not see the value."""
    lines = []
    for line in text.splitlines():
        for where, var in from_env.items():
            if line.startswith(f"  {'.'.join(where)}:") or line.startswith(f"  {'.'.join(where)}."):
                line += f" (set by {var})"
        lines.append(line)
    return "\n".join(lines)


def dump_redacted(cfg: BaseModel) -> str:
    """The validated config as `--check-config` prints it: JSON, with the Redis password and the
    passwords in the Redis URL replaced by `***` (a config check's output lands in CI logs and
    terminals; the processor's start-up log redacts them the same way)."""
    from floodgate.extproc.redis_client import redact_url

    data = cfg.model_dump(mode="json")
    redis = data.get("redis")
    if isinstance(redis, dict):
        if redis.get("password"):
            redis["password"] = "***"
        if isinstance(redis.get("url"), str):
            redis["url"] = redact_url(redis["url"])
    return json.dumps(data, indent=2)
