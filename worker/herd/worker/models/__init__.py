"""Model architectures herd runs, by the ``architectures`` name in a HF ``config.json``."""

from __future__ import annotations

from herd.worker.layers.attention import AttentionBackend
from herd.worker.models.args import SUPPORTED_ARCHITECTURES, ModelArgs, UnsupportedModelError
from herd.worker.models.gemma import GemmaForCausalLM
from herd.worker.models.llama import LlamaForCausalLM
from herd.worker.models.qwen3_moe import Qwen3MoeForCausalLM

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelArgs",
    "UnsupportedModelError",
    "build_model",
]

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}
"""Every architecture ``ModelArgs`` parses, and the model that runs it."""


def build_model(args: ModelArgs, backend: AttentionBackend, max_positions: int) -> LlamaForCausalLM:
    return MODEL_CLASSES[args.architecture](args, backend, max_positions)
