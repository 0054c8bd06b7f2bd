"""The emulator's public face: a server on 127.0.0.1 in a background thread, plus test helpers.

The server is kmock's handler behind aiohttp's own runner: ``kmock.Server`` also swaps aiohttp's
resolver process-wide and insists on LIFO exits, which breaks with several emulators in threads.
Helpers run their store operations on the server's event loop, so watches see their writes.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp.web
import yaml

from ._errors import ApiError
from ._handler import KubeHandler
from ._patches import merge_patch
from ._resources import ResourceType
from ._router import Router
from ._selectors import parse_field_selector, parse_label_selector
from ._store import Store
from ._workloads import deployment_status, pod_from_template, pod_status, selects

if TYPE_CHECKING:
    import kopf
    import kubernetes.client

__all__ = ["Emulator", "kube_emulator"]

T = TypeVar("T")
KUBELET_FINALIZER = "emulator.herd.dev/kubelet"
_START_TIMEOUT_S = 60.0  # generous for a loaded machine; a quick start does not wait for it
_CALL_TIMEOUT_S = 60.0
_SHUTDOWN_TIMEOUT_S = 30.0
"""How long stopping waits for open requests: a watch that does not end on its own costs all of it,
far above what a prompt stop takes even on a loaded machine (test_stopping_ends_open_watches_promptly)."""


class Emulator:
    """A Kubernetes API emulator for tests; use it through :func:`kube_emulator`.

    ``url`` is ``http://127.0.0.1:PORT``; ``kubeconfig`` is a file for kubectl, kopf and the python client
    (namespace ``default``). Helpers take a resource by any name kubectl accepts (``pods``, ``Pod``, ``po``,
    ``deployments.apps``, ``md``) and a namespace (ignored for cluster-scoped types).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.kubeconfig = workdir / "kubeconfig.yaml"
        self.url = ""
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._store: Store | None = None
        self._handler: KubeHandler | None = None
        self._failure: BaseException | None = None

    # Lifecycle.

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S) or self._failure is not None:
            raise RuntimeError(
                f"the kube emulator did not start within {_START_TIMEOUT_S}s"
            ) from self._failure
        self._write_kubeconfig()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(_START_TIMEOUT_S)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        try:
            self._loop, self._stopping, self._store = asyncio.get_running_loop(), asyncio.Event(), Store()
            router = Router(self._store, address="")
            self._handler = KubeHandler(router=router)
            runner = aiohttp.web.ServerRunner(
                aiohttp.web.Server(self._handler), shutdown_timeout=_SHUTDOWN_TIMEOUT_S
            )
            await runner.setup()
            await aiohttp.web.TCPSite(runner, "127.0.0.1", 0).start()
        except BaseException as error:
            self._failure = error
            self._ready.set()
            raise
        host, port = runner.addresses[0][:2]
        router.address, self.url = f"{host}:{port}", f"http://{host}:{port}"
        async with self._handler:
            self._ready.set()
            await self._stopping.wait()
            self._store.log.close()
            await runner.cleanup()

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "emulator",
            "preferences": {},
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator"}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": "default"},
                }
            ],
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))

    # Running code against the store, on the server's loop.

    def call(self, operation: Callable[[Store], T]) -> T:
        """Run ``operation(store)`` on the server's event loop and return its result (or raise its error)."""
        assert self._loop is not None and self._store is not None, "start() the emulator first"
        store = self._store

        async def invoke() -> T:
            return operation(store)

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result(_CALL_TIMEOUT_S)

    @property
    def kmock(self) -> KubeHandler:
        """The kmock handler: its recorded requests and reactions (add reactions before the traffic)."""
        assert self._handler is not None, "start() the emulator first"
        return self._handler

    @property
    def resource_version(self) -> str:
        """The latest resourceVersion: a watch from here sees only later writes."""
        return self.call(lambda store: str(store.resource_version))

    def resource(self, name: str) -> ResourceType:
        return self.call(lambda store: store.registry.resolve(name))

    def _type_of(self, obj: Mapping[str, Any]) -> ResourceType:
        api_version, kind = obj.get("apiVersion"), obj.get("kind")

        def lookup(store: Store) -> ResourceType:
            for rtype in store.registry:
                if (rtype.api_version, rtype.kind) == (api_version, kind):
                    return rtype
            raise LookupError(f"no resource type serves {api_version}/{kind}: apply its CRD first")

        return self.call(lookup)

    # Helpers.

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        rtype = self._type_of(obj)
        return self.call(
            lambda store: store.create(rtype, obj.get("metadata", {}).get("namespace"), dict(obj))
        )

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create, or merge into the existing object; a given ``status`` is written through /status too."""
        rtype, meta = self._type_of(obj), obj.get("metadata", {})
        name, namespace = meta["name"], meta.get("namespace", "default")

        def upsert(store: Store) -> dict[str, Any]:
            try:
                store.get(rtype, namespace, name)
            except ApiError as error:
                if error.status != 404:
                    raise
                return store.create(rtype, namespace, dict(obj))
            return store.update(rtype, namespace, name, lambda current: merge_patch(current, obj), None)

        def write_status(store: Store) -> dict[str, Any]:
            status = {"status": obj["status"]}
            return store.update(
                rtype, namespace, name, lambda current: merge_patch(current, status), "status"
            )

        result = self.call(upsert)
        return self.call(write_status) if "status" in obj and rtype.has_status else result

    def apply_yaml(self, manifests: str) -> list[dict[str, Any]]:
        """Apply every document of a multi-document YAML text (empty documents skipped), in order."""
        return [self.apply(doc) for doc in yaml.safe_load_all(manifests) if doc]

    def get(self, resource: str, name: str, namespace: str = "default") -> dict[str, Any]:
        rtype = self.resource(resource)
        return self.call(lambda store: store.get(rtype, namespace, name))

    def find(
        self, resource: str, name: str, namespace: str = "default", *, api_version: str | None = None
    ) -> dict[str, Any] | None:
        """The object, or None where it (or its type) does not exist."""
        try:
            rtype = self._type_of({"apiVersion": api_version, "kind": resource}) if api_version else None
            rtype = rtype or self.resource(resource)
            return self.call(lambda store: store.get(rtype, namespace, name))
        except LookupError:  # no such type (a CRD not applied yet): no such object either
            return None
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def list(
        self,
        resource: str,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> list[dict[str, Any]]:
        rtype = self.resource(resource)
        labels, fields = parse_label_selector(label_selector), parse_field_selector(field_selector)
        return self.call(lambda store: store.select(rtype, namespace, labels, fields))

    def patch(
        self,
        resource: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str = "default",
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """A JSON merge patch to the object, or to its ``status`` subresource."""
        rtype = self.resource(resource)
        return self.call(
            lambda store: store.update(
                rtype, namespace, name, lambda obj: merge_patch(obj, patch), subresource
            )
        )

    def delete(
        self, resource: str, name: str, namespace: str = "default", *, propagation: str = "Background"
    ) -> dict[str, Any]:
        rtype = self.resource(resource)
        return self.call(lambda store: store.delete(rtype, namespace, name, propagation))

    def create_namespace(self, name: str) -> dict[str, Any]:
        return self.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def set_pod_ready(
        self, namespace: str, name: str, ready: bool = True, *, pod_ip: str = "127.0.0.1"
    ) -> dict[str, Any]:
        """Mark a pod Running and Ready (or Running and not Ready), as the kubelet would."""
        pod = self.get("pods", name, namespace)
        status = pod_status(pod, is_ready=ready, pod_ip=pod_ip)
        return self.patch("pods", name, {"status": status}, namespace, subresource="status")

    def terminate_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """Leave a pod Terminating (deletionTimestamp set, still listed), as during a kubelet's grace period.

        The emulator deletes pods at once otherwise; a kubelet finalizer holds this one until ``release``.
        """
        finalizers = self.get("pods", name, namespace)["metadata"].get("finalizers", [])
        self.patch("pods", name, {"metadata": {"finalizers": [*finalizers, KUBELET_FINALIZER]}}, namespace)
        return self.delete("pods", name, namespace)

    def release(self, resource: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
        """Remove every finalizer, so an object being deleted goes (returns it where it stays)."""
        self.patch(resource, name, {"metadata": {"finalizers": None}}, namespace)
        return self.find(resource, name, namespace)

    def sync_deployment_status(self, namespace: str, name: str) -> dict[str, Any]:
        """Write a Deployment's status from the pods matching its selector; the emulator never does this itself."""
        deployment = self.get("deployments.apps", name, namespace)
        status = deployment_status(deployment, self.list("pods", namespace))
        return self.patch("deployments.apps", name, {"status": status}, namespace, subresource="status")

    def run_deployment(
        self, namespace: str, name: str, *, ready: bool = True, pod_ips: Sequence[str] = ()
    ) -> builtins.list[dict[str, Any]]:
        """One step of the controllers the emulator lacks: make the Deployment's pods match spec.replicas.

        Missing pods are created from the template as ``NAME-0``, ``NAME-1``, ... (owned by the Deployment, so
        deleting it deletes them), surplus ones deleted from the highest name down, every remaining pod marked
        Ready (or not) with its address from ``pod_ips`` in name order (127.0.0.1 beyond it), then the status
        synced. Call it again after a scale; template changes do not replace pods. Returns the pods by name.
        """
        deployment = self.get("deployments.apps", name, namespace)
        current = self._pod_names(deployment)
        wanted = deployment["spec"].get("replicas", 1)
        for surplus in current[wanted:]:
            self.delete("pods", surplus, namespace)
        free = [
            f"{name}-{index}" for index in range(wanted + len(current)) if f"{name}-{index}" not in current
        ]
        for pod_name in free[: max(wanted - len(current), 0)]:
            self.create(pod_from_template(deployment, pod_name))
        ips = itertools.chain(pod_ips, itertools.repeat("127.0.0.1"))
        pods = [(pod_name, next(ips)) for pod_name in self._pod_names(deployment)]
        started = [self.set_pod_ready(namespace, pod_name, ready, pod_ip=ip) for pod_name, ip in pods]
        self.sync_deployment_status(namespace, name)
        return started

    def _pod_names(self, deployment: dict[str, Any]) -> builtins.list[str]:
        pods = self.list("pods", deployment["metadata"]["namespace"])
        return sorted(pod["metadata"]["name"] for pod in pods if selects(deployment, pod))

    # Clients.

    def api_client(self) -> kubernetes.client.ApiClient:
        """A ``kubernetes`` client configured for this emulator (close it when done)."""
        import kubernetes.config

        client: kubernetes.client.ApiClient = kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )
        return client

    def kopf_connection(self) -> kopf.ConnectionInfo:
        """For an ``@kopf.on.login()`` handler: kopf's default login reads KUBECONFIG at import time."""
        import kopf

        return kopf.ConnectionInfo(server=self.url, default_namespace="default", token="emulator")


@contextlib.contextmanager
def kube_emulator(workdir: Path) -> Iterator[Emulator]:
    """A started emulator whose files live in ``workdir``; stopped and joined on exit."""
    emulator = Emulator(workdir)
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()
