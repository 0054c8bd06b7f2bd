"""The chart as support.chart renders it offline is what ``helm install`` puts on the real control
plane: with Redis enabled, every object rendered is stored by the server, and nothing else is.

Moved from the kmock emulator (issue 19, item 6), where the rendered objects were applied without
Helm. What the emulator test also checked is covered on the real server elsewhere: the chart's CRD
kept through ``helm uninstall`` (tests/e2e/test_cluster_helm.py) and ModelDeployments reconciled from
it, the GPU limits among them (tests/e2e/test_operator.py, test_cluster_operator.py). A release of its
own, beside the session's ``herd``, so it installs no CRD (``crds.install=false``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from support.chart import render_chart
from support.cluster import ControlPlane, install_herd_chart

pytestmark = pytest.mark.e2e

RELEASE = NAMESPACE = "herd-redis"
SETS = ("redis.enabled=true", "crds.install=false")
# SETS as values, with the zero replicas install_herd_chart gives the chart's operator and orchestrator.
VALUES = {"redis": {"enabled": True}, "crds": {"install": False}, "operator": {"replicas": 0}, "orchestrator": {"replicas": 0}}  # fmt: skip
Identity = tuple[str, str, str]


def identities(objects: list[dict[str, Any]]) -> set[Identity]:
    return {(obj["apiVersion"], obj["kind"], obj["metadata"]["name"]) for obj in objects}


@pytest.fixture(scope="module")
def installed(cluster: ControlPlane) -> Iterator[str]:
    """The release's manifest as Helm installed it."""
    install_herd_chart(cluster)  # the CRD, owned by the main release
    install_herd_chart(cluster, *SETS, release=RELEASE, namespace=NAMESPACE)
    try:
        yield cluster.helm("get", "manifest", RELEASE, "-n", NAMESPACE).stdout
    finally:
        cluster.helm("uninstall", RELEASE, "-n", NAMESPACE)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def test_helm_installs_exactly_what_the_chart_renders(installed: str) -> None:
    helm_objects = [obj for obj in yaml.safe_load_all(installed) if obj]
    rendered = render_chart(VALUES, release=RELEASE, namespace=NAMESPACE)
    assert identities(helm_objects) == identities(rendered)
    assert any(obj["kind"] == "Deployment" and "redis" in obj["metadata"]["name"] for obj in rendered)


def test_every_rendered_object_is_stored(cluster: ControlPlane, installed: str) -> None:
    rendered = render_chart(VALUES, release=RELEASE, namespace=NAMESPACE)
    manifest = "\n---\n".join(yaml.safe_dump(obj) for obj in rendered)
    stored = json.loads(
        cluster.kubectl("get", "-n", NAMESPACE, "-f", "-", "-o", "json", stdin=manifest).stdout
    )
    assert identities(stored["items"]) == identities(rendered)
    uids = {item["metadata"]["uid"] for item in stored["items"]}
    assert len(uids) == len(rendered), "each a stored object of its own"
