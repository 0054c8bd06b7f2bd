"""Per-request sampling and stopping settings, as the engine sees them (token ids, not strings).

``SamplingParams`` refuses values no sampler can use (NaN, a negative temperature, a seed that
``torch.Generator`` cannot take, oversized stop lists) when it is built, and ``check_vocab`` refuses
token ids outside the loaded model's vocabulary. Both raise ``InvalidParamError``, which names the
OpenAI request field, so the server's 400 and the engine's own refusal use the same words.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from herd.worker.grammar import CompiledGrammar

__all__ = [
    "MAX_SEED",
    "MAX_STOP_STRING_CHARS",
    "MAX_TOKEN_ID_LIST",
    "MIN_SEED",
    "InvalidParamError",
    "SamplingParams",
    "check_token_ids",
]

MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1
"""``torch.Generator.manual_seed`` takes any int64 (vLLM's bounds too)."""
MAX_TOKEN_ID_LIST = 1024
"""Entries of ``logit_bias`` and ``stop_token_ids``: their checks run at every step of the request."""
MAX_STOP_STRING_CHARS = 1024
"""Characters per stop string: the detokenizer holds back that much text and searches it each step."""


class InvalidParamError(ValueError):
    """A request setting the engine cannot use; ``param`` names the OpenAI request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(token_ids: Collection[int], vocab_size: int, *, param: str) -> None:
    """Raise ``InvalidParamError`` for the first id of ``token_ids`` outside ``[0, vocab_size)``."""
    if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):  # C loops: long prompts
        return
    bad = next(token_id for token_id in token_ids if not 0 <= token_id < vocab_size)
    raise InvalidParamError(
        param, f"token id {bad} in {param} is outside this model's vocabulary (0..{vocab_size - 1})"
    )


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
    priority: int = 0
    """Where the sequence waits: smaller first (vLLM's priority scheduling); it may also be preempted
    for a more urgent one when the KV pool is full."""
    hold_prompt_blocks: bool = False
    """Disaggregated prefill: when the sequence finishes, keep its prompt's cached full blocks held
    (reported in the last output's ``held_block_ids``) until ``release_held`` or an abort."""
    grammar: CompiledGrammar | None = None
    """What the output must match (``herd.worker.grammar``); each token is sampled under its mask
    and the sequence stops when the grammar is complete."""

    def __post_init__(self) -> None:
        self._check_lengths()
        self._check_floats()
        self._check_lists()
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise InvalidParamError("seed", f"seed must lie in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        if self.top_k < -1:
            raise InvalidParamError(
                "top_k", f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidParamError("logprobs", f"logprobs must be at least 0, got {self.logprobs}")

    def _check_lengths(self) -> None:
        if self.max_tokens < 1:
            raise InvalidParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParamError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must lie in [0, max_tokens ({self.max_tokens})]",
            )

    def _check_floats(self) -> None:
        checks = (
            ("temperature", self.temperature, self.temperature >= 0.0, "at least 0"),
            ("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", self.min_p, 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("presence_penalty", self.presence_penalty, True, "finite"),
            ("frequency_penalty", self.frequency_penalty, True, "finite"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0.0, "above 0"),
        )
        for name, value, is_in_range, allowed in checks:
            if not (math.isfinite(value) and is_in_range):
                raise InvalidParamError(name, f"{name} must be a finite number {allowed}, got {value}")
        if not all(math.isfinite(bias) for bias in self.logit_bias.values()):
            raise InvalidParamError("logit_bias", "logit_bias values must be finite numbers")

    def _check_lists(self) -> None:
        for name, size in (
            ("logit_bias", len(self.logit_bias)),
            ("stop_token_ids", len(self.stop_token_ids)),
        ):
            if size > MAX_TOKEN_ID_LIST:
                raise InvalidParamError(
                    name, f"{name} holds {size} token ids; send at most {MAX_TOKEN_ID_LIST}"
                )
        if any(len(stop) > MAX_STOP_STRING_CHARS for stop in self.stop):
            raise InvalidParamError(
                "stop", f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``InvalidParamError`` for a token id or count this model's vocabulary cannot have."""
        check_token_ids(self.logit_bias, vocab_size, param="logit_bias")
        check_token_ids(self.stop_token_ids, vocab_size, param="stop_token_ids")
        if self.top_k > vocab_size:
            raise InvalidParamError(
                "top_k", f"top_k {self.top_k} exceeds this model's vocabulary of {vocab_size} tokens"
            )
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise InvalidParamError(
                "logprobs", f"logprobs {self.logprobs} exceeds this model's vocabulary of {vocab_size} tokens"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def edits_logits(self) -> bool:
        """Whether a penalty, a logit bias or ``min_tokens`` may change this sequence's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )
