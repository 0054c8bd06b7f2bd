"""The node agent on the real control plane: pods bound to herd-node run as local processes on
their own loopback addresses, with the probes, restarts, volumes, environment, ServiceAccount
tokens, graceful deletion and Services a kubelet and kube-proxy would give them.

Most tests share one Deployment (``web``: a python HTTP server that answers with its pod's name and
environment, and records its preStop hook and SIGTERM in an emptyDir file) to keep the file quick.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster import HERD_ENTRYPOINTS, NODE, ControlPlane, container_pid, install_herd_chart, is_alive
from support.operator_harness import embedded_operator
from support.procs import wait_until

pytestmark = pytest.mark.e2e

NAMESPACE = "node-e2e"
TIMEOUT = 60.0
Object = dict[str, Any]
SERVER = textwrap.dedent("""
    import http.server, json, os, pathlib, signal, sys
    events = pathlib.Path("/data/events")
    def on_term(*_):
        with events.open("a") as sink:
            sink.write("SIGTERM\\n")
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            keys = ("POD_NAME", "POD_IP", "GREETING", "TOKEN", "CFG_LEVEL", "HOSTNAME")
            body = json.dumps({key: os.environ.get(key) for key in keys}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Handler).serve_forever()
""")


def kubectl(cluster: ControlPlane, *args: str, stdin: str | None = None) -> str:
    return cluster.kubectl("-n", NAMESPACE, *args, stdin=stdin).stdout


def apply(cluster: ControlPlane, *manifests: Object) -> None:
    kubectl(cluster, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}))  # fmt: skip


def get(cluster: ControlPlane, kind: str, name: str) -> Object:
    return cluster.get_json(kind, name, NAMESPACE)


def eventually(check: Any, what: str, timeout: float = TIMEOUT) -> None:
    wait_until(check, timeout=timeout, interval=0.2, what=what)


def container_state(cluster: ControlPlane, name: str) -> Object:
    statuses = (get(cluster, "pod", name).get("status") or {}).get("containerStatuses") or [{}]
    return dict(statuses[0])


def web_deployment(replicas: int) -> Object:
    container = {
        "name": "web",
        "image": "python:3",
        "command": ["python", "-c", SERVER],
        "args": ["0.0.0.0", "8080"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "web-config", "key": "greeting"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "web-secret", "key": "token"}}},
        ],
        "envFrom": [{"configMapRef": {"name": "web-config"}, "prefix": "CFG_"}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo preStop >> /data/events"]}}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}],
                         "terminationGracePeriodSeconds": 10},
            },
        },
    }  # fmt: skip


def config_objects() -> list[Object]:
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "web-config"},
         "data": {"greeting": "hello", "LEVEL": "2"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "web-secret"}, "stringData": {"token": "s3cret"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"selector": {"app": "web"}, "ports": [{"name": "web", "port": 80, "targetPort": "http"}]}},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def web(cluster: ControlPlane) -> Iterator[list[Object]]:
    """The namespace with ``web`` at 2 ready replicas behind Service ``web``; yields its pods."""
    cluster.kubectl("create", "namespace", NAMESPACE)
    apply(cluster, *config_objects(), web_deployment(2))
    yield cluster.wait_ready_pods(NAMESPACE, "app=web", 2)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def bare_pod(name: str, argv: list[str], **spec: Any) -> Object:
    """A pod running ``argv`` once; ``container``: more fields of its container, the rest its spec."""
    command = {"command": argv} if argv else {}
    container = {"name": "main", "image": "python:3", **command, **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "containers": [container], **spec}}  # fmt: skip


def test_the_node_is_ready_with_the_apiservers_version(cluster: ControlPlane) -> None:
    node = cluster.get_json("node", NODE)
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert node["status"]["nodeInfo"]["kubeletVersion"] == version
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == NODE
    assert {"type": "InternalIP", "address": "127.0.0.1"} in node["status"]["addresses"]
    assert not node["spec"].get("taints")
    lease = cluster.get_json("lease", NODE, "kube-node-lease")
    assert lease["spec"]["holderIdentity"] == NODE


def test_deployment_pods_run_ready_on_their_own_loopback_addresses(
    cluster: ControlPlane, web: list[Object]
) -> None:
    addresses = {pod["status"]["podIP"] for pod in web}
    block = ipaddress.IPv4Network(
        cluster.get_json("node", NODE)["metadata"]["annotations"]["herd.dev/pod-cidr"]
    )
    assert block.subnet_of(ipaddress.IPv4Network("127.244.0.0/16")), (
        "the node's own block of loopback addresses"
    )
    assert len(addresses) == 2 and all(ipaddress.IPv4Address(address) in block for address in addresses)
    for pod in web:
        assert pod["spec"]["nodeName"] == NODE and pod["status"]["hostIP"] == "127.0.0.1"
        assert b"http.server" in Path(f"/proc/{container_pid(pod)}/cmdline").read_bytes()
        answer = httpx.get(f"http://{pod['status']['podIP']}:8080/", timeout=5).json()
        assert answer == {"POD_NAME": pod["metadata"]["name"], "POD_IP": pod["status"]["podIP"],
                          "GREETING": "hello", "TOKEN": "s3cret", "CFG_LEVEL": "2",
                          "HOSTNAME": pod["metadata"]["name"]}  # fmt: skip
    eventually(
        lambda: get(cluster, "deployment", "web")["status"].get("readyReplicas") == 2, "readyReplicas 2"
    )


def test_the_service_answers_at_its_address_and_by_name_inside_a_pod(
    cluster: ControlPlane, web: list[Object]
) -> None:
    address = cluster.service_address("web", NAMESPACE, 80)
    assert address.startswith("127.96.") and address.rsplit(":", 1)[1] == "80"
    names = {pod["metadata"]["name"] for pod in web}

    def both_answer() -> bool:
        return {httpx.get(f"http://{address}/", timeout=5).json()["POD_NAME"] for _ in range(4)} == names

    eventually(both_answer, "round robin over both pods")
    hosts = cluster.pod_dir(web[0]) / "etc-hosts"
    inode = hosts.stat().st_ino
    apply(cluster, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "late"},
                    "spec": {"selector": {"app": "web"}, "ports": [{"port": 81, "targetPort": 8080}]}})  # fmt: skip
    eventually(lambda: " late.node-e2e.svc " in hosts.read_text(), "a new Service in a running pod's hosts")
    assert hosts.stat().st_ino == inode, "rewritten in place: the bind mount holds the inode"
    assert any(line.endswith(" web.node-e2e web") for line in hosts.read_text().splitlines())
    fetch = "import urllib.request as u; print(u.urlopen('http://web.node-e2e.svc.cluster.local/', timeout=5).read().decode())"  # fmt: skip
    apply(cluster, bare_pod("client", ["python", "-c", fetch]))
    eventually(
        lambda: get(cluster, "pod", "client")["status"].get("phase") == "Succeeded", "the client pod done"
    )
    log = (cluster.pod_dir(get(cluster, "pod", "client")) / "main.log").read_text()
    assert json.loads(log)["POD_NAME"] in names


def test_scaling_starts_and_stops_processes_with_prestop_and_sigterm(
    cluster: ControlPlane, web: list[Object]
) -> None:
    kubectl(cluster, "scale", "deployment/web", "--replicas=3")
    three = cluster.wait_ready_pods(NAMESPACE, "app=web", 3)
    assert len({pod["status"]["podIP"] for pod in three}) == 3
    kubectl(cluster, "scale", "deployment/web", "--replicas=1")
    one = cluster.wait_ready_pods(NAMESPACE, "app=web", 1)
    gone = [pod for pod in three if pod["metadata"]["uid"] != one[0]["metadata"]["uid"]]
    for pod in gone:
        assert not is_alive(container_pid(pod)), f"{pod['metadata']['name']}'s process outlived its pod"
        events = (cluster.pod_dir(pod) / "volumes" / "data" / "events").read_text().split()
        assert events == ["preStop", "SIGTERM"]
    kubectl(cluster, "scale", "deployment/web", "--replicas=2")
    web[:] = cluster.wait_ready_pods(NAMESPACE, "app=web", 2)


@pytest.mark.parametrize(("exit_code", "phase"), [(0, "Succeeded"), (3, "Failed")], ids=["exit-0", "exit-3"])
def test_a_never_restarting_pod_ends_with_its_exit_code(
    cluster: ControlPlane, web: list[Object], exit_code: int, phase: str
) -> None:
    name = f"once-{exit_code}"
    apply(cluster, bare_pod(name, ["python", "-c", f"raise SystemExit({exit_code})"]))
    eventually(lambda: get(cluster, "pod", name)["status"].get("phase") == phase, f"{name} {phase}")
    state = container_state(cluster, name)["state"]["terminated"]
    assert state["exitCode"] == exit_code
    assert state["reason"] == ("Completed" if exit_code == 0 else "Error")


def test_a_failing_liveness_probe_restarts_the_container(cluster: ControlPlane, web: list[Object]) -> None:
    probe = {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}
    apply(cluster, bare_pod("unhealthy", ["sleep", "600"], restartPolicy="Always",
                            terminationGracePeriodSeconds=2, container={"livenessProbe": probe}))  # fmt: skip
    eventually(lambda: container_state(cluster, "unhealthy").get("restartCount", 0) >= 2, "two restarts")
    listed = json.loads(kubectl(cluster, "get", "events", "--field-selector", "involvedObject.name=unhealthy", "-o", "json"))  # fmt: skip
    reasons = {event["reason"] for event in listed["items"]}
    assert {"Started", "Unhealthy", "Killing"} <= reasons
    assert all(
        event["source"]["component"] == "kubelet" for event in listed["items"] if event["reason"] == "Killing"
    )


def test_a_missing_secret_holds_the_container_until_it_exists(
    cluster: ControlPlane, web: list[Object]
) -> None:
    env = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "later", "key": "key"}}}]
    apply(cluster, bare_pod("waits", ["sh", "-c", 'test "$KEY" = ok'], container={"env": env}))

    def reason() -> str:
        return str(container_state(cluster, "waits").get("state", {}).get("waiting", {}).get("reason"))

    eventually(lambda: reason() == "CreateContainerConfigError", "CreateContainerConfigError")
    apply(
        cluster,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "later"}, "stringData": {"key": "ok"}},
    )
    eventually(
        lambda: get(cluster, "pod", "waits")["status"].get("phase") == "Succeeded",
        "the pod run once it exists",
    )


def test_a_persistent_volume_claim_fails_the_pod_naming_the_limit(
    cluster: ControlPlane, web: list[Object]
) -> None:
    volume = {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}
    # Bound by name: the scheduler holds back a pod whose claim does not exist.
    apply(cluster, bare_pod("claims", ["true"], volumes=[volume], nodeName=NODE))
    eventually(lambda: get(cluster, "pod", "claims")["status"].get("phase") == "Failed", "the pod Failed")
    assert "no storage" in get(cluster, "pod", "claims")["status"]["message"]
    listed = json.loads(kubectl(cluster, "get", "events", "--field-selector", "involvedObject.name=claims", "-o", "json"))  # fmt: skip
    assert any(
        e["reason"] == "FailedMount" and "persistentVolumeClaim" in e["message"] for e in listed["items"]
    )


def test_init_containers_run_in_order_with_the_pods_volumes(cluster: ControlPlane, web: list[Object]) -> None:
    """Two init containers in order (the second sees the first's file in the emptyDir), then the
    container, which reads it and finds the configMap volume's item read-only."""
    mounts = [
        {"name": "work", "mountPath": "/scratch"},
        {"name": "config", "mountPath": "/config", "readOnly": True},
    ]
    volumes = [
        {"name": "work", "emptyDir": {}},
        {"name": "config", "configMap": {"name": "web-config", "items": [{"key": "greeting", "path": "hi"}]}},
    ]
    init = [
        {
            "name": "first",
            "image": "busybox",
            "command": ["sh", "-c", "cp /config/hi /scratch/msg"],
            "volumeMounts": mounts,
        },
        {
            "name": "second",
            "image": "busybox",
            "command": ["sh", "-c", "echo -n ' world' >> /scratch/msg"],
            "volumeMounts": mounts,
        },
    ]
    check = 'test "$(cat /scratch/msg)" = "hello world" && ! touch /config/written 2>/dev/null'
    apply(cluster, bare_pod("init", ["sh", "-c", check], initContainers=init, volumes=volumes,
                            container={"volumeMounts": mounts}))  # fmt: skip
    eventually(lambda: get(cluster, "pod", "init")["status"].get("phase") == "Succeeded", "the pod Succeeded")
    statuses = get(cluster, "pod", "init")["status"]["initContainerStatuses"]
    assert [(s["name"], s["state"]["terminated"]["reason"]) for s in statuses] == [("first", "Completed"), ("second", "Completed")]  # fmt: skip


def test_the_service_account_token_logs_in_with_its_own_rbac(
    cluster: ControlPlane, web: list[Object]
) -> None:
    script = textwrap.dedent("""
        import sys
        from kubernetes import client, config
        config.load_incluster_config()
        try:
            client.CoreV1Api().list_namespaced_pod("node-e2e")
        except client.ApiException as error:
            sys.exit(3 if error.status == 403 else 1)
    """)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "reader"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
               "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": NAMESPACE}]}  # fmt: skip
    accounts = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
        for name in ("reader", "nobody")
    ]
    apply(cluster, role, binding, *accounts)
    apply(cluster, *(bare_pod(f"as-{name}", ["python", "-c", script], serviceAccountName=name) for name in ("reader", "nobody")))  # fmt: skip
    eventually(lambda: get(cluster, "pod", "as-reader")["status"].get("phase") == "Succeeded", "allowed")
    eventually(lambda: get(cluster, "pod", "as-nobody")["status"].get("phase") == "Failed", "refused")
    assert container_state(cluster, "as-nobody")["state"]["terminated"]["exitCode"] == 3


def test_args_alone_run_on_the_entrypoint_the_agent_was_given(
    cluster: ControlPlane, web: list[Object]
) -> None:
    """herd's images give only args in the chart: a node told their ENTRYPOINT (HERD_ENTRYPOINTS) runs
    them; for an image it was not told of, it says what to do."""
    node = "herd-node-images"
    worker = {"image": "herd/worker:0.1.0", "args": ["worker", "--help"]}
    with cluster.node_agent(node, "--taint=herd.dev/test=images:NoSchedule", *HERD_ENTRYPOINTS):
        apply(cluster, bare_pod("entry", [], nodeName=node, container=worker))
        apply(
            cluster, bare_pod("no-entry", [], container={"image": "curlimages/curl:8.11.1", "args": ["-s"]})
        )
        eventually(
            lambda: get(cluster, "pod", "entry")["status"].get("phase") == "Succeeded", "herd worker --help"
        )
        assert "--engine-json" in (cluster.pod_dir(get(cluster, "pod", "entry")) / "main.log").read_text()

    def waiting() -> Object:
        return dict(container_state(cluster, "no-entry").get("state", {}).get("waiting") or {})

    eventually(lambda: waiting().get("reason") == "CreateContainerConfigError", "CreateContainerConfigError")
    assert "--entrypoint=curlimages/curl=<command>" in waiting()["message"]
    kubectl(cluster, "delete", "pod", "entry", "--grace-period=0", "--force")
    cluster.kubectl("delete", "node", node)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_an_agent_stopped_or_killed_leaves_none_of_its_containers(
    cluster: ControlPlane, web: list[Object], how: str
) -> None:
    """SIGTERM: the agent stops each container by its pid; SIGKILL: the kernel kills them with it
    (PR_SET_PDEATHSIG). Either way no container outlives its agent."""
    node, pod = f"herd-node-{how.lower()}", f"pinned-{how.lower()}"
    with cluster.node_agent(node, f"--taint=herd.dev/test={how}:NoSchedule") as agent:
        apply(cluster, bare_pod(pod, ["sleep", "600"], nodeName=node))
        eventually(lambda: container_state(cluster, pod).get("started") is True, "the pinned pod running")
        pid = container_pid(get(cluster, "pod", pod))
        assert is_alive(pid)
        blocks = [cluster.get_json("node", name)["metadata"]["annotations"] for name in (NODE, node)]
        assert blocks[0]["herd.dev/pod-cidr"] != blocks[1]["herd.dev/pod-cidr"], (
            "each node its own pod addresses"
        )
        assert blocks[0]["herd.dev/service-loopback"] == blocks[1]["herd.dev/service-loopback"], (
            "the cluster's"
        )
        os.kill(agent.pid, getattr(signal, how))
        assert agent.wait(timeout=TIMEOUT) == (0 if how == "SIGTERM" else -signal.SIGKILL)
        eventually(lambda: not is_alive(pid), "the container gone with its agent", timeout=10)
    kubectl(cluster, "delete", "pod", pod, "--grace-period=0", "--force")
    cluster.kubectl("delete", "node", node)


WORKERS = "node-workers"


@pytest.fixture(scope="module")
def workers(cluster: ControlPlane, tiny_llama: Path) -> Iterator[list[Object]]:
    """A ModelDeployment of the tiny model (a ``file://`` source: a hostPath) reconciled by the operator
    (embedded, as the admin): its two ``herd worker`` pods, once Ready."""
    install_herd_chart(cluster)  # the CRD, owned by Helm as every test here installs it
    cluster.kubectl("create", "namespace", WORKERS)
    token = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "herd-internal-token"}, "stringData": {"token": "t"}}  # fmt: skip
    engine = {"dtype": "float32", "device": "cpu", "maxModelLen": 256, "kvCache": {"blockSize": 16, "memoryGiB": 0.05}}  # fmt: skip
    md = {"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "tiny"},
          "spec": {"model": {"source": f"file://{tiny_llama}", "servedName": "tiny"}, "engine": engine,
                   "workers": {"replicas": 2}}}  # fmt: skip
    with embedded_operator(cluster, namespace=WORKERS):
        cluster.kubectl("-n", WORKERS, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [token, md]}))  # fmt: skip
        yield cluster.wait_ready_pods(WORKERS, "herd.dev/deployment=tiny", 2, timeout=180)
        cluster.kubectl("delete", "namespace", WORKERS, "--wait=false")


def test_herd_workers_of_a_model_deployment_serve_at_their_pod_ips(workers: list[Object]) -> None:
    addresses = [pod["status"]["podIP"] for pod in workers]
    assert len(set(addresses)) == 2 and all(address.startswith("127.244.") for address in addresses)
    for pod in workers:
        assert pod["spec"]["containers"][0]["command"][:2] == ["herd", "worker"]
        models = httpx.get(f"http://{pod['status']['podIP']}:8000/v1/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == ["tiny"]
