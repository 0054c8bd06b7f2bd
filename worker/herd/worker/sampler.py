"""Chooses each sequence's next token from its logits row, with per-request settings.

Order: penalties, logit bias and min_tokens masking edit the logits; the grammar masks of
constrained rows (``herd.worker.grammar``, computed beside the forward pass) then hide every token
their grammar does not allow; greedy rows take the argmax;
the others are divided by their temperature, filtered by top-k, top-p and min-p, and sampled with
the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``) drawn from the sequence's own
``torch.Generator`` when it has a seed, so its draws do not depend on the rest of the batch. The
sampler keeps those generators, made at a sequence's first draw and dropped with the sequence.
Logprobs are those of the model's raw distribution, as in vLLM.

``verify`` is the same pipeline over the rows of a chunk that carried proposed tokens: each row's
edits see the proposed tokens before it as generated, and the tokens come from rejection sampling
(``herd.worker.speculative.rejection``) with the sequence's generator.

A row is one request: an exception in its logit edits, its draw or its logprobs fails that row only,
returned in its place instead of a token. Edits and logprobs run row by row anyway; the batched
draw, if it raises, is repeated one row at a time to find the row at fault (only on that path).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Collection

import torch

from herd.worker.grammar import PendingMasks, apply_bitmask
from herd.worker.logits_processors import edit_logits
from herd.worker.outputs import TokenLogprob
from herd.worker.runner import SampledToken, SpeculatedTokens, StepResult
from herd.worker.sequence import Sequence
from herd.worker.speculative.proposer import Proposal
from herd.worker.speculative.rejection import accept_greedy, accept_sampled

__all__ = ["LOGPROB_FLOOR", "Sampler", "filter_logits"]


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, top-p nucleus and min-p floor."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    outside_nucleus = probs.cumsum(dim=-1) - probs > top_p.unsqueeze(1)
    below_floor = probs < min_p.unsqueeze(1) * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(outside_nucleus | below_floor, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


class Sampler:
    """``sample`` returns one token (and its logprobs when asked) per row of ``logits``."""

    def __init__(self, generator: torch.Generator, eos_token_ids: Collection[int]) -> None:
        self.generator = generator
        self.eos_token_ids = frozenset(eos_token_ids)
        # Keyed by the sequence itself, so a finished sequence's generator goes with it.
        self._seeded: weakref.WeakKeyDictionary[Sequence, torch.Generator] = weakref.WeakKeyDictionary()

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: PendingMasks | None = None
    ) -> list[StepResult]:
        """One token per row of ``logits``, or the exception that failed that row's request.

        ``masks`` holds the grammar bitmasks of the constrained rows (``MaskFiller.start``)."""
        raw_logprobs = _raw_logprobs(logits) if any(s.params.logprobs is not None for s in seqs) else None
        failures = self._edit(logits, seqs)
        if masks is not None:
            self._constrain(logits, seqs, masks, failures)
        token_ids = self._choose_each(logits, seqs, failures)
        tokens: list[StepResult] = (
            [SampledToken(token_id, None) for token_id in token_ids]
            if raw_logprobs is None
            else [
                self._token(raw_logprobs, row, token_id, seq)
                for row, (token_id, seq) in enumerate(zip(token_ids, seqs, strict=True))
            ]
        )
        for row, error in failures.items():
            tokens[row] = error
        return tokens

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, seq: Sequence, proposal: Proposal) -> StepResult:
        """The tokens of ``seq`` after verifying ``proposal`` against ``logits`` ``[k + 1, vocab]``
        (the rows at its last own token and at each proposed one), or the exception that failed it."""
        try:
            raw = _raw_logprobs(logits) if seq.params.logprobs is not None else None
            if seq.params.edits_logits:
                for row in range(logits.shape[0]):
                    edit_logits(
                        logits[row], _as_if_accepted(seq, proposal.token_ids[:row]), self.eos_token_ids
                    )
            if seq.params.is_greedy:
                token_ids = accept_greedy(logits.argmax(dim=-1).tolist(), proposal.token_ids)
            else:
                probs = self.probs(logits, [seq] * logits.shape[0])
                token_ids = accept_sampled(probs, proposal.token_ids, proposal.probs, self.generator_for(seq))
            tokens = tuple(
                SampledToken(token_id, _logprob(raw, row, token_id, seq.params.logprobs))
                for row, token_id in enumerate(token_ids)
            )
            return SpeculatedTokens(tokens, num_proposed=len(proposal.token_ids))
        except Exception as error:
            return error

    def _edit(self, logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, Exception]:
        failures: dict[int, Exception] = {}
        for row, seq in enumerate(seqs):
            if seq.params.edits_logits:
                try:
                    edit_logits(logits[row], seq, self.eos_token_ids)
                except Exception as error:
                    failures[row] = error
        return failures

    @staticmethod
    def _constrain(
        logits: torch.Tensor, seqs: list[Sequence], masks: PendingMasks, failures: dict[int, Exception]
    ) -> None:
        """Apply the batch's grammar masks; a row whose matcher failed fails alone."""
        bitmask = masks.result()  # first: the matchers are busy until their masks are done
        for row in masks.rows:
            grammar = seqs[row].grammar
            try:
                if grammar is not None:
                    grammar.check()
            except Exception as error:
                failures[row] = error
        apply_bitmask(logits, masks.rows, bitmask)

    def _choose_each(
        self, logits: torch.Tensor, seqs: list[Sequence], failures: dict[int, Exception]
    ) -> list[int]:
        try:
            token_ids: list[int] = self._choose(logits, seqs).tolist()
            return token_ids
        except Exception:  # no row to blame yet: draw each alone (re-drawing is fine on this rare path)
            return [self._choose_row(logits, row, seq, failures) for row, seq in enumerate(seqs)]

    def _choose_row(
        self, logits: torch.Tensor, row: int, seq: Sequence, failures: dict[int, Exception]
    ) -> int:
        try:
            return int(self._choose(logits[row : row + 1], [seq])[0])
        except Exception as error:
            failures[row] = error
            return -1

    @staticmethod
    def _token(raw: torch.Tensor, row: int, token_id: int, seq: Sequence) -> StepResult:
        try:
            return SampledToken(token_id, _logprob(raw, row, token_id, seq.params.logprobs))
        except Exception as error:
            return error

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        chosen = logits.argmax(dim=-1)
        rows = [row for row, seq in enumerate(seqs) if not seq.params.is_greedy]
        if not rows:
            return chosen
        sampled = [seqs[row] for row in rows]
        probs = self.probs(logits[rows], sampled)
        for index, (row, seq) in enumerate(zip(rows, sampled, strict=True)):
            race = torch.empty_like(probs[index])
            race.exponential_(generator=self.generator_for(seq, race))
            chosen[row] = (probs[index] / race).argmax()
        return chosen

    def generator_for(self, seq: Sequence, race: torch.Tensor | None = None) -> torch.Generator:
        """The sequence's own generator when it has a seed, else the shared one.

        A seeded sequence's generator is made at its first draw. A sequence that already has output
        tokens then (a stream resumed from another worker, ``herd.api.resume``) had each of them drawn
        with a generator of the same seed, one race the size of ``race`` per token: the new one
        replays those draws, so it stands where the other worker's stood. (A speculating engine draws
        otherwise and refuses to resume a seeded stream, ``LLMEngine.add_request``.)"""
        seed = seq.params.seed
        if seed is None:
            return self.generator
        generator = self._seeded.get(seq)
        if generator is None:
            generator = torch.Generator(device=self.generator.device).manual_seed(seed)
            if race is not None:
                for _ in range(seq.num_output_tokens):
                    race.exponential_(generator=generator)
            self._seeded[seq] = generator
        return generator

    @staticmethod
    def probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, then top-k, top-p and min-p."""

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=logits.device)

        logits = logits / column([s.params.temperature for s in seqs]).unsqueeze(1)
        if any(s.params.top_k > 0 or s.params.top_p < 1.0 or s.params.min_p > 0.0 for s in seqs):
            top_k = torch.tensor([s.params.top_k for s in seqs], device=logits.device)
            logits = filter_logits(
                logits, top_k, column([s.params.top_p for s in seqs]), column([s.params.min_p for s in seqs])
            )
        return logits.softmax(dim=-1)


def _as_if_accepted(seq: Sequence, proposed: list[int]) -> Sequence:
    """``seq`` as its logit edits would see it with ``proposed`` generated (penalties, min_tokens)."""
    if not proposed:
        return seq
    return dataclasses.replace(seq, output_token_ids=[*seq.output_token_ids, *proposed], output_logprobs=[])


LOGPROB_FLOOR = -9999.0
"""What a token of probability zero reports (vLLM's figure): JSON has no ``-Infinity``."""


def _raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The model's log-probabilities before any edit or mask (what OpenAI reports), at least
    ``LOGPROB_FLOOR``."""
    return logits.log_softmax(dim=-1).clamp_min_(LOGPROB_FLOOR)


def _logprob(raw: torch.Tensor | None, row: int, token_id: int, num_top: int | None) -> TokenLogprob | None:
    if raw is None or num_top is None:
        return None
    top = raw[row].topk(num_top) if num_top > 0 else None
    alternatives = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=float(raw[row, token_id]), top=alternatives)
