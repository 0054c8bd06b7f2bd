"""Model architectures herd runs, by the ``architectures`` name in a HF ``config.json``."""

from __future__ import annotations

from herd.worker.layers.attention import AttentionBackend
from herd.worker.models.args import SUPPORTED_ARCHITECTURES, ModelArgs, UnsupportedModelError
from herd.worker.models.gemma import GemmaForCausalLM
from herd.worker.models.llama import LlamaForCausalLM
from herd.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from herd.worker.parallel import TensorParallel

__all__ = [
    "MODEL_CLASSES",
    "SUPPORTED_ARCHITECTURES",
    "TENSOR_PARALLEL_CLASSES",
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


TENSOR_PARALLEL_CLASSES: frozenset[type[LlamaForCausalLM]] = frozenset({LlamaForCausalLM})
"""The models that run split over ranks (Llama, Mistral, Qwen2/3); Gemma and MoE run on one."""


def build_model(
    args: ModelArgs, backend: AttentionBackend, max_positions: int, parallel: TensorParallel | None = None
) -> LlamaForCausalLM:
    """The model of ``args.architecture``; with ``parallel`` of several ranks, this rank's slice of it
    (``UnsupportedModelError`` for a family that does not split, or fewer KV heads than ranks)."""
    model_class = MODEL_CLASSES[args.architecture]
    if parallel is None or parallel.size == 1:
        return model_class(args, backend, max_positions)
    if model_class not in TENSOR_PARALLEL_CLASSES or args.num_kv_heads < parallel.size:
        raise UnsupportedModelError(
            f"a {args.architecture} with {args.num_kv_heads} KV heads cannot split over {parallel.size} ranks: "
            "tensor parallelism runs Llama, Mistral, Qwen2 and Qwen3 with at least one KV head per rank"
        )
    return LlamaForCausalLM(args, backend, max_positions, parallel=parallel)
