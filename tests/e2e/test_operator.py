"""The operator end to end on the real control plane: kubectl in, children, status and Events out.

kopf runs embedded, logged in with a TokenRequest token of the chart's operator ServiceAccount and
serving every namespace (as the chart's default runs it); the tests use a namespace of their own and
each its own ModelDeployment names. The real controller-manager runs the Deployment, ReplicaSet and
garbage-collection controllers, so the tests no longer create the objects those controllers would:
deletion is the garbage collector's, not a fake's. Most pools carry a nodeSelector no node matches, so
their pods stay Pending; the status and crash-loop tests run real tiny workers, which the node agent
runs as the pods (support.node).

Moved from the kmock emulator (issue 19, item 6). What changed: the invalid-spec test runs on a
control plane of its own whose CRD has no CEL rules (on the current CRD the server itself refuses
such a spec, tests/e2e/test_cluster_crd_rules.py); the operator's restart without duplicates is
tests/e2e/test_cluster_restarts.py; the request headers the emulator recorded are proven by use: the
operator and the discovery log in with ServiceAccount tokens, and the chart's RBAC allows every
request they make (a refused one fails the test).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cluster import ControlPlane
from support.operator_harness import (
    Models,
    RefusedRequests,
    embedded_operator,
    logged_refusals,
    model_deployment,
    model_namespace,
    operated_namespace,
    own_control_plane,
    pending_pool,
    tiny_model_deployment,
)
from support.procs import wait_until

from herd.orchestrator.discovery import Membership
from herd.orchestrator.kube_discovery import KubeSource

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "herd.dev_modeldeployments.yaml"
NAMESPACE = "operator-e2e"
EXAMPLES = "operator-examples"
TOKEN = "operator-e2e-token"
TIMEOUT = 60.0  # for what the operator does in the background: generous for a loaded machine, free when quick
# The garbage collector learns the CRD's kind at its discovery resync, every 30 s: the first collection
# after the CRD was installed can wait that long (41 s measured on a fresh cluster).
GC_TIMEOUT = 150.0
POD_TIMEOUT = 180.0  # real workers start (torch imported) on 2 shared cores


@pytest.fixture(scope="module")
def served(cluster: ControlPlane) -> Iterator[tuple[Models, RefusedRequests]]:
    """The test namespace, with the operator serving every namespace as the chart runs it."""
    with logged_refusals() as refused, operated_namespace(cluster, NAMESPACE, TOKEN) as models:
        yield models, refused


@pytest.fixture
def models(served: tuple[Models, RefusedRequests]) -> Iterator[Models]:
    """The namespace the operator serves; every test ends with no request of the operator refused."""
    models, refused = served
    yield models
    assert not refused.records, refused.records[:3]


def eventually(check: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    wait_until(check, timeout=timeout, interval=0.2, what=what)


def owners(obj: dict[str, Any]) -> list[tuple[str, str, bool]]:
    return [
        (ref["kind"], ref["uid"], ref["controller"]) for ref in obj["metadata"].get("ownerReferences", [])
    ]


def no_pods_policy(namespace: str) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy (CEL, in the apiserver) and its binding refusing pods in ``namespace``."""
    name = f"herd-test-no-pods-{namespace}"
    rules = [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": name},
              "spec": {"failurePolicy": "Fail", "matchConstraints": {"resourceRules": rules},
                       "validations": [{"expression": "false", "message": "this namespace runs no pods"}]}}  # fmt: skip
    binding = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": name},
               "spec": {"policyName": name, "validationActions": ["Deny"],
                        "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}}}  # fmt: skip
    return [policy, binding]


def refuses_pods(models: Models) -> bool:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
           "spec": {"containers": [{"name": "probe", "image": "none", "command": ["true"]}]}}  # fmt: skip
    argv = ["-n", models.namespace, "create", "--dry-run=server", "-f", "-"]
    done = models.plane.kubectl(*argv, stdin=json.dumps(pod), check=False)
    return done.returncode != 0 and "this namespace runs no pods" in done.stderr


@pytest.fixture
def no_pods(served: tuple[Models, RefusedRequests]) -> Iterator[Models]:
    """A namespace of its own whose pods the apiserver refuses (an admission policy): the examples'
    pools name no nodeSelector and would run real SmolLM2 workers; this test is about what the
    operator writes."""
    models, refused = served
    policy = no_pods_policy(EXAMPLES)
    with model_namespace(models.plane, EXAMPLES) as examples:
        for obj in policy:
            models.plane.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
        try:
            eventually(lambda: refuses_pods(examples), "the admission policy in force")
            yield examples
        finally:
            for obj in reversed(policy):
                models.plane.kubectl("delete", obj["kind"], obj["metadata"]["name"])
    assert not refused.records, refused.records[:3]


def test_kubectl_apply_examples_creates_children_of_the_right_shape(no_pods: Models) -> None:
    models = no_pods
    models.kubectl("apply", "-f", str(REPO / "examples"))
    expected = {
        "smollm2": {"Deployment/smollm2-workers": 2, "Service/smollm2-workers": None},
        "llama-3-8b": {"Deployment/llama-3-8b-workers": 2, "Service/llama-3-8b-workers": None},
        "qwen-chat": {"Deployment/qwen-chat-workers": 3, "Service/qwen-chat-workers": None},
        "chat": {"Deployment/chat-workers": 1, "Service/chat-workers": None},
        "minilm": {"Deployment/minilm-workers": 2, "Service/minilm-workers": None},
        "smollm2-disagg": {
            "Deployment/smollm2-disagg-prefill": 1,
            "Service/smollm2-disagg-prefill": None,
            "Deployment/smollm2-disagg-decode": 1,
            "Service/smollm2-disagg-decode": None,
        },
    }
    for md, shape in expected.items():
        eventually(lambda md=md, shape=shape: set(models.children(md)) == set(shape), f"children of {md}")
        uid = models.get("md", md)["metadata"]["uid"]
        for key, obj in models.children(md).items():
            assert obj["spec"].get("replicas") == shape[key], key
            assert owners(obj) == [("ModelDeployment", uid, True)], key
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "herd"
    llama = models.children("llama-3-8b")["Deployment/llama-3-8b-workers"]["spec"]["template"]["spec"]
    assert llama["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert llama["initContainers"][0]["command"][:2] == ["hf", "download"]
    qwen = models.children("qwen-chat")["Deployment/qwen-chat-workers"]["spec"]["template"]["spec"]
    assert qwen["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "1"}
    decode = models.children("smollm2-disagg")["Deployment/smollm2-disagg-decode"]
    assert decode["spec"]["template"]["metadata"]["labels"]["herd.dev/role"] == "decode"
    num_deployments = len(models.get("deployments")["items"])
    eventually(lambda: len(models.get("replicasets")["items"]) == num_deployments, "a ReplicaSet for each")
    assert not models.get("pods")["items"], "the policy admits no pod"
    assert_herd_plan_printed_what_the_operator_made(models)


def assert_herd_plan_printed_what_the_operator_made(models: Models) -> None:
    """``herd plan -f`` of each example, with the operator's default settings, prints every child the
    operator created, with the same desired-content hash and the same labels."""
    for path in sorted((REPO / "examples").glob("*.yaml")):
        argv = [sys.executable, "-m", "herd.cli.main", "plan", "-f", str(path), "-n", models.namespace]
        printed = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
        for doc in yaml.safe_load_all(printed):
            meta = doc["metadata"]
            made = models.children(meta["labels"]["herd.dev/deployment"])[f"{doc['kind']}/{meta['name']}"]
            assert (
                made["metadata"]["annotations"]["herd.dev/spec-hash"]
                == meta["annotations"]["herd.dev/spec-hash"]
            )
            assert made["metadata"]["labels"] == meta["labels"], meta["name"]
            assert made["spec"]["selector"] == doc["spec"]["selector"], meta["name"]


def test_replicas_updates_patch_the_deployment(models: Models) -> None:
    models.apply(model_deployment("scaled"))
    eventually(lambda: "Deployment/scaled-workers" in models.children("scaled"), "Deployment created")
    uid = models.children("scaled")["Deployment/scaled-workers"]["metadata"]["uid"]

    def replicas() -> int:
        return int(models.children("scaled")["Deployment/scaled-workers"]["spec"]["replicas"])

    models.apply(model_deployment("scaled", workers=pending_pool(4)))
    eventually(lambda: replicas() == 4, "replicas 4")
    models.kubectl("scale", "md/scaled", "--replicas=1")
    eventually(lambda: replicas() == 1, "scaled to 1")
    assert models.children("scaled")["Deployment/scaled-workers"]["metadata"]["uid"] == uid
    eventually(lambda: {("Normal", "Created"), ("Normal", "Updated")} <= models.reasons("scaled"), "Events")


def test_a_scale_up_undone_before_its_pods_are_ready_is_undone_in_the_deployment(models: Models) -> None:
    """0 replicas is ready at once, so kopf records it as handled; 4 pending pods never turn ready, and
    the scale back to 0 comes while the pass for 4 waits on them. A handler that failed until pods were
    ready left kopf's last-handled spec at 0, so 0 -> 4 -> 0 read as no change and the Deployment
    stayed at 4 (seen with the chart's 30 s retry; the module's operator retries after 1 s, which
    narrows that window without closing it)."""
    models.apply(model_deployment("bounce", workers=pending_pool(0)))
    eventually(lambda: "Deployment/bounce-workers" in models.children("bounce"), "Deployment created")

    def replicas() -> int:
        return int(models.children("bounce")["Deployment/bounce-workers"]["spec"]["replicas"])

    models.kubectl("scale", "md/bounce", "--replicas=4")
    eventually(lambda: replicas() == 4, "replicas 4")
    models.kubectl("scale", "md/bounce", "--replicas=0")
    eventually(lambda: replicas() == 0, "back to 0")
    time.sleep(2)  # past the module operator's retry delay: nothing scales it up again
    assert replicas() == 0


def test_manual_edits_of_owned_fields_are_reverted(models: Models) -> None:
    models.apply(model_deployment("drifty"))
    eventually(lambda: "Deployment/drifty-workers" in models.children("drifty"), "Deployment created")
    template = models.children("drifty")["Deployment/drifty-workers"]["spec"]["template"]
    edit = {
        "spec": {"replicas": 9, "template": {"spec": {"containers": [{"name": "worker", "image": "evil:1"}]}}}
    }
    models.kubectl("patch", "deployment", "drifty-workers", "-p", json.dumps(edit))

    def is_restored() -> bool:
        spec = models.children("drifty")["Deployment/drifty-workers"]["spec"]
        return bool(spec["replicas"] == 2 and spec["template"] == template)

    eventually(is_restored, "the edit reverted")
    eventually(lambda: ("Warning", "DriftReverted") in models.reasons("drifty"), "a Warning Event")
    models.kubectl("delete", "service", "drifty-workers")
    eventually(lambda: "Service/drifty-workers" in models.children("drifty"), "the deleted Service recreated")


def test_an_object_herd_does_not_own_is_left_alone(models: Models) -> None:
    squatter = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "squat-workers"},
                "spec": {"ports": [{"port": 80}]}}  # fmt: skip
    models.apply(squatter)
    uid = models.get("service", "squat-workers")["metadata"]["uid"]
    models.apply(model_deployment("squat"))
    eventually(lambda: models.condition("squat", "Ready").get("reason") == "ChildConflict", "ChildConflict")
    assert "Service/squat-workers" in models.condition("squat", "Ready")["message"]
    service = models.get("service", "squat-workers")
    assert [port["port"] for port in service["spec"]["ports"]] == [80]
    assert not service["metadata"].get("ownerReferences")
    models.kubectl("delete", "service", "squat-workers")
    eventually(lambda: "Service/squat-workers" in models.children("squat"), "the Service created once free")
    assert models.children("squat")["Service/squat-workers"]["metadata"]["uid"] != uid


def test_deleting_a_modeldeployment_lets_the_garbage_collector_remove_its_children(models: Models) -> None:
    models.apply(model_deployment("doomed"))
    eventually(lambda: len(models.children("doomed")) == 2, "children created")
    eventually(lambda: bool(models.get("pods", "-l", "herd.dev/deployment=doomed")["items"]), "pods")
    assert not models.get("md", "doomed")["metadata"].get("finalizers"), (
        "no finalizer: deletion never waits on herd"
    )
    models.kubectl("delete", "md/doomed")
    for kind in ("deployments", "services", "replicasets", "pods"):
        eventually(lambda kind=kind: not models.get(kind, "-l", "herd.dev/deployment=doomed")["items"],
                   f"{kind} garbage-collected", timeout=GC_TIMEOUT)  # fmt: skip


def without_cel(node: Any) -> Any:
    """The CRD as it was before its CEL rules: every ``x-kubernetes-validations`` dropped."""
    if isinstance(node, dict):
        return {key: without_cel(value) for key, value in node.items() if key != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [without_cel(item) for item in node]
    return node


@pytest.fixture(scope="module")
def rule_less(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    """A control plane of its own whose CRD predates the CEL rules (an older herd's CRD kept by
    ``crds.install=false``): the server stores a spec the operator refuses."""
    with own_control_plane(tmp_path_factory.mktemp("rule-less")) as plane:
        plane.kubectl("apply", "-f", "-", stdin=json.dumps(without_cel(yaml.safe_load(CRD.read_text()))))
        plane.kubectl("wait", "--for=condition=Established", "crd/modeldeployments.herd.dev", "--timeout=60s")
        with embedded_operator(plane, namespace="default"):
            yield Models(plane, "default")


def test_invalid_spec_sets_invalid_spec_and_the_operator_keeps_going(rule_less: Models) -> None:
    models = rule_less
    models.apply(model_deployment("broken", serving={"mode": "disaggregated"}))
    eventually(lambda: models.condition("broken", "Ready").get("reason") == "InvalidSpec", "InvalidSpec")
    ready = models.condition("broken", "Ready")
    assert ready["status"] == "False"
    assert "spec.prefill" in ready["message"] and "spec.decode" in ready["message"]
    assert not models.children("broken")
    eventually(lambda: ("Warning", "InvalidSpec") in models.reasons("broken"), "a Warning Event")
    models.apply(model_deployment("fine"))
    eventually(lambda: len(models.children("fine")) == 2, "a valid one still reconciles")
    models.apply(
        model_deployment(
            "broken", serving={"mode": "disaggregated"}, prefill=pending_pool(1), decode=pending_pool(1)
        )
    )
    eventually(lambda: len(models.children("broken")) == 4, "the fixed spec reconciles")


async def next_membership(
    updates: AsyncIterator[Membership], check: Callable[[Membership], bool]
) -> Membership:
    async with asyncio.timeout(POD_TIMEOUT):
        async for membership in updates:
            if check(membership):
                return membership
    raise AssertionError("the discovery stream ended")


def worker_ids(membership: Membership, model: str) -> set[str]:
    return {endpoint.id for endpoint in membership.endpoints if endpoint.model == model}


async def test_ready_pods_roll_up_into_status_and_discovery(models: Models, tiny_llama: Path) -> None:
    """Two real workers (the node agent runs them; their readiness probes make them Ready) roll up
    into the status and into the orchestrator's discovery, read with the chart orchestrator
    ServiceAccount's token; a deleted pod leaves discovery at once and its replacement joins; a
    scale to zero empties it. (On the emulator the test set pods Ready, terminating and gone itself.)"""
    models.apply(tiny_model_deployment("ready", tiny_llama, replicas=2, routing={"strategy": "round_robin"}))
    eventually(
        lambda: models.condition("ready", "Ready").get("reason") == "PoolsNotReady", "Ready=False first"
    )
    login = models.plane.login_as("herd-orchestrator", "herd", default_namespace=NAMESPACE)
    updates = KubeSource(NAMESPACE, kubeconfig=str(login.kubeconfig)).watch()
    try:
        pods = models.plane.wait_ready_pods(NAMESPACE, "herd.dev/deployment=ready", 2, timeout=POD_TIMEOUT)
        eventually(lambda: models.condition("ready", "Ready").get("status") == "True", "Ready=True")
        status = models.get("md", "ready")["status"]
        assert status["pools"]["workers"] == {
            "replicas": 2,
            "readyReplicas": 2,
            "updatedReplicas": 2,
            "ready": "2/2",
        }
        assert status["replicas"] == 2
        assert models.condition("ready", "Progressing")["status"] == "False"

        membership = await next_membership(updates, lambda m: len(worker_ids(m, "ready")) == 2)
        ids = {f"{NAMESPACE}/{pod['metadata']['name']}": pod["status"]["podIP"] for pod in pods}
        assert worker_ids(membership, "ready") == set(ids)
        assert {e.url for e in membership.endpoints if e.model == "ready"} == {
            f"http://{ip}:8000" for ip in ids.values()
        }
        assert (
            next(m for m in membership.models if m.served_name == "ready").routing.strategy == "round_robin"
        )

        gone = f"{NAMESPACE}/{pods[0]['metadata']['name']}"
        models.kubectl("delete", "pod", pods[0]["metadata"]["name"], "--wait=false")
        membership = await next_membership(updates, lambda m: gone not in worker_ids(m, "ready"))
        assert worker_ids(membership, "ready") <= set(ids)
        replaced = await next_membership(updates, lambda m: len(worker_ids(m, "ready") - set(ids)) == 1)
        assert gone not in worker_ids(replaced, "ready")
        models.kubectl("scale", "md/ready", "--replicas=0")
        await next_membership(updates, lambda m: not worker_ids(m, "ready"))
        eventually(lambda: models.get("md", "ready")["status"]["pools"]["workers"]["ready"] == "0/0", "0/0")
    finally:
        await updates.aclose()


def test_rollouts_and_crash_loops_show_in_the_conditions(models: Models, tiny_llama: Path) -> None:
    """A rollout to a pod template whose worker exits at start (a KV budget that holds no block): the
    node agent restarts it with a back-off and reports CrashLoopBackOff, as a kubelet does, while the
    old pods keep serving. (On the emulator the test wrote the crashing container status itself.)"""
    models.apply(tiny_model_deployment("rolling", tiny_llama, replicas=2))
    models.plane.wait_ready_pods(NAMESPACE, "herd.dev/deployment=rolling", 2, timeout=POD_TIMEOUT)
    eventually(
        lambda: models.condition("rolling", "Progressing").get("reason") == "RolloutComplete", "rolled out"
    )
    broken = tiny_model_deployment("rolling", tiny_llama, replicas=2)
    broken["spec"]["engine"]["kvCache"]["memoryGiB"] = 1e-7
    models.apply(broken)
    eventually(
        lambda: models.condition("rolling", "Progressing").get("reason") == "RollingOut", "rolling out"
    )
    eventually(lambda: models.condition("rolling", "Degraded").get("reason") == "CrashLoop", "Degraded=True",
               timeout=POD_TIMEOUT)  # fmt: skip
    crashing = [
        pod["metadata"]["name"]
        for pod in models.get("pods", "-l", "herd.dev/deployment=rolling")["items"]
        if pod["status"].get("containerStatuses", [{}])[0].get("state", {}).get("waiting", {}).get("reason")
        == "CrashLoopBackOff"
    ]
    assert crashing and all(name in models.condition("rolling", "Degraded")["message"] for name in crashing)
    assert models.condition("rolling", "Ready")["status"] == "True", "old pods keep serving during a rollout"
    eventually(lambda: ("Warning", "CrashLoop") in models.reasons("rolling"), "a Warning Event")
    assert models.get("md", "rolling")["status"]["pools"]["workers"]["ready"] == "2/2"
