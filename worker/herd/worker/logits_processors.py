"""Per-request logit edits applied before sampling: penalties, logit bias, and min_tokens masking.

Each edit touches only the rows whose request asked for it, so a batch of plain requests pays nothing.
Penalties follow OpenAI / vLLM: presence and frequency count generated tokens; repetition (the CTRL
rule: positive logits divided, negative multiplied) covers prompt and generated tokens.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from herd.worker.sequence import Sequence

__all__ = ["apply_logit_bias", "apply_min_tokens", "apply_penalties"]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.presence_penalty or params.frequency_penalty:
            counts = _counts(seq.output_token_ids, logits.shape[-1], logits.device)
            logits[row] -= params.presence_penalty * (counts > 0) + params.frequency_penalty * counts
        if params.repetition_penalty != 1.0:
            seen = _counts(seq.prompt_token_ids + seq.output_token_ids, logits.shape[-1], logits.device) > 0
            row_logits = logits[row]
            penalized = torch.where(
                row_logits > 0, row_logits / params.repetition_penalty, row_logits * params.repetition_penalty
            )
            logits[row] = torch.where(seen, penalized, row_logits)


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        if seq.params.logit_bias:
            ids = torch.tensor(list(seq.params.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(
                list(seq.params.logit_bias.values()), dtype=logits.dtype, device=logits.device
            )
            logits[row].index_add_(0, ids, bias)


def apply_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int]) -> None:
    """Until ``min_tokens`` are out, no token that would stop the request may be chosen."""
    for row, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            stopping = set(seq.params.stop_token_ids) | (
                set() if seq.params.ignore_eos else set(eos_token_ids)
            )
            if stopping:
                logits[row, sorted(stopping)] = float("-inf")


def _counts(token_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size].float()
