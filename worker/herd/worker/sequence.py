"""One request's state as it moves through the engine: tokens, KV blocks, sampling state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from herd.api.kv_hash import BlockHash
from herd.worker.outputs import FinishReason, TokenLogprob
from herd.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from herd.worker.grammar import GrammarMatcher

__all__ = ["Sequence", "SequenceStatus"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt plus its generated tokens, the KV blocks that hold them, and how far they are computed.

    Invariant: ``num_computed_tokens <= num_tokens`` and ``block_table`` covers at least
    ``num_computed_tokens`` slots; the first ``num_committed_blocks`` blocks are in the prefix cache.
    ``num_cached_tokens`` is the prefix-cache hit of the first admission (what usage reports).
    ``lora_name`` is the LoRA adapter the sequence runs with (``None``: the base model); it is in
    ``root_hash``, so its blocks are cached apart from every other adapter's.
    Preemption drops the blocks and keeps the tokens, so recomputation includes what was generated.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    root_hash: BlockHash
    lora_name: str | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_committed_blocks: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    grammar: GrammarMatcher | None = None
    """Where the output stands in ``params.grammar``; advanced with every appended token, kept
    across preemption (the tokens are)."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (a decode step asks for one)."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        """The token ids of block ``index`` (the last one may be partial)."""
        start = index * block_size
        return self.tokens_between(start, min(start + block_size, self.num_tokens))

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the KV, keep every token."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_committed_blocks = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
