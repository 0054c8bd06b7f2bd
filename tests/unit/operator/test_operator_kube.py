"""Credentials: the kubeconfig's token reaches kopf and every request of the operator's own client."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from herd.kube import load_connection
from herd.operator.kube import kopf_login


def write_kubeconfig(folder: Path, token: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }
    path = folder / "kubeconfig.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_the_kubeconfig_token_reaches_kopf_and_every_request(tmp_path: Path) -> None:
    connection = load_connection(str(write_kubeconfig(tmp_path, "t0k3n")))
    info = kopf_login(connection)
    assert (info.server, info.scheme, info.token) == ("http://127.0.0.1:6443", "Bearer", "t0k3n")
    async with connection.http_client() as client:
        request = client.build_request("GET", "/api/v1/pods")
        assert client.auth is not None
        signed = next(client.auth.sync_auth_flow(request))
    assert signed.headers["Authorization"] == "Bearer t0k3n"
    assert isinstance(signed, httpx.Request)
