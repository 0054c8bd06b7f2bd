"""The ModelDeployment custom resource (group ``herd.dev``, version ``v1alpha1``, short name ``md``).

This module is the source of truth for the schema: ``make crds`` renders ``crds/`` from it, the
operator plans from it, and ``herd up`` reads the same manifest. Field names are camelCase on the
wire (aliases) and snake_case in Python. Our own config forbids unknown keys so that a typo is an
error naming the field, never a silently ignored setting.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAME",
    "VERSION",
    "Accelerator",
    "AutoscalingObserved",
    "AutoscalingPoolStatus",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "AutoscalingTargets",
    "CacheSpec",
    "Condition",
    "EngineSpec",
    "KVCacheAwareRouting",
    "KVCacheSpec",
    "LeastRequestRouting",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "ModelDeploymentStatus",
    "ModelSpec",
    "ObjectMeta",
    "PoolName",
    "PoolSpec",
    "PoolStatus",
    "PrefixHashRouting",
    "RandomRouting",
    "Resources",
    "RoundRobinRouting",
    "RoutingSpec",
    "ServingSpec",
    "StickySessionRouting",
    "StrategyName",
]

GROUP = "herd.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SHORT_NAME = "md"

SOURCE_SCHEMES = ("hf://", "s3://", "pvc://", "file://")
PoolName = Literal["workers", "prefill", "decode"]
StrategyName = Literal[
    "round_robin", "least_request", "random", "prefix_hash", "sticky_session", "kv_cache_aware"
]
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class _Spec(BaseModel):
    """Base of herd's own configuration objects: camelCase aliases, unknown keys rejected."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, validate_default=True
    )


class CacheSpec(_Spec):
    pvc: str = Field(description="A PersistentVolumeClaim shared by every pool as the model cache.")


class ModelSpec(_Spec):
    source: str = Field(
        description="Where the weights are: hf://Org/Name, s3://bucket/prefix, pvc://claim/path or file:///path."
    )
    revision: str = Field(default="main", description="Hub revision (hf:// only).")
    served_name: str | None = Field(
        default=None, description="The OpenAI `model` name; defaults to metadata.name."
    )
    cache: CacheSpec | None = None

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        if not value.startswith(SOURCE_SCHEMES) or value in SOURCE_SCHEMES:
            raise ValueError(
                f"model.source {value!r} has no known scheme: use one of "
                + ", ".join(f"{scheme}..." for scheme in SOURCE_SCHEMES)
            )
        return value

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def location(self) -> str:
        """The source without its scheme: ``Org/Name``, ``bucket/prefix``, ``claim/path``, ``/path``."""
        return self.source.split("://", 1)[1]


class KVCacheSpec(_Spec):
    block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV block (a power of two).")
    memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of accelerator memory the worker may use (CUDA)."
    )
    memory_gib: float | None = Field(
        default=None,
        alias="memoryGiB",
        gt=0.0,
        description="KV pool size in GiB; overrides memoryUtilization (CPU default 1).",
    )
    prefix_caching: bool = True

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"engine.kvCache.blockSize must be a power of two (16, 32, ...), got {value}")
        return value


class EngineSpec(_Spec):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int = Field(default=4096, ge=16, description="Longest prompt plus output, in tokens.")
    max_batch_size: int = Field(default=64, ge=1, description="Most sequences running at once.")
    max_batch_tokens: int = Field(
        default=8192, ge=16, description="Chunked-prefill token budget per engine step."
    )
    max_queue_len: int = Field(default=1024, ge=1, description="Waiting requests before 429.")
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)


class ServingSpec(_Spec):
    mode: Literal["aggregated", "disaggregated"] = "aggregated"
    prefill_threshold_tokens: int = Field(
        default=256,
        ge=0,
        description=(
            "Disaggregated only: uncached prompt parts of at least this many tokens always prefill on the "
            "prefill pool; shorter ones (from 4 blocks on) prefill there while that worker's queued prefill "
            "tokens, theirs included, stay within this many, else on the decode worker."
        ),
    )


class Accelerator(_Spec):
    vendor: Literal["nvidia", "amd", "none"] = "none"
    count: int = Field(default=1, ge=0)


class Resources(_Spec):
    accelerator: Accelerator = Field(default_factory=Accelerator)
    cpu: str | None = None
    memory: str | None = None


class PoolSpec(_Spec):
    replicas: int = Field(default=1, ge=0)
    resources: Resources = Field(default_factory=Resources)
    image: str | None = Field(default=None, description="Worker image; defaults to the operator's.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")


class _Routing(_Spec):
    pass


class RoundRobinRouting(_Routing):
    strategy: Literal["round_robin"]


class LeastRequestRouting(_Routing):
    strategy: Literal["least_request"]


class RandomRouting(_Routing):
    strategy: Literal["random"]


class _BoundedLoad(_Routing):
    load_factor: float = Field(
        default=1.25, ge=1.0, description="A worker above loadFactor x mean in-flight requests is skipped."
    )


class PrefixHashRouting(_BoundedLoad):
    strategy: Literal["prefix_hash"]
    prefix_blocks: int = Field(default=4, ge=1, description="Leading KV blocks that form the hash key.")


class StickySessionRouting(_Routing):
    strategy: Literal["sticky_session"]
    session_header: str = "X-Session-ID"
    session_ttl_seconds: int = Field(default=3600, ge=1)


class KVCacheAwareRouting(_BoundedLoad):
    strategy: Literal["kv_cache_aware"]
    cache_weight: float = Field(default=1.0, ge=0.0, description="Weight of the cached-prefix share.")
    load_weight: float = Field(default=1.0, ge=0.0, description="Weight of the worker's load.")


RoutingSpec = Annotated[
    RoundRobinRouting
    | LeastRequestRouting
    | RandomRouting
    | PrefixHashRouting
    | StickySessionRouting
    | KVCacheAwareRouting,
    Field(discriminator="strategy"),
]


class AutoscalingTargets(_Spec):
    ttft_p95_ms: float = Field(default=1000.0, gt=0.0)
    itl_p95_ms: float = Field(default=100.0, gt=0.0)


class AutoscalingSpec(_Spec):
    """HPA-style scaling of the pool behind ``spec.replicas`` (``workers``, or ``decode`` when
    disaggregated) and, when disaggregated, of ``prefill`` (never below one replica)."""

    enabled: bool = False
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=8, ge=1)
    targets: AutoscalingTargets = Field(default_factory=AutoscalingTargets)

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) exceeds maxReplicas ({self.max_replicas})"
            )
        return self


class ModelDeploymentSpec(_Spec):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    serving: ServingSpec = Field(default_factory=ServingSpec)
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Scale target (kubectl scale): overrides workers.replicas, or decode.replicas when disaggregated.",
    )
    workers: PoolSpec = Field(default_factory=PoolSpec)
    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    routing: RoutingSpec = Field(
        default_factory=lambda: KVCacheAwareRouting(strategy="kv_cache_aware"),
        json_schema_extra={"default": {"strategy": "kv_cache_aware"}},
    )
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)

    @model_validator(mode="after")
    def _check_pools(self) -> ModelDeploymentSpec:
        if self.serving.mode == "disaggregated":
            missing = [name for name in ("prefill", "decode") if getattr(self, name) is None]
            if missing:
                raise ValueError(
                    "serving.mode disaggregated needs "
                    + " and ".join(f"spec.{name}" for name in missing)
                    + " (a pool with replicas and resources)"
                )
        else:
            extra = [name for name in ("prefill", "decode") if getattr(self, name) is not None]
            if extra:
                raise ValueError(
                    " and ".join(f"spec.{name}" for name in extra)
                    + " is only used with serving.mode: disaggregated; remove it or set the mode"
                )
        return self

    def pools(self) -> dict[PoolName, PoolSpec]:
        """The pools this spec runs, with the scale target applied to the scalable pool."""
        if self.serving.mode == "disaggregated":
            assert self.prefill is not None and self.decode is not None
            decode = (
                self.decode
                if self.replicas is None
                else self.decode.model_copy(update={"replicas": self.replicas})
            )
            return {"prefill": self.prefill, "decode": decode}
        workers = (
            self.workers
            if self.replicas is None
            else self.workers.model_copy(update={"replicas": self.replicas})
        )
        return {"workers": workers}


class ObjectMeta(BaseModel):
    """The part of Kubernetes metadata herd reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow")
    name: str
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _DNS_LABEL.match(value) or len(value) > 52:
            raise ValueError(
                f"metadata.name {value!r} must be a DNS label of at most 52 characters "
                "(lowercase letters, digits, '-'), since pool objects append a suffix"
            )
        return value


class Condition(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class PoolStatus(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    ready: str = Field(default="0/0", description="readyReplicas/desired, for printer columns.")


class AutoscalingObserved(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None
    num_requests_waiting: float = 0.0
    kv_cache_usage: float = 0.0


class AutoscalingPoolStatus(BaseModel):
    """The autoscaler's last decision for one pool."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    desired_replicas: int = 0
    last_scale_time: str | None = Field(default=None, description="When it last changed the pool's replicas.")
    reason: str = ""
    observed: AutoscalingObserved = Field(default_factory=AutoscalingObserved)


class AutoscalingStatus(AutoscalingPoolStatus):
    """The autoscaler's last decisions (written only when spec.autoscaling is on): the pool behind
    ``spec.replicas`` at the top level, the prefill pool of a disaggregated model in ``prefill``."""

    prefill: AutoscalingPoolStatus | None = Field(
        default=None, description="Disaggregated only: the decision for spec.prefill.replicas."
    )


class ModelDeploymentStatus(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    pools: dict[str, PoolStatus] = Field(default_factory=dict)
    replicas: int = 0
    selector: str = ""
    endpoint: str | None = None
    autoscaling: AutoscalingStatus | None = None


class ModelDeployment(BaseModel):
    """A whole ModelDeployment object, as ``kubectl apply`` or ``herd up`` reads it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    api_version: Literal["herd.dev/v1alpha1"]
    kind: Literal["ModelDeployment"]
    metadata: ObjectMeta
    spec: ModelDeploymentSpec
    status: ModelDeploymentStatus | None = None

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.metadata.name
