"""Kubernetes discovery, the pure part: which pods are routable workers of which model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from herd.orchestrator import kube_discovery
from herd.orchestrator.discovery import WorkerEndpoint
from herd.orchestrator.kube_discovery import KubeSource, membership_of

MD = {
    "apiVersion": "herd.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "chat", "namespace": "ml"},
    "spec": {
        "model": {"source": "hf://Org/Chat", "servedName": "chatty"},
        "engine": {"maxModelLen": 1024, "kvCache": {"blockSize": 32}},
        "routing": {"strategy": "prefix_hash", "loadFactor": 1.5},
    },
}


def pod(name: str, **state: Any) -> dict[str, Any]:
    labels = {"herd.dev/deployment": state.get("md", "chat"), "herd.dev/role": state.get("role", "unified")}
    metadata: dict[str, Any] = {"name": name, "namespace": state.get("namespace", "ml"), "labels": labels}
    if state.get("terminating"):
        metadata["deletionTimestamp"] = "2026-11-22T00:00:00Z"
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if state.get("ready", True) else "False"}]
    }
    if state.get("ip", "127.0.0.1"):
        status["podIP"] = state.get("ip", "127.0.0.1")
    ports = [{"name": "http", "containerPort": 8000}, {"name": "internal", "containerPort": 9000}]
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "worker", "ports": state.get("ports", ports)}]},
        "status": status,
    }


CASES = {
    "ready": (pod("a"), True),
    "not-ready": (pod("a", ready=False), False),
    "terminating": (pod("a", terminating=True), False),
    "no-ip-yet": (pod("a", ip=""), False),
    "unknown-deployment": (pod("a", md="other"), False),
    "other-namespace": (pod("a", namespace="prod"), False),
    "unknown-role": (pod("a", role="sidecar"), False),
}


@pytest.mark.parametrize(("worker", "is_routed"), CASES.values(), ids=CASES.keys())
def test_which_pods_are_routed(worker: dict[str, Any], is_routed: bool) -> None:
    membership = membership_of([MD], [worker])
    assert len(membership.endpoints) == int(is_routed)


def test_endpoint_urls_come_from_named_ports() -> None:
    ports = [{"name": "http", "containerPort": 18000}, {"name": "internal", "containerPort": 19000}]
    membership = membership_of([MD], [pod("p1", role="decode", ip="127.0.0.1", ports=ports)])
    assert membership.endpoints == (
        WorkerEndpoint("ml/p1", "chatty", "http://127.0.0.1:18000", "http://127.0.0.1:19000", "decode"),
    )


def test_model_settings_come_from_the_deployment() -> None:
    (config,) = membership_of([MD], []).models
    assert config.served_name == "chatty"
    assert (config.block_size, config.max_model_len, config.mode) == (32, 1024, "aggregated")
    assert config.routing.strategy == "prefix_hash"
    assert config.model_path is None


def test_an_invalid_deployment_serves_nothing() -> None:
    invalid = {**MD, "spec": {**MD["spec"], "serving": {"mode": "disaggregated"}}}
    assert membership_of([invalid], [pod("a")]).endpoints == ()
    assert membership_of([invalid], [pod("a")]).models == ()


def malformed(**changes: Any) -> dict[str, Any]:
    """Pod b (routable but for ``changes``) with some of its top-level parts replaced."""
    return {**pod("b", ip="127.0.0.2"), **changes}


def ports(value: Any) -> dict[str, Any]:
    return {"containers": [{"name": "worker", "ports": [{"name": "http", "containerPort": value}]}]}


MALFORMED: dict[str, Any] = {
    "pod-is-null": None,
    "pod-is-a-string": "ml/b",
    "metadata-is-a-string": malformed(metadata="ml/b"),
    "labels-are-a-list": malformed(metadata={"name": "b", "namespace": "ml", "labels": ["herd.dev/role"]}),
    "no-name": malformed(metadata={"namespace": "ml", "labels": pod("b")["metadata"]["labels"]}),
    "containers-a-string": malformed(spec={"containers": "worker"}),
    "condition-a-string": malformed(status={"podIP": "127.0.0.2", "conditions": ["Ready"]}),
    "port-missing": malformed(spec=ports(None)),
    "port-a-string": malformed(spec=ports("http")),
    "port-zero": malformed(spec=ports(0)),
    "port-too-large": malformed(spec=ports(65536)),
    "port-a-bool": malformed(spec=ports(True)),
    "port-a-float": malformed(spec=ports(8000.5)),
    "ip-not-an-address": malformed(status={**pod("b")["status"], "podIP": "127.0.0.300"}),
    "ip-a-number": malformed(status={**pod("b")["status"], "podIP": 167772162}),
}


@pytest.mark.parametrize("bad", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_pod_is_skipped_and_the_others_still_count(
    caplog: pytest.LogCaptureFixture, bad: Any
) -> None:
    membership = membership_of([MD], [pod("a"), bad, pod("c", ip="127.0.0.3")])
    assert [endpoint.id for endpoint in membership.endpoints] == ["ml/a", "ml/c"]
    assert "malformed" in caplog.text and "not routing to it" in caplog.text


@pytest.mark.parametrize(
    ("ip", "url"),
    [
        ("127.0.0.9", "http://127.0.0.9:8000"),
        ("::1", "http://[::1]:8000"),
        ("0:0:0:0:0:0:0:1", "http://[::1]:8000"),
    ],
    ids=["ipv4", "ipv6", "ipv6-long-form"],
)
def test_an_ipv6_pod_ip_goes_in_brackets(ip: str, url: str) -> None:
    (endpoint,) = membership_of([MD], [pod("a", ip=ip)]).endpoints
    assert (endpoint.url, endpoint.internal_url) == (url, url.replace(":8000", ":9000"))


def test_membership_is_ordered_and_comparable() -> None:
    first = membership_of([MD], [pod("b", ip="127.0.0.2"), pod("a")])
    assert [e.id for e in first.endpoints] == ["ml/a", "ml/b"]
    assert first == membership_of([MD], [pod("a"), pod("b", ip="127.0.0.2")])


class _Hang(httpx.AsyncByteStream):
    """A watch that stays open and quiet."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.Event().wait()
        yield b""


GONE = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired"}}
BROKEN_WATCHES = {
    "error-410": [{"type": "MODIFIED", "object": pod("a", ready=False)}, GONE],
    "event-is-a-list": [["ADDED", pod("c")]],
    "object-is-a-string": [{"type": "ADDED", "object": "ml/c"}],
    "metadata-is-a-string": [{"type": "MODIFIED", "object": {"metadata": "ml/a"}}],
    "event-is-null": [None],
    "nested-too-deep": ["[" * 100_000 + "]" * 100_000],
}
"""How the first pod watch ends (each entry one line; a string is sent as it is)."""


def fake_api(first_watch: list[Any]) -> httpx.AsyncClient:
    """An API peer whose first pod watch sends ``first_watch`` and then only a relist shows pod b."""
    pod_lists = [[pod("a")], [pod("b", ip="127.0.0.2")]]
    watches = {"pods": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        is_pods = request.url.path.endswith("/pods")
        if request.url.params.get("watch") != "true":
            items = pod_lists.pop(0) if is_pods else [MD]
            return httpx.Response(200, json={"items": items, "metadata": {"resourceVersion": "1"}})
        if is_pods and watches["pods"] == 0:
            watches["pods"] += 1
            lines = (line if isinstance(line, str) else json.dumps(line) for line in first_watch)
            return httpx.Response(200, content="\n".join(lines) + "\n")
        return httpx.Response(200, stream=_Hang())

    return httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(handle))


@pytest.mark.parametrize("first_watch", BROKEN_WATCHES.values(), ids=BROKEN_WATCHES.keys())
async def test_a_broken_watch_is_repaired_by_a_relist(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, first_watch: list[Any]
) -> None:
    monkeypatch.setattr(kube_discovery, "_RETRY_SECONDS", 0.01)
    async with fake_api(first_watch) as http:
        updates = KubeSource("ml", http=http).watch()
        seen = []
        try:
            async with asyncio.timeout(30):  # room for a loaded machine
                async for membership in updates:
                    seen.append({e.id for e in membership.endpoints})
                    if seen[-1] == {"ml/b"}:
                        break
        finally:
            await updates.aclose()
    # Pod b exists only in the second list: reaching it proves the relist (states in between may fold).
    assert seen[-1] == {"ml/b"}
    if first_watch is not BROKEN_WATCHES["error-410"]:  # an ERROR event is the server's own, not a fault
        assert "listing again" in caplog.text
