"""The real control plane itself: every component healthy on loopback, controllers at work, and
every process stopped by its own pid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cluster import ControlPlane, control_plane, find_binaries
from support.procs import wait_until

pytestmark = pytest.mark.e2e


def test_the_server_is_stamped_and_answers_on_loopback_only(cluster: ControlPlane) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"]
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert cluster.url.startswith("https://127.0.0.1:")
    assert set(cluster.start_seconds) >= {
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    }


def test_controllers_turn_a_deployment_into_pods(cluster: ControlPlane) -> None:
    cluster.kubectl("create", "namespace", "smoke")
    cluster.kubectl(
        "-n", "smoke", "create", "deployment", "web", "--image=example.invalid/web:1", "--replicas=2"
    )

    def pods() -> list[str]:
        return cluster.kubectl("-n", "smoke", "get", "pods", "-o", "name").stdout.split()

    wait_until(lambda: len(pods()) == 2, timeout=60, what="the ReplicaSet's two pods")
    # The namespace controller empties and removes a deleted namespace.
    cluster.kubectl("delete", "namespace", "smoke", "--wait=false")
    wait_until(
        lambda: cluster.kubectl("get", "namespace", "smoke", check=False).returncode != 0,
        timeout=60,
        what="namespace smoke gone",
    )


def test_stopping_ends_every_process_by_pid(tmp_path: Path) -> None:
    binaries = find_binaries()
    if binaries is None:
        pytest.skip("the control plane binaries are not built (make cluster-bin)")
    with control_plane(tmp_path, binaries) as plane:
        pids = [process.pid for process in plane.processes.values()]
        etcd_dir = plane.etcd_dir
        assert etcd_dir.exists()
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids)
    assert not etcd_dir.exists()
