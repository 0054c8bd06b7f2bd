"""The sampler on hand-made logits: filters, seeds, penalties, bias, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_seq

from herd.worker.sampler import LOGPROB_FLOOR, Sampler, filter_logits
from herd.worker.sampling_params import SamplingParams
from herd.worker.sequence import Sequence

EOS = 9
VOCAB = 10
# log-probabilities 0.4, 0.3, 0.2, 0.1 on tokens 0..3, nothing elsewhere
BASE = torch.tensor([math.log(p) for p in (0.4, 0.3, 0.2, 0.1)] + [-1e9] * (VOCAB - 4))


def seq_with(seed: int | None = None, output: list[int] | None = None, **params: object) -> Sequence:
    seq = make_seq([5, 6, 7], params=SamplingParams(max_tokens=64, seed=seed, **params))  # type: ignore[arg-type]
    seq.output_token_ids = list(output or [])
    return seq


def sample(
    seqs: list[Sequence], logits: torch.Tensor | None = None, seed: int = 0, sampler: Sampler | None = None
) -> list[int]:
    """One draw per sequence; ``sampler`` (else a new one seeded with ``seed``) keeps the seeded
    sequences' generators between calls, as the runner's sampler does between steps."""
    sampler = sampler or Sampler(torch.Generator().manual_seed(seed), {EOS})
    rows = (BASE if logits is None else logits).expand(len(seqs), -1).clone()
    return [token.token_id for token in sampler.sample(rows, seqs)]


def draws(n: int, **params: object) -> set[int]:
    return {sample([seq_with(**params)], seed=i)[0] for i in range(n)}


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"temperature": 0.0}, {0}),
        ({"temperature": 1.0, "top_k": 2}, {0, 1}),
        ({"temperature": 1.0, "top_p": 0.65}, {0, 1}),
        ({"temperature": 1.0, "top_p": 0.3}, {0}),
        ({"temperature": 1.0, "min_p": 0.6}, {0, 1}),
        ({"temperature": 1.0}, {0, 1, 2, 3}),
    ],
    ids=["greedy", "top-k-2", "top-p-0.65", "top-p-below-first", "min-p-0.6", "plain"],
)
def test_filters_bound_the_draws(params: dict[str, object], allowed: set[int]) -> None:
    assert draws(60, **params) == allowed


def test_filter_logits_row_by_row() -> None:
    logits = BASE.expand(2, -1).clone()
    out = filter_logits(logits, torch.tensor([1, 0]), torch.tensor([1.0, 0.65]), torch.tensor([0.0, 0.0]))
    assert torch.isfinite(out[0]).tolist() == [True] + [False] * (VOCAB - 1)
    assert torch.isfinite(out[1]).tolist() == [True, True] + [False] * (VOCAB - 2)


def test_seed_reproducible_whatever_the_batch() -> None:
    alone = [sample([seq_with(seed=42, temperature=1.0)], seed=s)[0] for s in range(3)]
    with_others = [
        sample([seq_with(temperature=1.0), seq_with(seed=42, temperature=1.0)], seed=s + 100)[1]
        for s in range(3)
    ]
    assert alone == with_others
    seeded = [seq_with(seed=7, temperature=1.0) for _ in range(2)]
    samplers = [Sampler(torch.Generator().manual_seed(run), {EOS}) for run in range(2)]
    runs = [
        [sample([seq], sampler=sampler)[0] for _ in range(20)]
        for seq, sampler in zip(seeded, samplers, strict=True)
    ]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


@pytest.mark.parametrize(
    ("params", "output", "expected"),
    [
        ({"temperature": 0.0, "presence_penalty": 0.5}, [0], 1),
        ({"temperature": 0.0, "frequency_penalty": 0.2}, [0, 0], 1),
        ({"temperature": 0.0, "frequency_penalty": 0.2}, [0], 0),
        ({"temperature": 0.0, "repetition_penalty": 2.0}, [0], 1),
        ({"temperature": 0.0, "logit_bias": {3: 5.0}}, [], 3),
        ({"temperature": 0.0, "logit_bias": {0: -5.0}}, [], 1),
    ],
    ids=["presence", "frequency-twice", "frequency-once-not-enough", "repetition", "bias-up", "bias-down"],
)
def test_logit_edits_change_the_greedy_choice(
    params: dict[str, object], output: list[int], expected: int
) -> None:
    # probabilities 0.4 vs 0.3: a gap of log(4/3) ~ 0.29 nats between token 0 and token 1
    logits = BASE.clone()
    if "repetition_penalty" in params:
        # token 0 (generated) and token 5 (in the prompt) are both divided: 1.0 -> 0.5, 1.5 -> 0.75
        logits[:6] = torch.tensor([1.0, 0.8, 0.1, 0.0, -1.0, 1.5])
    assert sample([seq_with(output=output, **params)], logits) == [expected]


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.full((VOCAB,), -5.0)
    logits[EOS], logits[5], logits[6] = 10.0, 9.0, 1.0
    early = seq_with(temperature=0.0, min_tokens=2, stop_token_ids=(5,), output=[1])
    done = seq_with(temperature=0.0, min_tokens=2, stop_token_ids=(5,), output=[1, 1])
    assert sample([early, done], logits) == [6, EOS]


def test_logprobs_are_the_raw_distribution() -> None:
    sampler = Sampler(torch.Generator().manual_seed(0), {EOS})
    seq = seq_with(temperature=0.0, logprobs=2, logit_bias={3: 100.0})
    [token] = sampler.sample(BASE.unsqueeze(0).clone(), [seq])
    assert token.token_id == 3
    assert token.logprob is not None
    assert token.logprob.logprob == pytest.approx(math.log(0.1), abs=1e-5)
    assert [t for t, _ in token.logprob.top] == [0, 1]
    assert token.logprob.top[0][1] == pytest.approx(math.log(0.4), abs=1e-5)


def test_a_token_of_probability_zero_reports_the_floor_not_minus_infinity() -> None:
    """JSON has no -Infinity: a token the model rules out (a -inf logit) reports LOGPROB_FLOOR."""
    sampler = Sampler(torch.Generator().manual_seed(0), {EOS})
    logits = torch.full((VOCAB,), -math.inf)
    logits[2] = 0.0
    seq = seq_with(temperature=0.0, logprobs=3)
    [token] = sampler.sample(logits.unsqueeze(0), [seq])
    assert token.token_id == 2 and token.logprob is not None
    assert token.logprob.top[0] == (2, 0.0)
    assert [logprob for _, logprob in token.logprob.top[1:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
