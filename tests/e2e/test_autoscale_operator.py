"""spec.autoscaling end to end on the real control plane: the operator scrapes real worker pods,
scales up on slow TTFT, and holds scale-down for the stabilization window.

The pods are tiny ``herd worker`` processes the node agent runs on their own loopback addresses; the
operator scrapes their ``/metrics`` there. The test makes their TTFT "slow" by a target below any
real first token (0.5 ms) and drives them with real chat requests at the pod IPs (``max_tokens`` 1,
so a first token and no inter-token latency, as a prefill worker reports).

Moved from the kmock emulator (issue 19, item 6), where the pods were ``prometheus_client`` servers
whose histograms the test filled in and whose scrapes it counted: the rounds are now waited for in
time (the autoscaler's interval) instead of counted, and the disaggregated prefill pool's load goes to
its pod directly, as the orchestrator's prefill leg would send it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster import ControlPlane
from support.operator_harness import Models, embedded_operator, model_namespace, tiny_model_deployment
from support.procs import wait_until

from herd.operator.settings import AutoscalerSettings, OperatorConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAMESPACE = "autoscale"
TOKEN = "autoscale-token"
TIMEOUT = 60.0  # generous for a loaded machine; nothing waits for it when the operator is quick
POD_TIMEOUT = 180.0  # real workers start (torch imported) on 2 shared cores
INTERVAL_S = 0.3
LONG_WINDOW_S = 3600.0  # far longer than any run of the test, however slow: a scale-down in it is a bug
SHORT_WINDOW_S = 1.5
AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "targets": {"ttftP95Ms": 0.5, "itlP95Ms": 100000}}  # fmt: skip


@pytest.fixture(scope="module")
def namespace(cluster: ControlPlane) -> Iterator[Models]:
    with model_namespace(cluster, NAMESPACE, TOKEN) as models:
        yield models


@pytest.fixture(params=[LONG_WINDOW_S], ids=lambda window: f"window-{window:g}s")
def models(request: pytest.FixtureRequest, namespace: Models) -> Iterator[Models]:
    """The operator (the chart's ServiceAccount) with the autoscaler every 0.3 s and the given window;
    the test's ModelDeployments are deleted afterwards, so that their workers stop."""
    config = OperatorConfig(retry_delay=1.0, autoscaler=AutoscalerSettings(interval_s=INTERVAL_S, stabilization_s=request.param))  # fmt: skip
    login = namespace.plane.login_as("herd-operator", "herd", default_namespace=NAMESPACE)
    with embedded_operator(login, namespace=None, config=config):
        yield namespace
    namespace.kubectl("delete", "md", "--all", "--wait=false")


def autoscaled(models: Models, md: str, tiny_llama: Path, **pools: Any) -> dict[str, Any]:
    manifest = tiny_model_deployment(md, tiny_llama, replicas=2, autoscaling=AUTOSCALING)
    if pools:
        workers = manifest["spec"].pop("workers")
        manifest["spec"].update({"serving": {"mode": "disaggregated"}, **{name: {**workers, **pool} for name, pool in pools.items()}})  # fmt: skip
    models.apply(manifest)
    return manifest


def ready_pods(models: Models, md: str, count: int, role: str = "unified") -> list[str]:
    """The pod IPs of the ``count`` Ready pods of ``md``'s ``role`` pool."""
    selector = f"herd.dev/deployment={md},herd.dev/role={role}"
    pods = models.plane.wait_ready_pods(NAMESPACE, selector, count, timeout=POD_TIMEOUT)
    return [pod["status"]["podIP"] for pod in pods]


def first_tokens(md: str, ip: str, count: int = 20) -> None:
    """``count`` chat requests with one output token each, to the worker pod at ``ip``."""
    body = {"model": md, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 1}
    for _ in range(count):
        httpx.post(f"http://{ip}:8000/v1/chat/completions", json=body, timeout=30).raise_for_status()


def autoscaling(models: Models, md: str) -> dict[str, Any]:
    return dict(models.get("md", md).get("status", {}).get("autoscaling") or {})


def deployment_replicas(models: Models, name: str) -> int:
    return int(models.get("deployment", name)["spec"]["replicas"])


def eventually(check: Any, what: str, timeout: float = TIMEOUT) -> None:
    wait_until(check, timeout=timeout, interval=0.2, what=what)


def scale_up_ttft_percent(models: Models, md: str, change: str) -> int:
    """The TTFT p95, in percent of its target, that a ScaledUp Event of ``md`` gives for ``change``;
    0 while there is none."""
    for event in models.events(md):
        found = re.match(rf"{change}: ttft p95 at (\d+)% of target", event.get("message", ""))
        if event["reason"] == "ScaledUp" and found:
            return int(found.group(1))
    return 0


def test_slow_ttft_scales_up_and_scale_down_waits_for_the_window(models: Models, tiny_llama: Path) -> None:
    autoscaled(models, "chat", tiny_llama)
    ips = ready_pods(models, "chat", 2)
    # Idle pods recommend minReplicas, but the window has not passed: no scale-down.
    eventually(lambda: "window" in autoscaling(models, "chat").get("reason", ""), "a held scale-down")
    assert autoscaling(models, "chat")["desiredReplicas"] == 2
    assert models.get("md", "chat")["spec"].get("replicas") is None

    for ip in ips:
        first_tokens("chat", ip)
    eventually(lambda: models.get("md", "chat")["spec"].get("replicas") == 4, "spec.replicas doubled to 4")
    eventually(lambda: deployment_replicas(models, "chat-workers") == 4, "Deployment at 4")
    status = autoscaling(models, "chat")
    assert status["desiredReplicas"] == 4 and status["lastScaleTime"]
    # The status holds the latest round's figures; the Event keeps the scale-up's reason.
    eventually(
        lambda: scale_up_ttft_percent(models, "chat", "workers replicas 2 -> 4") >= 200, "a ScaledUp Event"
    )

    # Quiet again: no further step up, and no step down in the window, round after round.
    ready_pods(models, "chat", 4)
    eventually(lambda: "no scale-down" in autoscaling(models, "chat").get("reason", ""), "a held scale-down after the scale-up")  # fmt: skip
    held_since = time.monotonic()
    eventually(lambda: time.monotonic() - held_since > 5 * INTERVAL_S, "five more autoscaler intervals")
    assert models.get("md", "chat")["spec"]["replicas"] == 4
    assert autoscaling(models, "chat")["desiredReplicas"] == 4
    assert "no scale-down" in autoscaling(models, "chat")["reason"]
    assert not models.get("md", "chat")["metadata"].get("finalizers"), "autoscaling adds no finalizer"


def test_a_disaggregated_prefill_pool_scales_on_its_own_ttft(models: Models, tiny_llama: Path) -> None:
    autoscaled(models, "pd", tiny_llama, prefill={"replicas": 1}, decode={"replicas": 1})
    (prefill,) = ready_pods(models, "pd", 1, "prefill")
    ready_pods(models, "pd", 1, "decode")
    # A first round per pod is the baseline: latencies are bucket deltas between two scrapes.
    eventually(lambda: "prefill" in autoscaling(models, "pd"), "a first decision for the prefill pool")
    first_tokens("pd", prefill)  # a prefill worker reports TTFT and no ITL; the decode pool is idle
    eventually(lambda: models.get("md", "pd")["spec"]["prefill"]["replicas"] == 2, "spec.prefill.replicas 2")
    eventually(lambda: deployment_replicas(models, "pd-prefill") == 2, "prefill at 2")
    status = autoscaling(models, "pd")["prefill"]
    assert status["desiredReplicas"] == 2 and status["lastScaleTime"]
    assert "itlP95Ms" not in status["observed"]
    assert models.get("md", "pd")["spec"].get("replicas") is None, "the decode pool is not scaled"
    assert deployment_replicas(models, "pd-decode") == 1
    assert autoscaling(models, "pd")["desiredReplicas"] == 1
    eventually(lambda: scale_up_ttft_percent(models, "pd", "prefill replicas 1 -> 2") >= 200,
               "a ScaledUp Event for the prefill pool, driven by TTFT")  # fmt: skip


@pytest.mark.parametrize("models", [SHORT_WINDOW_S], indirect=True, ids=["window-1.5s"])
def test_an_idle_pool_scales_down_to_min_after_the_window_and_stops_when_disabled(
    models: Models, tiny_llama: Path
) -> None:
    applied = time.monotonic()  # the scaler cannot have seen the resource before this
    autoscaled(models, "quiet", tiny_llama)
    ready_pods(models, "quiet", 2)
    eventually(
        lambda: models.get("md", "quiet")["spec"].get("replicas") == 1, "spec.replicas down to minReplicas"
    )
    assert time.monotonic() - applied >= SHORT_WINDOW_S
    eventually(lambda: deployment_replicas(models, "quiet-workers") == 1, "Deployment at 1")
    eventually(lambda: ("Normal", "ScaledDown") in models.reasons("quiet"), "a ScaledDown Event")
    assert autoscaling(models, "quiet")["reason"] == "idle: no requests"

    models.kubectl(
        "patch", "md", "quiet", "--type=merge", "-p", '{"spec": {"autoscaling": {"enabled": false}}}'
    )
    eventually(lambda: not autoscaling(models, "quiet"), "status.autoscaling cleared once disabled")
    assert models.get("md", "quiet")["spec"]["replicas"] == 1  # where the autoscaler left it
