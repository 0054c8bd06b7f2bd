"""What a real API server does with a CRD's structural schema on every write of a custom resource:
apply ``default`` values, prune fields the schema does not declare (unless
``x-kubernetes-preserve-unknown-fields``), then validate, answering 422 with the field path.

Validation is JSON Schema draft 4 (OpenAPI 3.0's base) over the OpenAPI v3 schema with ``nullable`` honoured; CEL rules
(``x-kubernetes-validations``) and formats are not checked. ``apiVersion``, ``kind`` and ``metadata``
at the root are never pruned.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]

from ._errors import invalid

__all__ = ["apply_schema"]

_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def _walk(value: Any, schema: Mapping[str, Any], is_root: bool = False) -> Any:
    """Defaults and pruning, bottom-up in one pass; returns the new value."""
    if isinstance(value, dict):
        return _walk_object(value, schema, is_root)
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_walk(item, schema["items"]) for item in value]
    return value


def _walk_object(value: dict[str, Any], schema: Mapping[str, Any], is_root: bool) -> dict[str, Any]:
    properties: Mapping[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
    result: dict[str, Any] = {}
    for key, item in value.items():
        if is_root and key in _ROOT_FIELDS:
            result[key] = item
        elif key in properties:
            result[key] = _walk(item, properties[key])
        elif isinstance(extra, Mapping):
            result[key] = _walk(item, extra)
        elif keeps_unknown:
            result[key] = item
    for key, child in properties.items():
        if key not in result and "default" in child:
            result[key] = _walk(copy.deepcopy(child["default"]), child)
    return result


def _nullable(schema: Any) -> Any:
    """OpenAPI's ``nullable: true`` as JSON Schema's ``type: [T, "null"]``."""
    if isinstance(schema, list):
        return [_nullable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: _nullable(value) for key, value in schema.items()}
    if converted.get("nullable") and isinstance(converted.get("type"), str):
        converted["type"] = [converted["type"], "null"]
    return converted


@functools.lru_cache(maxsize=64)
def _validator(schema_json: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_nullable(json.loads(schema_json)))


def _message(kind: str, name: str, error: jsonschema.ValidationError) -> str:
    path = ".".join(str(step) for step in error.absolute_path) or "<root>"
    return f'{kind} "{name}" is invalid: {path}: Invalid value: {json.dumps(error.instance)}: {error.message}'


def apply_schema(obj: dict[str, Any], schema: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The object defaulted and pruned; raises 422 Invalid naming the first failing field."""
    result: dict[str, Any] = _walk(obj, schema, is_root=True)
    errors = sorted(_validator(json.dumps(schema, sort_keys=True)).iter_errors(result), key=lambda e: e.path)
    if errors:
        raise invalid(_message(kind, result.get("metadata", {}).get("name", ""), errors[0]))
    return result
