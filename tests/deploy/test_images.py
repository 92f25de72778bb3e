"""Every image a shipped manifest runs is pinned to a version: no `latest`, no floating tag
(`v1.40-latest`, `7.4-alpine`, `3.11-slim` move under you), one vLLM version everywhere."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# major.minor.patch, optionally a variant suffix (-alpine, -slim), or a digest.
PINNED = re.compile(r"^v?\d+\.\d+\.\d+([-+][A-Za-z0-9.-]+)?$")


def _tag(image: str) -> str:
    if "@sha256:" in image:
        return "@digest"
    name = image.rsplit("/", 1)[-1]
    return name.split(":", 1)[1] if ":" in name else ""


def is_pinned(image: str) -> bool:
    tag = _tag(image)
    return tag == "@digest" or (bool(PINNED.match(tag)) and "latest" not in tag)


def _defaults(value: str) -> str:
    """Compose interpolation with the file's defaults: ${VAR:-default} -> default."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def compose_images() -> dict[str, str]:
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    anchors = {k: v for k, v in doc.items() if k.startswith("x-")}
    out: dict[str, str] = {}
    for name, svc in {**anchors, **doc["services"]}.items():
        if isinstance(svc, dict) and "image" in svc and "build" not in svc:
            out[f"compose.yaml:{name}"] = _defaults(svc["image"])
    return out


def kubernetes_images() -> dict[str, str]:
    out: dict[str, str] = {}
    kdir = ROOT / "deploy" / "kubernetes"
    kust = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    overrides = {i["name"]: i for i in kust.get("images", [])}
    for path in sorted(kdir.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec: Any = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                image = c["image"]
                if image in overrides:  # kustomize `images:` sets the tag
                    image = f"{image}:{overrides[image]['newTag']}"
                out[f"{path.relative_to(ROOT)}:{c['name']}"] = image
    return out


def dockerfile_images() -> dict[str, str]:
    out: dict[str, str] = {}
    for i, line in enumerate((ROOT / "Dockerfile").read_text().splitlines()):
        if line.startswith("FROM "):
            out[f"Dockerfile:{i + 1}"] = line.split()[1]
    return out


ALL = {**compose_images(), **kubernetes_images(), **dockerfile_images()}


def test_the_checker_tells_pinned_from_floating() -> None:
    for good in ("redis:7.4.2-alpine", "envoyproxy/envoy:v1.40.0", "python:3.11.11-slim-bookworm",
                 "vllm/vllm-openai:v0.11.0", "floodgate:0.1.0", "x@sha256:" + "a" * 64):
        assert is_pinned(good), good
    for bad in ("redis:7.4-alpine", "envoyproxy/envoy:v1.40-latest", "python:3.11-slim", "vllm/vllm-openai",
                "nginx:latest", "x:1.2.3-latest", "registry:5000/img", "grafana/grafana:12"):
        assert not is_pinned(bad), bad


@pytest.mark.parametrize("where", sorted(ALL))
def test_every_shipped_image_is_pinned(where: str) -> None:
    assert is_pinned(ALL[where]), f"{where} runs {ALL[where]}: pin a version (major.minor.patch)"


def test_one_vllm_version_across_compose_and_kubernetes() -> None:
    vllm = {w: i for w, i in ALL.items() if i.startswith("vllm/vllm-openai")}
    assert any(w.startswith("compose.yaml") for w in vllm) and any(w.startswith("deploy/") for w in vllm)
    assert len(set(vllm.values())) == 1, vllm


def test_enough_images_are_checked() -> None:
    kinds = {i.split(":")[0].rsplit("/", 1)[-1] for i in ALL.values()}
    assert {"redis", "envoy", "vllm-openai", "prometheus", "grafana", "python", "floodgate"} <= kinds, kinds
