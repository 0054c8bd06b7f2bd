"""``kubectl --validate=false`` against the kube emulator: apply, get, scale, delete (skipped without kubectl)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube import Emulator
from support.kube.samples import WIDGET_CRD, pod

pytest_plugins = ["support.kube.fixtures"]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed"),
]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = [
    doc for path in sorted((REPO / "examples").glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
]

DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web", "labels": {"app": "web"}},
    "spec": {
        "replicas": 1,
        "selector": {"matchLabels": {"app": "web"}},
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [{"name": "c", "image": "nginx:1", "ports": [{"containerPort": 80}]}]},
        },
    },
}


def kubectl(kube: Emulator, *args: str, manifest: Any = None) -> str:
    """Run kubectl against the emulator with its own discovery cache; fail with its stderr."""
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig), "HOME": str(kube.workdir)}
    argv = ["kubectl", f"--cache-dir={kube.workdir / 'kubectl-cache'}", "--request-timeout=60s", *args]
    stdin = (
        None
        if manifest is None
        else yaml.safe_dump_all(manifest if isinstance(manifest, list) else [manifest])
    )
    done = subprocess.run(
        argv, env=env, input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)} failed: {done.stderr}"
    return done.stdout


def test_apply_get_scale_delete_a_deployment(kube: Emulator) -> None:
    assert (
        kubectl(kube, "apply", "--validate=false", "-f", "-", manifest=DEPLOYMENT).strip()
        == "deployment.apps/web created"
    )
    changed = json.loads(json.dumps(DEPLOYMENT).replace("nginx:1", "nginx:2"))
    assert "configured" in kubectl(kube, "apply", "--validate=false", "-f", "-", manifest=changed)
    assert "unchanged" in kubectl(kube, "apply", "--validate=false", "-f", "-", manifest=changed)
    kubectl(kube, "scale", "deployment/web", "--replicas=3")
    fetched = json.loads(kubectl(kube, "get", "deployment", "web", "-o", "json"))
    assert fetched["spec"]["replicas"] == 3 and fetched["metadata"]["generation"] == 3
    assert fetched["spec"]["template"]["spec"]["containers"][0]["image"] == "nginx:2"
    assert kubectl(kube, "get", "deployments", "-l", "app=web", "-o", "name").split() == [
        "deployment.apps/web"
    ]
    kubectl(kube, "delete", "deployment", "web")
    assert kube.find("deployments.apps", "web") is None


def test_crd_then_custom_resource_with_scale(kube: Emulator) -> None:
    kubectl(kube, "apply", "--validate=false", "-f", "-", manifest=WIDGET_CRD)
    widget = {
        "apiVersion": "example.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"replicas": 1},
    }
    kubectl(kube, "apply", "--validate=false", "-f", "-", manifest=widget)
    kubectl(kube, "scale", "widgets/w", "--replicas=2")
    assert kubectl(kube, "get", "wd", "w", "-o", "jsonpath={.spec.replicas}") == "2"
    kubectl(kube, "delete", "-f", "-", manifest=widget)
    assert kube.find("widgets", "w") is None


def test_get_lists_namespaced_and_cluster_scoped(kube: Emulator) -> None:
    kube.create_namespace("team")
    settings = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"k": "v"}}
    kubectl(kube, "apply", "--validate=false", "-n", "team", "-f", "-", manifest=settings)
    names = kubectl(kube, "get", "configmaps", "--all-namespaces", "-o", "name").split()
    assert names == ["configmap/settings"]
    assert "namespace/team" in kubectl(kube, "get", "namespaces", "-o", "name").split()


def test_herd_crd_and_examples_apply_with_schema_defaults(kube: Emulator) -> None:
    kubectl(kube, "apply", "--validate=false", "-f", str(REPO / "crds"))
    applied = kubectl(kube, "apply", "--validate=false", "-f", str(REPO / "examples"), "-o", "name").split()
    assert sorted(applied) == sorted(f"modeldeployment.herd.dev/{md['metadata']['name']}" for md in EXAMPLES)
    for example in EXAMPLES:
        stored = kube.get("md", example["metadata"]["name"])
        assert stored["spec"]["model"]["revision"] == example["spec"]["model"].get("revision", "main")
    name = EXAMPLES[0]["metadata"]["name"]
    kubectl(kube, "scale", f"md/{name}", "--replicas=2")
    assert kube.get("md", name)["spec"]["replicas"] == 2


def test_server_side_apply_wait_and_rollout_status(kube: Emulator) -> None:
    assert "serverside-applied" in kubectl(
        kube, "apply", "--server-side", "--validate=false", "-f", "-", manifest=DEPLOYMENT
    )
    for name in ("web-1", "web-2"):
        kube.create(pod(name, app="web"))
    ready_later = threading.Timer(0.5, lambda: kube.set_pod_ready("default", "web-1"))
    ready_later.start()
    assert "condition met" in kubectl(kube, "wait", "--for=condition=Ready", "pod/web-1", "--timeout=60s")
    ready_later.join()
    kube.set_pod_ready("default", "web-2")
    kube.sync_deployment_status("default", "web")
    assert "successfully rolled out" in kubectl(kube, "rollout", "status", "deployment/web", "--timeout=60s")


def test_get_prints_the_crd_printer_columns(kube: Emulator) -> None:
    kubectl(kube, "apply", "--validate=false", "-f", str(REPO / "crds"))  # kubectl maps kinds before applying
    kubectl(kube, "apply", "--validate=false", "-f", str(REPO / "examples" / "smollm2.yaml"))
    status = {
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady"}],
        "pools": {"workers": {"ready": "2/2"}},
    }
    kube.patch("md", "smollm2", {"status": status}, subresource="status")
    header, row = kubectl(kube, "get", "md").splitlines()
    assert header.split() == ["NAME", "READY", "MODE", "WORKERS", "PREFILL", "DECODE", "STRATEGY", "AGE"]
    assert row.split()[:5] == ["smollm2", "True", "aggregated", "2/2", "kv_cache_aware"]
