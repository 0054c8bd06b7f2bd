"""Fixtures of the end-to-end tests: one real Kubernetes control plane for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.cluster import BinariesMissingError, ControlPlane, control_plane, ensure_binaries


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler on 127.0.0.1, started once.

    Tests share it: each uses its own names or namespaces. Skipped only when the binaries are missing
    and scripts/cluster-bin.sh cannot build them (``make test`` builds them first).
    """
    try:
        binaries = ensure_binaries()
    except BinariesMissingError as error:
        pytest.skip(f"no Kubernetes control plane binaries: {error}")
    with control_plane(tmp_path_factory.mktemp("cluster"), binaries) as plane:
        yield plane
