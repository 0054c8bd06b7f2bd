"""The three PATCH flavours: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge.

Strategic merge is a merge patch, except that lists of known object types are merged item by item
on their merge key (containers by ``name``, volume mounts by ``mountPath``, ...), ``$patch: delete``
and ``$patch: replace`` directives are honoured, and kubectl's ``$setElementOrder``/``$retainKeys``
hints are dropped. The merge keys are a fixed table, not the OpenAPI schema.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import bad_request, invalid

__all__ = ["PATCHERS", "json_patch", "merge_patch", "strategic_merge_patch"]

Patcher = Callable[[dict[str, Any], Any], dict[str, Any]]

_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "envFrom": None,
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "hostAliases": "ip",
}
_PORT_KEYS = ("containerPort", "port")


def _merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value)
    return result


def merge_patch(target: dict[str, Any], patch: Any) -> dict[str, Any]:
    if not isinstance(patch, Mapping):
        raise bad_request("a merge patch must be a JSON object")
    merged: dict[str, Any] = _merge(target, patch)
    return merged


def _merge_key(name: str, items: list[Any]) -> str | None:
    if name == "ports":
        return next((key for key in _PORT_KEYS if all(key in item for item in items)), None)
    return _MERGE_KEYS.get(name)


def _strategic_list(name: str, target: Any, patch: list[Any]) -> list[Any]:
    key = _merge_key(name, patch)
    if key is None or not isinstance(target, list) or not all(isinstance(item, Mapping) for item in patch):
        return [_strategic(None, item) for item in patch if not _is_directive(item, "delete")]
    result = list(target)
    for item in patch:
        index = next((i for i, old in enumerate(result) if old.get(key) == item.get(key)), None)
        if _is_directive(item, "delete"):
            result = [old for old in result if old.get(key) != item.get(key)]
        elif index is None:
            result.append(_strategic(None, item))
        else:
            result[index] = _strategic(result[index], item)
    return result


def _is_directive(item: Any, directive: str) -> bool:
    return isinstance(item, Mapping) and item.get("$patch") == directive


def _strategic(target: Any, patch: Any) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {key: copy.deepcopy(value) for key, value in patch.items() if key != "$patch"}
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _strategic_list(key, result.get(key), value)
        else:
            result[key] = _strategic(result.get(key), value)
    return result


def strategic_merge_patch(target: dict[str, Any], patch: Any) -> dict[str, Any]:
    if not isinstance(patch, Mapping):
        raise bad_request("a strategic merge patch must be a JSON object")
    merged: dict[str, Any] = _strategic(target, patch)
    return merged


def _parse_pointer(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise invalid(f"JSON patch path {pointer!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in pointer[1:].split("/")]


def _parent(doc: Any, parts: list[str], pointer: str) -> Any:
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise invalid(f"JSON patch path {pointer!r} does not exist in the object") from None
    return node


def _get(doc: Any, pointer: str) -> Any:
    parts = _parse_pointer(pointer)
    if not parts:
        return doc
    parent = _parent(doc, parts, pointer)
    try:
        return parent[int(parts[-1])] if isinstance(parent, list) else parent[parts[-1]]
    except (KeyError, IndexError, ValueError, TypeError):
        raise invalid(f"JSON patch path {pointer!r} does not exist in the object") from None


def _add(doc: Any, pointer: str, value: Any) -> None:
    parts = _parse_pointer(pointer)
    parent = _parent(doc, parts, pointer)
    if isinstance(parent, list):
        index = len(parent) if parts[-1] == "-" else int(parts[-1])
        parent.insert(index, copy.deepcopy(value))
    elif isinstance(parent, dict):
        parent[parts[-1]] = copy.deepcopy(value)
    else:
        raise invalid(f"JSON patch path {pointer!r} has no container to add into")


def _remove(doc: Any, pointer: str) -> Any:
    value = _get(doc, pointer)
    parts = _parse_pointer(pointer)
    parent = _parent(doc, parts, pointer)
    if isinstance(parent, list):
        del parent[int(parts[-1])]
    else:
        del parent[parts[-1]]
    return value


def _apply_op(doc: dict[str, Any], op: Mapping[str, Any]) -> None:
    kind, path = op.get("op"), op.get("path", "")
    if kind == "test":
        if _get(doc, path) != op.get("value"):
            raise invalid(f"JSON patch test failed: {path} is not {op.get('value')!r}")
    elif kind == "add":
        _add(doc, path, op.get("value"))
    elif kind == "remove":
        _remove(doc, path)
    elif kind == "replace":
        _remove(doc, path)
        _add(doc, path, op.get("value"))
    elif kind in ("move", "copy"):
        value = _remove(doc, op["from"]) if kind == "move" else _get(doc, op["from"])
        _add(doc, path, value)
    else:
        raise bad_request(
            f"unknown JSON patch operation {kind!r}: use add, remove, replace, move, copy or test"
        )


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    if not isinstance(ops, list):
        raise bad_request("a JSON patch must be a JSON list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        _apply_op(doc, op)
    return doc


PATCHERS: dict[str, Patcher] = {
    "application/merge-patch+json": merge_patch,
    "application/json-patch+json": json_patch,
    "application/strategic-merge-patch+json": strategic_merge_patch,
}
