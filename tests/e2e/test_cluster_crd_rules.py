"""The generated CRD on the real apiserver: ``kubectl apply`` of a bad ModelDeployment is refused by
the server with the sentence of the rule it breaks (CEL ``x-kubernetes-validations``, bounds, enums,
strict field validation), pydantic refuses the same manifest, and every example applies."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from support.cluster import ControlPlane, install_herd_chart

from herd.api.crd import ModelDeployment
from herd.api.crd_schema import crd_manifest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "crd-rules"


@pytest.fixture(scope="module")
def crd(cluster: ControlPlane) -> Iterator[ControlPlane]:
    install_herd_chart(cluster)
    cluster.kubectl("create", "namespace", NAMESPACE)
    yield cluster
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def manifest(name: str = "bad", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, **spec},
    }


def disaggregated(**pools: Any) -> dict[str, Any]:
    return manifest(serving={"mode": "disaggregated"}, **pools)


def with_source(source: str) -> dict[str, Any]:
    return manifest(model={"source": source})


BAD = {
    "disaggregated-without-pools": (
        disaggregated(),
        "serving.mode disaggregated needs spec.prefill and spec.decode (a pool with replicas and resources)",
    ),
    "disaggregated-without-decode": (
        disaggregated(prefill={"replicas": 1}),
        "serving.mode disaggregated needs spec.prefill and spec.decode (a pool with replicas and resources)",
    ),
    "aggregated-with-pools": (
        manifest(prefill={"replicas": 1}, decode={"replicas": 1}),
        "spec.prefill and spec.decode are only used with serving.mode: disaggregated; remove them or set "
        "the mode",
    ),
    "autoscaling-min-above-max": (
        manifest(autoscaling={"enabled": True, "minReplicas": 4, "maxReplicas": 2}),
        "autoscaling.minReplicas exceeds maxReplicas: raise maxReplicas or lower minReplicas",
    ),
    "load-factor-below-one": (
        manifest(routing={"strategy": "prefix_hash", "loadFactor": 0.5}),
        "spec.routing.loadFactor: Invalid value: 0.5: spec.routing.loadFactor in body should be greater "
        "than or equal to 1",
    ),
    "load-factor-with-round-robin": (
        manifest(routing={"strategy": "round_robin", "loadFactor": 2}),
        "loadFactor applies only to strategy prefix_hash or kv_cache_aware: remove it or set strategy to "
        "one of them",
    ),
    "prefix-blocks-with-kv-cache-aware": (
        manifest(routing={"strategy": "kv_cache_aware", "prefixBlocks": 8}),
        "prefixBlocks applies only to strategy prefix_hash: remove it or set strategy: prefix_hash",
    ),
    "session-header-with-random": (
        manifest(routing={"strategy": "random", "sessionHeader": "X-User"}),
        "sessionHeader applies only to strategy sticky_session: remove it or set strategy: sticky_session",
    ),
    "session-ttl-with-least-request": (
        manifest(routing={"strategy": "least_request", "sessionTtlSeconds": 60}),
        "sessionTtlSeconds applies only to strategy sticky_session: remove it or set strategy: "
        "sticky_session",
    ),
    "cache-weight-with-prefix-hash": (
        manifest(routing={"strategy": "prefix_hash", "cacheWeight": 2}),
        "cacheWeight applies only to strategy kv_cache_aware: remove it or set strategy: kv_cache_aware",
    ),
    "load-weight-with-sticky-session": (
        manifest(routing={"strategy": "sticky_session", "loadWeight": 2}),
        "loadWeight applies only to strategy kv_cache_aware: remove it or set strategy: kv_cache_aware",
    ),
    "tier-cost-with-round-robin": (
        manifest(routing={"strategy": "round_robin", "tierCost": "weights"}),
        "tierCost applies only to strategy kv_cache_aware: remove it or set strategy: kv_cache_aware",
    ),
    "tier-weights-with-least-request": (
        manifest(routing={"strategy": "least_request", "tierWeights": {"host": 0.5}}),
        "tierWeights applies only to strategy kv_cache_aware: remove it or set strategy: kv_cache_aware",
    ),
    "peer-pulls-with-prefix-hash": (
        manifest(routing={"strategy": "prefix_hash", "peerPulls": True}),
        "peerPulls applies only to strategy kv_cache_aware: remove it or set strategy: kv_cache_aware",
    ),
    "unknown-strategy": (
        manifest(routing={"strategy": "fastest"}),
        'spec.routing.strategy: Unsupported value: "fastest"',
    ),
    "source-without-scheme": (
        with_source("Org/Name"),
        "model.source has no known scheme: use one of hf://..., s3://..., pvc://..., file://...",
    ),
    "source-scheme-alone": (
        with_source("hf://"),
        "model.source has no known scheme: use one of hf://..., s3://..., pvc://..., file://...",
    ),
    "block-size-not-a-power-of-two": (
        manifest(engine={"kvCache": {"blockSize": 24}}),
        "engine.kvCache.blockSize must be a power of two (16, 32, ...)",
    ),
    "name-too-long": (
        manifest(name="m" * 53),
        "metadata.name must be a DNS label of at most 52 characters (lowercase letters, digits, '-'), "
        "since pool objects append a suffix",
    ),
    "name-with-a-dot": (
        manifest(name="llama.v3"),
        "metadata.name must be a DNS label of at most 52 characters (lowercase letters, digits, '-'), "
        "since pool objects append a suffix",
    ),
    "simulation-with-herd-backend": (
        manifest(engine={"simulation": {"costModel": {"stepMs": 5}}}),
        "engine.simulation applies only to engine.backend simulated: remove it or set backend: simulated",
    ),
    "vllm-block-with-simulated-backend": (
        manifest(engine={"backend": "simulated", "vllm": {"extraArgs": ["--enforce-eager"]}}),
        "engine.vllm applies only to engine.backend vllm: remove it or set backend: vllm",
    ),
    "vllm-disaggregated": (
        disaggregated(engine={"backend": "vllm"}, prefill={"replicas": 1}, decode={"replicas": 1}),
        "engine.backend vllm serves aggregated only (herd's KV handoff needs herd's engine): set "
        "serving.mode: aggregated, or backend: herd",
    ),
    "unknown-backend": (
        manifest(engine={"backend": "sglang"}),
        'spec.engine.backend: Unsupported value: "sglang"',
    ),
    "pool-engine-sets-dtype": (
        manifest(workers={"engine": {"dtype": "float16"}}),
        'unknown field "spec.workers.engine.dtype"',
    ),
    "negative-replicas": (
        manifest(workers={"replicas": -1}),
        "spec.workers.replicas in body should be greater than or equal to 0",
    ),
}


def cel_messages(node: Any) -> list[str]:
    """Every ``x-kubernetes-validations`` message in a schema."""
    if isinstance(node, list):
        return [message for item in node for message in cel_messages(item)]
    if not isinstance(node, dict):
        return []
    own = [rule["message"] for rule in node.get("x-kubernetes-validations", [])]
    return own + [message for key, value in node.items() if key != "x-kubernetes-validations" for message in cel_messages(value)]  # fmt: skip


def test_every_cel_rule_has_a_bad_manifest() -> None:
    messages = set(cel_messages(crd_manifest()))
    assert len(messages) >= 10
    assert messages <= {expected for _, expected in BAD.values()}


@pytest.mark.parametrize(("bad", "expected"), BAD.values(), ids=BAD.keys())
def test_the_server_refuses_a_bad_manifest_with_the_rules_sentence(
    crd: ControlPlane, bad: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValidationError):
        ModelDeployment.model_validate(copy.deepcopy(bad))
    done = crd.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump(bad), check=False)
    assert done.returncode != 0, f"the server took it: {done.stdout}"
    assert expected in done.stderr


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda path: path.stem)
def test_every_example_applies(crd: ControlPlane, example: Path) -> None:
    for document in yaml.safe_load_all(example.read_text()):
        ModelDeployment.model_validate(document)
    crd.kubectl("apply", "-n", NAMESPACE, "--dry-run=server", "-f", str(example))
