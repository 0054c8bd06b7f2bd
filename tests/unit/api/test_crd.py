from __future__ import annotations

from typing import Any

import pytest

from herd.api import ManifestError, parse_manifest
from herd.api.crd import KVCacheAwareRouting, ModelDeployment, PrefixHashRouting


def manifest(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "demo"},
        "spec": {"model": {"source": "hf://Org/Name"}, **spec},
    }


def test_defaults_fill_a_minimal_manifest() -> None:
    md = parse_manifest(manifest())
    assert md.served_name == "demo"
    assert md.spec.engine.kv_cache.block_size == 16
    assert md.spec.serving.mode == "aggregated"
    assert isinstance(md.spec.routing, KVCacheAwareRouting)
    assert md.spec.routing.load_factor == 1.25
    assert list(md.spec.pools()) == ["workers"]


def test_routing_is_a_discriminated_union() -> None:
    md = parse_manifest(manifest(routing={"strategy": "prefix_hash", "loadFactor": 1.5, "prefixBlocks": 2}))
    assert isinstance(md.spec.routing, PrefixHashRouting)
    assert (md.spec.routing.load_factor, md.spec.routing.prefix_blocks) == (1.5, 2)


def test_scale_target_overrides_the_scalable_pool() -> None:
    aggregated = parse_manifest(manifest(replicas=5, workers={"replicas": 2}))
    assert aggregated.spec.pools()["workers"].replicas == 5
    disaggregated = parse_manifest(
        manifest(
            replicas=3, serving={"mode": "disaggregated"}, prefill={"replicas": 1}, decode={"replicas": 1}
        )
    )
    pools = disaggregated.spec.pools()
    assert (pools["prefill"].replicas, pools["decode"].replicas) == (1, 3)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"serving": {"mode": "disaggregated"}}, "needs spec.prefill and spec.decode"),
        ({"prefill": {"replicas": 1}}, "spec.prefill is only used with serving.mode: disaggregated"),
        ({"workers": {"replicas": -1}}, "spec.workers.replicas: Input should be greater than or equal to 0"),
        ({"replicas": 2**31}, "spec.replicas: Input should be less than or equal to 2147483647"),
        (
            {"engine": {"kvCache": {"memoryGiB": float("inf")}}},
            "spec.engine.kvCache.memoryGiB: Input should be a finite number",
        ),
        (
            {"engine": {"kvCache": {"blockSize": 24}}},
            "spec.engine.kvCache.blockSize: engine.kvCache.blockSize must be a power of two",
        ),
        ({"routing": {"strategy": "fastest"}}, "spec.routing"),
        ({"routing": {"strategy": "round_robin", "loadFactor": 2}}, "spec.routing.loadFactor: unknown field"),
        ({"engine": {"maxModelLen": "long"}}, "spec.engine.maxModelLen: Input should be a valid integer"),
        ({"engine": {"dtypes": "float32"}}, "spec.engine.dtypes: unknown field"),
        ({"autoscaling": {"minReplicas": 4, "maxReplicas": 2}}, "minReplicas (4) exceeds maxReplicas (2)"),
        (
            {"workers": {"engine": {"dtype": "float16"}}},
            "spec.workers.engine: engine.dtype must be the same in every pool",
        ),
        (
            {"workers": {"engine": {"max_model_len": 64}}},
            "engine.maxModelLen must be the same in every pool (a request admitted by one pool must fit "
            "the other): set it in spec.engine instead of a pool's engine",
        ),
        (
            {"workers": {"engine": {"kvCache": {"blockSize": 32}}}},
            "engine.kvCache.blockSize must be the same",
        ),
        (
            {"workers": {"engine": {"maxBatchTokens": 8}}},
            "spec.workers.engine.maxBatchTokens: Input should be",
        ),
        ({"adapters": [{"name": "a", "source": "gs://x"}]}, "adapters[].source 'gs://x' has no known scheme"),
        ({"adapters": [{"name": "a b", "source": "file:///a"}]}, "spec.adapters.0.name"),
        (
            {"adapters": [{"name": "a", "source": "file:///a"}, {"name": "a", "source": "file:///b"}]},
            "adapters[].name must be unique",
        ),
        (
            {"adapters": [{"name": "a", "source": "file:///a", "rank": 32}]},
            "rank 32, above engine.maxLoraRank 16: raise maxLoraRank",
        ),
        (
            {"engine": {"maxLoras": 0}, "adapters": [{"name": "a", "source": "file:///a"}]},
            "adapters need LoRA slots",
        ),
        ({"adapters": [{"name": "demo", "source": "file:///a"}]}, "the served model's name: rename it"),
        (
            {"engine": {"task": "embed", "backend": "simulated"}},
            "engine.task embed runs on backend herd or vllm",
        ),
        (
            {
                "engine": {"task": "embed"},
                "serving": {"mode": "disaggregated"},
                "prefill": {"replicas": 1},
                "decode": {"replicas": 1},
            },
            "engine.task embed serves aggregated only",
        ),
        ({"engine": {"task": "rerank"}}, "spec.engine.task: Input should be 'auto', 'generate' or 'embed'"),
    ],
    ids=[
        "disagg-without-pools",
        "pool-without-disagg",
        "negative-replicas",
        "replicas-past-a-deployments-int32",
        "yaml-inf",
        "block-size-not-power-of-two",
        "unknown-strategy",
        "setting-of-another-strategy",
        "wrong-type",
        "typo",
        "autoscaling-bounds",
        "pool-dtype",
        "pool-max-model-len-snake-case",
        "pool-block-size",
        "pool-chunk-too-small",
        "adapter-scheme",
        "adapter-name",
        "adapter-names-unique",
        "adapter-rank",
        "adapters-without-slots",
        "adapter-named-as-the-model",
        "embed-simulated",
        "embed-disaggregated",
        "unknown-task",
    ],
)
def test_invalid_specs_name_the_field(spec: dict[str, Any], expected: str) -> None:
    with pytest.raises(ManifestError) as error:
        parse_manifest(manifest(**spec))
    assert expected in str(error.value)


@pytest.mark.parametrize(
    "source",
    ["gs://bucket/model", "Org/Name", "hf://", "http://example/x"],
    ids=["gs", "bare", "empty", "http"],
)
def test_unknown_source_schemes_are_refused(source: str) -> None:
    doc = manifest()
    doc["spec"]["model"]["source"] = source
    with pytest.raises(ManifestError, match=r"spec\.model\.source: model\.source .* has no known scheme"):
        parse_manifest(doc)


@pytest.mark.parametrize(
    ("source", "scheme", "location"),
    [
        ("hf://Org/Name", "hf", "Org/Name"),
        ("s3://bucket/prefix", "s3", "bucket/prefix"),
        ("pvc://cache/llama", "pvc", "cache/llama"),
        ("file:///models/x", "file", "/models/x"),
    ],
    ids=["hf", "s3", "pvc", "file"],
)
def test_source_parts(source: str, scheme: str, location: str) -> None:
    doc = manifest()
    doc["spec"]["model"]["source"] = source
    model = parse_manifest(doc).spec.model
    assert (model.scheme, model.location) == (scheme, location)


def test_metadata_name_must_be_a_short_dns_label() -> None:
    doc = manifest()
    doc["metadata"]["name"] = "Not_A_Label"
    with pytest.raises(ManifestError, match=r"metadata\.name"):
        parse_manifest(doc)


def test_round_trip_uses_camel_case() -> None:
    md = parse_manifest(manifest(engine={"maxModelLen": 1024, "kvCache": {"memoryGiB": 2}}))
    dumped = md.model_dump(by_alias=True, exclude_none=True)
    assert dumped["spec"]["engine"]["maxModelLen"] == 1024
    assert dumped["spec"]["engine"]["kvCache"]["memoryGiB"] == 2
    assert ModelDeployment.model_validate(dumped) == md


PER_POOL = {
    "engine": {"maxBatchSize": 32, "maxBatchTokens": 512, "kvCache": {"memoryGiB": 2}},
    "serving": {"mode": "disaggregated"},
    "prefill": {"engine": {"maxBatchTokens": 4096}},
    "decode": {"engine": {"maxBatchSize": 128, "kvCache": {"memoryUtilization": 0.95}}},
}


@pytest.mark.parametrize(
    ("pool", "batch_size", "batch_tokens", "memory_gib", "utilization"),
    [("prefill", 32, 4096, 2.0, 0.9), ("decode", 128, 512, None, 0.95)],
    ids=["prefill-chunk", "decode-batch-and-kv-share"],
)
def test_a_pool_engine_overrides_the_model_engine(
    pool: str, batch_size: int, batch_tokens: int, memory_gib: float | None, utilization: float
) -> None:
    """A pool's kvCache replaces the model's KV sizing: the decode pool's utilization is not
    overruled by the model's memoryGiB."""
    spec = parse_manifest(manifest(**PER_POOL)).spec
    engine = spec.engine_for(pool)  # type: ignore[arg-type]
    assert (engine.max_batch_size, engine.max_batch_tokens) == (batch_size, batch_tokens)
    assert (engine.kv_cache.memory_gib, engine.kv_cache.memory_utilization) == (memory_gib, utilization)
    assert (engine.max_model_len, engine.kv_cache.block_size) == (spec.engine.max_model_len, 16)


def test_the_serving_pool_answers_clients() -> None:
    assert parse_manifest(manifest()).spec.serving_pool == "workers"
    assert parse_manifest(manifest(**PER_POOL)).spec.serving_pool == "decode"
    spec = parse_manifest(manifest()).spec
    assert spec.engine_for("workers") == spec.engine.model_copy(update={"tensor_parallel_size": 1})


@pytest.mark.parametrize(
    ("engine", "accelerator", "expected"),
    [
        ({}, {"vendor": "nvidia", "count": 4}, 4),
        ({}, {"vendor": "none", "count": 1}, 1),
        ({"tensorParallelSize": 2}, {"vendor": "none", "count": 1}, 2),
        ({"tensorParallelSize": 2}, {"vendor": "nvidia", "count": 2}, 2),
    ],
    ids=["one-rank-per-gpu", "cpu", "cpu-split-on-request", "explicit-matching-gpus"],
)
def test_tensor_parallelism_follows_the_pods_accelerators(
    engine: dict[str, Any], accelerator: dict[str, Any], expected: int
) -> None:
    spec = parse_manifest(manifest(engine=engine, workers={"resources": {"accelerator": accelerator}})).spec
    assert spec.engine_for("workers").tensor_parallel_size == expected


def test_a_tensor_parallel_size_other_than_the_gpus_is_refused() -> None:
    workers = {"resources": {"accelerator": {"vendor": "nvidia", "count": 4}}}
    with pytest.raises(
        ManifestError, match=r"tensorParallelSize 2 differs from spec\.workers's 4 accelerators"
    ):
        parse_manifest(manifest(engine={"tensorParallelSize": 2}, workers=workers))


GPUS_4 = {"vendor": "nvidia", "count": 4}


@pytest.mark.parametrize(
    ("engine", "workers", "expected"),
    [
        ({}, {"podsPerReplica": 2, "resources": {"accelerator": GPUS_4}}, 8),
        ({}, {"podsPerReplica": 2}, 2),
        ({"tensorParallelSize": 4}, {"podsPerReplica": 2}, 4),
        ({"tensorParallelSize": 8}, {"podsPerReplica": 2, "resources": {"accelerator": GPUS_4}}, 8),
    ],
    ids=["gpus-times-pods", "cpu-one-rank-a-pod", "cpu-two-ranks-a-pod", "explicit-matches"],
)
def test_a_replica_over_several_pods_runs_a_rank_per_device_of_each(
    engine: dict[str, Any], workers: dict[str, Any], expected: int
) -> None:
    spec = parse_manifest(manifest(engine=engine, workers=workers)).spec
    assert spec.engine_for("workers").tensor_parallel_size == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {
                "engine": {"tensorParallelSize": 4},
                "workers": {"podsPerReplica": 2, "resources": {"accelerator": GPUS_4}},
            },
            r"tensorParallelSize 4 differs from spec\.workers's 2 pods x 4 accelerators",
        ),
        (
            {"engine": {"tensorParallelSize": 3}, "workers": {"podsPerReplica": 2}},
            r"tensorParallelSize 3 does not split evenly over spec\.workers\.podsPerReplica 2",
        ),
        (
            {"engine": {"backend": "vllm"}, "workers": {"podsPerReplica": 2}},
            r"spec\.workers\.podsPerReplica 2 needs engine\.backend herd: vLLM over several pods needs a Ray",
        ),
        (
            {"engine": {"backend": "simulated"}, "workers": {"podsPerReplica": 2}},
            r"needs engine\.backend herd",
        ),
        (
            {"serving": {"mode": "disaggregated"}, "prefill": {}, "decode": {"podsPerReplica": 2}},
            r"spec\.decode\.podsPerReplica 2 serves aggregated only",
        ),
        ({"workers": {"podsPerReplica": 0}}, r"podsPerReplica"),
    ],
    ids=["gpus-mismatch", "uneven", "vllm", "simulated", "disaggregated", "zero"],
)
def test_a_replica_over_several_pods_is_refused_where_it_cannot_run(
    spec: dict[str, Any], message: str
) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_manifest(manifest(**spec))
