"""The seam between the engine and whatever computes its steps: the ``Runner`` protocol.

As nano-vllm's ``ModelRunner.run(seqs, is_prefill)`` returns token ids, a runner takes the
scheduler's whole plan and returns one sampled token per sequence whose chunk reached its end; the
engine never sees a logit, a tensor or a device. The runner owns everything behind that: the device
and the cache geometry it measured there, sampling (per-request generators included) and the KV
pool, whose blocks it copies as the plan lists (``block_copies``), exports (``read_blocks``) and
imports (``write_blocks``) for disaggregation, moves between the device and the tiers below it
(``move_blocks``: the plan's ``kv_moves`` before its forward), and the LoRA adapters it reads
(``load_lora``) and applies to each chunk's sequence's own adapter (``Sequence.lora_name``). Each
runner measures what its work costs (``measured``: the prefill rate, the restore bandwidth per tier),
which the worker reports to the router. Two runners implement it: the torch runner
(``herd.worker.model_runner``) and the cost model (``herd.worker.simulated_runner``).

Faults keep their owner: an error that belongs to one sequence (its logit edits, its draw, its
logprobs) comes back as data in that sequence's place; an exception raised by ``execute`` fails
the whole batch, after which the engine asks ``check_health`` whether it may go on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from herd.api.protocol import MAX_LOAD_RATE, Medium
from herd.worker.cache_geometry import CacheGeometry
from herd.worker.kv_tiers import KVMove
from herd.worker.outputs import TokenLogprob
from herd.worker.pooling import PoolingConfig

if TYPE_CHECKING:
    import torch

    from herd.worker.scheduler import SchedulerOutput

__all__ = [
    "PREFILL_MIN_TOKENS",
    "Measured",
    "PooledOutput",
    "Rate",
    "Runner",
    "SampledToken",
    "SpeculatedTokens",
    "StepResult",
]

PREFILL_MIN_TOKENS = 64
"""A step of at least this many tokens counts toward the prefill rate (decode steps would understate it)."""


_AVERAGE_WEIGHT = 0.2
"""The weight of the newest observation in a measured average."""


def _averaged(last: float | None, value: float, alpha: float) -> float:
    """``value`` averaged into ``last`` exponentially (weight ``alpha``); ``value`` itself at first."""
    return value if last is None else last + alpha * (value - last)


@dataclass
class Rate:
    """An amount per second, averaged over recent observations (exponentially, weight ``alpha``)."""

    alpha: float = _AVERAGE_WEIGHT
    per_second: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        rate = amount / seconds
        if rate <= MAX_LOAD_RATE:  # else a clock too coarse to time it (the load report refuses it)
            self.per_second = _averaged(self.per_second, rate, self.alpha)


@dataclass
class Measured:
    """What a runner measured of its own work: prefill tokens a second, the seconds of a step too
    small to time a prefill by (decodes), restore bytes a second per tier restored from, and bytes a
    second of KV blocks pulled from peers (the server's fetches, recorded through the engine);
    ``None`` / absent until observed."""

    prefill: Rate = field(default_factory=Rate)
    restore: dict[Medium, Rate] = field(default_factory=dict)
    pull: Rate = field(default_factory=Rate)
    decode_step_s: float | None = None
    """Averaged over recent steps as a ``Rate`` is."""

    def add_step(self, num_tokens: int, seconds: float) -> None:
        """A forward of ``num_tokens`` tokens that took ``seconds``: a prefill's rate from a step of
        ``PREFILL_MIN_TOKENS`` or more, else a decode step's time. A peer's lease waits for the step
        in progress, so routing prices the wait with the decode step too (kv_cache_aware)."""
        if num_tokens >= PREFILL_MIN_TOKENS:
            self.prefill.add(num_tokens, seconds)
        elif num_tokens > 0 and seconds > 0:
            self.decode_step_s = _averaged(self.decode_step_s, seconds, _AVERAGE_WEIGHT)

    def add_restore(self, medium: Medium, num_bytes: int, seconds: float) -> None:
        self.restore.setdefault(medium, Rate()).add(num_bytes, seconds)

    def restore_bytes_per_s(self) -> dict[Medium, float]:
        return {medium: rate.per_second for medium, rate in self.restore.items() if rate.per_second}


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


@dataclass(frozen=True)
class PooledOutput:
    """An embedding model's answer for a whole sequence: its pooled (and normalized) vector."""

    embedding: list[float]


StepResult = SampledToken | SpeculatedTokens | PooledOutput | Exception
"""One finished chunk's outcome: its sampled token (a generation model; or tokens, after a verified
proposal), its pooled vector (an embedding model), or the exception that failed that sequence alone."""


class Runner(Protocol):
    """Executes scheduler plans over a KV pool it owns; see the module docstring for the contract."""

    @property
    def geometry(self) -> CacheGeometry:
        """The KV pool's shape, measured when the runner was built (the block manager's input)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def measured(self) -> Measured: ...

    @property
    def pooling(self) -> PoolingConfig | None:
        """An embedding model's pooling (its steps return ``PooledOutput``); None for a generation model."""
        ...

    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        """Make ``plan.kv_moves`` (``move_blocks``) and ``plan.block_copies``, run every chunk, and
        sample: one result per chunk whose ``is_sampled``, in chunk order. A chunk with
        ``num_draft_slots`` may carry up to that many proposed tokens after its own, verified in the
        same pass (a ``SpeculatedTokens``); their KV lands in the reserved slots, and the engine rolls
        back what was rejected. Raises only when the batch as a whole failed; ``KVTierError`` when a
        tier failed before anything of the step ran."""
        ...

    def move_blocks(self, moves: list[KVMove]) -> None:
        """Copy blocks between the device pool and the tiers below it, in the order listed
        (``herd.worker.kv_tiers``); raises ``KVTierError`` (having moved nothing) if a tier failed."""
        ...

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' KV on the CPU: ``[layers, 2, len(block_ids), block_size, kv_heads, head_dim]``.

        Called beside a step, for blocks that no step writes (held by a lease)."""
        ...

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        """Write block ``i`` of ``kv`` (laid out as ``read_blocks`` gives it) into ``block_ids[i]``;
        ``None`` skips that block."""
        ...

    def load_lora(self, name: str, path: Path) -> None:
        """Read the PEFT adapter at ``path`` as ``name`` (``ValueError`` if it does not fit the model)."""
        ...

    def unload_lora(self, name: str) -> None: ...

    def check_health(self) -> None:
        """Raise if the runner can run no more work (after a failed batch)."""
        ...

    def close(self) -> None:
        """Release what the runner started beside its process (tensor-parallel ranks, the disk
        tier's writer); it runs no step afterwards."""
        ...
