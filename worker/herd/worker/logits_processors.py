"""Per-request logit edits applied before sampling: penalties, logit bias, and min_tokens masking.

``edit_logits`` edits one request's row in place; the sampler calls it only for rows whose request
asked for an edit (``SamplingParams.edits_logits``), so a batch of plain requests pays nothing, and
each row on its own, so an edit that raises fails only its own request. Penalties follow OpenAI /
vLLM: presence and frequency count generated tokens; repetition (the CTRL rule: positive logits
divided, negative multiplied) covers prompt and generated tokens.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from herd.worker.sequence import Sequence

__all__ = ["edit_logits"]


def edit_logits(row: torch.Tensor, seq: Sequence, eos_token_ids: Collection[int]) -> None:
    """Apply ``seq``'s penalties, logit bias and min_tokens mask to its logits ``row`` (a 1-D view)."""
    _apply_penalties(row, seq)
    _apply_logit_bias(row, seq)
    _apply_min_tokens(row, seq, eos_token_ids)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    params = seq.params
    if params.presence_penalty or params.frequency_penalty:
        counts = _counts(seq.output_token_ids, row.shape[-1], row.device)
        row -= params.presence_penalty * (counts > 0) + params.frequency_penalty * counts
    if params.repetition_penalty != 1.0:
        seen = _counts(seq.prompt_token_ids + seq.output_token_ids, row.shape[-1], row.device) > 0
        penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))


def _apply_logit_bias(row: torch.Tensor, seq: Sequence) -> None:
    if seq.params.logit_bias:
        ids = torch.tensor(list(seq.params.logit_bias), dtype=torch.long, device=row.device)
        bias = torch.tensor(list(seq.params.logit_bias.values()), dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, bias)


def _apply_min_tokens(row: torch.Tensor, seq: Sequence, eos_token_ids: Collection[int]) -> None:
    """Until ``min_tokens`` are out, no token that would stop the request may be chosen."""
    if seq.num_output_tokens < seq.params.min_tokens:
        stopping = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))
        if stopping:
            row[sorted(stopping)] = float("-inf")


def _counts(token_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size].float()
