"""The seam between the engine and whatever computes its steps: the ``Runner`` protocol.

As nano-vllm's ``ModelRunner.run(seqs, is_prefill)`` returns token ids, a runner takes the
scheduler's whole plan and returns one sampled token per sequence whose chunk reached its end; the
engine never sees a logit, a tensor or a device. The runner owns everything behind that: the device
and the cache geometry it measured there, sampling (per-request generators included) and the KV
pool, whose blocks it copies as the plan lists (``block_copies``), exports (``read_blocks``) and
imports (``write_blocks``) for disaggregation. Two runners implement it: the torch runner
(``herd.worker.model_runner``) and the cost model (``herd.worker.simulated_runner``).

Faults keep their owner: an error that belongs to one sequence (its logit edits, its draw, its
logprobs) comes back as data in that sequence's place; an exception raised by ``execute`` fails
the whole batch, after which the engine asks ``check_health`` whether it may go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from herd.worker.cache_geometry import CacheGeometry
from herd.worker.outputs import TokenLogprob

if TYPE_CHECKING:
    import torch

    from herd.worker.scheduler import SchedulerOutput

__all__ = ["Runner", "SampledToken", "SpeculatedTokens", "StepResult"]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class SpeculatedTokens:
    """A chunk's verified proposal: the accepted proposed tokens, then the target's own token (so
    ``1 + num_accepted`` tokens), and how many tokens were proposed."""

    tokens: tuple[SampledToken, ...]
    num_proposed: int

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


StepResult = SampledToken | SpeculatedTokens | Exception
"""One sampled sequence's outcome: its token (or tokens, after a verified proposal), or the
exception that failed that sequence alone."""


class Runner(Protocol):
    """Executes scheduler plans over a KV pool it owns; see the module docstring for the contract."""

    @property
    def geometry(self) -> CacheGeometry:
        """The KV pool's shape, measured when the runner was built (the block manager's input)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        """Copy ``plan.block_copies``, run every chunk, and sample: one result per chunk whose
        ``is_sampled``, in chunk order. A chunk with ``num_draft_slots`` may carry up to that many
        proposed tokens after its own, verified in the same pass (a ``SpeculatedTokens``); their
        KV lands in the reserved slots, and the engine rolls back what was rejected. Raises only
        when the batch as a whole failed."""
        ...

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV on the CPU: ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``.

        Called beside a step, for blocks that no step writes (held by a lease)."""
        ...

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        """Write block ``i`` of ``kv`` (laid out as ``read_blocks`` gives it) into ``block_ids[i]``;
        ``None`` skips that block."""
        ...

    def check_health(self) -> None:
        """Raise if the runner can run no more work (after a failed batch)."""
        ...
