"""From ``kubectl apply`` to a chat completion: the operator's worker command, run as a kubelet would.

The operator plans the Deployment; the test runs its container command (ports moved to free loopback
ports, ``--host`` to 127.0.0.1, the binary from this venv) with the token as the Secret would give it,
creates the Pod from the template with those ports and marks it Ready. ``herd orchestrator
--kubernetes`` then discovers it through the API and routes a request to it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.kube.emulator import Emulator, kube_emulator
from support.operator_harness import embedded_operator, install_crd, kubectl
from support.procs import free_port, running, wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TOKEN = "routing-test-token"


def manifest(model: Path) -> dict[str, Any]:
    spec = {
        "model": {"source": f"file://{model}", "servedName": "tiny"},
        "engine": {"device": "cpu", "dtype": "float32", "maxModelLen": 512, "kvCache": {"memoryGiB": 0.05}},
        "workers": {"replicas": 1},
        "routing": {"strategy": "kv_cache_aware"},
    }
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "tiny"},
        "spec": spec,
    }


def as_kubelet_runs_it(container: dict[str, Any], port: int, internal_port: int) -> list[str]:
    argv = list(container["command"])
    moved = {"--host": "127.0.0.1", "--port": str(port), "--internal-port": str(internal_port)}
    for flag, value in moved.items():
        argv[argv.index(flag) + 1] = value
    assert argv[:2] == ["herd", "worker"]
    return [sys.executable, "-m", "herd.cli.main", *argv[1:], "--log-level", "WARNING"]


def start_pod(kube: Emulator, template: dict[str, Any], port: int, internal_port: int) -> None:
    spec = yaml.safe_load(yaml.safe_dump(template["spec"]))
    spec["containers"][0]["ports"] = [
        {"name": "http", "containerPort": port, "protocol": "TCP"},
        {"name": "internal", "containerPort": internal_port, "protocol": "TCP"},
    ]
    metadata = {**template["metadata"], "name": "tiny-workers-0", "namespace": "default"}
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    kube.set_pod_ready("default", "tiny-workers-0", pod_ip="127.0.0.1")


def test_the_orchestrator_routes_to_the_pod_the_operator_planned(tmp_path: Path, tiny_llama: Path) -> None:
    with kube_emulator(tmp_path / "kube") as kube:
        # The CRD before the operator: kopf picks up a CRD created after its start only eventually
        # (a run here waited a minute for it), and that is no part of what this test checks.
        install_crd(kube)
        with embedded_operator(kube):
            kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest(tiny_llama)))
            wait_until(
                lambda: kube.find("deployments.apps", "tiny-workers") is not None,
                timeout=60,
                what="Deployment",
            )
            template = kube.get("deployments.apps", "tiny-workers")["spec"]["template"]
            container = template["spec"]["containers"][0]
            assert container["env"][0]["name"] == "HERD_INTERNAL_TOKEN"
            port, internal_port, gateway_port = free_port(), free_port(), free_port()
            env = {"HERD_INTERNAL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
            worker_argv = as_kubelet_runs_it(container, port, internal_port)
            gateway_argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--kubernetes", "--namespace", "default",
                            "--port", str(gateway_port), "--log-level", "WARNING"]  # fmt: skip
            gateway_env = {**env, "KUBECONFIG": str(kube.kubeconfig)}
            with running(worker_argv, log=tmp_path / "worker.log", env=env) as worker:

                def is_worker_ready() -> bool:
                    assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
                    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200

                wait_until(
                    is_worker_ready, timeout=120, interval=0.2, what="the planned worker command serving"
                )
                start_pod(kube, template, port, internal_port)
                wait_until(lambda: _ready(kube), timeout=60, what="ModelDeployment Ready=True")
                with running(gateway_argv, log=tmp_path / "gateway.log", env=gateway_env):
                    body = {
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 4,
                    }

                    def routed() -> bool:
                        response = httpx.post(
                            f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json=body, timeout=30
                        )
                        return (
                            response.status_code == 200
                            and response.headers[WORKER_HEADER] == "default/tiny-workers-0"
                        )

                    wait_until(routed, timeout=180, interval=0.3, what="a chat completion routed to the pod")


def _ready(kube: Emulator) -> bool:
    conditions = kube.get("md", "tiny").get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
