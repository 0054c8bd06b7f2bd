"""A small async Kubernetes API client for the objects the operator owns.

kopf watches ModelDeployments with its own client; the children (Deployments, Services, Pods) and
the status are read and written here, through plain REST calls on the ``httpx.AsyncClient`` of a
``herd.kube.Connection``; kopf logs in with the same connection (``kopf_login``), so both always
talk to the same server as the same user.
"""

from __future__ import annotations

from typing import Any

import httpx
import kopf

from herd.kube import Connection, resource_path

__all__ = ["KubeApi", "KubeError", "kopf_login"]

Object = dict[str, Any]
_MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


class KubeError(RuntimeError):
    """An API answer that is neither success nor a benign AlreadyExists/NotFound."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API answered {status}: {message}")
        self.status = status


def kopf_login(connection: Connection) -> kopf.ConnectionInfo:
    """The same server and user for kopf's own watches as for this client."""
    config = connection.config
    token = connection.token
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        scheme="Bearer" if token else None,
        token=token,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


class KubeApi:
    """get/list/create/replace/delete/patch-status; AlreadyExists and NotFound count as success."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def get(self, api_version: str, plural: str, namespace: str, name: str) -> Object | None:
        response = await self.http.get(resource_path(api_version, plural, namespace, name))
        return None if response.status_code == 404 else _json(response)

    async def serves(self, api_version: str, plural: str, namespace: str | None) -> bool:
        """Whether the API server knows this resource type (in ``namespace``, or cluster-wide for ``None``)."""
        response = await self.http.get(resource_path(api_version, plural, namespace), params={"limit": "1"})
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
