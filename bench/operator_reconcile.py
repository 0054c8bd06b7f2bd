"""Operator reconcile latency on a real Kubernetes control plane.

A real ``herd operator`` process (kopf, standalone, every namespace, as the chart runs it, with a
token of the chart's operator ServiceAccount) runs against the control plane of
``tests/support/cluster.py`` (etcd, kube-apiserver, controller-manager and scheduler on 127.0.0.1,
built by ``make cluster-bin``). Two measurements, in one run:

* **single**: one ModelDeployment created at a time (API POST), timed until its Deployment and
  Service both exist (polled every 5 ms), repeated ``--repeats`` times with fresh names.
* **burst**: ``--burst`` ModelDeployments created back to back, timed until all their children
  exist (the time to reconcile all of them), with each one's own create -> children latency.

The benchmark creates and polls through the API with the admin's token (no kubectl in the timed
path), so the figures include the HTTP round trips of kopf's watch, the operator's GET/POST calls and
the status write, on this shared 2-core machine where the control plane's own processes (and the
controller-manager making ReplicaSets and Pending pods) compete for the cores. The pools carry a
nodeSelector no node matches: no pod runs. Polling adds up to 5 ms to each single latency and up to
50 ms to each burst one.

    .venv/bin/python bench/operator_reconcile.py     # writes bench/results/operator.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.cluster import ADMIN_TOKEN, ControlPlane, control_plane, install_herd_chart  # noqa: E402
from support.operator_harness import model_deployment  # noqa: E402
from support.procs import free_port, running, wait_until  # noqa: E402

__all__ = ["main"]

POLL_S = 0.005
# Listing 100 children every 5 ms would cost the apiserver (and so the operator) more than it measures.
BURST_POLL_S = 0.05
TIMEOUT_S = 120.0
MODELS = "/apis/herd.dev/v1alpha1/namespaces/default/modeldeployments"
DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
SERVICES = "/api/v1/namespaces/default/services"


def api(plane: ControlPlane) -> httpx.Client:
    """The admin's client for the API server, checking its certificate against the plane's CA."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.Client(base_url=plane.url, verify=str(plane.ca), headers=headers, timeout=30)


def create(kube: httpx.Client, name: str) -> None:
    kube.post(MODELS, json=model_deployment(name)).raise_for_status()


def children_present(kube: httpx.Client, names: set[str]) -> set[str]:
    """The ModelDeployments among ``names`` whose Deployment and Service both exist."""
    listed = {path: kube.get(path).raise_for_status().json()["items"] for path in (DEPLOYMENTS, SERVICES)}
    deployments = {d["metadata"]["name"] for d in listed[DEPLOYMENTS]}
    services = {s["metadata"]["name"] for s in listed[SERVICES]}
    return {name for name in names if f"{name}-workers" in deployments and f"{name}-workers" in services}


def wait_for_children(kube: httpx.Client, started: dict[str, float], poll_s: float) -> dict[str, float]:
    """Latency per name from its create to the moment its children were first seen."""
    done: dict[str, float] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(done) < len(started) and time.monotonic() < deadline:
        now = time.perf_counter()
        for name in children_present(kube, set(started) - set(done)):
            done[name] = now - started[name]
        time.sleep(poll_s)
    if len(done) < len(started):
        raise TimeoutError(f"children missing for {sorted(set(started) - set(done))} after {TIMEOUT_S}s")
    return done


def single(kube: httpx.Client, repeats: int) -> list[float]:
    latencies = []
    for index in range(repeats):
        name = f"single-{index}"
        started = time.perf_counter()
        create(kube, name)
        latencies.append(wait_for_children(kube, {name: started}, POLL_S)[name])
    return latencies


def burst(kube: httpx.Client, count: int) -> tuple[float, list[float]]:
    started: dict[str, float] = {}
    begin = time.perf_counter()
    for index in range(count):
        name = f"burst-{index}"
        started[name] = time.perf_counter()
        create(kube, name)
    latencies = wait_for_children(kube, started, BURST_POLL_S)
    return max(started[n] + latencies[n] for n in started) - begin, list(latencies.values())


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    quantiles = statistics.quantiles(ordered, n=100, method="inclusive")
    return {
        "n": len(values),
        "mean_ms": round(1000 * statistics.fmean(values), 1),
        "p50_ms": round(1000 * quantiles[49], 1),
        "p99_ms": round(1000 * quantiles[98], 1),
        "max_ms": round(1000 * ordered[-1], 1),
    }


def run(repeats: int, count: int, workdir: Path) -> dict[str, Any]:
    herd = shutil.which("herd") or str(REPO / ".venv" / "bin" / "herd")
    port = free_port()
    with control_plane(workdir / "cluster") as plane, api(plane) as kube:
        install_herd_chart(plane)
        login = plane.login_as("herd-operator", "herd")
        argv = [herd, "operator", "-A", "--standalone", "--kubeconfig", str(login.kubeconfig),
                "--liveness", f"http://127.0.0.1:{port}/healthz", "--log-level", "WARNING"]  # fmt: skip
        with running(argv, log=workdir / "operator.log") as operator:
            wait_until(
                lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200,
                timeout=60,
                what="operator",
            )
            single_latencies = single(kube, repeats)
            cpu_before, own_before = cpu_seconds(operator.pid), time.process_time()
            total, burst_latencies = burst(kube, count)
            operator_cpu, own_cpu = cpu_seconds(operator.pid) - cpu_before, time.process_time() - own_before
    return {
        "single": percentiles(single_latencies),
        "burst": {
            "count": count,
            "total_s": round(total, 3),
            "operator_cpu_s": round(operator_cpu, 2),
            "poller_cpu_s": round(own_cpu, 2),
            "per_deployment": percentiles(burst_latencies),
        },
    }


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (Linux /proc), to tell its share of a burst's wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=30, help="single creates, one at a time")
    parser.add_argument("--burst", type=int, default=50, help="ModelDeployments created back to back")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "operator.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        results = run(args.repeats, args.burst, Path(workdir))
    results["command"] = (
        "python bench/operator_reconcile.py " + f"--repeats {args.repeats} --burst {args.burst}"
    )
    load = [round(value, 1) for value in os.getloadavg()]
    results["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_1_5_15": load,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
