"""Operator-wide settings: what the planner needs beyond the ModelDeployment itself."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AutoscalerSettings", "OperatorConfig", "PlanSettings"]


class PlanSettings(BaseModel):
    """Cluster-level choices shared by every ModelDeployment the operator reconciles."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    worker_image: str = Field(default="herd-worker:0.1.0", description="Image of pools that set none.")
    vllm_image: str = Field(
        default="vllm/vllm-openai:v0.32.0",
        description="vLLM's image, for pools of engine.backend vllm whose spec names none.",
    )
    s3_image: str = Field(
        default="amazon/aws-cli:2.22.35", description="Init image that syncs s3:// sources."
    )
    epp_image: str = Field(
        default="herd-orchestrator:0.1.0",
        description="Image of the endpoint picker (herd epp) of spec.gateway.inferencePool: the orchestrator's.",
    )
    token_secret: str = Field(
        default="herd-internal-token", description="Secret whose key `token` guards the internal port."
    )
    orchestrator_service: str = "herd-orchestrator"
    orchestrator_namespace: str | None = Field(
        default=None, description="Namespace of the orchestrator Service; defaults to the resource's."
    )
    drain_seconds: int = Field(
        default=5, ge=0, description="preStop pause so the orchestrator stops routing before SIGTERM."
    )
    grace_seconds: int = Field(default=120, ge=1, description="Time a worker has to finish in-flight work.")
    fs_group: int = Field(
        default=10001, ge=0, description="Pod fsGroup, so the worker image's user can write the cache PVC."
    )
    run_as_user: int = Field(
        default=10001,
        ge=1,
        description="User and group of every container of a worker pod (never root): the worker image's.",
    )


class AutoscalerSettings(BaseModel):
    """How the autoscaler of ``spec.autoscaling`` samples and how cautious it is (see autoscale.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    interval_s: float = Field(
        default=15.0, gt=0.0, description="Seconds between metric scrapes and decisions."
    )
    stabilization_s: float = Field(
        default=300.0,
        ge=0.0,
        description="A scale-down waits this long, to the window's highest recommendation.",
    )
    tolerance: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="No change while within this of the target."
    )
    kv_high_water: float = Field(
        default=0.9,
        gt=0.0,
        le=1.0,
        description="No scale-down while the mean KV cache usage is at least this.",
    )
    scrape_timeout_s: float = Field(
        default=2.0, gt=0.0, description="A pod slower than this counts as missing."
    )
    demand_interval_s: float = Field(
        default=1.0,
        gt=0.0,
        description="Seconds between reads of the requests the gateways hold for pools at zero.",
    )


class OperatorConfig(BaseModel):
    """What ``herd operator`` is started with; kept in ``kopf.Memo`` for every handler."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kubeconfig: str | None = Field(
        default=None, description="None: in-cluster credentials, else $KUBECONFIG."
    )
    plan: PlanSettings = Field(default_factory=PlanSettings)
    autoscaler: AutoscalerSettings = Field(default_factory=AutoscalerSettings)
    retry_delay: float = Field(
        default=30.0,
        gt=0.0,
        description="Seconds before a pass that an API error failed runs again (child events act at once).",
    )
