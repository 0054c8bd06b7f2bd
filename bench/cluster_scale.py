"""From ``kubectl scale md/smollm2`` to ``status`` showing the new ready count, on a real control plane.

Everything runs as a user's cluster would run it: the control plane of ``tests/support/cluster.py``
(etcd, kube-apiserver, controller-manager, scheduler) with its node agent, ``helm install`` of
charts/herd running the operator and the orchestrator as pods, ``examples/smollm2.yaml`` applied
(two SmolLM2-135M workers on CPU, real processes). Each round scales 2 -> 3, timed until the
ModelDeployment's ``status.pools.workers.ready`` reads ``3/3``, then 3 -> 2, timed until ``2/2``
with the third pod gone. Each scale-up is split into its steps, polled through the API every 50 ms
with the admin's token: the operator's Deployment at 3 replicas, the new pod created, its startup
probe passed (``/health``, probed every second as the operator plans it: the process serves HTTP), the
pod Ready (the model loaded and ``/ready`` answering the readiness probe, every second), and the status
written by the operator; ``status_after_pods_ready`` is the last two apart, the operator's share.

    .venv/bin/python bench/cluster_scale.py --rounds 5      # writes bench/results/cluster_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.cluster import ADMIN_TOKEN, ControlPlane, control_plane, install_herd_chart  # noqa: E402

__all__ = ["main"]

POLL_S = 0.05
TIMEOUT_S = 300.0
NAMESPACE = "bench"
MODEL = "smollm2"
TOKEN_SECRET = "herd-internal-token"
MODELS = f"/apis/herd.dev/v1alpha1/namespaces/{NAMESPACE}/modeldeployments/{MODEL}"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{MODEL}-workers"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
STEPS = ("deployment_scaled", "pod_created", "startup_probe_passed", "pod_ready", "status_ready")


def api(plane: ControlPlane) -> httpx.Client:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.Client(base_url=plane.url, verify=str(plane.ca), headers=headers, timeout=30)


def read(kube: httpx.Client, path: str) -> dict[str, Any]:
    """One object ({} while it does not exist yet)."""
    response = kube.get(path)
    if response.status_code == httpx.codes.NOT_FOUND:
        return {}
    found: dict[str, Any] = response.raise_for_status().json()
    return found


def workers(kube: httpx.Client) -> list[dict[str, Any]]:
    """The worker pods that are not terminating."""
    pods = kube.get(PODS, params={"labelSelector": f"herd.dev/deployment={MODEL}"}).raise_for_status()
    return [pod for pod in pods.json()["items"] if not pod["metadata"].get("deletionTimestamp")]


def is_true(pod: dict[str, Any], kind: str) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == kind and c["status"] == "True" for c in conditions)


def is_started(pod: dict[str, Any]) -> bool:
    return any(s.get("started") for s in pod.get("status", {}).get("containerStatuses") or [])


def observe(kube: httpx.Client, count: int) -> dict[str, bool]:
    """Which steps toward ``count`` ready workers hold now."""
    pods = workers(kube)
    status = read(kube, MODELS).get("status", {})
    return {
        "deployment_scaled": read(kube, DEPLOYMENT).get("spec", {}).get("replicas") == count,
        "pod_created": len(pods) == count,
        "startup_probe_passed": len(pods) == count and all(map(is_started, pods)),
        "pod_ready": len(pods) == count and all(is_true(pod, "Ready") for pod in pods),
        "status_ready": status.get("pools", {}).get("workers", {}).get("ready") == f"{count}/{count}",
    }


def scale(plane: ControlPlane, kube: httpx.Client, count: int) -> dict[str, float]:
    """``kubectl scale`` to ``count``; seconds from its start to each step first seen."""
    began = time.perf_counter()
    plane.kubectl("-n", NAMESPACE, "scale", f"md/{MODEL}", f"--replicas={count}")
    seen: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        now, steps = time.perf_counter() - began, observe(kube, count)
        seen.update({step: round(now, 3) for step, holds in steps.items() if holds and step not in seen})
        # Done when the status says so and the pods agree (a scale-down's extra pod has gone).
        if steps["status_ready"] and steps["pod_created"]:
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(f"scaling to {count}: only {sorted(seen)} after {TIMEOUT_S}s")
        time.sleep(POLL_S)


def summary(values: list[float]) -> dict[str, float]:
    return {"median_s": round(statistics.median(values), 2), "min_s": min(values), "max_s": max(values)}


def status_lag(ups: list[dict[str, float]]) -> dict[str, float]:
    """Seconds from the new pod seen Ready to the status seen saying 3/3 (both polled in one pass,
    so a status written within the same 50 ms reads as 0)."""
    return summary([round(max(0.0, up["status_ready"] - up["pod_ready"]), 3) for up in ups])


def deploy(plane: ControlPlane, kube: httpx.Client) -> None:
    """The chart's pods, the token Secret copied as docs/kubernetes.md says, the example at 2/2."""
    install_herd_chart(plane, pods=True)
    plane.kubectl("create", "namespace", NAMESPACE)
    secret = plane.get_json("secret", TOKEN_SECRET, "herd")
    copy = {"apiVersion": "v1", "kind": "Secret", "type": secret["type"], "data": secret["data"],
            "metadata": {"name": TOKEN_SECRET, "namespace": NAMESPACE}}  # fmt: skip
    plane.kubectl("apply", "-f", "-", stdin=json.dumps(copy))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(REPO / "examples" / "smollm2.yaml"))
    deadline = time.monotonic() + TIMEOUT_S
    while not observe(kube, 2)["status_ready"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{MODEL} not ready 2/2 after {TIMEOUT_S}s")
        time.sleep(0.5)


def run(rounds: int, workdir: Path) -> dict[str, Any]:
    ups: list[dict[str, float]] = []
    downs: list[dict[str, float]] = []
    with control_plane(workdir / "cluster") as plane, api(plane) as kube:
        deploy(plane, kube)
        for _ in range(rounds):
            ups.append(scale(plane, kube, 3))
            downs.append(scale(plane, kube, 2))
    return {
        "scale_up_2_to_3": {step: summary([up[step] for up in ups]) for step in STEPS},
        "status_after_pods_ready": status_lag(ups),
        "scale_down_3_to_2": summary([down["status_ready"] for down in downs]),
        "rounds": {"up": ups, "down": downs},
        "control_plane_start_s": plane.start_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cluster_scale.json")
    args = parser.parse_args()
    model = REPO / ".cache" / "models" / "smollm2-135m-instruct"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "herd.cli.main", "model", "prepare", "smollm2", "--out", str(model)],
                       check=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as workdir:
        results = run(args.rounds, Path(workdir))
    results["command"] = f"python bench/cluster_scale.py --rounds {args.rounds}"
    results["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_1_5_15": [round(value, 1) for value in os.getloadavg()],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
