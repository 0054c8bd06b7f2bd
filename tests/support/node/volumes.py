"""A pod's volumes, materialised under its pod folder (``<workdir>/pods/<ns>_<name>_<uid>/volumes``)
for the sandbox to bind-mount: emptyDir, hostPath, secret, configMap, downwardAPI and projected
(ServiceAccount token through the TokenRequest API bound to the pod, ``kube-root-ca.crt``, downward
API, secrets, configMaps). A volume of any other kind (a PersistentVolumeClaim above all: this node
has no storage) fails the pod, with an Event naming the limit.
"""

from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any

from herd.kube import resource_path
from support.node.client import Kube
from support.node.env import decoded_data, field_value, resource_value

__all__ = ["VolumeError", "materialise", "mounts_for", "token_refresh_s"]

Object = dict[str, Any]
_DEFAULT_MODE = 0o644
_TOKEN_SECONDS = 3607


class VolumeError(Exception):
    """A volume this node cannot provide yet (a missing Secret: tried again, as a kubelet does) or
    ever (``is_permanent``: a kind of volume this node has no means for; the pod fails)."""

    def __init__(self, reason: str, message: str, *, is_permanent: bool = False) -> None:
        super().__init__(message)
        self.reason, self.message, self.is_permanent = reason, message, is_permanent


async def materialise(kube: Kube, pod: Object, root: Path) -> dict[str, Path]:
    """Each volume's folder (or host path) by name; raises :class:`VolumeError` for one this node
    cannot provide, or a non-optional Secret/ConfigMap that is missing."""
    paths = {}
    for volume in pod["spec"].get("volumes") or []:
        path = root / volume["name"]
        if "hostPath" in volume:
            paths[volume["name"]] = _host_path(volume["hostPath"])
            continue
        path.mkdir(parents=True, exist_ok=True)
        files = await _files(kube, pod, volume)
        _write(path, files, volume)
        paths[volume["name"]] = path
    return paths


def token_refresh_s(pod: Object) -> float | None:
    """Seconds after which the pod's ServiceAccount tokens are written anew (at 80 % of the shortest
    lifetime, as a kubelet renews them); None when it has none."""
    lifetimes = [
        source["serviceAccountToken"].get("expirationSeconds", _TOKEN_SECONDS)
        for volume in pod["spec"].get("volumes") or []
        for source in (volume.get("projected") or {}).get("sources") or []
        if "serviceAccountToken" in source
    ]
    return 0.8 * min(lifetimes) if lifetimes else None


def _host_path(host: Object) -> Path:
    path, kind = Path(host["path"]), host.get("type", "")
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif kind in ("Directory", "File") and not (path.is_dir() if kind == "Directory" else path.is_file()):
        raise VolumeError(
            "FailedMount", f"hostPath type check failed: {path} is not a {kind.lower()}", is_permanent=True
        )
    return path


async def _files(kube: Kube, pod: Object, volume: Object) -> dict[str, tuple[str, int | None]]:
    """``relative path -> (content, mode)`` of a volume made of files; {} for an emptyDir."""
    if "emptyDir" in volume:
        return {}
    if "secret" in volume or "configMap" in volume:
        return await _object_files(kube, pod, volume)
    if "downwardAPI" in volume:
        return _downward_files(pod, volume["downwardAPI"])
    if "projected" in volume:
        files: dict[str, tuple[str, int | None]] = {}
        for source in volume["projected"].get("sources") or []:
            files.update(await _projected_files(kube, pod, source))
        return files
    kind = next((key for key in volume if key != "name"), "unknown")
    raise VolumeError(
        "FailedMount",
        f"volume {volume['name']!r} is a {kind}: the test node agent provides emptyDir, hostPath, secret, "
        "configMap, downwardAPI and projected volumes only (no storage: use a hostPath for local files)",
        is_permanent=True,
    )


async def _object_files(kube: Kube, pod: Object, volume: Object) -> dict[str, tuple[str, int | None]]:
    kind, source = ("Secret", volume["secret"]) if "secret" in volume else ("ConfigMap", volume["configMap"])
    name = source.get("secretName") or source.get("name")
    return await _keyed_files(kube, pod["metadata"]["namespace"], kind, name, source)


async def _keyed_files(
    kube: Kube, namespace: str, kind: str, name: str, source: Object
) -> dict[str, tuple[str, int | None]]:
    body = await kube.get(resource_path("v1", f"{kind.lower()}s", namespace, name))
    if body is None:
        if source.get("optional"):
            return {}
        raise VolumeError("FailedMount", f'{kind.lower()} "{name}" not found: create it, or mark the volume optional')  # fmt: skip
    data = decoded_data(kind, body)
    items = source.get("items")
    if not items:
        return {key: (value, None) for key, value in data.items()}
    missing = [item["key"] for item in items if item["key"] not in data]
    if missing and not source.get("optional"):
        raise VolumeError("FailedMount", f"{kind} {name} has no key {missing[0]!r}")
    return {item["path"]: (data[item["key"]], item.get("mode")) for item in items if item["key"] in data}


def _downward_files(pod: Object, downward: Object) -> dict[str, tuple[str, int | None]]:
    files = {}
    for item in downward.get("items") or []:
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"])
        else:
            value = resource_value(pod, pod["spec"]["containers"][0], item["resourceFieldRef"])
        files[item["path"]] = (value, item.get("mode"))
    return files


async def _projected_files(kube: Kube, pod: Object, source: Object) -> dict[str, tuple[str, int | None]]:
    namespace = pod["metadata"]["namespace"]
    if "serviceAccountToken" in source:
        token = source["serviceAccountToken"]
        return {token["path"]: (await _token(kube, pod, token), None)}
    if "downwardAPI" in source:
        return _downward_files(pod, source["downwardAPI"])
    kind, ref = ("Secret", source["secret"]) if "secret" in source else ("ConfigMap", source["configMap"])
    return await _keyed_files(kube, namespace, kind, ref["name"], ref)


async def _token(kube: Kube, pod: Object, token: Object) -> str:
    """A TokenRequest token of the pod's ServiceAccount, bound to the pod (valid while it exists)."""
    metadata = pod["metadata"]
    account = pod["spec"].get("serviceAccountName") or "default"
    spec: Object = {
        "expirationSeconds": token.get("expirationSeconds", _TOKEN_SECONDS),
        "boundObjectRef": {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": metadata["name"],
            "uid": metadata["uid"],
        },
    }
    if token.get("audience"):
        spec["audiences"] = [token["audience"]]
    path = resource_path("v1", "serviceaccounts", metadata["namespace"], account) + "/token"
    answer = await kube.create(
        path, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    )
    if answer is None:
        raise VolumeError("FailedMount", f'serviceaccount "{account}" not found: create it before the pod')
    return str(answer["status"]["token"])


def _write(folder: Path, files: dict[str, tuple[str, int | None]], volume: Object) -> None:
    source: Object = next(
        (volume[key] for key in ("secret", "configMap", "downwardAPI", "projected") if key in volume), {}
    )
    default_mode = source.get("defaultMode", _DEFAULT_MODE)
    for relative, (content, mode) in files.items():
        path = folder / posixpath.normpath(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: a container reading a renewed token never sees half of it.
        fresh = path.with_name(f".{path.name}.new")
        fresh.write_text(content)
        fresh.chmod(mode if mode is not None else default_mode)
        fresh.replace(path)


def mounts_for(container: Object, volumes: dict[str, Path]) -> list[Object]:
    """The sandbox's bind mounts of ``container``: ``{source, target, readOnly}``, with subPath."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = volumes[mount["name"]]
        if mount.get("subPath"):
            source = source / mount["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        mounts.append(
            {"source": str(source), "target": mount["mountPath"], "readOnly": bool(mount.get("readOnly"))}
        )
    return mounts
