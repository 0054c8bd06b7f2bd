"""Running herd's operator against the Kubernetes API emulator in tests and benchmarks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import yaml

from herd.operator.runner import run_operator
from herd.operator.settings import OperatorConfig
from support.kube.emulator import Emulator

__all__ = [
    "CRD",
    "HasKubeconfig",
    "RefusedRequests",
    "embedded_operator",
    "install_crd",
    "kubectl",
    "logged_refusals",
]

CRD = Path(__file__).resolve().parents[2] / "crds" / "herd.dev_modeldeployments.yaml"
TIMEOUT_S = 60.0  # generous for a loaded machine; nothing waits for it when things are quick


def install_crd(kube: Emulator) -> None:
    kube.create(yaml.safe_load(CRD.read_text()))


class HasKubeconfig(Protocol):
    """Where the operator logs in: the emulator, or a real control plane's credentials."""

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


def kubectl(kube: Emulator, *args: str, stdin: str | None = None) -> str:
    """Run kubectl against the emulator; asserts success and returns stdout."""
    # A private discovery cache: a cache left by an earlier emulator on the same port would lack the CRD.
    argv = [
        "kubectl",
        "--kubeconfig",
        str(kube.kubeconfig),
        "--cache-dir",
        str(kube.workdir / "kubectl"),
        *args,
    ]
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


class RefusedRequests(logging.Handler):
    """Every warning or error logged about a refused request (403, Forbidden), as ``logger: message``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "403" in message or "forbidden" in message.lower():
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
