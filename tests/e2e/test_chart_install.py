"""The rendered Helm chart applied into the Kubernetes API emulator: the CRD installs, then a
ModelDeployment reconciles into its worker Deployment and Service (issue 6, chart tests)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.chart import NAMESPACE, find, render_chart
from support.kube.emulator import Emulator, kube_emulator
from support.operator_harness import embedded_operator
from support.procs import wait_until

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[tuple[Emulator, list[dict[str, Any]]]]:
    objects = render_chart({"redis": {"enabled": True}})
    with kube_emulator(tmp_path) as kube:
        kube.create_namespace(NAMESPACE)
        for obj in objects:
            kube.apply(obj)
        yield kube, objects


def test_every_rendered_object_is_stored(installed: tuple[Emulator, list[dict[str, Any]]]) -> None:
    kube, objects = installed
    for obj in objects:
        meta = obj["metadata"]
        stored = kube.find(
            obj["kind"], meta["name"], meta.get("namespace", NAMESPACE), api_version=obj["apiVersion"]
        )
        assert stored is not None, f"{obj['kind']}/{meta['name']} was not stored"


def test_chart_crd_serves_modeldeployments_that_reconcile(
    installed: tuple[Emulator, list[dict[str, Any]]],
) -> None:
    kube, objects = installed
    crd = find(objects, "CustomResourceDefinition")[0]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    manifest = yaml.safe_load((REPO / "examples" / "llama-3-8b.yaml").read_text())
    with embedded_operator(kube, namespace="default"):
        kube.apply(manifest)
        wait_until(
            lambda: kube.find("deployments", "llama-3-8b-workers") is not None,
            timeout=60,
            what="the operator creating llama-3-8b-workers from the chart-installed CRD",
        )
        wait_until(
            lambda: kube.find("services", "llama-3-8b-workers") is not None,
            timeout=60,
            what="the operator creating the llama-3-8b-workers Service",
        )
    deployment = kube.get("deployments", "llama-3-8b-workers")
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] in (1, "1")
    assert deployment["spec"]["replicas"] == 2
