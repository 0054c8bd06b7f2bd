"""The engine's configuration: one validated value object, built from the manifest's ``EngineSpec``."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from herd.api.crd import EngineSpec
from herd.api.protocol import RENDEZVOUS_PORT

__all__ = ["EngineConfig", "PodGroup"]


class PodGroup(BaseModel):
    """The pods one model's ranks span (a LeaderWorkerSet group): ``size`` pods, this one being
    ``index`` (0 is the leader, which serves HTTP and runs rank 0). The ranks meet at the leader's
    rendezvous store, ``leader_host:port``; a rank that has not joined within ``join_timeout_s``
    fails the worker with its name. One pod (the default) keeps every rank on loopback."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(default=1, ge=1)
    index: int = Field(default=0, ge=0)
    leader_host: str = "127.0.0.1"
    port: int = Field(default=RENDEZVOUS_PORT, ge=1, le=65535)
    join_timeout_s: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _check_index(self) -> PodGroup:
        if self.index >= self.size:
            raise ValueError(
                f"pod index {self.index} is outside a group of {self.size} pods (0..{self.size - 1})"
            )
        return self

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    @property
    def on_loopback(self) -> bool:
        """Every rank on this machine: one pod, or a group whose leader is a loopback address (a
        test's processes). Then the store and gloo listen on 127.0.0.1 only."""
        if self.size == 1 or self.leader_host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.leader_host).is_loopback
        except ValueError:  # a DNS name, such as the one LeaderWorkerSet gives the leader
            return False

    @property
    def bind_host(self) -> str:
        """Where the leader's rendezvous store listens: loopback, or every interface for pods."""
        return "127.0.0.1" if self.on_loopback else "0.0.0.0"  # other pods dial it

    @property
    def gloo_host(self) -> str | None:
        """The address gloo's connections use: loopback, or None for the pod's own (its hostname)."""
        return "127.0.0.1" if self.on_loopback else None


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfig(BaseModel):
    """Everything an ``LLMEngine`` needs to start.

    ``model_path`` is a HF-format folder (``config.json``, ``*.safetensors``, ``tokenizer.json``).
    ``served_name`` is the OpenAI ``model`` and the model identity in every KV block hash.
    ``engine`` carries the manifest's engine settings unchanged; ``seed`` seeds unseeded sampling.
    ``lora_modules`` are the LoRA adapters (name -> PEFT folder) loaded at start.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path
    served_name: str = Field(min_length=1)
    role: Literal["unified", "prefill", "decode"] = "unified"
    engine: EngineSpec = Field(default_factory=EngineSpec)
    seed: int = 0
    lora_modules: dict[str, Path] = Field(default_factory=dict)
    group: PodGroup = Field(default_factory=PodGroup)

    @field_validator("model_path")
    @classmethod
    def _check_model_path(cls, value: Path) -> Path:
        if not (value / "config.json").is_file():
            raise ValueError(f"model_path {value} has no config.json: pass a HF-format model folder")
        return value

    @model_validator(mode="after")
    def _check_draft_model(self) -> EngineConfig:
        path = self.draft_model_path
        if path is None:
            return self
        if not (path / "config.json").is_file():
            raise ValueError(
                f"engine.speculative.draftModel {path} has no config.json: pass a HF-format model folder"
            )
        kv_cache = self.engine.kv_cache
        if self.tensor_parallel_size > 1 or kv_cache.host_memory_gib or kv_cache.disk is not None:
            # Its KV pool mirrors one device's pool block for block: not split over ranks, not moved
            # to the tiers (a block restored from one would have no draft KV).
            raise ValueError(
                "engine.speculative.method draft runs beside one device's KV pool: it cannot run with "
                "engine.tensorParallelSize above 1 or a KV tier (kvCache.hostMemoryGiB, kvCache.disk); "
                "use method ngram, or leave those out"
            )
        return self

    @property
    def draft_model_path(self) -> Path | None:
        """The folder of ``engine.speculative.draftModel``: a worker reads a ``file://`` source (the
        operator and ``herd up`` hand it one, having fetched any other)."""
        spec = self.engine.speculative
        if spec is None or spec.draft_model is None:
            return None
        if not spec.draft_model.startswith("file://"):
            raise ValueError(
                f"engine.speculative.draftModel {spec.draft_model!r}: a worker reads the draft model from a "
                "folder (file://...); the operator fetches other sources into the pod"
            )
        return Path(spec.draft_model.removeprefix("file://"))

    @model_validator(mode="after")
    def _check_loras(self) -> EngineConfig:
        if self.lora_modules and self.max_loras == 0:
            raise ValueError(
                "LoRA adapters need adapter slots: leave engine.maxLoras unset or set it above 0"
            )
        if self.served_name in self.lora_modules:
            raise ValueError(f"adapter name {self.served_name!r} is the base model's served name: rename it")
        if self.tensor_parallel_size % self.group.size:
            raise ValueError(
                f"engine.tensorParallelSize {self.tensor_parallel_size} does not split evenly over "
                f"{self.group.size} pods: give each pod the same number of ranks"
            )
        return self

    @property
    def device(self) -> torch.device:
        """The resolved device: ``auto`` picks CUDA when one is visible."""
        name = self.engine.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("engine.device is 'cuda' but no CUDA device is visible: use 'cpu' or 'auto'")
        return torch.device(name)

    def resolve_dtype(self, checkpoint_dtype: str | None) -> torch.dtype:
        """``auto`` is float32 on CPU and the checkpoint's half type (else bfloat16) on CUDA."""
        if self.engine.dtype != "auto":
            return _DTYPES[self.engine.dtype]
        if self.device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in ("bfloat16", "float16"):
            return _DTYPES[checkpoint_dtype]
        return torch.bfloat16

    @property
    def max_loras(self) -> int:
        """The adapter slots: ``engine.maxLoras``, else a default when adapters are given, else 0 (off)."""
        return self.engine.lora_slots(has_adapters=bool(self.lora_modules))

    @property
    def tensor_parallel_size(self) -> int:
        """The ranks that split the model (``engine.tensorParallelSize``; 1 when unset)."""
        return self.engine.tensor_parallel_size or 1

    @property
    def ranks_per_pod(self) -> int:
        """The ranks each pod of the group runs (one per device)."""
        return self.tensor_parallel_size // self.group.size

    @property
    def block_size(self) -> int:
        return self.engine.kv_cache.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
