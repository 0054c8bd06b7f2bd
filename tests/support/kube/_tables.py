"""``meta.k8s.io/v1 Table`` responses, which ``kubectl get`` asks for: Name, then a CRD's
additionalPrinterColumns (or Age for every other type), cells computed by the server as kube-apiserver does.

Column paths support the JSONPath subset CRDs use: ``.a.b``, ``[N]`` and ``[?(@.key=="value")]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ._resources import ResourceType
from ._selectors import field_value

__all__ = ["is_table_wanted", "json_path", "table"]

_STEP = re.compile(r"""\.([^.\[]+)|\[\?\(@\.([^=!)]+)==["']([^"']*)["']\)\]|\[(\d+)\]""")
_AGE = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
_NAME = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name of the object",
    "priority": 0,
}


def is_table_wanted(accept: str) -> bool:
    return "as=Table" in accept


def _step(
    value: Any, key: str | None, filter_key: str | None, filter_value: str | None, index: str | None
) -> list[Any]:
    if key is not None:
        return [value[key]] if isinstance(value, Mapping) and key in value else []
    if not isinstance(value, list):
        return []
    if index is not None:
        return [value[int(index)]] if int(index) < len(value) else []
    return [
        item
        for item in value
        if isinstance(item, Mapping) and str(field_value(item, str(filter_key))) == filter_value
    ]


def json_path(obj: Any, path: str) -> list[Any]:
    values = [obj]
    for match in _STEP.finditer(path.strip().strip("{}")):
        values = [found for value in values for found in _step(value, *match.groups())]
    return values


def _age(timestamp: str) -> str:
    seconds = int(
        (datetime.now(UTC) - datetime.fromisoformat(timestamp.replace("Z", "+00:00"))).total_seconds()
    )
    for unit, size, limit in (("s", 1, 120), ("m", 60, 120 * 60), ("h", 3600, 48 * 3600)):
        if seconds < limit:
            return f"{max(seconds, 0) // size}{unit}"
    return f"{seconds // 86400}d"


def _cell(obj: dict[str, Any], column: Mapping[str, Any]) -> Any:
    found = json_path(obj, column["jsonPath"])
    if not found or found[0] is None:
        return None
    return _age(found[0]) if column.get("type") == "date" else found[0]


def _row_object(obj: dict[str, Any], include: str) -> dict[str, Any]:
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}


def table(
    rtype: ResourceType, objs: list[dict[str, Any]], resource_version: str, include: str
) -> dict[str, Any]:
    columns = list(rtype.printer_columns) or [_AGE]
    definitions = [_NAME] + [
        {
            "name": c["name"],
            "type": c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ]
    rows = [
        {
            "cells": [obj["metadata"]["name"]] + [_cell(obj, c) for c in columns],
            "object": _row_object(obj, include),
        }
        for obj in objs
    ]
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }
