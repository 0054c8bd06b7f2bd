"""spec.autoscaling end to end: the operator scrapes worker pods, scales up on slow TTFT, and holds
scale-down for the stabilization window.

The worker pods are fake metrics servers on loopback: each is a ``prometheus_client`` HTTP server
with the worker's metric names, at 127.0.0.1 on its own port (the pod's container port named
``http``). The test observes latencies into their histograms as a worker would.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, Histogram, Metric, start_http_server
from prometheus_client.registry import Collector
from support.kube.emulator import Emulator, kube_emulator
from support.operator_harness import embedded_operator, install_crd, kubectl
from support.procs import wait_until

from herd.api import metrics as names
from herd.operator.settings import AutoscalerSettings, OperatorConfig

pytestmark = pytest.mark.e2e

TIMEOUT = 60.0  # generous for a loaded machine; nothing waits for it when the operator is quick
LONG_WINDOW_S = 3600.0  # far longer than any run of the test, however slow: a scale-down in it is a bug
SHORT_WINDOW_S = 1.5


def operator_config(window_s: float) -> OperatorConfig:
    return OperatorConfig(
        retry_delay=1.0, autoscaler=AutoscalerSettings(interval_s=0.3, stabilization_s=window_s)
    )


class ScrapeCounter(Collector):
    """Counts the scrapes of a registry: each autoscaler round scrapes every Ready pod once."""

    def __init__(self) -> None:
        self.num_scrapes = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        self.num_scrapes += 1
        return []


@dataclass
class FakeWorker:
    """One pod's /metrics: the histograms and gauges the autoscaler reads."""

    port: int
    ttft: Histogram
    itl: Histogram
    scrapes: ScrapeCounter


@contextlib.contextmanager
def fake_worker() -> Iterator[FakeWorker]:
    registry = CollectorRegistry()
    ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", ["model_name"], registry=registry)
    itl = Histogram(names.INTER_TOKEN_LATENCY_SECONDS, "itl", ["model_name"], registry=registry)
    Gauge(names.NUM_REQUESTS_WAITING, "waiting", registry=registry).set(0)
    Gauge(names.KV_CACHE_USAGE_PERC, "kv", registry=registry).set(0.2)
    scrapes = ScrapeCounter()
    registry.register(scrapes)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield FakeWorker(server.server_port, ttft, itl, scrapes)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


@pytest.fixture(params=[LONG_WINDOW_S], ids=lambda window: f"window-{window:g}s")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with kube_emulator(tmp_path_factory.mktemp("kube")) as emulator:
        install_crd(emulator)
        with embedded_operator(emulator, config=operator_config(request.param)):
            yield emulator


@pytest.fixture
def workers() -> Iterator[list[FakeWorker]]:
    with fake_worker() as first, fake_worker() as second:
        yield [first, second]


AUTOSCALING = {
    "enabled": True,
    "minReplicas": 1,
    "maxReplicas": 6,
    "targets": {"ttftP95Ms": 1000, "itlP95Ms": 100},
}
DISAGGREGATED = {"serving": {"mode": "disaggregated"}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}


def manifest(name: str, pools: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {
        "model": {"source": "pvc://weights/chat"},
        **(pools or {"workers": {"replicas": 2}}),
        "autoscaling": AUTOSCALING,
    }
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": spec,
    }


def start_pods(kube: Emulator, deployment: str, workers: list[FakeWorker]) -> None:
    """The Deployment controller's and kubelet's part: Ready pods whose http port is a fake worker."""
    template = kube.get("deployments.apps", deployment)["spec"]["template"]
    for index, worker in enumerate(workers):
        spec = copy.deepcopy(template["spec"])
        for port in spec["containers"][0]["ports"]:
            if port["name"] == "http":
                port["containerPort"] = worker.port
        meta = {**template["metadata"], "name": f"{deployment}-{index}", "namespace": "default"}
        kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
        kube.set_pod_ready("default", meta["name"], pod_ip="127.0.0.1")


def autoscaling(kube: Emulator, md: str) -> dict[str, Any]:
    return dict(kube.get("md", md).get("status", {}).get("autoscaling") or {})


def eventually(check: Any, what: str) -> None:
    wait_until(check, timeout=TIMEOUT, interval=0.05, what=what)


def test_slow_ttft_scales_up_and_scale_down_waits_for_the_window(
    kube: Emulator, workers: list[FakeWorker]
) -> None:
    kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest("chat")))
    eventually(lambda: kube.find("deployments.apps", "chat-workers") is not None, "Deployment created")
    start_pods(kube, "chat-workers", workers)
    # Idle pods recommend minReplicas, but the window has not passed: no scale-down.
    eventually(lambda: "window" in autoscaling(kube, "chat").get("reason", ""), "a held scale-down")
    assert autoscaling(kube, "chat")["desiredReplicas"] == 2
    assert kube.get("md", "chat")["spec"].get("replicas") is None

    for worker in workers:
        for _ in range(20):
            worker.ttft.labels("chat").observe(2.0)  # p95 ~2.4 s against a 1 s target
            worker.itl.labels("chat").observe(0.02)
    eventually(lambda: kube.get("md", "chat")["spec"].get("replicas") == 4, "spec.replicas doubled to 4")
    eventually(
        lambda: kube.get("deployments.apps", "chat-workers")["spec"]["replicas"] == 4, "Deployment at 4"
    )
    status = autoscaling(kube, "chat")
    assert status["desiredReplicas"] == 4 and status["lastScaleTime"]
    # The status holds the latest round's figures (a later round may already have found no new
    # latencies); the Event keeps the scale-up's reason: the observed p95 against its target.
    eventually(
        lambda: scale_up_ttft_percent(kube, "chat", "workers replicas 2 -> 4") >= 200, "a ScaledUp Event"
    )

    # Quiet again, and the new pods are not Ready: no further step up, and no step down in the window.
    held = "a held scale-down after the scale-up"
    eventually(lambda: "no scale-down" in autoscaling(kube, "chat").get("reason", ""), held)
    rounds = [worker.scrapes.num_scrapes for worker in workers]
    eventually(
        lambda: all(w.scrapes.num_scrapes >= n + 3 for w, n in zip(workers, rounds, strict=True)),
        "three more autoscaler rounds",
    )
    assert kube.get("md", "chat")["spec"]["replicas"] == 4
    assert autoscaling(kube, "chat")["desiredReplicas"] == 4
    assert not kube.get("md", "chat")["metadata"].get("finalizers"), "autoscaling adds no finalizer"


def test_a_disaggregated_prefill_pool_scales_on_its_own_ttft(
    kube: Emulator, workers: list[FakeWorker]
) -> None:
    prefill, decode = workers
    kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest("pd", DISAGGREGATED)))
    eventually(lambda: kube.find("deployments.apps", "pd-prefill") is not None, "prefill Deployment")
    eventually(lambda: kube.find("deployments.apps", "pd-decode") is not None, "decode Deployment")
    start_pods(kube, "pd-prefill", [prefill])
    start_pods(kube, "pd-decode", [decode])
    # A first round per pod is the baseline: latencies are bucket deltas between two scrapes.
    eventually(lambda: "prefill" in autoscaling(kube, "pd"), "a first decision for the prefill pool")
    eventually(
        lambda: prefill.scrapes.num_scrapes > 0 and decode.scrapes.num_scrapes > 0, "both pods scraped"
    )
    for _ in range(20):
        prefill.ttft.labels("pd").observe(2.0)  # a prefill worker reports TTFT and no ITL
        decode.itl.labels("pd").observe(0.05)  # decode within its ITL target
    eventually(lambda: kube.get("md", "pd")["spec"]["prefill"]["replicas"] == 2, "spec.prefill.replicas 2")
    eventually(lambda: kube.get("deployments.apps", "pd-prefill")["spec"]["replicas"] == 2, "prefill at 2")
    status = autoscaling(kube, "pd")["prefill"]
    assert status["desiredReplicas"] == 2 and status["lastScaleTime"]
    assert "itlP95Ms" not in status["observed"]
    assert kube.get("md", "pd")["spec"].get("replicas") is None, "the decode pool is not scaled"
    assert kube.get("deployments.apps", "pd-decode")["spec"]["replicas"] == 1
    assert autoscaling(kube, "pd")["desiredReplicas"] == 1
    # Later rounds see no new latencies (idle, held by the window); the Event keeps why it scaled.
    eventually(
        lambda: scale_up_ttft_percent(kube, "pd", "prefill replicas 1 -> 2") >= 200,
        "a ScaledUp Event for the prefill pool, driven by TTFT",
    )


@pytest.mark.parametrize("kube", [SHORT_WINDOW_S], indirect=True, ids=["window-1.5s"])
def test_an_idle_pool_scales_down_to_min_after_the_window_and_stops_when_disabled(
    kube: Emulator, workers: list[FakeWorker]
) -> None:
    applied = time.monotonic()  # the scaler cannot have seen the resource before this
    kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest("quiet")))
    eventually(lambda: kube.find("deployments.apps", "quiet-workers") is not None, "Deployment created")
    start_pods(kube, "quiet-workers", workers)
    eventually(
        lambda: kube.get("md", "quiet")["spec"].get("replicas") == 1, "spec.replicas down to minReplicas"
    )
    assert time.monotonic() - applied >= SHORT_WINDOW_S
    eventually(
        lambda: kube.get("deployments.apps", "quiet-workers")["spec"]["replicas"] == 1, "Deployment at 1"
    )
    eventually(lambda: ("Normal", "ScaledDown") in events(kube, "quiet"), "a ScaledDown Event")
    assert autoscaling(kube, "quiet")["reason"] == "idle: no requests"

    kube.patch("md", "quiet", {"spec": {"autoscaling": {"enabled": False}}})
    eventually(lambda: not autoscaling(kube, "quiet"), "status.autoscaling cleared once disabled")
    assert kube.get("md", "quiet")["spec"]["replicas"] == 1  # where the autoscaler left it


def scale_up_ttft_percent(kube: Emulator, md: str, change: str) -> int:
    """The TTFT p95, in percent of its target, that a ScaledUp Event of ``md`` gives for ``change``;
    0 while there is none."""
    scale_ups = [
        event["message"]
        for event in kube.list("events", "default")
        if event.get("involvedObject", {}).get("name") == md and event.get("reason") == "ScaledUp"
    ]
    for message in scale_ups:
        if found := re.match(rf"{change}: ttft p95 at (\d+)% of target", message):
            return int(found.group(1))
    return 0


def events(kube: Emulator, md: str) -> set[tuple[str, str]]:
    found = kube.list("events", "default")
    return {(e["type"], e["reason"]) for e in found if e.get("involvedObject", {}).get("name") == md}
