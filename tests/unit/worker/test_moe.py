"""The mixture-of-experts layer: routing, and the batched dispatch against a token-by-token reference."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from herd.worker.layers.moe import FusedExperts, grouped_linear, route

NUM_EXPERTS, HIDDEN, INTERMEDIATE = 6, 16, 8


def make_experts(hidden: int = HIDDEN, intermediate: int = INTERMEDIATE) -> FusedExperts:
    torch.manual_seed(0)
    experts = FusedExperts(NUM_EXPERTS, hidden, intermediate, functional.silu)
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    return experts


def reference(
    experts: FusedExperts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
) -> torch.Tensor:
    """Each (token, pick) through a copy of its own expert's weights: no sorting, no grouping."""
    gate, up = torch.einsum("tkoh,th->tko", experts.gate_up_proj[chosen], x).chunk(2, dim=-1)
    down = torch.einsum("tkhi,tki->tkh", experts.down_proj[chosen], functional.silu(gate) * up)
    return (down * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("normalize", [True, False])
def test_route_picks_the_top_k_softmax_probabilities(normalize: bool) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.0]])
    weights, chosen = route(logits, 2, normalize=normalize)
    probs = logits.softmax(dim=-1)
    assert chosen[0].tolist() == [1, 2] and sorted(chosen[1].tolist()) == [0, 3]
    expected = probs.topk(2).values
    if normalize:
        expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, expected)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_dispatch_equals_each_token_through_its_experts(num_tokens: int, top_k: int) -> None:
    experts = make_experts()
    x = torch.randn(num_tokens, HIDDEN)
    weights, chosen = route(torch.randn(num_tokens, NUM_EXPERTS), top_k, normalize=False)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, chosen), reference(experts, x, weights, chosen))


def test_grouped_gemm_and_per_expert_gemms_agree() -> None:
    weight = torch.randn(NUM_EXPERTS, 12, HIDDEN)
    counts = torch.tensor([3, 0, 5, 1, 0, 7])  # experts without tokens among them
    rows = torch.randn(int(counts.sum()), HIDDEN)
    expected = torch.cat([rows[start:end] @ weight[e].T for e, (start, end) in enumerate(_runs(counts))])
    for grouped in (True, False):
        torch.testing.assert_close(grouped_linear(rows, weight, counts, grouped=grouped), expected)


def test_checkpoint_names_fill_each_experts_rows() -> None:
    experts = make_experts()
    shards = dict(experts.checkpoint_shards("model.layers.0.mlp.experts."))
    assert len(shards) == 3 * NUM_EXPERTS
    with torch.no_grad():
        shards["model.layers.0.mlp.experts.4.up_proj.weight"].fill_(7.0)
        shards["model.layers.0.mlp.experts.4.down_proj.weight"].fill_(3.0)
    assert (experts.gate_up_proj[4, INTERMEDIATE:] == 7.0).all() and (
        experts.gate_up_proj[4, :INTERMEDIATE] != 7.0
    ).all()
    assert (experts.down_proj[4] == 3.0).all() and (experts.down_proj[3] != 3.0).all()


def _runs(counts: torch.Tensor) -> list[tuple[int, int]]:
    ends = counts.cumsum(0).tolist()
    return [(end - count, end) for end, count in zip(ends, counts.tolist(), strict=True)]


def test_sizes_the_grouped_kernel_cannot_take_run_per_expert() -> None:
    experts = make_experts(hidden=6, intermediate=5)  # 24- and 20-byte rows: not 16-byte aligned
    x = torch.randn(7, 6)
    weights, chosen = route(torch.randn(7, NUM_EXPERTS), 2, normalize=True)
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, chosen), reference(experts, x, weights, chosen))
