"""The draft-model proposer: a smaller model with the target's vocabulary, in lockstep with it.

The draft keeps its own KV pool with as many blocks as the target's and reads it through the same
block tables, so paged KV, prefix caching, chunked prefill and preemption need nothing of their
own: every step, before the target's forward, the draft runs each chunk's tokens too (a prefill
chunk as the target runs it; a decode from the first token the draft has not seen, so after a
verification it catches up on the accepted proposals). A block the target caches thus holds the
draft's KV as well, and a later request that hits the prefix cache finds both. A sequence with
draft slots then takes its first proposed token from that pass's last row and one more per decode
pass, writing the draft's KV into the slots the scheduler reserved; the tokens are the draft's
argmax for greedy requests, else drawn from the draft's distribution under the request's
temperature and filters (returned with the proposal, for rejection sampling). The draft has no
LoRA adapters: a sequence that runs with one gets its proposals from ``adapter_proposer`` (n-gram
lookup) instead, while the draft still keeps its KV in step.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection

import torch

from herd.worker.input_batch import Query, prepare_queries
from herd.worker.models.llama import LlamaForCausalLM
from herd.worker.sampler import Sampler
from herd.worker.scheduler import ScheduledChunk, SchedulerOutput
from herd.worker.sequence import Sequence
from herd.worker.speculative.proposer import NgramProposer, Proposal
from herd.worker.speculative.rejection import draw

__all__ = ["DraftModelProposer"]


class DraftModelProposer:
    """``Proposer`` running ``model`` over ``kv_cache`` (bound to it) with the target's block tables."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int,
        window_sizes: Collection[int],
        device: torch.device,
        sampler: Sampler,
        adapter_proposer: NgramProposer,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.window_sizes = window_sizes
        self.device = device
        self.sampler = sampler
        self.adapter_proposer = adapter_proposer
        # Tokens whose draft KV is computed, per sequence; dropped with the sequence.
        self._computed: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def propose(self, plan: SchedulerOutput) -> dict[ScheduledChunk, Proposal]:
        proposing = [
            chunk
            for chunk in plan.chunks
            if chunk.num_draft_slots and chunk.is_sampled and chunk.seq.lora_name is None
        ]
        queries = [self._catch_up(chunk, chunk in proposing) for chunk in plan.chunks]
        logits = self._forward(queries)
        drafts: dict[ScheduledChunk, list[int]] = {chunk: [] for chunk in proposing}
        probs: dict[ScheduledChunk, list[torch.Tensor]] = {chunk: [] for chunk in proposing}
        active = proposing
        while active:
            for row, chunk in enumerate(active):
                token_id, distribution = self._choose(logits[row], chunk.seq)
                drafts[chunk].append(token_id)
                if distribution is not None:
                    probs[chunk].append(distribution)
            active = [chunk for chunk in active if len(drafts[chunk]) < chunk.num_draft_slots]
            if active:
                logits = self._forward([self._next(chunk, drafts[chunk]) for chunk in active])
        adapted = SchedulerOutput(
            [chunk for chunk in plan.chunks if chunk.num_draft_slots and chunk.seq.lora_name is not None]
        )
        return self.adapter_proposer.propose(adapted) | {
            chunk: Proposal(drafts[chunk], torch.stack(probs[chunk]) if probs[chunk] else None)
            for chunk in proposing
        }

    def _catch_up(self, chunk: ScheduledChunk, is_proposing: bool) -> Query:
        """The chunk's tokens from the first one the draft has not computed; a proposing chunk's
        last row gives the first proposed token."""
        seq, end = chunk.seq, chunk.start + chunk.num_tokens
        start = min(self._computed.get(seq, chunk.start), chunk.start)
        self._computed[seq] = end
        return Query(seq, start, seq.tokens_between(start, end), int(is_proposing), chunk.num_tokens == 1)

    @staticmethod
    def _next(chunk: ScheduledChunk, drafted: list[int]) -> Query:
        """The latest proposed token at its position, for the next one's logits."""
        position = chunk.start + chunk.num_tokens - 1 + len(drafted)
        return Query(chunk.seq, position, [drafted[-1]], 1, True)

    def _forward(self, queries: list[Query]) -> torch.Tensor:
        inputs = prepare_queries(queries, self.block_size, self.device, self.window_sizes)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model.compute_logits(hidden[inputs.sample_index]).float()

    def _choose(self, logits: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        """The draft's argmax for a greedy request, else a draw from its distribution (returned)."""
        if seq.params.is_greedy:
            return int(logits.argmax()), None
        distribution = self.sampler.probs(logits.unsqueeze(0), [seq])[0]
        return draw(distribution, self.sampler.generator_for(seq)), distribution
