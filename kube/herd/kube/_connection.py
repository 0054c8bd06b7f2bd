"""Where the API server is, who we are there, and an ``httpx`` client that says so."""

from __future__ import annotations

import ssl
from collections.abc import Generator
from dataclasses import dataclass

import httpx
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

__all__ = ["Connection", "CredentialsError", "load_connection"]

_TIMEOUT_S = 30.0


class CredentialsError(RuntimeError):
    """Neither in-cluster credentials nor a usable kubeconfig were found."""


@dataclass(frozen=True)
class Connection:
    """The server and credentials as the ``kubernetes`` loaders found them."""

    config: k8s_client.Configuration

    @property
    def token(self) -> str | None:
        """The bearer token, re-read on every call: the loader refreshes a projected token that rotates."""
        value = self.config.get_api_key_with_prefix("BearerToken", alias="authorization") or ""
        scheme, _, token = value.partition(" ")
        return (token if scheme.lower() == "bearer" else value) or None

    def http_client(self) -> httpx.AsyncClient:
        """A client for the API server: its CA, a client certificate if the kubeconfig has one, the token."""
        config = self.config
        verify: ssl.SSLContext | bool = bool(config.verify_ssl)
        if verify and (config.ssl_ca_cert or config.cert_file):
            verify = ssl.create_default_context(cafile=config.ssl_ca_cert)
            if config.cert_file and config.key_file:
                verify.load_cert_chain(config.cert_file, config.key_file)
        return httpx.AsyncClient(
            base_url=config.host, auth=_BearerAuth(self), verify=verify, timeout=_TIMEOUT_S
        )


class _BearerAuth(httpx.Auth):
    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.connection.token
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def load_connection(kubeconfig: str | None = None) -> Connection:
    """In-cluster credentials when running in a pod (and no kubeconfig is named), else the kubeconfig
    (``kubeconfig``, or ``$KUBECONFIG``, or ``~/.kube/config``)."""
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
