"""Mixture-of-experts MLP: top-k routing and a batched dispatch of tokens to experts.

Every token picks ``top_k`` experts (``route``). The dispatch then sorts the step's ``T * top_k``
(token, expert) pairs by expert, so each expert's tokens are one contiguous run of rows, and runs
every expert's gated MLP over its run at once: one grouped GEMM over all experts
(``torch.nn.functional.grouped_mm``, where torch has a kernel for the device and dtype: CPU, and
bfloat16 on CUDA), else one GEMM per expert that has tokens. No loop runs per token; the cost is
one gather of the rows in expert order and one scatter back, weighted by the routing weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional

__all__ = ["FusedExperts", "grouped_linear", "route"]


def route(router_logits: torch.Tensor, top_k: int, *, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)``, each ``[T, top_k]``: the softmax (in float32) of the router's logits
    at its ``top_k`` experts, renormalized to sum to 1 when ``normalize``, in the logits' dtype."""
    probs = functional.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def grouped_linear(
    rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, *, grouped: bool
) -> torch.Tensor:
    """``rows[i] @ weight[e].T`` for each row, where the rows come sorted by expert ``e`` and
    ``counts[e]`` of them belong to expert ``e``; ``grouped`` runs one grouped GEMM, else one GEMM
    per expert with rows (a single device-to-host copy of ``counts``)."""
    if grouped:
        offsets = counts.cumsum(0).to(torch.int32)
        return functional.grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    out = rows.new_empty(rows.shape[0], weight.shape[1])
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            torch.mm(rows[start : start + count], weight[expert].t(), out=out[start : start + count])
            start += count
    return out


def _has_grouped_kernel(x: torch.Tensor, intermediate_size: int) -> bool:
    """Whether ``grouped_mm`` runs here: on CPU, or CUDA in bfloat16, with rows of a multiple of 16 bytes."""
    is_aligned = all(size * x.element_size() % 16 == 0 for size in (x.shape[-1], intermediate_size))
    return is_aligned and (x.device.type == "cpu" or (x.device.type == "cuda" and x.dtype == torch.bfloat16))


class FusedExperts(nn.Module):
    """``num_experts`` gated MLPs in two stacked weights: ``gate_up_proj`` ``[E, 2I, H]`` (each
    expert's ``gate_proj`` rows, then its ``up_proj`` rows) and ``down_proj`` ``[E, H, I]``."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.activation = activation

    def checkpoint_shards(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, the slice it loads into)``: the per-expert tensors of a HF checkpoint
        (``{prefix}{e}.gate_proj.weight``, ...), ``prefix`` naming this module, dot included."""
        size = self.intermediate_size
        for expert in range(self.num_experts):
            yield f"{prefix}{expert}.gate_proj.weight", self.gate_up_proj[expert, :size]
            yield f"{prefix}{expert}.up_proj.weight", self.gate_up_proj[expert, size:]
            yield f"{prefix}{expert}.down_proj.weight", self.down_proj[expert]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token ``x[t]`` ``[T, H]`` through its experts ``experts[t]``, summed by ``weights[t]``."""
        num_tokens, top_k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        grouped = _has_grouped_kernel(x, self.intermediate_size)
        rows = x[order // top_k]
        gate, up = grouped_linear(rows, self.gate_up_proj, counts, grouped=grouped).chunk(2, dim=-1)
        out = grouped_linear(self.activation(gate) * up, self.down_proj, counts, grouped=grouped)
        out = out * weights.flatten()[order].unsqueeze(-1)
        by_token = torch.empty_like(out).index_copy_(0, order, out)
        return by_token.view(num_tokens, top_k, -1).sum(dim=1)
