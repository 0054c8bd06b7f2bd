"""Where a worker finds its weights: volumes, mounts and init containers per model source scheme.

``hf://`` and ``s3://`` are fetched by an init container into ``/models`` (the cache PVC when the
spec names one, so replicas and restarts share one download; an ``emptyDir`` otherwise).
``pvc://claim/path`` is mounted read-only; ``file:///abs`` is a node path (``hostPath``) and a
relative ``file://path`` is a path inside the worker image. A pool that needs no weights (the
simulated backend reads the config and tokenizer only) fetches everything else. A LoRA adapter's
source is planned the same way under its own volume, root folder and init container
(``adapter_place``), so adapters and the model never share a mount.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from herd.api.crd import ModelSpec
from herd.operator.settings import PlanSettings

__all__ = ["MODELS_DIR", "WEIGHT_FILES", "ModelSource", "Place", "adapter_place", "plan_source"]

MODELS_DIR = "/models"
ADAPTERS_DIR = "/adapters"
_HF_TOKEN_SECRET = "herd-hf-token"
_S3_SECRET = "herd-s3-credentials"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
"""File patterns of model weights, left out of a fetch for a pool that reads none."""

Object = dict[str, Any]


@dataclass(frozen=True)
class Place:
    """Where one source lands in the pod: its volume's name, the folder it is fetched or mounted
    under, and the name of its fetching init container."""

    volume: str = "models"
    root: str = MODELS_DIR
    fetcher: str = "fetch-model"


def adapter_place(index: int) -> Place:
    """The place of the deployment's adapter number ``index``."""
    return Place(f"adapter-{index}", f"{ADAPTERS_DIR}/{index}", f"fetch-adapter-{index}")


@dataclass(frozen=True)
class ModelSource:
    """The pod-level pieces that make ``path`` hold the model inside the worker container."""

    path: str
    volumes: list[Object] = field(default_factory=list)
    mounts: list[Object] = field(default_factory=list)
    init_containers: list[Object] = field(default_factory=list)


def plan_source(
    model: ModelSpec,
    settings: PlanSettings,
    *,
    worker_image: str,
    needs_weights: bool = True,
    place: Place = Place(),
) -> ModelSource:
    match model.scheme:
        case "hf":
            path = posixpath.join(place.root, "hf", model.location, model.revision)
            argv = ["hf", "download", model.location, "--revision", model.revision, "--local-dir", path]
            argv += [] if needs_weights else ["--exclude", *WEIGHT_FILES]
            env = [_secret_env("HF_TOKEN", _HF_TOKEN_SECRET, "token")]
            return _fetched(model, path, _init(place, worker_image, argv, env=env), place)
        case "s3":
            path = posixpath.join(place.root, "s3", model.location)
            argv = ["aws", "s3", "sync", model.source, path]
            argv += (
                [] if needs_weights else [part for pattern in WEIGHT_FILES for part in ("--exclude", pattern)]
            )
            fetch = _init(place, settings.s3_image, argv, env_from=_S3_SECRET)
            return _fetched(model, path, fetch, place)
        case "pvc":
            claim, _, sub_path = model.location.partition("/")
            root = posixpath.join(place.root, "pvc", claim)
            volume = {"name": place.volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            return ModelSource(
                posixpath.join(root, sub_path), [volume], [_mount(place, root, read_only=True)]
            )
        case _:
            return _node_or_image_path(model.location, place)


def _fetched(model: ModelSpec, path: str, fetch: Object, place: Place) -> ModelSource:
    if model.cache is not None:
        volume: Object = {"name": place.volume, "persistentVolumeClaim": {"claimName": model.cache.pvc}}
    else:
        volume = {"name": place.volume, "emptyDir": {}}
    return ModelSource(path, [volume], [_mount(place, place.root, read_only=True)], [fetch])


def _node_or_image_path(location: str, place: Place) -> ModelSource:
    if not location.startswith("/"):
        return ModelSource(location)
    volume = {"name": place.volume, "hostPath": {"path": location, "type": "Directory"}}
    return ModelSource(location, [volume], [_mount(place, location, read_only=True)])


def _init(
    place: Place, image: str, argv: list[str], *, env: list[Object] | None = None, env_from: str | None = None
) -> Object:
    container: Object = {
        "name": place.fetcher,
        "image": image,
        "command": argv,
        "volumeMounts": [_mount(place, place.root, read_only=False)],
    }
    if env:
        container["env"] = env
    if env_from:
        container["envFrom"] = [{"secretRef": {"name": env_from, "optional": True}}]
    return container


def _mount(place: Place, path: str, *, read_only: bool) -> Object:
    return {"name": place.volume, "mountPath": path, "readOnly": read_only}


def _secret_env(name: str, secret: str, key: str) -> Object:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
