"""Continuous batching with chunked prefill: each step plans which tokens of which sequences to run.

A step has a token budget (``max_batch_tokens``). Running sequences go first, in arrival order:
a decoding one needs one token, a partly prefilled one gets the next chunk of its prompt. When the
pool has no block for a running sequence, the newest running sequence is preempted (its blocks are
freed and it returns to the head of the queue to be recomputed later), until the older one fits.
Then waiting sequences are admitted in order while budget, blocks and ``max_batch_size`` allow,
each starting after its prefix-cache hit; a long prompt takes what budget is left and continues in
later steps (with ``is_chunked`` off, for an encoder, a prompt runs whole or waits: one larger than
the whole budget runs alone). No admission happens in a step that preempted, so a preempted sequence cannot bounce
straight back. Each chunk's full blocks enter the prefix cache as it is planned, so a prompt admitted
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
    """Run tokens ``[seq.num_computed_tokens, + num_tokens)`` of ``seq``; sample if they reach its end."""

    seq: Sequence
    num_tokens: int

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


class Scheduler:
    """Holds the waiting queue and the running list; ``schedule`` plans one step."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_batch_tokens: int,
        max_batch_size: int,
        is_chunked: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.is_chunked = is_chunked
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output)
        if not output.preempted:
            self._schedule_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput) -> int:
        budget = self.max_batch_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, num_tokens, output):
                break
            self.block_manager.append_slots(seq, num_tokens)
            self._plan_chunk(seq, num_tokens, output)
            budget -= num_tokens
            index += 1
        return budget

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
            uncached = seq.num_tokens - len(hits) * self.block_manager.block_size
            num_tokens = min(uncached, budget) if self.is_chunked else uncached
            if num_tokens > budget and output.chunks:  # whole prompts only: this one waits a step
                break
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

    def _plan_chunk(self, seq: Sequence, num_tokens: int, output: SchedulerOutput) -> None:
        output.chunks.append(ScheduledChunk(seq, num_tokens))
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

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (done or aborted) wherever it is, freeing its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
