"""Every pod and container the chart runs is locked down: non-root, read-only, no privileges."""

from __future__ import annotations

from typing import Any

from support.chart import pod_specs

CONTAINER_CONTEXT = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_every_pod_runs_as_non_root_with_the_default_seccomp_profile(manifests: list[dict[str, Any]]) -> None:
    for owner, spec in pod_specs(manifests).items():
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True, owner
        assert context["runAsUser"] > 0, owner
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, owner


def test_every_container_has_the_locked_down_security_context(manifests: list[dict[str, Any]]) -> None:
    specs = pod_specs(manifests)
    assert specs, "the chart rendered no pods"
    for owner, spec in specs.items():
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["securityContext"] == CONTAINER_CONTEXT, f"{owner}: {container['name']}"


def test_every_container_has_resources_and_a_pinned_image(manifests: list[dict[str, Any]]) -> None:
    for owner, spec in pod_specs(manifests).items():
        for container in spec["containers"]:
            assert container["resources"]["requests"], f"{owner}: {container['name']}"
            assert "memory" in container["resources"]["limits"], f"{owner}: {container['name']}"
            repository, _, tag = container["image"].rpartition(":")
            assert repository and tag and tag != "latest", container["image"]


def test_writable_paths_are_volumes_under_the_read_only_root(manifests: list[dict[str, Any]]) -> None:
    for owner, spec in pod_specs(manifests).items():
        volumes = {volume["name"] for volume in spec.get("volumes", [])}
        for container in spec["containers"]:
            mounts = {mount["name"] for mount in container.get("volumeMounts", [])}
            assert mounts <= volumes, f"{owner}: {container['name']} mounts {mounts - volumes}"
