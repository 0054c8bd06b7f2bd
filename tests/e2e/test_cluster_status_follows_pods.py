"""The ModelDeployment's status follows its pods at once, on the real control plane (issue 17).

The operator runs embedded with its default settings, so a pass that an API error failed would run
again only after 30 s (``retry_delay``): the status of a scale-up can only be prompt if the operator
acts on the events of the pods it owns. Two real tiny workers (the node agent runs them) are asked
for with ``kubectl scale``; the moment the second pod turned Ready and the moment the status said
``Ready=True`` are both read from the objects' own ``lastTransitionTime`` (the node agent's and the
operator's clocks are this machine's), so how often the test polls does not enter the figure.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from support.cluster import ControlPlane
from support.operator_harness import Models, embedded_operator, model_namespace, tiny_model_deployment
from support.procs import wait_until

from herd.operator.settings import OperatorConfig

pytestmark = pytest.mark.e2e

NAMESPACE = "status-follows"
TOKEN = "status-follows-token"
POD_TIMEOUT = 180.0  # real workers start (torch imported) on 2 shared cores
STATUS_BOUND_S = 10.0
"""Generous for a loaded machine, and still a third of the 30 s retry it must not wait for."""


@pytest.fixture(scope="module")
def models(cluster: ControlPlane) -> Iterator[Models]:
    with model_namespace(cluster, NAMESPACE, TOKEN) as models:
        login = cluster.login_as("herd-operator", "herd", default_namespace=NAMESPACE)
        assert OperatorConfig().retry_delay == 30.0
        with embedded_operator(login, namespace=NAMESPACE, config=OperatorConfig()):
            yield models


def transition(conditions: list[dict[str, Any]], kind: str) -> datetime | None:
    """When the condition ``kind`` last turned True, or None while it is not True."""
    found = next((c for c in conditions if c["type"] == kind and c["status"] == "True"), None)
    return None if found is None else datetime.fromisoformat(found["lastTransitionTime"])


def test_a_scale_up_is_in_the_status_within_seconds_of_its_pods_turning_ready(
    models: Models, tiny_llama: Path
) -> None:
    models.apply(tiny_model_deployment("follows", tiny_llama, replicas=1))
    models.plane.wait_ready_pods(NAMESPACE, "herd.dev/deployment=follows", 1, timeout=POD_TIMEOUT)
    wait_until(lambda: models.condition("follows", "Ready").get("status") == "True", timeout=60,
               interval=0.2, what="Ready=True at 1/1")  # fmt: skip

    models.kubectl("scale", "md/follows", "--replicas=2")
    wait_until(lambda: models.condition("follows", "Ready").get("status") == "False", timeout=60,
               interval=0.2, what="Ready=False while the second pod starts")  # fmt: skip
    pods = models.plane.wait_ready_pods(NAMESPACE, "herd.dev/deployment=follows", 2, timeout=POD_TIMEOUT)
    wait_until(lambda: models.condition("follows", "Ready").get("status") == "True",
               timeout=3 * STATUS_BOUND_S, interval=0.2, what="Ready=True at 2/2")  # fmt: skip

    pods_ready = max(filter(None, (transition(pod["status"]["conditions"], "Ready") for pod in pods)))
    body = models.get("md", "follows")
    status_ready = transition(body["status"]["conditions"], "Ready")
    assert status_ready is not None and body["status"]["pools"]["workers"]["ready"] == "2/2"
    lag = (status_ready - pods_ready).total_seconds()
    assert lag <= STATUS_BOUND_S, f"the status said Ready {lag:.0f} s after the last pod did"
