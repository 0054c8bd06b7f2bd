"""Qwen3-MoE: Qwen3's decoder (q/k norms) whose sparse layers' MLP is a top-k mixture of experts.

The router (``mlp.gate``) scores every expert; each token goes to its ``num_experts_per_tok``
best, weighted by their softmax probabilities (renormalized over the chosen ones when
``norm_topk_prob``). The layers in ``mlp_only_layers``, or off the ``decoder_sparse_step``, keep
the dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

import torch
from torch import nn

from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.linear import Linear
from herd.worker.layers.moe import FusedExperts, route
from herd.worker.models.args import ModelArgs, MoEArgs
from herd.worker.models.llama import ACTIVATIONS, LlamaForCausalLM

__all__ = ["Qwen3MoeForCausalLM", "Qwen3MoeSparseBlock"]


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, args: ModelArgs, moe: MoEArgs) -> None:
        super().__init__()
        self.top_k, self.normalize = moe.top_k, moe.normalize_top_k
        self.gate = Linear(args.hidden_size, {"gate": moe.num_experts}, bias=False)
        self.experts = FusedExperts(
            moe.num_experts, args.hidden_size, moe.intermediate_size, ACTIVATIONS[args.hidden_act]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, normalize=self.normalize)
        return self.experts(x, weights, experts)  # type: ignore[no-any-return]


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(args, backend, max_positions)
        assert args.moe is not None
        for index in sorted(args.moe.sparse_layers):
            layer = self.model.layers[index]
            assert isinstance(layer, nn.Module)
            layer.mlp = Qwen3MoeSparseBlock(args, args.moe)
