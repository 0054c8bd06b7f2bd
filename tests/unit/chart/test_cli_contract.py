"""The commands the chart renders are ones the real `herd` CLI accepts, with the intended meaning."""

from __future__ import annotations

import argparse
from typing import Any

from support.chart import find

from herd.cli.main import build_parser


def _parse(manifests: list[dict[str, Any]], deployment: str) -> argparse.Namespace:
    (found,) = find(manifests, "Deployment", deployment)
    args: list[str] = found["spec"]["template"]["spec"]["containers"][0]["args"]
    return build_parser(args).parse_args(args)


def _watched(values: dict[str, Any]) -> list[str] | None:
    """The namespaces named in ``values``, or None for every namespace."""
    watch = values.get("watch", {})
    return None if watch.get("allNamespaces", True) else watch.get("namespaces") or ["herd"]


def _redis_url(values: dict[str, Any]) -> str | None:
    redis = values.get("redis", {})
    if redis.get("enabled"):
        return "redis://herd-redis.herd.svc:6379/0"
    url: str | None = redis.get("externalUrl")
    return url


def test_operator_command_parses_with_the_intended_scope(
    values: dict[str, Any], manifests: list[dict[str, Any]]
) -> None:
    parsed = _parse(manifests, "herd-operator")
    watched = _watched(values)
    assert parsed.all_namespaces is (watched is None)
    assert parsed.namespace == (watched or [])
    assert parsed.standalone is True
    assert parsed.liveness == "http://0.0.0.0:8080/healthz"
    assert (parsed.worker_image, parsed.token_secret) == ("herd/worker:0.1.0", "herd-internal-token")


def test_orchestrator_command_parses_with_the_intended_wiring(
    values: dict[str, Any], manifests: list[dict[str, Any]]
) -> None:
    parsed = _parse(manifests, "herd-orchestrator")
    watched = _watched(values)
    assert parsed.kubernetes is True
    assert parsed.namespace == (watched[0] if watched else None)
    assert (parsed.host, parsed.port) == ("0.0.0.0", 8000)
    assert parsed.internal_token is None  # read from HERD_INTERNAL_TOKEN: never on a command line
    assert parsed.redis == _redis_url(values)
    has_keys = bool(values.get("orchestrator", {}).get("apiKeys"))
    assert (parsed.api_keys_file is not None) is has_keys
