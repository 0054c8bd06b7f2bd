"""Model architectures herd runs, by the ``architectures`` name in a HF ``config.json``."""

from __future__ import annotations

from herd.worker.models.args import ModelArgs
from herd.worker.models.llama import LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelArgs"]

SUPPORTED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
