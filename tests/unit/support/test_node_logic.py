"""The node agent's pure parts, table-driven: addresses, environment, pod status, probes, Services."""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

import pytest
from support.node.addresses import (
    POD_SPACE,
    AddressPool,
    HostsEntry,
    bind_pod_ip,
    claim_block,
    hosts_file,
    service_loopback,
)
from support.node.containers import should_restart
from support.node.env import (
    ConfigError,
    container_argv,
    container_env,
    decoded_data,
    expand,
    field_value,
    image_repository,
    resource_value,
)
from support.node.probes import ProbeCounter
from support.node.services import desired_listeners, service_endpoints
from support.node.status import ContainerRecord, PodRecord, pod_phase, pod_status, terminated, waiting
from support.node.volumes import token_refresh_s

Object = dict[str, Any]
POD: Object = {
    "metadata": {"name": "web-1", "namespace": "apps", "uid": "u-1", "labels": {"app": "web", "tier": "a"}},
    "spec": {"nodeName": "herd-node", "serviceAccountName": "runner", "containers": [{"name": "c"}]},
    "status": {"podIP": "127.244.0.7", "hostIP": "127.0.0.1", "podIPs": [{"ip": "127.244.0.7"}]},
}


def test_addresses_start_at_one_and_come_back_once_released() -> None:
    pool = AddressPool(ipaddress.IPv4Network("127.244.3.0/24"))
    assert [pool.allocate() for _ in range(3)] == ["127.244.3.1", "127.244.3.2", "127.244.3.3"]
    pool.release("127.244.3.2")
    assert pool.allocate() == "127.244.3.2"
    assert pool.allocate() == "127.244.3.4"


def test_each_claim_holds_its_own_block_until_closed() -> None:
    first, first_claim = claim_block(POD_SPACE)
    second, second_claim = claim_block(POD_SPACE)
    try:
        assert first != second and first.prefixlen == second.prefixlen == 24
        with pytest.raises(RuntimeError, match="other node agents on this machine hold them"):
            claim_block(POD_SPACE, str(first))
    finally:
        first_claim.close()
        second_claim.close()
    again, claim = claim_block(POD_SPACE, str(first))
    claim.close()
    assert again == first


@pytest.mark.parametrize(
    ("cluster_ip", "expected"),
    [
        ("10.96.0.17", "127.96.2.17"),
        ("10.96.0.1", "127.96.2.1"),
        ("None", None),
        ("", None),
        (None, None),
        ("10.97.0.5", None),
    ],
    ids=["service", "kubernetes", "headless", "empty", "missing", "outside-the-cidr"],
)
def test_a_cluster_ip_maps_onto_loopback(cluster_ip: str | None, expected: str | None) -> None:
    assert service_loopback(cluster_ip, "10.96.0.0/24", "127.96.2.0/24") == expected


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (["--host", "0.0.0.0", "--port", "8000"], ["--host", "127.244.0.5", "--port", "8000"]),
        (["http://0.0.0.0:8080/healthz"], ["http://127.244.0.5:8080/healthz"]),
        (["--bind=127.0.0.1"], ["--bind=127.0.0.1"]),
    ],
    ids=["alone", "in-a-url", "another-address-kept"],
)
def test_the_any_address_becomes_the_pod_ip(words: list[str], expected: list[str]) -> None:
    assert bind_pod_ip(words, "127.244.0.5") == expected


def test_hosts_name_services_by_their_dns_names_and_the_short_name_in_the_own_namespace() -> None:
    entries = [HostsEntry("api", "apps", "127.96.0.9"), HostsEntry("db", "data", "127.96.0.3")]
    lines = hosts_file("127.244.0.7", "web-1", "apps", entries).splitlines()
    assert "127.244.0.7\tweb-1" in lines
    assert "127.96.0.9\tapi.apps.svc.cluster.local api.apps.svc api.apps api" in lines
    assert "127.96.0.3\tdb.data.svc.cluster.local db.data.svc db.data" in lines


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("$(A)-x", {"A": "1"}, "1-x"),
        ("$(MISSING)", {}, "$(MISSING)"),
        ("$$(A)", {"A": "1"}, "$(A)"),
        ("plain", {}, "plain"),
    ],
    ids=["known", "unknown-kept", "escaped", "plain"],
)
def test_references_expand_as_kubernetes_does(text: str, env: dict[str, str], expected: str) -> None:
    assert expand(text, env) == expected


def _env(entries: list[Object], env_from: list[Object] | None = None) -> dict[str, str]:
    sources = {("Secret", "s"): {"token": "t0k"}, ("ConfigMap", "cm"): {"MODE": "fast", "LEVEL": "2"}}
    container = {"name": "c", "env": entries, "envFrom": env_from or []}
    return container_env(POD, container, sources, {"HOSTNAME": "web-1"})


@pytest.mark.parametrize(
    ("entries", "env_from", "expected"),
    [
        ([{"name": "A", "value": "1"}, {"name": "B", "value": "$(A)2"}], None, {"A": "1", "B": "12"}),
        ([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}], None, {"T": "t0k"}),
        ([{"name": "M", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "MODE"}}}], None, {"M": "fast"}),
        ([{"name": "X", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}}}], None, {}),
        ([{"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}], None, {"N": "web-1"}),
        ([{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}], None, {"IP": "127.244.0.7"}),
        ([], [{"configMapRef": {"name": "cm"}, "prefix": "CFG_"}], {"CFG_MODE": "fast", "CFG_LEVEL": "2"}),
        ([], [{"secretRef": {"name": "gone", "optional": True}}], {}),
        ([{"name": "LEVEL", "value": "9"}], [{"configMapRef": {"name": "cm"}}], {"MODE": "fast", "LEVEL": "9"}),
    ],
    ids=["value-and-reference", "secret-key", "configmap-key", "optional-missing", "field-name",
         "field-pod-ip", "env-from-prefix", "env-from-optional", "env-wins-over-env-from"],
)  # fmt: skip
def test_the_environment_is_built_in_kubernetes_order(
    entries: list[Object], env_from: list[Object] | None, expected: dict[str, str]
) -> None:
    assert _env(entries, env_from) == {"HOSTNAME": "web-1", **expected}


@pytest.mark.parametrize(
    ("entries", "env_from", "message"),
    [
        ([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k"}}}], None, 'secret "gone" not found'),
        ([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}], None, "couldn't find key nope"),
        ([], [{"configMapRef": {"name": "absent"}}], 'configmap "absent" not found'),
    ],
    ids=["missing-secret", "missing-key", "missing-env-from"],
)  # fmt: skip
def test_a_missing_source_is_a_config_error(
    entries: list[Object], env_from: list[Object] | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _env(entries, env_from)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("metadata.namespace", "apps"),
        ("metadata.uid", "u-1"),
        ("metadata.labels['app']", "web"),
        ("metadata.labels", 'app="web"\ntier="a"'),
        ("spec.nodeName", "herd-node"),
        ("spec.serviceAccountName", "runner"),
        ("status.hostIP", "127.0.0.1"),
    ],
    ids=["namespace", "uid", "one-label", "all-labels", "node", "service-account", "host-ip"],
)
def test_downward_fields(path: str, expected: str) -> None:
    assert field_value(POD, path) == expected


@pytest.mark.parametrize(
    ("resources", "ref", "expected"),
    [
        ({"limits": {"cpu": "1500m"}}, {"resource": "limits.cpu"}, "2"),
        ({"limits": {"cpu": "1500m"}}, {"resource": "limits.cpu", "divisor": "1m"}, "1500"),
        ({"requests": {"memory": "64Mi"}}, {"resource": "requests.memory", "divisor": "1Mi"}, "64"),
        ({}, {"resource": "limits.memory", "divisor": "1Gi"}, "256"),
        ({}, {"resource": "requests.cpu"}, "0"),
    ],
    ids=["cpu-rounded-up", "millicores", "memory-mi", "no-limit-is-allocatable", "no-request-is-zero"],
)
def test_resource_fields(resources: Object, ref: Object, expected: str) -> None:
    assert resource_value(POD, {"name": "c", "resources": resources}, ref) == expected


@pytest.mark.parametrize(
    ("image", "expected"),
    [("herd/worker:0.1.0", "herd/worker"), ("ghcr.io:443/herd/worker@sha256:ab", "ghcr.io:443/herd/worker"),
     ("busybox", "busybox"), ("localhost:5000/tool:v1", "localhost:5000/tool")],
    ids=["tag", "registry-port-and-digest", "bare", "registry-port-and-tag"],
)  # fmt: skip
def test_image_repository(image: str, expected: str) -> None:
    assert image_repository(image) == expected


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        ({"name": "c", "command": ["app", "$(MODE)"], "args": ["--x"]}, ["app", "fast", "--x"]),
        ({"name": "c", "image": "herd/worker:1", "args": ["worker", "$(MODE)"]}, ["herd", "worker", "fast"]),
    ],
    ids=["command-and-args", "entrypoint-of-a-known-image"],
)
def test_the_command_line(container: Object, expected: list[str]) -> None:
    assert container_argv(container, {"MODE": "fast"}, {"herd/worker": ["herd"]}) == expected


def test_args_alone_of_an_unknown_image_are_a_config_error_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="--entrypoint=curlimages/curl=<command>"):
        container_argv({"name": "c", "image": "curlimages/curl:8", "args": ["-s"]}, {}, {})


def test_secret_data_is_decoded() -> None:
    body = {"data": {"token": base64.b64encode(b"abc").decode()}, "stringData": {"plain": "p"}}
    assert decoded_data("Secret", body) == {"token": "abc", "plain": "p"}


def _record(state: Object, *, last: Object | None = None, ready: bool = False) -> ContainerRecord:
    return ContainerRecord("c", "img", state=state, last_state=last or {}, ready=ready)


RUNNING: Object = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
OK, FAILED = terminated(0, "t"), terminated(3, "t")


@pytest.mark.parametrize(
    ("policy", "init", "containers", "phase"),
    [
        ("Always", [], [_record(waiting("ContainerCreating"))], "Pending"),
        ("Always", [_record(RUNNING)], [_record(waiting("PodInitializing"))], "Pending"),
        ("Never", [_record(FAILED)], [_record(waiting("PodInitializing"))], "Failed"),
        ("Always", [_record(OK)], [_record(RUNNING)], "Running"),
        ("Always", [], [_record(waiting("CrashLoopBackOff"), last=FAILED)], "Running"),
        ("Never", [], [_record(OK)], "Succeeded"),
        ("Never", [], [_record(FAILED)], "Failed"),
        ("OnFailure", [], [_record(OK)], "Succeeded"),
        ("OnFailure", [], [_record(FAILED)], "Running"),
        ("Always", [], [_record(OK)], "Running"),
        ("Never", [], [_record(OK), _record(RUNNING)], "Running"),
        ("Always", [], [_record(waiting("CreateContainerConfigError"))], "Pending"),
    ],
    ids=["creating", "initializing", "init-failed-never", "running", "back-off", "never-ok", "never-failed",
         "on-failure-ok", "on-failure-failed-restarts", "always-restarts", "one-of-two-done", "config-error"],
)  # fmt: skip
def test_the_phase(
    policy: str, init: list[ContainerRecord], containers: list[ContainerRecord], phase: str
) -> None:
    assert pod_phase(PodRecord(policy, "127.244.0.1", "t", init, containers)) == phase


def test_a_pod_level_failure_fails_the_pod_with_its_reason() -> None:
    record = PodRecord("Always", "127.244.0.1", "t", [], [_record(waiting("ContainerCreating"))])
    record.failure = ("FailedMount", "volume 'data' is a persistentVolumeClaim")
    status = pod_status(record, [])
    assert (status["phase"], status["reason"]) == ("Failed", "FailedMount")


def test_conditions_move_only_when_their_status_changes() -> None:
    container = _record(RUNNING)
    record = PodRecord("Always", "127.244.0.1", "t", [], [container])
    before = [{"type": "Ready", "status": "False", "lastTransitionTime": "then"},
              {"type": "Initialized", "status": "True", "lastTransitionTime": "then"}]  # fmt: skip
    conditions = {c["type"]: c for c in pod_status(record, before)["conditions"]}
    assert conditions["Initialized"]["lastTransitionTime"] == "then"
    assert conditions["Ready"]["lastTransitionTime"] == "then"
    assert conditions["Ready"]["reason"] == "ContainersNotReady"
    container.ready = True
    conditions = {c["type"]: c for c in pod_status(record, before)["conditions"]}
    assert conditions["Ready"]["status"] == "True"
    assert conditions["Ready"]["lastTransitionTime"] != "then"
    assert conditions["Ready"]["reason"] is None  # a stale reason removed by the merge patch


def test_container_status_names_the_pid() -> None:
    status = ContainerRecord("c", "img", state=RUNNING, pid=42, ready=True, started=True).status()
    assert status["containerID"] == "herd://42"
    assert (status["ready"], status["started"], status["restartCount"]) == (True, True, 0)


@pytest.mark.parametrize(
    ("thresholds", "results", "verdicts"),
    [
        ((1, 3), [False, False, False], [None, None, False]),
        ((1, 3), [False, False, True, False], [None, None, True, None]),
        ((2, 1), [True, True], [None, True]),
        ((2, 1), [True, False, True, True], [None, False, None, True]),
    ],
    ids=["three-failures", "a-success-resets", "two-successes", "failure-breaks-a-run"],
)
def test_probe_thresholds(
    thresholds: tuple[int, int], results: list[bool], verdicts: list[bool | None]
) -> None:
    counter = ProbeCounter(*thresholds)
    assert [counter.observe(result) for result in results] == verdicts


@pytest.mark.parametrize(
    ("policy", "exit_code", "expected"),
    [("Always", 0, True), ("Always", 1, True), ("OnFailure", 0, False), ("OnFailure", 2, True),
     ("Never", 1, False)],
    ids=["always-ok", "always-failed", "on-failure-ok", "on-failure-failed", "never"],
)  # fmt: skip
def test_restart_policy(policy: str, exit_code: int, expected: bool) -> None:
    assert should_restart(policy, exit_code) is expected


def _service(name: str, cluster_ip: str, ports: list[Object]) -> Object:
    return {
        "metadata": {"name": name, "namespace": "apps"},
        "spec": {"clusterIP": cluster_ip, "ports": ports},
    }


def test_listeners_for_every_tcp_port_of_services_with_a_cluster_ip() -> None:
    services = [
        _service("web", "10.96.0.20", [{"name": "http", "port": 80}, {"name": "dns", "port": 53, "protocol": "UDP"}]),
        _service("headless", "None", [{"name": "http", "port": 80}]),
    ]  # fmt: skip
    listeners = desired_listeners(services, "10.96.0.0/24", "127.96.0.0/24")
    assert {(item.address, item.port, item.name) for item in listeners} == {("127.96.0.20", 80, "web")}


def _pod(name: str, ip: str, *, ready: bool = True, app: str = "web", terminating: bool = False) -> Object:
    metadata: Object = {"name": name, "labels": {"app": app}}
    if terminating:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    ports = [{"name": "http", "containerPort": 8080}]
    status = {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": metadata, "spec": {"containers": [{"name": "c", "ports": ports}]}, "status": status}


PODS = [_pod("b", "127.244.0.2"), _pod("a", "127.244.0.1"), _pod("unready", "127.244.0.3", ready=False),
        _pod("other", "127.244.0.4", app="db"), _pod("leaving", "127.244.0.5", terminating=True)]  # fmt: skip


@pytest.mark.parametrize(
    ("port", "expected"),
    [
        ({"port": 80, "targetPort": "http"}, [("127.244.0.1", 8080), ("127.244.0.2", 8080)]),
        ({"port": 80, "targetPort": 9000}, [("127.244.0.1", 9000), ("127.244.0.2", 9000)]),
        ({"port": 81}, [("127.244.0.1", 81), ("127.244.0.2", 81)]),
        ({"port": 80, "targetPort": "nope"}, []),
    ],
    ids=["named-target", "numbered-target", "target-defaults-to-port", "unknown-name"],
)
def test_endpoints_are_the_ready_selected_pods_at_the_target_port(
    port: Object, expected: list[tuple[str, int]]
) -> None:
    service = _service("web", "10.96.0.20", [port])
    service["spec"]["selector"] = {"app": "web"}
    assert service_endpoints(service, port, PODS) == expected


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ([{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}], 0.8 * 3607),
        ([{"serviceAccountToken": {"path": "a", "expirationSeconds": 600}},
          {"serviceAccountToken": {"path": "b", "expirationSeconds": 7200}}], 480.0),
        ([{"configMap": {"name": "kube-root-ca.crt"}}], None),
    ],
    ids=["kube-api-access", "the-shortest-lifetime", "no-token"],
)  # fmt: skip
def test_tokens_are_renewed_at_80_percent_of_their_lifetime(
    sources: list[Object], expected: float | None
) -> None:
    pod = {
        "spec": {"volumes": [{"name": "v", "projected": {"sources": sources}}, {"name": "e", "emptyDir": {}}]}
    }
    assert token_refresh_s(pod) == expected
