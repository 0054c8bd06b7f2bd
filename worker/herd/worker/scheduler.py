"""Continuous batching with chunked prefill: each step plans which tokens of which sequences to run.

A step has a token budget (``max_batch_tokens``). Running sequences go first, in arrival order:
a decoding one needs one token, a partly prefilled one gets the next chunk of its prompt. When the
pool has no block for a running sequence, the newest running sequence is preempted (its blocks are
freed and it returns to the head of the queue to be recomputed later), until the older one fits.
Then waiting sequences are admitted in order while budget, blocks and ``max_batch_size`` allow,
each starting after its prefix-cache hit; a long prompt takes what budget is left and continues in
later steps. No admission happens in a step that preempted, so a preempted sequence cannot bounce
straight back. With speculative decoding a decoding sequence also gets up to ``num_draft_tokens``
draft slots (the step's proposal size, chosen by the engine's policy, for at most
``num_draft_seqs`` sequences): budget and KV slots for the tokens a proposer may put after its own,
taken only where they fit without preempting anyone. ``settle_drafts`` then counts the accepted
ones as computed and releases the slots of the rejected ones. Each chunk's full blocks enter the prefix cache as it is planned, so a prompt admitted
later in the same step already starts after them. The plan is a ``SchedulerOutput``; the engine's
runner executes it and ``update`` then advances every scheduled sequence. Cost: linear in the number
of running and admitted sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from herd.worker.block_manager import BlockManager
from herd.worker.sequence import Sequence, SequenceStatus

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput"]


@dataclass(frozen=True)
class ScheduledChunk:
    """Run tokens ``[seq.num_computed_tokens, + num_tokens)`` of ``seq``; sample if they reach its end.

    ``num_draft_slots`` KV slots after them are reserved for proposed tokens to verify in the same pass."""

    seq: Sequence
    num_tokens: int
    num_draft_slots: int = 0

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def is_sampled(self) -> bool:
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: the chunks to run and the KV block copies a runner makes before them.

    ``block_copies`` lists ``(src, dst)`` block ids; nothing plans one yet: it is where KV tiers
    will plan their swaps, so that a runner copies and computes in the same step.
    ``cached_block_ids`` are the blocks this step's chunks fill, already in the prefix cache: should
    the step fail, the engine makes the block manager ``forget`` them.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    cached_block_ids: list[int] = field(default_factory=list)
    num_cache_queries: int = 0
    num_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class _DraftQuota:
    num_tokens: int
    num_seqs: int


class Scheduler:
    """Holds the waiting queue and the running list; ``schedule`` plans one step."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_batch_tokens: int,
        max_batch_size: int,
        max_model_len: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_draft_tokens: int = 0, num_draft_seqs: int | None = None) -> SchedulerOutput:
        """Plan a step; decoding sequences get up to ``num_draft_tokens`` draft slots each, the first
        ``num_draft_seqs`` of them (all when None)."""
        output = SchedulerOutput()
        quota = _DraftQuota(num_draft_tokens, len(self.running) if num_draft_seqs is None else num_draft_seqs)
        budget = self._schedule_running(output, quota)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, quota: _DraftQuota) -> int:
        budget = self.max_batch_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            num_slots = self._draft_slots(seq, num_tokens, budget, quota, len(self.running) - index - 1)
            if not self._make_room(seq, num_tokens, output):
                break
            self.block_manager.append_slots(seq, num_tokens + num_slots)
            self._plan_chunk(seq, num_tokens, output, num_slots)
            budget -= num_tokens + num_slots
            index += 1
        return budget

    def _draft_slots(
        self, seq: Sequence, num_tokens: int, budget: int, quota: _DraftQuota, num_after: int
    ) -> int:
        """Slots for proposals after a decode's one token: within the quota, the budget, what the
        request may still generate and the positions the model has; only where the blocks are free
        with one left for each of the ``num_after`` sequences still to plan, so no one is preempted."""
        if quota.num_tokens == 0 or quota.num_seqs == 0 or num_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return 0
        limit = min(quota.num_tokens, budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - seq.num_tokens)
        while limit > 0 and not self.block_manager.can_append(seq, 1 + limit, num_kept_free=num_after):
            limit -= 1
        if limit > 0:
            quota.num_seqs -= 1
        return max(0, limit)

    def _make_room(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until ``seq`` fits; False if ``seq`` itself went."""
        while not self.block_manager.can_append(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            hits = self.block_manager.computed_blocks(seq)
            num_tokens = min(seq.num_tokens - len(hits) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(seq, hits, num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, hits, num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._plan_chunk(seq, num_tokens, output)
            output.num_cache_queries += seq.num_tokens
            output.num_cache_hits += seq.num_computed_tokens
            budget -= num_tokens

    def _plan_chunk(
        self, seq: Sequence, num_tokens: int, output: SchedulerOutput, num_slots: int = 0
    ) -> None:
        output.chunks.append(ScheduledChunk(seq, num_tokens, num_slots))
        cached = self.block_manager.commit(seq, seq.num_computed_tokens + num_tokens)
        output.cached_block_ids.extend(cached)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def update(self, output: SchedulerOutput) -> None:
        """After the model ran: advance every scheduled sequence's computed count."""
        for chunk in output.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens

    def settle_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a verification (``update`` done, the accepted tokens and the target's own appended):
        the accepted tokens' KV is computed; the slots past it, rejected proposals', are released."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.trim(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (done or aborted) wherever it is, freeing its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
