"""The engine's configuration: one validated value object, built from the manifest's ``EngineSpec``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from herd.api.crd import EngineSpec

__all__ = ["EngineConfig"]

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

    @field_validator("model_path")
    @classmethod
    def _check_model_path(cls, value: Path) -> Path:
        if not (value / "config.json").is_file():
            raise ValueError(f"model_path {value} has no config.json: pass a HF-format model folder")
        return value

    @model_validator(mode="after")
    def _check_loras(self) -> EngineConfig:
        if self.lora_modules and self.max_loras == 0:
            raise ValueError(
                "LoRA adapters need adapter slots: leave engine.maxLoras unset or set it above 0"
            )
        if self.served_name in self.lora_modules:
            raise ValueError(f"adapter name {self.served_name!r} is the base model's served name: rename it")
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
    def block_size(self) -> int:
        return self.engine.kv_cache.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len
