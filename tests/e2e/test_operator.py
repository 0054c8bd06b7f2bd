"""The operator end to end against the Kubernetes API emulator: kubectl in, children and status out.

kopf runs embedded (``run_operator`` in a thread with its own loop) against one emulator per module;
each test uses its own ModelDeployment names. The emulator runs no controllers, so tests create the
worker Pods a Deployment controller would, and mark them Ready as a kubelet would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube.emulator import Emulator, kube_emulator
from support.operator_harness import embedded_operator, install_crd, kubectl
from support.procs import wait_until

from herd.orchestrator.discovery import Membership
from herd.orchestrator.kube_discovery import KubeSource

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 60.0  # for what the operator does in the background: generous for a loaded machine, free when quick


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    with kube_emulator(tmp_path_factory.mktemp("kube")) as emulator:
        install_crd(emulator)
        with embedded_operator(emulator):
            yield emulator


def apply(kube: Emulator, manifest: dict[str, Any]) -> None:
    kubectl(kube, "apply", "--validate=false", "-f", "-", stdin=yaml.safe_dump(manifest))


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"source": "pvc://weights/chat", "servedName": name}, "workers": {"replicas": 2}, **spec}
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": body,
    }


def eventually(check: Callable[[], bool], what: str) -> None:
    wait_until(check, timeout=TIMEOUT, interval=0.05, what=what)


def is_observed(kube: Emulator, md: str) -> bool:
    """The operator has written the status of the ModelDeployment's current generation."""
    body = kube.get("md", md)
    return bool(body.get("status", {}).get("observedGeneration") == body["metadata"]["generation"])


def children(kube: Emulator, md: str) -> dict[str, dict[str, Any]]:
    selector = f"herd.dev/deployment={md}"
    found = kube.list("deployments.apps", "default", label_selector=selector)
    found += kube.list("services", "default", label_selector=selector)
    return {f"{obj['kind']}/{obj['metadata']['name']}": obj for obj in found}


def condition(kube: Emulator, md: str, kind: str) -> dict[str, Any]:
    conditions = kube.get("md", md).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


def events(kube: Emulator, md: str) -> set[tuple[str, str]]:
    found = kube.list("events", "default")
    return {(e["type"], e["reason"]) for e in found if e.get("involvedObject", {}).get("name") == md}


def start_pods(kube: Emulator, deployment: str, count: int, *, first_ip: int = 1) -> list[str]:
    """What the Deployment controller and kubelet would do: pods from the template, then Ready."""
    template = kube.get("deployments.apps", deployment)["spec"]["template"]
    names = []
    for index in range(count):
        name = f"{deployment}-{index}"
        kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name, "namespace": "default"}, "spec": template["spec"]})  # fmt: skip
        kube.set_pod_ready("default", name, pod_ip=f"127.0.0.{first_ip + index}")
        names.append(name)
    return names


def test_kubectl_apply_examples_creates_children_of_the_right_shape(kube: Emulator) -> None:
    kubectl(kube, "apply", "--validate=false", "-f", str(REPO / "examples"))
    expected = {
        "smollm2": {"Deployment/smollm2-workers": 2, "Service/smollm2-workers": None},
        "llama-3-8b": {"Deployment/llama-3-8b-workers": 2, "Service/llama-3-8b-workers": None},
        "qwen-chat": {"Deployment/qwen-chat-workers": 3, "Service/qwen-chat-workers": None},
        "smollm2-disagg": {
            "Deployment/smollm2-disagg-prefill": 1,
            "Service/smollm2-disagg-prefill": None,
            "Deployment/smollm2-disagg-decode": 1,
            "Service/smollm2-disagg-decode": None,
        },
    }
    for md, shape in expected.items():
        eventually(lambda md=md, shape=shape: set(children(kube, md)) == set(shape), f"children of {md}")
        uid = kube.get("md", md)["metadata"]["uid"]
        for key, obj in children(kube, md).items():
            assert obj["spec"].get("replicas") == shape[key]
            assert [
                (ref["kind"], ref["uid"], ref["controller"]) for ref in obj["metadata"]["ownerReferences"]
            ] == [("ModelDeployment", uid, True)]
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "herd"
    llama = children(kube, "llama-3-8b")["Deployment/llama-3-8b-workers"]["spec"]["template"]["spec"]
    assert llama["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert llama["initContainers"][0]["command"][:2] == ["hf", "download"]
    qwen = children(kube, "qwen-chat")["Deployment/qwen-chat-workers"]["spec"]["template"]["spec"]
    assert qwen["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "1"}
    decode = children(kube, "smollm2-disagg")["Deployment/smollm2-disagg-decode"]
    assert decode["spec"]["template"]["metadata"]["labels"]["herd.dev/role"] == "decode"


def test_replicas_updates_patch_the_deployment(kube: Emulator) -> None:
    apply(kube, manifest("scaled"))
    eventually(lambda: "Deployment/scaled-workers" in children(kube, "scaled"), "Deployment created")
    uid = children(kube, "scaled")["Deployment/scaled-workers"]["metadata"]["uid"]
    apply(kube, manifest("scaled", workers={"replicas": 4}))
    eventually(
        lambda: children(kube, "scaled")["Deployment/scaled-workers"]["spec"]["replicas"] == 4, "replicas 4"
    )
    kubectl(kube, "scale", "md/scaled", "--replicas=1")
    eventually(
        lambda: children(kube, "scaled")["Deployment/scaled-workers"]["spec"]["replicas"] == 1, "scaled to 1"
    )
    assert children(kube, "scaled")["Deployment/scaled-workers"]["metadata"]["uid"] == uid
    eventually(
        lambda: {("Normal", "Created"), ("Normal", "Updated")} <= events(kube, "scaled"), "Events posted"
    )


def test_manual_edits_of_owned_fields_are_reverted(kube: Emulator) -> None:
    apply(kube, manifest("drifty"))
    eventually(lambda: "Deployment/drifty-workers" in children(kube, "drifty"), "Deployment created")
    template = children(kube, "drifty")["Deployment/drifty-workers"]["spec"]["template"]
    kube.patch("deployments.apps", "drifty-workers", {"spec": {"replicas": 9, "template": {"spec": {"containers": [{"name": "worker", "image": "evil:1"}]}}}})  # fmt: skip

    def is_restored() -> bool:
        spec = children(kube, "drifty")["Deployment/drifty-workers"]["spec"]
        return spec["replicas"] == 2 and spec["template"] == template

    eventually(is_restored, "the edit reverted")
    eventually(lambda: ("Warning", "DriftReverted") in events(kube, "drifty"), "a Warning Event")
    kube.delete("services", "drifty-workers")
    eventually(lambda: "Service/drifty-workers" in children(kube, "drifty"), "the deleted Service recreated")


async def next_membership(
    updates: AsyncIterator[Membership], check: Callable[[Membership], bool]
) -> Membership:
    async with asyncio.timeout(TIMEOUT):
        async for membership in updates:
            if check(membership):
                return membership
    raise AssertionError("the discovery stream ended")


async def test_ready_pods_roll_up_into_status_and_discovery(kube: Emulator) -> None:
    apply(kube, manifest("ready", workers={"replicas": 3}, routing={"strategy": "round_robin"}))
    eventually(
        lambda: condition(kube, "ready", "Ready").get("reason") == "PoolsNotReady", "Ready=False first"
    )
    updates = KubeSource("default", kubeconfig=str(kube.kubeconfig)).watch()
    try:
        pods = start_pods(kube, "ready-workers", 3, first_ip=11)
        eventually(lambda: condition(kube, "ready", "Ready").get("status") == "True", "Ready=True")
        status = kube.get("md", "ready")["status"]
        assert status["pools"]["workers"] == {
            "replicas": 3,
            "readyReplicas": 3,
            "updatedReplicas": 3,
            "ready": "3/3",
        }
        assert status["replicas"] == 3
        assert condition(kube, "ready", "Progressing")["status"] == "False"

        def urls(membership: Membership) -> set[str]:
            return {e.url for e in membership.endpoints if e.model == "ready"}

        membership = await next_membership(updates, lambda m: len(urls(m)) == 3)
        assert urls(membership) == {f"http://127.0.0.{ip}:8000" for ip in (11, 12, 13)}
        assert (
            next(m for m in membership.models if m.served_name == "ready").routing.strategy == "round_robin"
        )
        kube.set_pod_ready("default", pods[0], ready=False, pod_ip="127.0.0.11")
        membership = await next_membership(updates, lambda m: len(urls(m)) == 2)
        assert urls(membership) == {"http://127.0.0.12:8000", "http://127.0.0.13:8000"}
        kube.terminate_pod("default", pods[1])  # still listed and Ready, but terminating
        membership = await next_membership(updates, lambda m: len(urls(m)) == 1)
        assert urls(membership) == {"http://127.0.0.13:8000"}
        kube.delete("pods", pods[2])
        await next_membership(updates, lambda m: not urls(m))
        kube.release("pods", pods[1])
        eventually(lambda: condition(kube, "ready", "Ready").get("status") == "False", "Ready=False again")
    finally:
        await updates.aclose()
    # The operator's own client and KubeSource (both httpx) authenticate with the kubeconfig's token.
    ours = [r for r in kube.kmock if r.headers.get("User-Agent", "").startswith("python-httpx")]
    assert ours
    assert {r.headers.get("Authorization") for r in ours} == {"Bearer emulator"}


def test_rollouts_and_crash_loops_show_in_the_conditions(kube: Emulator) -> None:
    apply(kube, manifest("rolling"))
    eventually(lambda: "Deployment/rolling-workers" in children(kube, "rolling"), "Deployment created")
    pods = start_pods(kube, "rolling-workers", 2, first_ip=21)
    eventually(
        lambda: condition(kube, "rolling", "Progressing").get("reason") == "RolloutComplete", "rolled out"
    )
    apply(kube, manifest("rolling", engine={"maxModelLen": 8192}))  # a new pod template
    eventually(lambda: condition(kube, "rolling", "Progressing").get("reason") == "RollingOut", "rolling out")
    assert condition(kube, "rolling", "Ready")["status"] == "True", "old pods keep serving during a rollout"
    kube.set_pod_ready("default", pods[0], ready=False, pod_ip="127.0.0.21")
    crashing = {"name": "worker", "ready": False, "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}}}  # fmt: skip
    kube.patch("pods", pods[0], {"status": {"containerStatuses": [crashing]}}, subresource="status")
    eventually(lambda: condition(kube, "rolling", "Degraded").get("reason") == "CrashLoop", "Degraded=True")
    assert pods[0] in condition(kube, "rolling", "Degraded")["message"]
    eventually(lambda: ("Warning", "CrashLoop") in events(kube, "rolling"), "a Warning Event")
    assert kube.get("md", "rolling")["status"]["pools"]["workers"]["ready"] == "1/2"


def test_an_object_herd_does_not_own_is_left_alone(kube: Emulator) -> None:
    squatter = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "squat-workers", "namespace": "default"},
                "spec": {"ports": [{"port": 80}]}}  # fmt: skip
    uid = kube.create(squatter)["metadata"]["uid"]
    apply(kube, manifest("squat"))
    eventually(lambda: condition(kube, "squat", "Ready").get("reason") == "ChildConflict", "ChildConflict")
    assert "Service/squat-workers" in condition(kube, "squat", "Ready")["message"]
    service = kube.get("services", "squat-workers")
    assert [port["port"] for port in service["spec"]["ports"]] == [80]
    assert not service["metadata"].get("ownerReferences")
    kube.delete("services", "squat-workers")
    eventually(
        lambda: "Service/squat-workers" in children(kube, "squat"),
        "the Service created once the name is free",
    )
    assert children(kube, "squat")["Service/squat-workers"]["metadata"]["uid"] != uid


def test_delete_removes_the_children(kube: Emulator) -> None:
    apply(kube, manifest("doomed"))
    eventually(lambda: len(children(kube, "doomed")) == 2, "children created")
    assert not kube.get("md", "doomed")["metadata"].get("finalizers"), (
        "no finalizer: deletion never waits on herd"
    )
    kubectl(kube, "delete", "md/doomed")
    eventually(lambda: not children(kube, "doomed"), "children deleted")


def test_invalid_spec_sets_invalid_spec_and_the_operator_keeps_going(kube: Emulator) -> None:
    apply(kube, manifest("broken", serving={"mode": "disaggregated"}))
    eventually(lambda: condition(kube, "broken", "Ready").get("reason") == "InvalidSpec", "InvalidSpec")
    ready = condition(kube, "broken", "Ready")
    assert ready["status"] == "False"
    assert "spec.prefill" in ready["message"] and "spec.decode" in ready["message"]
    assert not children(kube, "broken")
    eventually(lambda: ("Warning", "InvalidSpec") in events(kube, "broken"), "a Warning Event")
    apply(kube, manifest("fine"))
    eventually(lambda: len(children(kube, "fine")) == 2, "a valid one still reconciles")
    apply(
        kube,
        manifest(
            "broken", serving={"mode": "disaggregated"}, prefill={"replicas": 1}, decode={"replicas": 1}
        ),
    )
    eventually(lambda: len(children(kube, "broken")) == 4, "the fixed spec reconciles")


def test_operator_restart_creates_no_duplicates(tmp_path: Path) -> None:
    with kube_emulator(tmp_path) as kube:
        install_crd(kube)
        apply(kube, manifest("steady"))
        with embedded_operator(kube):
            # the whole first pass, status included: stopping between children and status is no restart test
            eventually(
                lambda: len(children(kube, "steady")) == 2 and is_observed(kube, "steady"), "a full pass"
            )
        before = {key: obj["metadata"]["uid"] for key, obj in children(kube, "steady").items()}
        versions = {key: obj["metadata"]["resourceVersion"] for key, obj in children(kube, "steady").items()}
        generation = kube.get("md", "steady")["status"]["observedGeneration"]
        with embedded_operator(kube):
            apply(kube, manifest("steady", workers={"replicas": 3}))
            eventually(
                lambda: kube.get("md", "steady")["status"]["observedGeneration"] > generation, "a new pass"
            )
        after = children(kube, "steady")
        assert {key: obj["metadata"]["uid"] for key, obj in after.items()} == before
        assert (
            after["Service/steady-workers"]["metadata"]["resourceVersion"]
            == versions["Service/steady-workers"]
        )
        assert after["Deployment/steady-workers"]["spec"]["replicas"] == 3
