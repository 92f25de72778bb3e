"""Generate docs/configuration.md from the config schemas, so the reference cannot drift.

    python -m floodgate.config_reference > docs/configuration.md

`tests/test_config_reference.py` fails when the committed file differs from this output.
"""

from __future__ import annotations

import json
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _bounds(metadata: Any) -> str:
    """" (0-2)", " (>= 1)", ... from the numeric constraints in Annotated metadata; "" when none."""
    found: dict[str, Any] = {}
    for item in metadata:
        # Field(ge=..) inside Annotated arrives as a FieldInfo holding annotated_types Ge/Le/...
        for m in [item, *getattr(item, "metadata", [])]:
            for op in ("ge", "gt", "le", "lt"):
                if getattr(m, op, None) is not None:
                    found[op] = getattr(m, op)
    if "ge" in found and "le" in found:
        return f" ({found['ge']}-{found['le']})"
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    parts = [f"{symbols[op]} {value}" for op, value in found.items()]
    return f" ({', '.join(parts)})" if parts else ""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        return _type_name(inner) + _bounds(metadata)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if origin is dict:
        k, v = typing.get_args(annotation)
        return f"map {_type_name(k)} → {_type_name(v)}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return f"{len(value)} entry (see below)"
    if isinstance(value, dict) and value and isinstance(next(iter(value.values())), BaseModel):
        return ", ".join(f"{k}: {{{', '.join(f'{a}: {b}' for a, b in v.model_dump().items())}}}" for k, v in value.items())
    return f"`{json.dumps(value)}`"


def _rows(model: type[BaseModel], prefix: str, out: list[str], nested: list[tuple[str, type[BaseModel]]]) -> None:
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        desc = (field.description or "").replace("|", "\\|")
        out.append(f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        for sub in _models_in(field.annotation):
            origin = typing.get_origin(field.annotation)
            suffix = "[]." if origin in (list, tuple) else ".<key>." if origin is dict else "."
            nested.append((f"{path}{suffix}", sub))


def section(title: str, intro: str, root: type[BaseModel]) -> str:
    lines = [f"## {title}", "", intro, ""]
    queue: list[tuple[str, type[BaseModel]]] = [("", root)]
    seen: set[tuple[str, type[BaseModel]]] = set()
    while queue:
        prefix, model = queue.pop(0)
        if (prefix, model) in seen:
            continue
        seen.add((prefix, model))
        lines += [f"### `{prefix.rstrip('.') or '(top level)'}` — {model.__name__}", ""]
        # The docstring's first paragraph, whole (its first line alone may stop mid-sentence).
        doc = (model.__doc__ or "").strip().split("\n\n", 1)[0].split()
        if doc and doc[0] != "!!!" and "Usage docs" not in " ".join(doc):
            lines += [" ".join(doc), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        nested: list[tuple[str, type[BaseModel]]] = []
        _rows(model, prefix, lines, nested)
        lines.append("")
        queue += nested
    return "\n".join(lines)


def render() -> str:
    from floodgate.controller.config import ENV_OVERRIDES as CONTROLLER_ENV
    from floodgate.controller.config import ControllerConfig
    from floodgate.extproc.config import ENV_OVERRIDES, Config

    env = ", ".join(f"`{k}` (`{'.'.join(v)}`)" for k, v in ENV_OVERRIDES.items())
    ctl_env = ", ".join(f"`{k}` (`{'.'.join(v)}`)" for k, v in CONTROLLER_ENV.items())
    parts = [
        "# Configuration reference",
        "",
        "Generated from the config schemas by `python -m floodgate.config_reference`; a test fails",
        "when this file and the code disagree. Unknown keys are errors, and every error names its",
        "field (`pools.0.limit.max: Input should be greater than or equal to 1`).",
        "",
        section("Processor (`floodgate extproc --config FILE`)",
                f"Environment overrides: {env}. Command-line flags win over both. An empty variable is "
                "unset, except `FLOODGATE_METRICS_LISTEN`, where empty turns the metrics listener off (as "
                "`--metrics-listen ''`); an error in a value a variable set names the variable.", Config),
        section("Controller (`floodgate controller --config FILE`)",
                "See docs/controller.md for what each policy setting does. "
                f"Environment overrides: {ctl_env}.", ControllerConfig),
    ]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    argparse.ArgumentParser(prog="python -m floodgate.config_reference",
                            description="Print the configuration reference (docs/configuration.md) "
                                        "generated from the config schemas.").parse_args(argv)
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
