"""Reading ModelDeployment manifests from YAML, with errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from herd.api.crd import ModelDeployment

__all__ = ["ManifestError", "format_validation_error", "load_manifest", "parse_manifest"]


class ManifestError(ValueError):
    """A manifest that is not a valid ModelDeployment; the message names each bad field."""


def format_validation_error(error: ValidationError, *, root: str = "") -> str:
    """One line per problem: ``spec.engine.kvCache.blockSize: must be a power of two ...``."""
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"] if not _is_union_tag(part))
        where = f"{root}.{path}" if root and path else (path or root or "<root>")
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; check its spelling against the ModelDeployment schema (crds/)"
        lines.append(f"{where}: {message}")
    return "\n".join(lines)


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the discriminator value (e.g. 'prefix_hash') into the location of union errors.
    return isinstance(part, str) and part in {
        "round_robin",
        "least_request",
        "random",
        "prefix_hash",
        "sticky_session",
        "kv_cache_aware",
    }


def parse_manifest(document: Any, *, source: str = "<manifest>") -> ModelDeployment:
    """Validate one decoded YAML document as a ModelDeployment."""
    if not isinstance(document, dict):
        raise ManifestError(f"{source}: expected a ModelDeployment mapping, got {type(document).__name__}")
    try:
        return ModelDeployment.model_validate(document)
    except ValidationError as error:
        raise ManifestError(f"{source}: invalid ModelDeployment\n{format_validation_error(error)}") from None


def load_manifest(path: str | Path) -> list[ModelDeployment]:
    """Every ModelDeployment in a (possibly multi-document) YAML file; other kinds are skipped."""
    path = Path(path)
    try:
        documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    except (OSError, yaml.YAMLError) as error:
        raise ManifestError(f"{path}: cannot read the manifest: {error}") from None
    deployments = [
        parse_manifest(doc, source=str(path))
        for doc in documents
        if isinstance(doc, dict) and doc.get("kind") == "ModelDeployment"
    ]
    if not deployments:
        raise ManifestError(f"{path}: no document of kind ModelDeployment found")
    return deployments
