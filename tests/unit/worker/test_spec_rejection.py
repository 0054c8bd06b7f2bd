"""Rejection sampling keeps the target's distribution: greedy tokens exactly, sampled ones in law.

The statistical tests draw many verifications with a fixed seed and compare the emitted tokens'
frequencies with the target's distribution by Pearson's chi-square. The bound is the 0.1 % tail of
the chi-square law, so an unbiased sampler passes with probability 0.999 (and, seeded, always); a
negative control, a sampler that redraws a rejected position from the target instead of the
residual, lands far beyond it with the same draws.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from herd.worker.speculative.rejection import accept_greedy, accept_sampled, draw

TARGET = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05])
DRAFT = torch.tensor([0.05, 0.2, 0.5, 0.05, 0.2])
NUM_TRIALS = 5_000
CHI2_999 = {4: 18.47, 24: 51.18}
"""The chi-square law's 99.9 % quantiles for 4 and 24 degrees of freedom."""

Verify = Callable[[torch.Tensor, list[int], torch.Tensor | None, torch.Generator], list[int]]


@pytest.mark.parametrize(
    ("argmax", "proposal", "expected"),
    [
        pytest.param([4, 5, 6, 7], [4, 5, 6], [4, 5, 6, 7], id="all-accepted-plus-bonus"),
        pytest.param([4, 5, 6, 7], [4, 9, 6], [4, 5], id="first-mismatch-takes-the-target"),
        pytest.param([4, 5], [8], [4], id="rejected-at-once"),
        pytest.param([3], [], [3], id="nothing-proposed"),
    ],
)
def test_greedy_emits_the_targets_argmax(argmax: list[int], proposal: list[int], expected: list[int]) -> None:
    assert accept_greedy(argmax, proposal) == expected


def chi_square(counts: Counter[tuple[int, ...]], expected: dict[tuple[int, ...], float], n: int) -> float:
    return sum((counts[cell] - n * p) ** 2 / (n * p) for cell, p in expected.items())


def emitted_pairs(verify: Verify, *, with_draft_probs: bool, seed: int = 7) -> Counter[tuple[int, ...]]:
    """The first two tokens of ``NUM_TRIALS`` generations, each step verifying 2 proposed tokens
    (a step that emits one token is followed by another, as in the engine); every position's target
    is ``TARGET``, so the pair is distributed as ``TARGET x TARGET``."""
    generator = torch.Generator().manual_seed(seed)
    target = TARGET.expand(3, -1)
    draft = DRAFT.expand(2, -1)
    counts: Counter[tuple[int, ...]] = Counter()
    for _ in range(NUM_TRIALS):
        tokens: list[int] = []
        while len(tokens) < 2:
            # a deterministic proposer (n-gram) always proposes the same two tokens
            proposal = [draw(DRAFT, generator), draw(DRAFT, generator)] if with_draft_probs else [2, 2]
            tokens += verify(target, proposal, draft if with_draft_probs else None, generator)
        counts[tuple(tokens[:2])] += 1
    return counts


def pair_law() -> dict[tuple[int, ...], float]:
    probs = TARGET.tolist()
    return {(a, b): probs[a] * probs[b] for a in range(5) for b in range(5)}


def biased(
    target: torch.Tensor, proposal: list[int], probs: torch.Tensor | None, gen: torch.Generator
) -> list[int]:
    """The negative control: a rejected position redrawn from the target, not the residual."""
    for index, token_id in enumerate(proposal):
        q = 1.0 if probs is None else float(probs[index, token_id])
        if float(torch.rand(1, generator=gen)) * q >= float(target[index, token_id]):
            return [*proposal[:index], draw(target[index], gen)]
    return [*proposal, draw(target[len(proposal)], gen)]


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-model", "ngram"])
def test_emitted_tokens_follow_the_target(with_draft_probs: bool) -> None:
    counts = emitted_pairs(accept_sampled, with_draft_probs=with_draft_probs)
    assert sum(counts.values()) == NUM_TRIALS
    assert chi_square(counts, pair_law(), NUM_TRIALS) < CHI2_999[24]


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft-model", "ngram"])
def test_a_biased_sampler_fails_the_same_bound(with_draft_probs: bool) -> None:
    counts = emitted_pairs(biased, with_draft_probs=with_draft_probs)
    assert chi_square(counts, pair_law(), NUM_TRIALS) > CHI2_999[24]


def test_first_token_alone_follows_the_target() -> None:
    counts = emitted_pairs(accept_sampled, with_draft_probs=True, seed=11)
    firsts: Counter[tuple[int, ...]] = Counter()
    for (first, _), count in counts.items():
        firsts[(first,)] += count
    law = {(token,): p for token, p in enumerate(TARGET.tolist())}
    assert chi_square(firsts, law, NUM_TRIALS) < CHI2_999[4]


def test_acceptance_rate_is_the_overlap_of_the_two_laws() -> None:
    """The first proposal is accepted with probability sum(min(p, q)) (0.6 here), the most any
    scheme that keeps p can accept."""
    generator = torch.Generator().manual_seed(3)
    target, draft = TARGET.expand(2, -1), DRAFT.expand(1, -1)
    accepted = sum(
        len(accept_sampled(target, [draw(DRAFT, generator)], draft, generator)) == 2
        for _ in range(NUM_TRIALS)
    )
    overlap = float(torch.minimum(TARGET, DRAFT).sum())
    assert abs(accepted / NUM_TRIALS - overlap) < 0.02
