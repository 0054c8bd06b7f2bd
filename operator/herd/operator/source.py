"""Where a worker finds its weights: volumes, mounts and init containers per model source scheme.

``hf://`` and ``s3://`` are fetched by an init container into ``/models`` (the cache PVC when the
spec names one, so replicas and restarts share one download; an ``emptyDir`` otherwise).
``pvc://claim/path`` is mounted read-only; ``file:///abs`` is a node path (``hostPath``) and a
relative ``file://path`` is a path inside the worker image. A pool that needs no weights (the
simulated backend reads the config and tokenizer only) fetches everything else.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from herd.api.crd import ModelSpec
from herd.operator.settings import PlanSettings

__all__ = ["MODELS_DIR", "WEIGHT_FILES", "ModelSource", "plan_source"]

MODELS_DIR = "/models"
_VOLUME = "models"
_HF_TOKEN_SECRET = "herd-hf-token"
_S3_SECRET = "herd-s3-credentials"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
"""File patterns of model weights, left out of a fetch for a pool that reads none."""

Object = dict[str, Any]


@dataclass(frozen=True)
class ModelSource:
    """The pod-level pieces that make ``path`` hold the model inside the worker container."""

    path: str
    volumes: list[Object] = field(default_factory=list)
    mounts: list[Object] = field(default_factory=list)
    init_containers: list[Object] = field(default_factory=list)


def plan_source(
    model: ModelSpec, settings: PlanSettings, *, worker_image: str, needs_weights: bool = True
) -> ModelSource:
    match model.scheme:
        case "hf":
            path = posixpath.join(MODELS_DIR, "hf", model.location, model.revision)
            argv = ["hf", "download", model.location, "--revision", model.revision, "--local-dir", path]
            argv += [] if needs_weights else ["--exclude", *WEIGHT_FILES]
            env = [_secret_env("HF_TOKEN", _HF_TOKEN_SECRET, "token")]
            return _fetched(model, path, _init("fetch-model", worker_image, argv, env=env))
        case "s3":
            path = posixpath.join(MODELS_DIR, "s3", model.location)
            argv = ["aws", "s3", "sync", model.source, path]
            argv += (
                [] if needs_weights else [part for pattern in WEIGHT_FILES for part in ("--exclude", pattern)]
            )
            fetch = _init("fetch-model", settings.s3_image, argv, env_from=_S3_SECRET)
            return _fetched(model, path, fetch)
        case "pvc":
            claim, _, sub_path = model.location.partition("/")
            root = posixpath.join(MODELS_DIR, "pvc", claim)
            volume = {"name": _VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            return ModelSource(posixpath.join(root, sub_path), [volume], [_mount(root, read_only=True)])
        case _:
            return _node_or_image_path(model.location)


def _fetched(model: ModelSpec, path: str, fetch: Object) -> ModelSource:
    if model.cache is not None:
        volume: Object = {"name": _VOLUME, "persistentVolumeClaim": {"claimName": model.cache.pvc}}
    else:
        volume = {"name": _VOLUME, "emptyDir": {}}
    return ModelSource(path, [volume], [_mount(MODELS_DIR, read_only=True)], [fetch])


def _node_or_image_path(location: str) -> ModelSource:
    if not location.startswith("/"):
        return ModelSource(location)
    volume = {"name": _VOLUME, "hostPath": {"path": location, "type": "Directory"}}
    return ModelSource(location, [volume], [_mount(location, read_only=True)])


def _init(
    name: str, image: str, argv: list[str], *, env: list[Object] | None = None, env_from: str | None = None
) -> Object:
    container: Object = {
        "name": name,
        "image": image,
        "command": argv,
        "volumeMounts": [_mount(MODELS_DIR, read_only=False)],
    }
    if env:
        container["env"] = env
    if env_from:
        container["envFrom"] = [{"secretRef": {"name": env_from, "optional": True}}]
    return container


def _mount(path: str, *, read_only: bool) -> Object:
    return {"name": _VOLUME, "mountPath": path, "readOnly": read_only}


def _secret_env(name: str, secret: str, key: str) -> Object:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
