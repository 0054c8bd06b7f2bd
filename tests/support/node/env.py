"""A container's environment and command line, as a kubelet builds them (pure: the Secrets and
ConfigMaps it names are fetched by the caller and handed in).

The order is Kubernetes': ``envFrom`` sources in order, then ``env`` entries in order (a later name
wins), ``$(VAR)`` references expanded against the variables defined before them, ``$$`` an escaped
``$``. A missing Secret or ConfigMap, or key, that is not ``optional`` raises :class:`ConfigError`:
the container then waits with reason CreateContainerConfigError until it appears.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

__all__ = [
    "ConfigError",
    "Sources",
    "container_argv",
    "container_env",
    "decoded_data",
    "expand",
    "field_value",
    "image_repository",
    "parse_quantity",
    "referenced_sources",
    "resource_value",
]

Object = dict[str, Any]
Sources = Mapping[tuple[str, str], Mapping[str, str] | None]
"""``(kind, name) -> data`` for each Secret/ConfigMap a container names; None when it does not exist."""

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
NODE_ALLOCATABLE = {"cpu": "64", "memory": "256Gi", "ephemeral-storage": "1Ti"}
"""A container without a limit sees the node's allocatable, as a kubelet's downward API gives it."""


class ConfigError(Exception):
    """A Secret, ConfigMap or key the container needs is missing (CreateContainerConfigError)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names replaced, unknown ones left as written."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


def image_repository(image: str) -> str:
    """``registry/name`` of an image reference, without its tag or digest."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


def container_argv(
    container: Object, env: Mapping[str, str], entrypoints: Mapping[str, list[str]]
) -> list[str]:
    """``command + args`` with ``$(VAR)`` expanded (args replace the image's CMD). Without a command,
    the image's entrypoint when the agent was told it (``--entrypoint``), else a ConfigError."""
    image = image_repository(container.get("image", ""))
    command = container.get("command") or entrypoints.get(image)
    if not command:
        raise ConfigError(
            f"container {container['name']!r} has no command and the entrypoint of image {image!r} is not "
            "known to this node, which runs no images: give the container a command, or start the node "
            f"agent with --entrypoint={image}=<command>"
        )
    return [expand(word, env) for word in [*command, *(container.get("args") or [])]]


def decoded_data(kind: str, body: Object) -> dict[str, str]:
    """A Secret's ``data`` decoded (and ``stringData``), or a ConfigMap's ``data`` and ``binaryData``."""
    if kind == "Secret":
        data = {key: base64.b64decode(value).decode() for key, value in (body.get("data") or {}).items()}
        return {**data, **(body.get("stringData") or {})}
    binary = {key: base64.b64decode(value).decode() for key, value in (body.get("binaryData") or {}).items()}
    return {**(body.get("data") or {}), **binary}


def referenced_sources(container: Object) -> set[tuple[str, str]]:
    """Every ``(kind, name)`` of Secret and ConfigMap the container's ``env`` and ``envFrom`` name."""
    found = set()
    for source in container.get("envFrom") or []:
        for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
            if key in source:
                found.add((kind, source[key]["name"]))
    for entry in container.get("env") or []:
        value_from = entry.get("valueFrom") or {}
        for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
            if key in value_from:
                found.add((kind, value_from[key]["name"]))
    return found


def container_env(
    pod: Object, container: Object, sources: Sources, base: Mapping[str, str]
) -> dict[str, str]:
    """The container's environment over ``base`` (PATH, HOSTNAME, KUBERNETES_SERVICE_*, ...)."""
    env = dict(base)
    for source in container.get("envFrom") or []:
        env.update(_env_from(source, sources))
    for entry in container.get("env") or []:
        if "value" in entry or "valueFrom" not in entry:
            env[entry["name"]] = expand(entry.get("value", ""), env)
            continue
        value = _value_from(pod, container, entry["valueFrom"], sources)
        if value is not None:
            env[entry["name"]] = value
    return env


def _env_from(source: Object, sources: Sources) -> dict[str, str]:
    kind, ref = (
        ("Secret", source["secretRef"]) if "secretRef" in source else ("ConfigMap", source["configMapRef"])
    )
    data = sources.get((kind, ref["name"]))
    if data is None:
        if ref.get("optional"):
            return {}
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    prefix = source.get("prefix", "")
    return {f"{prefix}{key}": value for key, value in data.items()}


def _value_from(pod: Object, container: Object, value_from: Object, sources: Sources) -> str | None:
    for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
        if key in value_from:
            return _key_value(kind, value_from[key], sources)
    if "fieldRef" in value_from:
        return field_value(pod, value_from["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in value_from:
        return resource_value(pod, container, value_from["resourceFieldRef"])
    raise ConfigError(f"valueFrom {sorted(value_from)} is not one this node agent knows")


def _key_value(kind: str, ref: Object, sources: Sources) -> str | None:
    data = sources.get((kind, ref["name"]))
    if data is not None and ref["key"] in data:
        return data[ref["key"]]
    if ref.get("optional"):
        return None
    if data is None:
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    raise ConfigError(f"couldn't find key {ref['key']} in {kind} {ref['name']}")


def field_value(pod: Object, path: str) -> str:
    """A downward-API ``fieldRef`` of ``pod`` (its status carrying the pod IP the agent gave it)."""
    metadata, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    label = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if label:
        return str((metadata.get(label.group(1)) or {}).get(label.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((metadata.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{key}="{value}"' for key, value in items)
    values = {
        "metadata.name": metadata.get("name"), "metadata.namespace": metadata.get("namespace"),
        "metadata.uid": metadata.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(entry["ip"] for entry in status.get("podIPs") or []),
        "status.hostIPs": ",".join(entry["ip"] for entry in status.get("hostIPs") or []),
    }  # fmt: skip
    if path not in values:
        raise ConfigError(f"fieldRef {path!r} is not a field the downward API offers")
    return str(values[path] or "")


def parse_quantity(text: str) -> Decimal:
    """A Kubernetes quantity (``500m``, ``2Gi``, ``1.5``, ``1e3``) as a number."""
    match = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", str(text).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise ConfigError(f"{text!r} is not a Kubernetes quantity (such as 500m, 2Gi, 1.5)")
    return Decimal(match.group(1)) * Decimal(_SUFFIXES[match.group(2)])


def resource_value(pod: Object, container: Object, ref: Object) -> str:
    """A ``resourceFieldRef`` (``limits.cpu``, ``requests.memory``, ...) rounded up in ``divisor``s;
    a limit the container does not set is the node's allocatable, a request it does not set is 0."""
    if ref.get("containerName"):
        every = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
        container = next(c for c in every if c["name"] == ref["containerName"])
    kind, _, resource = ref["resource"].partition(".")
    declared = (container.get("resources") or {}).get(kind) or {}
    fallback = NODE_ALLOCATABLE.get(resource, "0") if kind == "limits" else "0"
    value = parse_quantity(declared.get(resource, fallback))
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(value / divisor))
