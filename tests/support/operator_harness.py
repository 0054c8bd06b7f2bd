"""Running herd's operator against the real control plane (tests/support/cluster.py) in tests and
benchmarks, and reading what it made through kubectl."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

from herd.api.protocol import TOKEN_ENV
from herd.operator.runner import run_operator
from herd.operator.settings import OperatorConfig, PlanSettings
from support.cluster import ControlPlane, control_plane, find_binaries, install_herd_chart
from support.procs import free_port, running, wait_until

__all__ = [
    "HasKubeconfig",
    "Models",
    "RefusedRequests",
    "embedded_operator",
    "is_refusal",
    "kube_orchestrator",
    "logged_refusals",
    "model_deployment",
    "model_namespace",
    "operated_namespace",
    "own_control_plane",
    "pending_pool",
    "tiny_model_deployment",
]

TIMEOUT_S = 60.0  # generous for a loaded machine; nothing waits for it when things are quick
TOKEN_SECRET = PlanSettings().token_secret
NO_NODE = {"herd.dev/test-node": "none"}
"""A nodeSelector no node matches."""


class HasKubeconfig(Protocol):
    """Where the operator logs in: a control plane's admin, or a ServiceAccount's :class:`Login`."""

    @property
    def kubeconfig(self) -> Path: ...


@contextlib.contextmanager
def embedded_operator(
    kube: HasKubeconfig, namespace: str | None = "default", config: OperatorConfig | None = None
) -> Iterator[None]:
    """kopf in a thread with its own event loop, serving ``namespace`` (None: every namespace, as the
    chart's default ``watch.allNamespaces`` runs it); stopped through its stop flag.

    ``config`` (its kubeconfig is replaced by ``kube``'s) defaults to a 1 s retry delay.
    """
    stop, ready = threading.Event(), threading.Event()
    base = config or OperatorConfig(retry_delay=1.0)
    config = base.model_copy(update={"kubeconfig": str(kube.kubeconfig)})
    namespaces = [] if namespace is None else [namespace]
    main = run_operator(config, namespaces=namespaces, standalone=True, stop_flag=stop, ready_flag=ready)
    thread = threading.Thread(target=asyncio.run, args=(main,), name="operator", daemon=True)
    thread.start()
    try:
        assert ready.wait(TIMEOUT_S), "the operator did not become ready"
        yield
    finally:
        stop.set()
        thread.join(TIMEOUT_S)


@contextlib.contextmanager
def own_control_plane(workdir: Path) -> Iterator[ControlPlane]:
    """A control plane of a test's own, for what the session's shared one must not see (no CRD, an
    older CRD, a restarted apiserver); skips when the binaries are not built."""
    binaries = find_binaries()
    if binaries is None:
        pytest.skip("the control plane binaries are not built (make cluster-bin)")
    with control_plane(workdir, binaries) as plane:
        yield plane


def pending_pool(replicas: int) -> dict[str, Any]:
    """A pool whose pods stay Pending (no node matches it): for tests of what the operator writes."""
    return {"replicas": replicas, "nodeSelector": NO_NODE}


def tiny_model_deployment(name: str, model: Path, replicas: int = 1, **spec: Any) -> dict[str, Any]:
    """A ModelDeployment of the tiny checkpoint at ``model`` (a node path: the node agent's pods run
    on this machine) whose workers the node agent runs: CPU, float32, a small KV pool, one thread."""
    engine = {"device": "cpu", "dtype": "float32", "maxModelLen": 512, "kvCache": {"memoryGiB": 0.05}}
    workers = {"replicas": replicas, "env": {"OMP_NUM_THREADS": "1"}}
    return model_deployment(name, model={"source": f"file://{model}", "servedName": name}, engine=engine,
                            workers=workers, **spec)  # fmt: skip


def model_deployment(name: str, **spec: Any) -> dict[str, Any]:
    """A ModelDeployment served as ``name`` with two pending workers; ``spec`` adds or replaces fields."""
    body = {"model": {"source": "pvc://weights/chat", "servedName": name}, "workers": pending_pool(2), **spec}
    return {"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": name}, "spec": body}  # fmt: skip


@dataclass(frozen=True)
class Models:
    """One namespace's ModelDeployments and what the operator made of them, read as the admin."""

    plane: ControlPlane
    namespace: str

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        """kubectl in this namespace; asserts success and returns stdout."""
        return self.plane.kubectl("-n", self.namespace, *args, stdin=stdin).stdout

    def apply(self, manifest: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))

    def get(self, *args: str) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json"))
        return body

    def children(self, md: str) -> dict[str, dict[str, Any]]:
        """The Deployments and Services labelled as ``md``'s, by ``Kind/name``."""
        found = self.get("deployments,services", "-l", f"herd.dev/deployment={md}")["items"]
        return {f"{obj['kind']}/{obj['metadata']['name']}": obj for obj in found}

    def condition(self, md: str, kind: str) -> dict[str, Any]:
        conditions = self.get("md", md).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == kind), {})

    def is_observed(self, md: str) -> bool:
        """The operator has written the status of the ModelDeployment's current generation."""
        body = self.get("md", md)
        return bool(body.get("status", {}).get("observedGeneration") == body["metadata"]["generation"])

    def events(self, md: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("events", "--field-selector", f"involvedObject.name={md}")[
            "items"
        ]
        return items

    def reasons(self, md: str) -> set[tuple[str, str]]:
        """The (type, reason) of every Event about ``md``."""
        return {(event["type"], event["reason"]) for event in self.events(md)}


@contextlib.contextmanager
def model_namespace(plane: ControlPlane, namespace: str, token: str | None = None) -> Iterator[Models]:
    """A namespace of a test's own, with the chart installed (its CRD and ServiceAccounts) and, given
    ``token``, the Secret the workers' internal token comes from; deleted afterwards."""
    install_herd_chart(plane)
    plane.kubectl("create", "namespace", namespace)
    models = Models(plane, namespace)
    try:
        if token is not None:
            models.kubectl("create", "secret", "generic", TOKEN_SECRET, f"--from-literal=token={token}")
        yield models
    finally:
        plane.kubectl("delete", "namespace", namespace, "--wait=false")


@contextlib.contextmanager
def operated_namespace(plane: ControlPlane, namespace: str, token: str | None = None) -> Iterator[Models]:
    """:func:`model_namespace` with the operator embedded, logged in with a token of the chart's
    operator ServiceAccount and serving every namespace, as the chart runs it."""
    with model_namespace(plane, namespace, token) as models:
        login = plane.login_as("herd-operator", "herd", default_namespace=namespace)
        with embedded_operator(login, namespace=None):
            yield models


@contextlib.contextmanager
def kube_orchestrator(models: Models, token: str, log: Path, *args: str) -> Iterator[str]:
    """``herd orchestrator --kubernetes`` as a local process serving ``models``' namespace, logged in
    with a token of the chart's orchestrator ServiceAccount, in the log's folder (a relative
    ``file://`` source, a path inside the worker image, is not found there, as in an orchestrator pod);
    yields its URL once it answers."""
    login = models.plane.login_as("herd-orchestrator", "herd", default_namespace=models.namespace)
    port = free_port()
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--kubernetes", "--namespace", models.namespace,
            "--port", str(port), *args]  # fmt: skip
    env = {"KUBECONFIG": str(login.kubeconfig), TOKEN_ENV: token}
    with running(argv, log=log, env=env, cwd=log.parent) as process:
        url = f"http://127.0.0.1:{port}"

        def is_up() -> bool:
            assert process.poll() is None, f"the orchestrator exited with {process.returncode}: see {log}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/health", timeout=2).status_code == httpx.codes.OK
            return False

        wait_until(is_up, timeout=120, interval=0.2, what="herd orchestrator --kubernetes answering")
        yield url


def is_refusal(message: str) -> bool:
    """Whether a logged message tells of a request RBAC refused (403, Forbidden).

    A write into a namespace being deleted is a 403 too ("... because it is being terminated", as an
    operator serving every namespace meets in another test's namespace): no RBAC rule is missing
    there, so it does not count."""
    is_refused = "403" in message or "forbidden" in message.lower()
    return is_refused and "because it is being terminated" not in message


class RefusedRequests(logging.Handler):
    """Every warning or error logged about a refused request (:func:`is_refusal`), as ``logger: message``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if is_refusal(message):
            self.records.append(f"{record.name}: {message}")


@contextlib.contextmanager
def logged_refusals() -> Iterator[RefusedRequests]:
    """Collect refused requests from every logger (kopf's and herd's) while in the block."""
    handler = RefusedRequests()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)
