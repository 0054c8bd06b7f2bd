"""A tiny kopf operator embedded in a thread, against the kube emulator: what the herd operator relies on."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import kopf
from support.kube import Emulator
from support.kube.samples import WIDGET_CRD
from support.procs import wait_until

pytest_plugins = ["support.kube.fixtures"]


def _registry(kube: Emulator, deleted: threading.Event) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kube.kopf_connection()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 10
        settings.posting.level = 20

    @kopf.on.create("example.dev", "v1", "widgets", id="create", registry=registry)
    def create(body: kopf.Body, name: str, namespace: str, patch: kopf.Patch, **_: Any) -> dict[str, str]:
        child: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-cfg"}}
        kopf.adopt(child, owner=body)
        kube.create(child)
        kopf.info(body, reason="Created", message=f"made {name}-cfg")
        patch.status["phase"] = "Ready"
        return {"child": f"{name}-cfg"}

    @kopf.on.delete("example.dev", "v1", "widgets", id="delete", registry=registry)
    def delete(**_: Any) -> None:
        deleted.set()

    return registry


@contextlib.contextmanager
def _operator(registry: kopf.OperatorRegistry) -> Iterator[None]:
    ready, stop = threading.Event(), threading.Event()
    coroutine = kopf.operator(
        registry=registry, standalone=True, namespaces=["default"], ready_flag=ready, stop_flag=stop
    )
    thread = threading.Thread(target=asyncio.run, args=(coroutine,), name="kopf")
    thread.start()
    try:
        assert ready.wait(60), "kopf did not become ready within 60 s"
        yield
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "kopf did not stop within 60 s"


def test_kopf_reconciles_a_custom_resource(kube: Emulator) -> None:
    kube.apply(WIDGET_CRD)
    deleted = threading.Event()
    with _operator(_registry(kube, deleted)):
        kube.create({"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}})
        wait_until(
            lambda: kube.get("widgets", "w").get("status", {}).get("create"),
            timeout=60,
            what="kopf patched the widget's status",
        )
        widget = kube.get("widgets", "w")
        assert widget["status"] == {"phase": "Ready", "create": {"child": "w-cfg"}}
        assert (
            kube.get("configmaps", "w-cfg")["metadata"]["ownerReferences"][0]["uid"]
            == widget["metadata"]["uid"]
        )
        assert widget["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        wait_until(
            lambda: any(event.get("reason") == "Created" for event in kube.list("events", "default")),
            timeout=60,
            what="kopf posted an event",
        )
        kube.delete("widgets", "w")
        wait_until(lambda: kube.find("widgets", "w") is None, timeout=60, what="kopf released its finalizer")
    assert deleted.is_set()
    assert kube.find("configmaps", "w-cfg") is None
