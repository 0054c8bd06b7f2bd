"""Each long-running container's probes match what its endpoints mean.

``/health`` (``/healthz`` for kopf) says the process can serve: liveness restarts it when it cannot,
and a startup probe holds liveness off while it starts. ``/ready`` says it admits requests: readiness
only takes the pod out of its Service (a draining or workerless orchestrator must not be restarted).
"""

from __future__ import annotations

from typing import Any

import pytest
from support.chart import find, render_chart

HTTP = "httpGet"
PING = ["redis-cli", "ping"]

EXPECTED: dict[str, dict[str, object]] = {
    "herd-orchestrator": {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"},
    "herd-operator": {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": None},
    "herd-redis": {"startupProbe": PING, "livenessProbe": PING, "readinessProbe": PING},
}


def probe_target(probe: dict[str, Any] | None) -> object:
    """What a probe asks: an HTTP path, an exec command, or ``None`` for no probe."""
    if probe is None:
        return None
    return probe[HTTP]["path"] if HTTP in probe else probe["exec"]["command"]


@pytest.mark.parametrize("deployment", list(EXPECTED))
def test_probes_of_each_component(deployment: str) -> None:
    (found,) = find(render_chart({"redis": {"enabled": True}}), "Deployment", deployment)
    (container,) = found["spec"]["template"]["spec"]["containers"]
    actual = {kind: probe_target(container.get(kind)) for kind in EXPECTED[deployment]}
    assert actual == EXPECTED[deployment]


def test_no_liveness_probe_restarts_a_pod_for_being_unready(manifests: list[dict[str, Any]]) -> None:
    for deployment in find(manifests, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for kind in ("startupProbe", "livenessProbe"):
                assert probe_target(container[kind]) != "/ready", f"{deployment['metadata']['name']}: {kind}"
                # A loaded node answers slower than the 1 s default timeout: not a reason to restart.
                assert container[kind]["timeoutSeconds"] >= 2, f"{deployment['metadata']['name']}: {kind}"
