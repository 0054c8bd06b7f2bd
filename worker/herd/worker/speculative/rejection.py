"""Acceptance of proposed tokens by rejection sampling, keeping the target's distribution exactly.

For proposals ``d_1..d_k`` drawn from the proposer's distributions ``q_i`` and the target's
distributions ``p_i`` at the same positions (one verification pass gives ``p_1..p_{k+1}``):
``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the
token is drawn from the residual ``max(0, p_i - q_i)`` (normalized) and the rest is dropped; if all
``k`` are accepted a bonus token is drawn from ``p_{k+1}``. Every emitted token is then distributed
exactly as the target would sample it alone (Leviathan et al., 2023; Chen et al., 2023). An n-gram
proposal is deterministic, ``q_i`` a point mass: accepted with probability ``p_i(d_i)``, the
residual is ``p_i`` without ``d_i``. Greedy rows have a point-mass ``p_i`` at the argmax, so a
proposal is accepted iff it is the argmax and the tokens are those of decoding without speculation.
"""

from __future__ import annotations

import torch

__all__ = ["accept_greedy", "accept_sampled", "draw"]


def accept_greedy(target_argmax: list[int], proposal: list[int]) -> list[int]:
    """The greedy tokens: the proposal's leading run that equals the target's argmax, then the
    target's own next token (``len(target_argmax) == len(proposal) + 1``)."""
    accepted = 0
    while accepted < len(proposal) and proposal[accepted] == target_argmax[accepted]:
        accepted += 1
    return [*proposal[:accepted], target_argmax[accepted]]


def accept_sampled(
    target_probs: torch.Tensor,
    proposal: list[int],
    proposal_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Rejection sampling over ``target_probs`` ``[k + 1, vocab]`` for the ``k`` proposed ids;
    ``proposal_probs`` ``[k, vocab]`` are the proposer's distributions, ``None`` for a
    deterministic proposal. Returns the accepted ids and one more drawn from the target."""
    uniforms = torch.rand(len(proposal), generator=generator, device=target_probs.device).tolist()
    for index, token_id in enumerate(proposal):
        p = float(target_probs[index, token_id])
        q = 1.0 if proposal_probs is None else float(proposal_probs[index, token_id])
        if uniforms[index] * q < p:
            continue
        if proposal_probs is None:
            residual = target_probs[index].clone()
            residual[token_id] = 0.0
        else:
            residual = (target_probs[index] - proposal_probs[index]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # only by rounding: p(d) < q(d) leaves mass elsewhere
            residual = target_probs[index]
        return [*proposal[:index], draw(residual, generator)]
    return [*proposal, draw(target_probs[len(proposal)], generator)]


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id drawn in proportion to the nonnegative ``weights`` (unnormalized is fine), by the
    exponential race the sampler uses: ``argmax(w / e)`` with ``e ~ Exp(1)``."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / race).argmax())
