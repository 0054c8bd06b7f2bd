"""Kubernetes with an hf:// model: the orchestrator pod has no model folder, so it takes the tokenizer
from the worker and routes by tokens (the default kv_cache_aware strategy) without a single 400.

As ``tests/e2e/test_operator_routing.py`` does, the test runs the operator's planned worker command
as a kubelet would (loopback ports; ``--model`` pointed at the tiny checkpoint where the init
container would have downloaded it) and ``herd orchestrator --kubernetes`` discovers the Pod.
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

TOKEN = "tokenizer-route-token"
POD = "tiny-workers-0"
MANIFEST = {
    "apiVersion": "herd.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "tiny"},
    "spec": {
        "model": {"source": "hf://example/tiny-llama", "servedName": "tiny"},
        "engine": {"device": "cpu", "dtype": "float32", "maxModelLen": 512, "kvCache": {"memoryGiB": 0.05}},
        "workers": {"replicas": 1},
    },
}


def kubelet_argv(container: dict[str, Any], model: Path, ports: tuple[int, int]) -> list[str]:
    argv = list(container["command"])
    moved = {"--host": "127.0.0.1", "--port": str(ports[0]), "--internal-port": str(ports[1])}
    for flag, value in {**moved, "--model": str(model)}.items():
        argv[argv.index(flag) + 1] = value
    return [sys.executable, "-m", "herd.cli.main", *argv[1:], "--log-level", "WARNING"]


def start_pod(kube: Emulator, template: dict[str, Any], ports: tuple[int, int]) -> None:
    spec = yaml.safe_load(yaml.safe_dump(template["spec"]))
    spec["containers"][0]["ports"] = [
        {"name": "http", "containerPort": ports[0], "protocol": "TCP"},
        {"name": "internal", "containerPort": ports[1], "protocol": "TCP"},
    ]
    metadata = {**template["metadata"], "name": POD, "namespace": "default"}
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec})
    kube.set_pod_ready("default", POD, pod_ip="127.0.0.1")


def test_an_hf_model_is_routed_by_the_workers_tokenizer(tmp_path: Path, tiny_llama: Path) -> None:
    with kube_emulator(tmp_path / "kube") as kube:
        # The CRD before the operator: kopf picks up a CRD created after its start only eventually
        # (a run here waited a minute for it), and that is no part of what this test checks.
        install_crd(kube)
        with embedded_operator(kube):
            kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(MANIFEST))
            wait_until(
                lambda: kube.find("deployments.apps", "tiny-workers") is not None, timeout=60, what="plan"
            )
            template = kube.get("deployments.apps", "tiny-workers")["spec"]["template"]
            ports, gateway_port = (free_port(), free_port()), free_port()
            env = {"HERD_INTERNAL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
            worker_argv = kubelet_argv(template["spec"]["containers"][0], tiny_llama, ports)
            gateway_argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--kubernetes", "--namespace", "default",
                            "--port", str(gateway_port), "--log-level", "INFO"]  # fmt: skip
            with running(worker_argv, log=tmp_path / "worker.log", env=env):
                ready = f"http://127.0.0.1:{ports[0]}/ready"
                wait_until(lambda: _answers(ready), timeout=120, interval=0.2, what="the worker serving")
                start_pod(kube, template, ports)
                gateway_env = {**env, "KUBECONFIG": str(kube.kubeconfig)}
                with running(gateway_argv, log=tmp_path / "gateway.log", env=gateway_env):
                    statuses = _chat_until_tokenized(gateway_port, tmp_path / "gateway.log")
    assert set(statuses) == {200}, statuses


def _chat_until_tokenized(port: int, log: Path) -> list[int]:
    """Chat until the orchestrator logs the fetched tokenizer; every answer's status, in order."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
    statuses: list[int] = []

    def served_after_fetch() -> bool:
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        if response.status_code != 503:  # 503 only until the Pod is discovered and admitted
            statuses.append(response.status_code)
            assert response.headers.get(WORKER_HEADER) == f"default/{POD}", response.text
        return "tokenizer fetched from worker" in log.read_text() and len(statuses) >= 2

    wait_until(
        served_after_fetch, timeout=180, interval=0.3, what="a chat answered after the tokenizer fetch"
    )
    return statuses


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
