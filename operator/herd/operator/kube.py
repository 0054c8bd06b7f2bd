"""A small async Kubernetes API client for the objects the operator owns.

kopf watches ModelDeployments with its own client; the children (Deployments, Services, Pods) and
the status are read and written here, through plain REST calls on one ``httpx.AsyncClient``.
Credentials come from the ``kubernetes`` package's loaders (in-cluster service account, else a
kubeconfig), so kopf and this client always talk to the same server as the same user.
"""

from __future__ import annotations

import ssl
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import httpx
import kopf
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

__all__ = ["Connection", "CredentialsError", "KubeApi", "KubeError", "load_connection", "resource_path"]

Object = dict[str, Any]
_MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


class KubeError(RuntimeError):
    """An API answer that is neither success nor a benign AlreadyExists/NotFound."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API answered {status}: {message}")
        self.status = status


class CredentialsError(RuntimeError):
    """Neither in-cluster credentials nor a usable kubeconfig were found."""


@dataclass(frozen=True)
class Connection:
    """Where the API server is and who we are, as the ``kubernetes`` loaders found it."""

    config: k8s_client.Configuration

    @property
    def token(self) -> str | None:
        """The bearer token, re-read when the loader says it expired (projected tokens rotate)."""
        value = self.config.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
        scheme, _, token = value.partition(" ")
        return (token if scheme.lower() == "bearer" else value) or None

    def kopf_info(self) -> kopf.ConnectionInfo:
        token = self.token
        return kopf.ConnectionInfo(
            server=self.config.host,
            ca_path=self.config.ssl_ca_cert,
            insecure=not self.config.verify_ssl,
            scheme="Bearer" if token else None,
            token=token,
            certificate_path=self.config.cert_file,
            private_key_path=self.config.key_file,
        )

    def http_client(self) -> httpx.AsyncClient:
        config = self.config
        verify: ssl.SSLContext | bool = bool(config.verify_ssl)
        if verify and (config.ssl_ca_cert or config.cert_file):
            verify = ssl.create_default_context(cafile=config.ssl_ca_cert)
            if config.cert_file and config.key_file:
                verify.load_cert_chain(config.cert_file, config.key_file)
        return httpx.AsyncClient(base_url=config.host, auth=_BearerAuth(self), verify=verify, timeout=30.0)


class _BearerAuth(httpx.Auth):
    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.connection.token
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def load_connection(kubeconfig: str | None = None) -> Connection:
    """In-cluster credentials when running in a pod (and no kubeconfig is named), else the kubeconfig."""
    config = k8s_client.Configuration()
    try:
        if kubeconfig is not None:
            raise k8s_config.ConfigException("a kubeconfig was named")
        k8s_config.load_incluster_config(client_configuration=config)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=config)  # type: ignore[no-untyped-call]
        except (k8s_config.ConfigException, OSError) as error:
            raise CredentialsError(
                f"no Kubernetes credentials ({error}): run in a pod with a service account, "
                "or pass --kubeconfig (or set KUBECONFIG) to a valid kubeconfig file"
            ) from None
    return Connection(config)


def resource_path(api_version: str, plural: str, namespace: str, name: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class KubeApi:
    """get/list/create/replace/delete/patch-status; AlreadyExists and NotFound count as success."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def get(self, api_version: str, plural: str, namespace: str, name: str) -> Object | None:
        response = await self.http.get(resource_path(api_version, plural, namespace, name))
        return None if response.status_code == 404 else _json(response)

    async def serves(self, api_version: str, plural: str, namespace: str | None) -> bool:
        """Whether the API server knows this resource type (in ``namespace``, or cluster-wide for ``None``)."""
        path = resource_path(api_version, plural, namespace) if namespace else f"/apis/{api_version}/{plural}"
        response = await self.http.get(path, params={"limit": "1"})
        if response.status_code == 404:
            return False
        _json(response)
        return True

    async def list(self, api_version: str, plural: str, namespace: str, selector: str) -> list[Object]:
        path = resource_path(api_version, plural, namespace)
        items: list[Object] = _json(await self.http.get(path, params={"labelSelector": selector}))["items"]
        return items

    async def create(self, api_version: str, plural: str, body: Object) -> Object | None:
        path = resource_path(api_version, plural, body["metadata"]["namespace"])
        response = await self.http.post(path, json=body)
        return None if response.status_code == 409 else _json(response)

    async def replace(self, api_version: str, plural: str, body: Object) -> Object | None:
        meta = body["metadata"]
        response = await self.http.put(
            resource_path(api_version, plural, meta["namespace"], meta["name"]), json=body
        )
        return None if response.status_code == 404 else _json(response)

    async def delete(self, api_version: str, plural: str, namespace: str, name: str) -> None:
        response = await self.http.delete(resource_path(api_version, plural, namespace, name))
        if response.status_code != 404:
            _json(response)

    async def patch_status(
        self, api_version: str, plural: str, namespace: str, name: str, status: Object
    ) -> None:
        path = resource_path(api_version, plural, namespace, name) + "/status"
        response = await self.http.patch(path, json={"status": status}, headers=_MERGE_PATCH)
        if response.status_code != 404:
            _json(response)


def _json(response: httpx.Response) -> Any:
    if response.is_success:
        return response.json()
    try:
        message = response.json().get("message", response.text)
    except ValueError:
        message = response.text
    raise KubeError(response.status_code, f"{response.request.method} {response.request.url.path}: {message}")
