"""Cold start after scale to zero on a real control plane, beside a warm request.

As a user's cluster runs it: the control plane of ``tests/support/cluster.py`` with its node agent,
``helm install`` of charts/herd with the operator and the orchestrator as pods (their defaults: the
autoscaler every 15 s, the demand of pools at zero read every second), and ``examples/smollm2.yaml``
(SmolLM2-135M, CPU) with one worker and ``autoscaling`` to zero after ``--idle`` seconds. Each round
waits until the operator has scaled the idle pool to zero and its pod is gone, then sends a streamed
chat request to the orchestrator's Service (cold) and at once a second one (warm: the worker is up).
The cold request's parts, polled through the API every 50 ms with the admin's token:

* ``scaled``: arrival to the ModelDeployment's ``spec.replicas`` at 1 (the gateway holds the request,
  the operator reads the held count from the orchestrator pod's ``/metrics`` and scales);
* ``pod_created``: to the worker pod existing (the Deployment and ReplicaSet controllers, the scheduler);
* ``pod_started``: to its startup probe passed (the process serves ``/health``; probed every second);
* ``pod_ready``: to the pod Ready (the model loaded, ``/ready`` answering; probed every second);
* ``first_token``: to the first streamed token (the orchestrator admits the worker, its registry
  polling ``/ready`` every 0.25 s, and routes the held request; the prefill).

    .venv/bin/python bench/cluster_cold_start.py --rounds 3   # writes bench/results/cluster_cold_start.json
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from _common import REPO, wait_until
from cluster_scale import MODEL, NAMESPACE, TOKEN_SECRET, api, is_started, is_true, read, workers
from cold_start import cold_start_main, first_token_at, summary
from support.cluster import ControlPlane, control_plane, install_herd_chart

__all__ = ["main"]

TIMEOUT_S = 300.0
POLL_S = 0.05
MODELS = f"/apis/herd.dev/v1alpha1/namespaces/{NAMESPACE}/modeldeployments/{MODEL}"
STEPS = ("scaled", "pod_created", "pod_started", "pod_ready")


def manifest(idle_s: int) -> str:
    """examples/smollm2.yaml with one worker that scales to zero."""
    body = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    body["spec"]["workers"]["replicas"] = 1
    body["spec"]["routing"] = {"strategy": "round_robin"}
    body["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                                   "scaleToZeroAfterSeconds": idle_s, "coldStartTimeoutSeconds": int(TIMEOUT_S)}  # fmt: skip
    return json.dumps(body)


def deploy(plane: ControlPlane, idle_s: int) -> str:
    """The chart's pods, the token Secret copied, the model applied; the orchestrator Service's URL."""
    install_herd_chart(plane, pods=True)
    for component in ("operator", "orchestrator"):
        plane.wait_ready_pods("herd", f"app.kubernetes.io/component={component}", 1, timeout=TIMEOUT_S)
    plane.kubectl("create", "namespace", NAMESPACE)
    secret = plane.get_json("secret", TOKEN_SECRET, "herd")
    copy = {"apiVersion": "v1", "kind": "Secret", "type": secret["type"], "data": secret["data"],
            "metadata": {"name": TOKEN_SECRET, "namespace": NAMESPACE}}  # fmt: skip
    plane.kubectl("apply", "-f", "-", stdin=json.dumps(copy))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=manifest(idle_s))
    plane.wait_ready_pods(NAMESPACE, f"herd.dev/deployment={MODEL}", 1, timeout=TIMEOUT_S)
    return "http://" + plane.service_address("herd-orchestrator", "herd", 8000)


def steps_seen(kube: httpx.Client) -> dict[str, bool]:
    pods = workers(kube)
    return {
        "scaled": read(kube, MODELS).get("spec", {}).get("replicas") == 1,
        "pod_created": bool(pods),
        "pod_started": bool(pods) and all(map(is_started, pods)),
        "pod_ready": bool(pods) and all(is_true(pod, "Ready") for pod in pods),
    }


def watch_steps(kube: httpx.Client, began: float) -> tuple[threading.Thread, dict[str, float]]:
    """A thread noting when each step first holds (wall clock), until all do or the time runs out."""
    seen: dict[str, float] = {}

    def poll() -> None:
        while len(seen) < len(STEPS) and time.time() - began < TIMEOUT_S:
            now, steps = time.time(), steps_seen(kube)
            seen.update({step: now for step, holds in steps.items() if holds and step not in seen})
            time.sleep(POLL_S)

    thread = threading.Thread(target=poll, name="steps", daemon=True)
    thread.start()
    return thread, seen


def is_at_zero(kube: httpx.Client) -> bool:
    return read(kube, MODELS).get("spec", {}).get("replicas") == 0 and not workers(kube)


def one_round(url: str, plane: ControlPlane, kube: httpx.Client) -> dict[str, float]:
    wait_until(lambda: is_at_zero(kube), timeout=TIMEOUT_S, interval=0.2, what="the idle pool at zero")
    with api(plane) as watcher:  # a client of the watching thread's own
        arrived = time.time()
        watch, seen = watch_steps(watcher, arrived)
        first = first_token_at(url)
        watch.join(TIMEOUT_S)
    warm_arrived = time.time()
    warm = first_token_at(url) - warm_arrived
    marks = [arrived, *(seen[step] for step in STEPS), first]
    parts = {
        name: round(end - start, 3)
        for name, start, end in zip((*STEPS, "first_token"), marks[:-1], marks[1:], strict=True)
    }
    return {"cold_ttft_s": round(first - arrived, 3), "warm_ttft_s": round(warm, 3), **parts}


def run(rounds: int, idle_s: int, workdir: Path) -> dict[str, Any]:
    with control_plane(workdir / "cluster") as plane, api(plane) as kube:
        url = deploy(plane, idle_s)
        results = [one_round(url, plane, kube) for _ in range(rounds)]
    keys = ("cold_ttft_s", "warm_ttft_s", *STEPS, "first_token")
    return {"summary": {key: summary([result[key] for result in results]) for key in keys}, "rounds": results}


def main() -> None:
    cold_start_main(run, doc=__doc__, name="cluster_cold_start", idle_s=5)


if __name__ == "__main__":
    main()
