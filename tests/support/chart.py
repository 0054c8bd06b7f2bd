"""Lint and render the herd Helm chart offline with helm-python-sdk.

helm-python-sdk binds Helm's own Go engine (``libhelm_c``), so templates, ``values.schema.json``
and ``helm lint`` behave exactly as with the ``helm`` binary, which cannot be installed here.
Rendering is offline: ``lookup`` finds nothing, as on a first install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

__all__ = [
    "CHART",
    "NAMESPACE",
    "RELEASE",
    "find",
    "is_hook",
    "lint_chart",
    "pod_specs",
    "render_chart",
    "render_templates",
]

CHART = Path(__file__).resolve().parents[2] / "charts" / "herd"
RELEASE = "herd"
NAMESPACE = "herd"

# Helm's install order (pkg/release/util/kind_sorter.go), cut to the kinds this chart renders;
# any other kind (ServiceMonitor, PodMonitor) goes last, as Helm does.
_INSTALL_ORDER = (
    "CustomResourceDefinition",
    "ServiceAccount",
    "Secret",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Service",
    "Pod",
    "Deployment",
    "PodDisruptionBudget",
)


def render_templates(
    values: dict[str, Any], *, release: str = RELEASE, namespace: str = NAMESPACE
) -> dict[str, str]:
    """Each template's rendered text by path; raises helm's HelmValuesError / HelmRenderError."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values=values, name=release, namespace=namespace, is_install=True)


def is_hook(manifest: dict[str, Any]) -> bool:
    """Whether Helm runs the object as a hook (``helm test`` pods) rather than installing it."""
    annotations = manifest.get("metadata", {}).get("annotations") or {}
    return "helm.sh/hook" in annotations


def render_chart(
    values: dict[str, Any],
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    include_hooks: bool = False,
) -> list[dict[str, Any]]:
    """The chart's objects for ``values`` in Helm's install order, ready to apply one by one.

    Hooks (the ``helm test`` pod) are left out unless ``include_hooks``; NOTES.txt is never an object.
    """
    rendered = render_templates(values, release=release, namespace=namespace)
    manifests = [
        document
        for path, text in sorted(rendered.items())
        if path.endswith((".yaml", ".yml"))
        for document in yaml.load_all(text, Loader=yaml.CSafeLoader)
        if document
    ]
    kept = [manifest for manifest in manifests if include_hooks or not is_hook(manifest)]
    return sorted(kept, key=_install_rank)


def _install_rank(manifest: dict[str, Any]) -> int:
    kind = manifest["kind"]
    return _INSTALL_ORDER.index(kind) if kind in _INSTALL_ORDER else len(_INSTALL_ORDER)


def lint_chart(values: dict[str, Any]) -> list[str]:
    """``helm lint --strict`` findings at warning level or above (info such as "icon" is ignored)."""
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    return [
        f"{message['path']}: {message['error']}" for message in report["messages"] if message["severity"] >= 2
    ]


def find(manifests: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    """The objects of ``kind`` (and ``name``, when given)."""
    return [
        manifest
        for manifest in manifests
        if manifest["kind"] == kind and name in (None, manifest["metadata"]["name"])
    ]


def pod_specs(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod spec by its owner's "Kind/name": Deployment templates and bare Pods alike."""
    specs = {f"Pod/{pod['metadata']['name']}": pod["spec"] for pod in find(manifests, "Pod")}
    for deployment in find(manifests, "Deployment"):
        specs[f"Deployment/{deployment['metadata']['name']}"] = deployment["spec"]["template"]["spec"]
    return specs
