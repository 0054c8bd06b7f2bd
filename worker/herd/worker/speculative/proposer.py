"""What proposes the tokens a step verifies: the ``Proposer`` protocol and the n-gram proposer.

A runner asks its proposer once per step, before the target's forward, for the chunks that have
draft slots (``ScheduledChunk.num_draft_slots``); a proposal may be shorter than the slots, or
missing (nothing worth proposing), and the chunk then verifies fewer tokens or plainly decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from herd.worker.scheduler import ScheduledChunk, SchedulerOutput
from herd.worker.speculative.ngram import propose_ngram

if TYPE_CHECKING:
    import torch

__all__ = ["NgramProposer", "Proposal", "Proposer"]


@dataclass(frozen=True)
class Proposal:
    """Proposed ids and, for ids drawn at random, the distributions ``[len, vocab]`` they were
    drawn from; ``None`` for a deterministic proposal (a point mass at each id)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, plan: SchedulerOutput) -> dict[ScheduledChunk, Proposal]:
        """Proposals for the plan's chunks with draft slots, at most ``num_draft_slots`` ids each."""
        ...


class NgramProposer:
    """Prompt lookup (``propose_ngram``) over each sequence's prompt and output so far."""

    def __init__(self, *, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, plan: SchedulerOutput) -> dict[ScheduledChunk, Proposal]:
        proposals: dict[ScheduledChunk, Proposal] = {}
        for chunk in plan.chunks:
            if chunk.num_draft_slots:
                ids = propose_ngram(
                    chunk.seq.token_ids, chunk.num_draft_slots, min_n=self.min_n, max_n=self.max_n
                )
                if ids:
                    proposals[chunk] = Proposal(ids)
        return proposals
