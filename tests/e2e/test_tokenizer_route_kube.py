"""Kubernetes with a model the orchestrator has no folder of: it takes the tokenizer from the worker
and routes by tokens (the default kv_cache_aware strategy) without a single 400.

On the real control plane (moved from the kmock emulator, issue 19, item 6): the model is a relative
``file://`` source, a path inside the worker image. The node agent's image root is the checkout, so
the pod finds the tiny checkpoint there (a link under the ignored ``.cache/``), while
``herd orchestrator --kubernetes`` runs elsewhere and finds no such folder, as an orchestrator pod
would not. What changed: the emulator test used an ``hf://`` source and ran the worker itself with
``--model`` pointed at the checkpoint; a hub download is what no test here can make.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.cluster import ControlPlane
from support.operator_harness import (
    Models,
    kube_orchestrator,
    operated_namespace,
    tiny_model_deployment,
)
from support.procs import wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "tokenizer-route"
TOKEN = "tokenizer-route-token"


@pytest.fixture(scope="module")
def models(cluster: ControlPlane) -> Iterator[Models]:
    with operated_namespace(cluster, NAMESPACE, TOKEN) as models:
        yield models


@pytest.fixture
def in_image(tiny_llama: Path) -> Iterator[str]:
    """The tiny checkpoint as a path inside the worker image (relative to the node agent's image root)."""
    link = Path(".cache", "worker-image", f"tiny-{uuid.uuid4().hex[:8]}")
    (REPO / link).parent.mkdir(parents=True, exist_ok=True)
    (REPO / link).symlink_to(tiny_llama, target_is_directory=True)
    try:
        yield str(link)
    finally:
        (REPO / link).unlink()


def test_a_model_in_the_worker_image_is_routed_by_the_workers_tokenizer(
    models: Models, in_image: str, tmp_path: Path
) -> None:
    manifest = tiny_model_deployment("tiny", Path(in_image))
    assert manifest["spec"]["model"]["source"] == f"file://{in_image}", "a relative source"
    assert "routing" not in manifest["spec"], "the default strategy, kv_cache_aware, routes by tokens"
    models.apply(manifest)
    (pod,) = models.plane.wait_ready_pods(NAMESPACE, "herd.dev/deployment=tiny", 1, timeout=180)
    log = tmp_path / "gateway.log"
    assert not (log.parent / in_image).exists(), "the orchestrator must have no model folder"
    with kube_orchestrator(models, TOKEN, log, "--log-level", "INFO") as url:
        statuses = chat_until_tokenized(url, log, f"{NAMESPACE}/{pod['metadata']['name']}")
    assert set(statuses) == {200}, statuses


def chat_until_tokenized(url: str, log: Path, worker: str) -> list[int]:
    """Chat until the orchestrator logs the fetched tokenizer; every answer's status, in order."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
    statuses: list[int] = []

    def served_after_fetch() -> bool:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        if response.status_code != 503:  # 503 only until the Pod is discovered and admitted
            statuses.append(response.status_code)
            assert response.headers.get(WORKER_HEADER) == worker, response.text
        return "tokenizer fetched from worker" in log.read_text() and len(statuses) >= 2

    wait_until(
        served_after_fetch, timeout=180, interval=0.3, what="a chat answered after the tokenizer fetch"
    )
    return statuses
