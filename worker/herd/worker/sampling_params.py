"""Per-request sampling and stopping settings, as the engine sees them (token ids, not strings)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence is sampled and when it stops.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` disable
    those filters. ``logprobs`` is None for no logprobs, or k >= 0 alternatives per token.
    ``seed`` makes sampling reproducible for this sequence whatever else is in the batch.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    hold_prompt_blocks: bool = False
    """Disaggregated prefill: when the sequence finishes, keep its prompt's cached full blocks held
    (reported in the last output's ``held_block_ids``) until ``release_held`` or an abort."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
