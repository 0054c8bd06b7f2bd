"""Continuous batching with chunked prefill: each step plans which tokens of which sequences to run.

A step has a token budget (``max_batch_tokens``). The waiting queue is ordered by priority (the
request's ``priority``: smaller first, as vLLM's priority policy), then by arrival. When the most
urgent waiting sequence cannot get its blocks, or a seat in the batch (``max_batch_size``), while
less urgent ones run, the least urgent of those (the newest among equals) are preempted until it can. Running sequences go first, in arrival order:
a decoding one needs one token, a partly prefilled one gets the next chunk of its prompt. When the
pool has no block for a running sequence, the least urgent sequence not yet planned this step (the
newest among equals) is preempted (its blocks are freed and it returns to the head of its priority in
the queue, to be recomputed later), until the older one fits.
Then waiting sequences are admitted in order while budget, blocks and ``max_batch_size`` allow,
each starting after its prefix-cache hit; a long prompt takes what budget is left and continues in
later steps (with ``is_chunked`` off, for an encoder, a prompt runs whole or waits: one larger than
the whole budget runs alone). A prompt's prefix found in a tier below the device
(``BlockManager.restore_run``) is restored, not computed: the plan lists the moves (``kv_moves``, made
before the forward, as block copies are) and the sequence starts after it. No admission happens in a
step that preempted a running sequence for room, so a preempted sequence cannot bounce straight back;
a step that preempted only for a more urgent arrival admits only sequences more urgent than those it
preempted (the arrival starts in that step, not the next). With LoRA, the running
sequences use at most ``max_loras`` distinct adapters (the runner's slots): a waiting sequence whose
adapter would be one too many is passed over, keeping its place, until a running adapter's last
sequence finishes. With speculative decoding a decoding sequence also gets up to ``num_draft_tokens``
draft slots (the step's proposal size, chosen by the engine's policy, for at most
``num_draft_seqs`` sequences): budget and KV slots for the tokens a proposer may put after its own,
taken only where the blocks are free, so that no one is preempted for them. ``settle_drafts`` then
counts the accepted ones as computed and releases the slots of the rejected ones. Each chunk's full
blocks enter the prefix cache as it is planned, so a prompt admitted
later in the same step already starts after them. The plan is a ``SchedulerOutput``; the engine's
runner executes it and ``update`` then advances every scheduled sequence. Cost: linear in the number
of running and admitted sequences.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from herd.worker.block_manager import BlockManager
from herd.worker.kv_tiers import KVMove
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
    """One step's plan: the chunks to run and the KV block moves and copies a runner makes before them.

    ``kv_moves`` are the moves between the device pool and the tiers below it, in order (offloads of
    the blocks this plan evicts, restores of the blocks it found in a tier). ``block_copies`` lists
    ``(src, dst)`` device block ids; nothing plans one yet.
    ``cached_block_ids`` are the blocks this step's chunks fill or its restores write, already in the
    prefix cache: should the step fail, the engine makes the block manager ``forget`` them (and what
    the moves wrote into the tiers).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    kv_moves: list[KVMove] = field(default_factory=list)
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
        max_loras: int = 0,
        is_chunked: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.is_chunked = is_chunked
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence of its priority or a more urgent one."""
        priority = seq.params.priority
        if not self.waiting or self.waiting[-1].params.priority <= priority:
            self.waiting.append(seq)
            return
        index = next(i for i, other in enumerate(self.waiting) if other.params.priority > priority)
        self.waiting.insert(index, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_draft_tokens: int = 0, num_draft_seqs: int | None = None) -> SchedulerOutput:
        """Plan a step; decoding sequences get up to ``num_draft_tokens`` draft slots each, the first
        ``num_draft_seqs`` of them (all when None)."""
        output = SchedulerOutput()
        self._preempt_for_urgent(output)
        num_for_urgent = len(output.preempted)
        quota = _DraftQuota(num_draft_tokens, len(self.running) if num_draft_seqs is None else num_draft_seqs)
        budget = self._schedule_running(output, quota)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        elif len(output.preempted) == num_for_urgent:  # preempted for urgency only: the urgent start now
            self._schedule_waiting(output, budget, below=min(seq.params.priority for seq in output.preempted))
        output.kv_moves, restored = self.block_manager.end_plan()
        output.cached_block_ids.extend(restored)
        return output

    def _schedule_running(self, output: SchedulerOutput, quota: _DraftQuota) -> int:
        budget = self.max_batch_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(index, num_tokens, output):
                continue  # it was the least urgent and went: running[index] is the next one now
            num_slots = self._draft_slots(seq, num_tokens, budget, quota, len(self.running) - index - 1)
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
        with one left for each of the ``num_after`` sequences still to plan, so no one is preempted.
        A grammar-constrained sequence gets none."""
        if quota.num_tokens == 0 or quota.num_seqs == 0 or num_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return 0
        if seq.grammar is not None:  # its grammar masks one row a step: it decodes without proposals
            return 0
        limit = min(quota.num_tokens, budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - seq.num_tokens)
        while limit > 0 and not self.block_manager.can_append(seq, 1 + limit, num_kept_free=num_after):
            limit -= 1
        if limit > 0:
            quota.num_seqs -= 1
        return max(0, limit)

    def _make_room(self, index: int, num_tokens: int, output: SchedulerOutput) -> bool:
        """Preempt the least urgent sequences not yet planned this step (``running[index:]``) until
        ``running[index]`` fits; False if it went itself."""
        seq = self.running[index]
        while not self.block_manager.can_append(seq, num_tokens):
            victim = self._victim(index)
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _victim(self, start: int) -> Sequence:
        """The least urgent running sequence from ``start`` on, the newest among equals; removed."""
        candidates = range(len(self.running) - 1, start - 1, -1)
        index = max(candidates, key=lambda i: (self.running[i].params.priority, i))
        return self.running.pop(index)

    def _preempt_for_urgent(self, output: SchedulerOutput) -> None:
        """Preempt less urgent running sequences while the head of the queue lacks a seat in the batch
        (``max_batch_size``) or the blocks to start: an urgent request never waits for a less urgent
        one (a batch line) to finish."""
        if not self.waiting:
            return
        head = self.waiting[0]
        while self.running:
            victim_index = max(range(len(self.running)), key=lambda i: (self.running[i].params.priority, i))
            if self.running[victim_index].params.priority <= head.params.priority:
                return
            hits = self.block_manager.computed_blocks(head)
            num_tokens = min(
                head.num_tokens - len(hits) * self.block_manager.block_size, self.max_batch_tokens
            )
            has_seat = len(self.running) < self.max_batch_size
            if has_seat and self.block_manager.can_allocate(head, hits, num_tokens):
                return
            victim = self.running.pop(victim_index)
            self._preempt(victim)
            output.preempted.append(victim)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, below: int | None = None) -> None:
        """Admit waiting sequences in order (``below``: only those more urgent than that priority)."""
        loras = {seq.lora_name for seq in self.running if seq.lora_name is not None}
        passed_over: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if below is not None and seq.params.priority >= below:
                break
            if seq.lora_name is not None and seq.lora_name not in loras and len(loras) >= self.max_loras:
                passed_over.append(self.waiting.popleft())
                continue
            hits = self.block_manager.computed_blocks(seq)
            restores = self.block_manager.restore_run(seq, len(hits))
            num_cached = (len(hits) + len(restores)) * self.block_manager.block_size
            uncached = seq.num_tokens - num_cached
            num_tokens = min(uncached, budget) if self.is_chunked else uncached
            if num_tokens > budget and output.chunks:  # whole prompts only: this one waits a step
                break
            if not self.block_manager.can_allocate(seq, hits, num_tokens, restores):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, hits, num_tokens, restores)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._plan_chunk(seq, num_tokens, output)
            output.num_cache_queries += seq.num_tokens
            output.num_cache_hits += seq.num_computed_tokens
            budget -= num_tokens
            if seq.lora_name is not None:
                loras.add(seq.lora_name)
        self.waiting.extendleft(reversed(passed_over))

    def _plan_chunk(
        self, seq: Sequence, num_tokens: int, output: SchedulerOutput, num_slots: int = 0
    ) -> None:
        output.chunks.append(ScheduledChunk(seq, num_tokens, num_slots))
        cached = self.block_manager.commit(seq, seq.num_computed_tokens + num_tokens)
        output.cached_block_ids.extend(cached)

    def requeue(self, seqs: list[Sequence]) -> None:
        """Send running ``seqs`` back to the head of the queue, in order, to be computed again (the
        step planned for them was abandoned before it ran)."""
        for seq in reversed(seqs):
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
                self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first among the waiting sequences of its priority."""
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        priority = seq.params.priority
        index = next((i for i, other in enumerate(self.waiting) if other.params.priority >= priority), None)
        if index is None:
            self.waiting.append(seq)
        else:
            self.waiting.insert(index, seq)

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
