"""``herd operator`` killed with SIGKILL in the middle of a reconcile pass, then started again: it
converges, every child exists once with the desired spec, and the status comes out Ready.

The emulator holds the operator's first Service create (a kmock reaction) until the test has killed
the process, so the kill lands between children: the first pool's Deployment exists, its Service
request is in flight, the second pool is not planned into objects yet. The held request then reaches
the API as a request from a client that died would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube.emulator import Emulator, kube_emulator
from support.operator_harness import install_crd, kubectl
from support.procs import free_port, running, wait_until

from herd.api.crd import ModelDeployment
from herd.operator.plan import ANNOTATION_SPEC_HASH, plan
from herd.operator.settings import PlanSettings

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60.0
IMAGE = "me/worker:7"
MANIFEST: dict[str, Any] = {
    "apiVersion": "herd.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "split", "namespace": "default"},
    "spec": {
        "model": {"source": "pvc://weights/chat"},
        "serving": {"mode": "disaggregated"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
    },
}


class HeldRequest:
    """A kmock payload that holds the first matching request until ``release``, then lets it through."""

    def __init__(self) -> None:
        self.is_held = threading.Event()
        self.is_released = threading.Event()

    async def __call__(self) -> None:
        """Returning no response lets the emulator serve the request; only the first one waits."""
        if self.is_held.is_set():
            return
        self.is_held.set()
        for _ in range(int(TIMEOUT_S / 0.05)):
            if self.is_released.is_set():
                return
            await asyncio.sleep(0.05)


def operator_argv(kube: Emulator, port: int) -> list[str]:
    herd = shutil.which("herd") or str(REPO / ".venv" / "bin" / "herd")
    return [herd, "operator", "-n", "default", "--standalone", "--kubeconfig", str(kube.kubeconfig),
            "--liveness", f"http://127.0.0.1:{port}/healthz", "--worker-image", IMAGE,
            "--orchestrator-namespace", "herd", "--retry-delay", "1"]  # fmt: skip


def children(kube: Emulator) -> list[dict[str, Any]]:
    selector = "herd.dev/deployment=split"
    return kube.list("deployments.apps", "default", label_selector=selector) + kube.list(
        "services", "default", label_selector=selector
    )


def by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{obj['kind']}/{obj['metadata']['name']}": obj for obj in objects}


def is_ready(kube: Emulator) -> bool:
    status = kube.get("md", "split").get("status", {})
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
    return ready.get("status") == "True"


def test_an_operator_killed_mid_reconcile_converges_without_duplicates(tmp_path: Path) -> None:
    desired = plan(ModelDeployment.model_validate(MANIFEST), PlanSettings(worker_image=IMAGE)).objects
    held = HeldRequest()
    with kube_emulator(tmp_path / "kube") as kube:
        install_crd(kube)
        kube.kmock["post /api/v1/namespaces/default/services"] << held
        kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(MANIFEST))
        with running(operator_argv(kube, free_port()), log=tmp_path / "operator-1.log") as first:
            assert held.is_held.wait(TIMEOUT_S), "the operator never created a Service"
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=TIMEOUT_S)
        at_kill = by_name(children(kube))
        assert list(at_kill) == ["Deployment/split-prefill"], "the kill did not land mid-pass"
        held.is_released.set()
        with running(operator_argv(kube, free_port()), log=tmp_path / "operator-2.log"):
            wait_until(lambda: len(children(kube)) == len(desired), timeout=TIMEOUT_S, what="every child")
            for deployment in ("split-prefill", "split-decode"):
                kube.run_deployment("default", deployment, ready=True)
            wait_until(lambda: is_ready(kube), timeout=TIMEOUT_S, what="Ready")
        found = children(kube)
    # Exactly once each (names are unique per kind, so also no second object under another name) ...
    assert sorted(f"{obj['kind']}/{obj['metadata']['name']}" for obj in found) == sorted(
        f"{obj.kind}/{obj.name}" for obj in desired
    )
    current = by_name(found)
    # ... the Deployment made before the kill kept (not deleted and made again) ...
    prefill = current["Deployment/split-prefill"]
    assert prefill["metadata"]["uid"] == at_kill["Deployment/split-prefill"]["metadata"]["uid"]
    # ... every child with the desired spec, owned by the ModelDeployment.
    for obj in desired:
        child = current[f"{obj.kind}/{obj.name}"]
        assert child["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == obj.spec_hash, obj.name
        assert child["spec"]["selector"] == obj.body["spec"]["selector"], obj.name
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("ModelDeployment", "split", True)
    assert prefill["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
