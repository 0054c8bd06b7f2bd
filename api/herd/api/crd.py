"""The ModelDeployment custom resource (group ``herd.dev``, version ``v1alpha1``, short name ``md``).

This module is the source of truth for the schema: ``make crds`` renders ``crds/`` from it, the
operator plans from it, and ``herd up`` reads the same manifest. Field names are camelCase on the
wire (aliases) and snake_case in Python. Our own config forbids unknown keys so that a typo is an
error naming the field, never a silently ignored setting.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from herd.api.openai import LORA_NAME_PATTERN
from herd.api.protocol import Role

__all__ = [
    "API_VERSION",
    "DEFAULT_MAX_LORAS",
    "GROUP",
    "KIND",
    "PLURAL",
    "POOL_ROLES",
    "SHORT_NAME",
    "VERSION",
    "Accelerator",
    "AdapterSpec",
    "AdapterStatus",
    "AutoscalingObserved",
    "AutoscalingPoolStatus",
    "AutoscalingSpec",
    "AutoscalingStatus",
    "AutoscalingTargets",
    "BackendName",
    "CacheSpec",
    "Condition",
    "CostModel",
    "EngineSpec",
    "GatewaySpec",
    "KVCacheAwareRouting",
    "KVCacheSpec",
    "KVDiskSpec",
    "LeastRequestRouting",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "ModelDeploymentStatus",
    "ModelSpec",
    "ObjectMeta",
    "PoolEngineSpec",
    "PoolKVCacheSpec",
    "PoolName",
    "PoolSpec",
    "PoolStatus",
    "PrefixHashRouting",
    "RandomRouting",
    "Resources",
    "RoundRobinRouting",
    "RoutingSpec",
    "ServingSpec",
    "SimulationSpec",
    "SpeculativeSpec",
    "StickySessionRouting",
    "StrategyName",
    "TierWeights",
    "VLLMSpec",
]

GROUP = "herd.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
SHORT_NAME = "md"

SOURCE_SCHEMES = ("hf://", "s3://", "pvc://", "file://")
PoolName = Literal["workers", "prefill", "decode"]
POOL_ROLES: dict[PoolName, Role] = {"workers": "unified", "prefill": "prefill", "decode": "decode"}
"""The worker role each pool's pods run (their ``herd.dev/role`` label)."""
StrategyName = Literal[
    "round_robin", "least_request", "random", "prefix_hash", "sticky_session", "kv_cache_aware"
]
BackendName = Literal["herd", "vllm", "simulated"]
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class _Spec(BaseModel):
    """Base of herd's own configuration objects: camelCase aliases, unknown keys rejected, and no
    infinite or NaN number (YAML's ``.inf`` and ``.nan``), which no setting means."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_default=True,
        allow_inf_nan=False,
    )


class CacheSpec(_Spec):
    pvc: str = Field(description="A PersistentVolumeClaim shared by every pool as the model cache.")


def _check_source(value: str, where: str) -> str:
    if not value.startswith(SOURCE_SCHEMES) or value in SOURCE_SCHEMES:
        raise ValueError(
            f"{where} {value!r} has no known scheme: use one of "
            + ", ".join(f"{scheme}..." for scheme in SOURCE_SCHEMES)
        )
    return value


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
        return _check_source(value, "model.source")

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def location(self) -> str:
        """The source without its scheme: ``Org/Name``, ``bucket/prefix``, ``claim/path``, ``/path``."""
        return self.source.split("://", 1)[1]


class KVDiskSpec(_Spec):
    """The local-disk KV tier: one preallocated file of ``sizeGiB`` in ``path`` (a fast local disk, an
    emptyDir or a hostPath). A full or failing disk turns the tier off with one log line."""

    path: str = Field(min_length=1, description="Folder for the tier's file; created if missing.")
    size_gib: float = Field(alias="sizeGiB", gt=0.0, description="Size of the tier's file in GiB.")


class AdapterSpec(_Spec):
    """A LoRA adapter (PEFT format) of the base model, served under its own ``name``."""

    name: str = Field(pattern=LORA_NAME_PATTERN, description="The OpenAI `model` that selects the adapter.")
    source: str = Field(
        description="Where the adapter is, with the model's schemes (hf://, s3://, pvc://, file://)."
    )
    rank: int | None = Field(
        default=None, ge=1, description="Its LoRA rank, checked against engine.maxLoraRank."
    )

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        return _check_source(value, "adapters[].source")

    def as_model(self) -> ModelSpec:
        """The adapter's source as a ``ModelSpec``, to be fetched or mounted as a model is."""
        return ModelSpec(source=self.source)


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
    host_memory_gib: float = Field(
        default=0.0,
        alias="hostMemoryGiB",
        ge=0.0,
        description="Host-memory tier in GiB: blocks evicted from the KV pool move here and are restored "
        "on a prefix hit instead of recomputed; 0 turns it off.",
    )
    disk: KVDiskSpec | None = Field(
        default=None, description="A local-disk tier below the host tier (needs hostMemoryGiB > 0)."
    )

    @model_validator(mode="after")
    def _check_tiers(self) -> KVCacheSpec:
        if self.disk is not None and self.host_memory_gib == 0:
            raise ValueError(
                "engine.kvCache.disk takes the blocks the host tier evicts: set engine.kvCache.hostMemoryGiB > 0"
            )
        return self

    @field_validator("block_size")
    @classmethod
    def _check_block_size(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"engine.kvCache.blockSize must be a power of two (16, 32, ...), got {value}")
        return value


class CostModel(_Spec):
    """What one step of the simulated engine costs, in milliseconds: ``stepMs`` per step, ``seqMs``
    per sequence in the batch, ``tokenMs`` per scheduled token (prefill and decode alike) and
    ``contextUs`` microseconds per token of context the batch's chunks attend to (a decode step
    reads its sequences' whole KV); ``hostShare`` says how much of that time the host's CPU works.
    ``herd bench calibrate`` fits it from the real engine; the
    defaults are near SmolLM2-135M in fp32 on one CPU thread (a 300-token prefill about 0.5 s, a
    decode step 60 ms; a block restored from host memory in 0.11 ms, from a disk file in the page cache
    in 1.2 ms)."""

    step_ms: float = Field(default=60.0, ge=0.0, description="Fixed cost of a step.")
    seq_ms: float = Field(default=0.0, ge=0.0, description="Cost per sequence in the batch.")
    token_ms: float = Field(default=1.5, ge=0.0, description="Cost per scheduled token.")
    context_us: float = Field(
        default=0.0, ge=0.0, description="Microseconds per context token the batch attends to."
    )
    host_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of a step the engine's thread keeps the host CPU busy (its CPU time over the "
        "step's wall time); a simulated worker spins for that share, holding a core and the GIL as the "
        "real step does, and sleeps the rest. 0 models an accelerator that leaves the host idle.",
    )

    host_gbps: float = Field(
        default=6.5,
        alias="hostGBps",
        gt=0.0,
        description="GB a second moved between the KV pool and the host tier (either way).",
    )
    disk_gbps: float = Field(
        default=0.6, alias="diskGBps", gt=0.0, description="GB a second moved to or from the disk tier."
    )

    def move_seconds(self, num_bytes: int, *, disk: bool) -> float:
        """The modelled time of moving ``num_bytes`` of KV between tiers (through the disk or not)."""
        return num_bytes / ((self.disk_gbps if disk else self.host_gbps) * 1e9)

    def step_seconds(self, num_tokens: int, num_seqs: int = 0, num_context_tokens: int = 0) -> float:
        """The modelled duration of a step, in seconds."""
        total_ms = self.step_ms + self.seq_ms * num_seqs + self.token_ms * num_tokens
        return (total_ms + self.context_us * num_context_tokens / 1000.0) / 1000.0


class SimulationSpec(_Spec):
    """The simulated backend: herd's scheduler, block manager, prefix cache and server over a cost
    model instead of the forward pass; only the model's config and tokenizer are read."""

    cost_model: CostModel = Field(
        default_factory=CostModel, description="Step cost; paste `herd bench calibrate`'s output here."
    )


class VLLMSpec(_Spec):
    """The vllm backend: a vLLM server and herd's sidecar in each worker pod."""

    image: str | None = Field(default=None, description="vLLM's image; defaults to the operator's.")
    extra_args: list[str] = Field(
        default_factory=list, description="Arguments appended to `vllm serve` (after herd's own)."
    )


class SpeculativeSpec(_Spec):
    """Speculative decoding: cheap proposals of the next ``numTokens`` tokens, verified by the model
    in one forward pass and accepted by rejection sampling, so outputs keep the model's distribution
    (greedy: the very tokens it decodes without speculation). ``ngram`` looks the last tokens up in
    the prompt and the output so far (no second model); ``draft`` runs ``draftModel``, a smaller
    model with the same tokenizer. With ``adaptive`` the engine proposes fewer tokens, down to none,
    where its measured acceptance and step times say speculation would cost more than it saves
    (large batches)."""

    method: Literal["ngram", "draft"] = Field(description="How proposals are made: ngram or draft.")
    draft_model: str | None = Field(
        default=None,
        description="method draft only: the draft model's weights, a source as model.source "
        "(hf://, s3://, pvc://, file://), with the target's tokenizer and vocabulary.",
    )
    num_tokens: int = Field(default=4, ge=1, le=16, description="Most tokens proposed per sequence and step.")
    adaptive: bool = Field(
        default=True,
        description="Choose the tokens proposed per step (numTokens down to none) from the batch size, "
        "the measured acceptance and the measured step cost.",
    )
    prompt_lookup_min: int = Field(
        default=2, ge=1, le=16, description="method ngram: shortest n-gram matched."
    )
    prompt_lookup_max: int = Field(
        default=4, ge=1, le=16, description="method ngram: longest n-gram matched."
    )

    @model_validator(mode="after")
    def _check_method(self) -> SpeculativeSpec:
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("engine.speculative.method draft needs draftModel: the draft model's source")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("engine.speculative.draftModel applies to method draft only: remove it")
        if self.draft_model is not None:
            ModelSpec(source=self.draft_model)  # the same schemes as model.source
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"engine.speculative.promptLookupMin ({self.prompt_lookup_min}) exceeds "
                f"promptLookupMax ({self.prompt_lookup_max})"
            )
        return self


DEFAULT_MAX_LORAS = 4
"""``engine.maxLoras`` when unset and the worker has adapters to serve."""


class EngineSpec(_Spec):
    backend: BackendName = Field(
        default="herd",
        description="What runs the model: herd's engine, a vLLM server behind herd's sidecar, or the "
        "simulated engine (a fitted cost model, no weights).",
    )
    task: Literal["auto", "generate", "embed"] = Field(
        default="auto",
        description="What the model serves: generate (chat and text completions), embed (/v1/embeddings: an "
        "encoder such as BERT, batched by the same engine), or auto: what the checkpoint is (an encoder embeds).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int = Field(default=4096, ge=16, description="Longest prompt plus output, in tokens.")
    max_batch_size: int = Field(default=64, ge=1, description="Most sequences running at once.")
    max_batch_tokens: int = Field(
        default=8192, ge=16, description="Chunked-prefill token budget per engine step."
    )
    max_queue_len: int = Field(default=1024, ge=1, description="Waiting requests before 429.")
    max_loras: int | None = Field(
        default=None,
        ge=0,
        le=256,
        description="LoRA adapters one engine step may run (the adapter slots on the device); 0 turns "
        f"LoRA off. Unset: {DEFAULT_MAX_LORAS} when the deployment lists adapters, else off.",
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=512, description="The largest adapter rank a worker loads."
    )
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        description="Ranks (one process each) that split the model's layers over one replica's pods; unset: the "
        "pool's resources.accelerator.count (else 1) times its podsPerReplica (set it to split a CPU worker).",
    )
    kv_cache: KVCacheSpec = Field(default_factory=KVCacheSpec)
    simulation: SimulationSpec | None = Field(default=None, description="backend simulated only.")
    vllm: VLLMSpec | None = Field(default=None, description="backend vllm only.")
    speculative: SpeculativeSpec | None = Field(
        default=None, description="Speculative decoding; off if absent."
    )

    def lora_slots(self, *, has_adapters: bool) -> int:
        """``maxLoras`` resolved: as given, else the default when there are adapters, else 0 (off)."""
        if self.max_loras is not None:
            return self.max_loras
        return DEFAULT_MAX_LORAS if has_adapters else 0

    @model_validator(mode="after")
    def _check_backend_blocks(self) -> EngineSpec:
        for block, backend in BACKEND_BLOCKS.items():
            if getattr(self, block) is not None and self.backend != backend:
                raise ValueError(backend_block_message(block, backend))
        if (
            self.backend == "simulated"
            and self.speculative is not None
            and self.speculative.method == "draft"
        ):
            raise ValueError(
                "engine.speculative.method draft needs a model to run: the simulated backend has none; "
                "use method ngram or backend herd"
            )
        if self.task == "embed" and self.backend == "simulated":
            raise ValueError(
                "engine.task embed runs on backend herd or vllm: the simulated engine's cost model "
                "models generation only"
            )
        if self.task == "embed" and self.speculative is not None:
            raise ValueError(
                "engine.speculative applies to generation: an embedding model (engine.task embed) decodes "
                "nothing; remove engine.speculative"
            )
        return self


BACKEND_BLOCKS: dict[str, BackendName] = {"simulation": "simulated", "vllm": "vllm"}
"""The engine blocks that belong to one backend each."""


def backend_block_message(block: str, backend: str) -> str:
    return f"engine.{block} applies only to engine.backend {backend}: remove it or set backend: {backend}"


VLLM_DISAGGREGATED = (
    "engine.backend vllm serves aggregated only (herd's KV handoff needs herd's engine): "
    "set serving.mode: aggregated, or backend: herd"
)


def _refuse_shared(data: Any, shared: dict[str, str], where: str) -> Any:
    """A pool's engine block may not set what every pool must share; name the field and the fix."""
    if isinstance(data, dict):
        for key in map(to_camel, data):
            if key in shared:
                raise ValueError(
                    f"{where}.{key} must be the same in every pool ({shared[key]}): "
                    f"set it in spec.{where} instead of a pool's engine"
                )
    return data


class PoolKVCacheSpec(_Spec):
    """A pool's KV pool size; given here, it replaces ``spec.engine.kvCache``'s sizing."""

    memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    memory_gib: float | None = Field(default=None, alias="memoryGiB", gt=0.0)

    @model_validator(mode="before")
    @classmethod
    def _check_shared(cls, data: Any) -> Any:
        shared = {"blockSize": "blocks move between pools as stored", "prefixCaching": "KV handoff needs it"}
        return _refuse_shared(data, shared, "engine.kvCache")


class PoolEngineSpec(_Spec):
    """Engine settings one pool sets apart from ``spec.engine`` (a prefill pool with a large
    chunk budget, a decode pool with large batches): batch, queue and KV pool sizes. The model's
    layout stays one for every pool, since KV blocks move between pools as they are stored."""

    max_batch_size: int | None = Field(default=None, ge=1)
    max_batch_tokens: int | None = Field(default=None, ge=16)
    max_queue_len: int | None = Field(default=None, ge=1)
    kv_cache: PoolKVCacheSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_shared(cls, data: Any) -> Any:
        shared = {
            "dtype": "blocks move between pools as stored",
            "device": "it decides the dtype, so the KV layout",
            "maxModelLen": "a request admitted by one pool must fit the other",
        }
        return _refuse_shared(data, shared, "engine")


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


MAX_REPLICAS = 2**31 - 1
"""A Deployment's ``spec.replicas`` is a 32-bit integer: a larger count could never be applied."""


class Accelerator(_Spec):
    vendor: Literal["nvidia", "amd", "none"] = "none"
    count: int = Field(default=1, ge=0)


class Resources(_Spec):
    accelerator: Accelerator = Field(default_factory=Accelerator)
    cpu: str | None = None
    memory: str | None = None

    @property
    def num_devices(self) -> int:
        """The accelerators of one pod (1 without any: the CPU)."""
        return self.accelerator.count if self.accelerator.vendor != "none" and self.accelerator.count else 1


class PoolSpec(_Spec):
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    pods_per_replica: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Pods (nodes) one replica's model spans, each with `resources`: above 1, each replica is a "
        "LeaderWorkerSet group (the leader serves, the other pods run its tensor-parallel ranks). backend herd, "
        "aggregated serving only.",
    )
    resources: Resources = Field(default_factory=Resources)
    image: str | None = Field(default=None, description="Worker image; defaults to the operator's.")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")
    engine: PoolEngineSpec | None = Field(
        default=None, description="This pool's batch, queue and KV pool sizes, over spec.engine."
    )


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


class TierWeights(_Spec):
    """What a block held in a tier below the device counts for, as a share of a device hit
    (``tierCost: weights``; llm-d's scorer weighs the host tier 0.8)."""

    host: float = Field(default=0.8, ge=0.0, le=1.0)
    disk: float = Field(default=0.8, ge=0.0, le=1.0)


class KVCacheAwareRouting(_BoundedLoad):
    strategy: Literal["kv_cache_aware"]
    cache_weight: float = Field(default=1.0, ge=0.0, description="Weight of the cached-prefix share.")
    load_weight: float = Field(default=1.0, ge=0.0, description="Weight of the worker's load.")
    tier_cost: Literal["measured", "weights", "device"] = Field(
        default="measured",
        description="How a prefix held in a worker's host or disk tier counts: its restore time from the "
        "worker's measured bandwidths (measured), a fixed share of a device hit (weights, tierWeights), "
        "or not at all (device: tier-blind).",
    )
    tier_weights: TierWeights = Field(default_factory=TierWeights)
    peer_pulls: bool = Field(
        default=False,
        description="A worker may pull a prompt's leading blocks from a peer whose device or host tier "
        "holds them, when its measured pull time is below the prefill time they would take "
        "(tierCost measured).",
    )


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
    min_replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    max_replicas: int = Field(default=8, ge=1, le=MAX_REPLICAS)
    targets: AutoscalingTargets = Field(default_factory=AutoscalingTargets)
    scale_to_zero_after_seconds: int = Field(
        default=300,
        ge=1,
        description="With minReplicas 0: the serving pool goes to zero after this long without a request.",
    )
    cold_start_timeout_seconds: int = Field(
        default=120,
        ge=1,
        description="With minReplicas 0: how long the gateway holds a request while the model has no ready "
        "worker, before it answers 503 with Retry-After.",
    )

    @property
    def scales_to_zero(self) -> bool:
        """Whether the serving pool goes to zero when idle and comes back on demand."""
        return self.enabled and self.min_replicas == 0

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) exceeds maxReplicas ({self.max_replicas})"
            )
        return self


class GatewaySpec(_Spec):
    """How Envoy-based gateways reach the model (the Gateway API Inference Extension)."""

    inference_pool: bool = Field(
        default=False,
        description="Also create an InferencePool (inference.networking.k8s.io/v1) selecting the worker pods, "
        "with herd's endpoint picker (a Deployment and Service <name>-epp) as its endpointPickerRef.",
    )


class ModelDeploymentSpec(_Spec):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    serving: ServingSpec = Field(default_factory=ServingSpec)
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=MAX_REPLICAS,
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
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="LoRA adapters every worker of every pool loads at start (more load at runtime).",
    )

    @model_validator(mode="after")
    def _check_adapters(self) -> ModelDeploymentSpec:
        names = [adapter.name for adapter in self.adapters]
        if len(set(names)) < len(names):
            raise ValueError(f"adapters[].name must be unique, got {names}")
        if self.engine.max_loras == 0 and self.adapters:
            raise ValueError("adapters need LoRA slots: leave engine.maxLoras unset or set it above 0")
        for adapter in self.adapters:
            if adapter.rank is not None and adapter.rank > self.engine.max_lora_rank:
                raise ValueError(
                    f"adapter {adapter.name!r} has rank {adapter.rank}, above engine.maxLoraRank "
                    f"{self.engine.max_lora_rank}: raise maxLoraRank"
                )
        return self

    @model_validator(mode="after")
    def _check_pools(self) -> ModelDeploymentSpec:
        if self.gateway.inference_pool and self.serving.mode == "disaggregated":
            raise ValueError(
                "gateway.inferencePool needs serving.mode aggregated: a gateway sends each request to "
                "one endpoint, and a disaggregated model needs herd's gateway for its two phases"
            )
        if self.serving.mode == "disaggregated" and self.engine.backend == "vllm":
            raise ValueError(VLLM_DISAGGREGATED)
        speculative = self.engine.speculative
        if self.serving.mode == "disaggregated" and speculative is not None and speculative.method == "draft":
            raise ValueError(
                "engine.speculative.method draft serves aggregated only (KV blocks handed between pools carry "
                "the target's KV, not the draft's): use method ngram, or serving.mode: aggregated"
            )
        size = self.engine.tensor_parallel_size
        for name, pool in self.pools().items():
            pods = pool.pods_per_replica
            devices = pool.resources.num_devices * pods
            if size is not None and pool.resources.accelerator.vendor != "none" and size != devices:
                held = f"{pods} pods x {pool.resources.num_devices}" if pods > 1 else str(devices)
                raise ValueError(
                    f"engine.tensorParallelSize {size} differs from spec.{name}'s {held} accelerators: "
                    "a worker pod runs one rank per accelerator; leave tensorParallelSize out or match them"
                )
            if pods > 1:
                _check_multi_pod(self, name, pods)
        if self.serving.mode == "disaggregated" and (self.engine.tensor_parallel_size or 1) > 1:
            raise ValueError(
                "engine.tensorParallelSize above 1 serves aggregated only: the KV handoff moves whole "
                "heads, which tensor parallelism splits over ranks; set serving.mode: aggregated"
            )
        if self.serving.mode == "disaggregated" and self.engine.task == "embed":
            raise ValueError(
                "engine.task embed serves aggregated only: an embedding is one prefill, with no decode "
                "to hand off; set serving.mode: aggregated"
            )
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

    @property
    def serving_pool(self) -> PoolName:
        """The pool that answers clients (``workers``, or ``decode`` when disaggregated): the one
        ``spec.replicas`` and the scale subresource size."""
        return "decode" if self.serving.mode == "disaggregated" else "workers"

    def pools(self) -> dict[PoolName, PoolSpec]:
        """The pools this spec runs, with the scale target applied to the serving pool."""
        pools: dict[PoolName, PoolSpec | None] = (
            {"prefill": self.prefill, "decode": self.decode}
            if self.serving.mode == "disaggregated"
            else {"workers": self.workers}
        )
        resolved = {name: pool for name, pool in pools.items() if pool is not None}
        if self.replicas is not None:
            serving = resolved[self.serving_pool]
            resolved[self.serving_pool] = serving.model_copy(update={"replicas": self.replicas})
        return resolved

    def engine_for(self, pool: PoolName) -> EngineSpec:
        """``spec.engine`` with ``pool``'s own ``engine`` settings over it (a pool's ``kvCache``
        replaces the model's KV sizing as a whole: its ``memoryGiB``, or its utilization alone)."""
        pool_spec = self.pools()[pool]
        engine = self.engine
        if engine.tensor_parallel_size is None:
            ranks = pool_spec.resources.num_devices * pool_spec.pods_per_replica
            engine = engine.model_copy(update={"tensor_parallel_size": ranks})
        spec = pool_spec.engine
        if spec is None:
            return engine
        changes: dict[str, Any] = spec.model_dump(exclude_none=True, exclude={"kv_cache"})
        if spec.kv_cache is not None:
            sizing = {"memory_gib": spec.kv_cache.memory_gib}
            if spec.kv_cache.memory_utilization is not None:
                sizing["memory_utilization"] = spec.kv_cache.memory_utilization
            changes["kv_cache"] = engine.kv_cache.model_copy(update=sizing)
        return engine.model_copy(update=changes)


def _check_multi_pod(spec: ModelDeploymentSpec, pool: str, pods: int) -> None:
    """A replica over several pods runs herd's engine, aggregated, with whole ranks on every pod."""
    where = f"spec.{pool}.podsPerReplica {pods}"
    if spec.engine.backend != "herd":
        raise ValueError(
            f"{where} needs engine.backend herd: vLLM over several pods needs a Ray cluster (or its "
            "multi-node launcher) in every group, which herd does not start yet; the simulated engine "
            "has no ranks. Use podsPerReplica: 1, or backend: herd"
        )
    if spec.serving.mode == "disaggregated":
        raise ValueError(
            f"{where} serves aggregated only (tensor parallelism does): set serving.mode: aggregated"
        )
    size = spec.engine.tensor_parallel_size
    if size is not None and size % pods:
        raise ValueError(
            f"engine.tensorParallelSize {size} does not split evenly over {where}: every pod runs the "
            "same number of ranks"
        )


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
    num_requests_held: float = Field(
        default=0.0, description="Requests the gateways hold for the model while it has no ready worker."
    )
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


class AdapterStatus(BaseModel):
    """Where one of ``spec.adapters`` is loaded: the Ready worker pods started with it (a worker
    loads every adapter of its command line before it reports Ready). Adapters loaded or unloaded at
    runtime through the gateway are not counted here; the gateway's ``/v1/models`` lists them."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    name: str
    source: str
    loaded_on: list[str] = Field(default_factory=list, description="Ready worker pods that loaded it.")


class ModelDeploymentStatus(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    pools: dict[str, PoolStatus] = Field(default_factory=dict)
    replicas: int = 0
    selector: str = ""
    endpoint: str | None = None
    autoscaling: AutoscalingStatus | None = None
    adapters: list[AdapterStatus] | None = Field(
        default=None, description="spec.adapters: where each is loaded."
    )


class ModelDeployment(BaseModel):
    """A whole ModelDeployment object, as ``kubectl apply`` or ``herd up`` reads it."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")
    api_version: Literal["herd.dev/v1alpha1"]
    kind: Literal["ModelDeployment"]
    metadata: ObjectMeta
    spec: ModelDeploymentSpec
    status: ModelDeploymentStatus | None = None

    @classmethod
    def from_object(cls, body: Mapping[str, Any]) -> ModelDeployment:
        """Validate an object the API server returned: its status and server-set fields are ignored
        (the status is the operator's output, not its input). Raises pydantic's ``ValidationError``."""
        return cls.model_validate({key: body.get(key) for key in _SPEC_KEYS})

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.metadata.name

    @model_validator(mode="after")
    def _check_adapter_names(self) -> ModelDeployment:
        if any(adapter.name == self.served_name for adapter in self.spec.adapters):
            raise ValueError(f"an adapter is named {self.served_name!r}, the served model's name: rename it")
        return self


_SPEC_KEYS = ("apiVersion", "kind", "metadata", "spec")
