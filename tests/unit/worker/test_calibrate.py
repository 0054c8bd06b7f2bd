"""Fitting the simulated engine's cost model: steps timed from a known cost model give it back,
and a plan's cost counts its sequences, tokens and attended context."""

from __future__ import annotations

import pytest

from herd.api.crd import CostModel
from herd.worker.calibrate import StepSample, fit_cost_model

KNOWN = [
    CostModel(step_ms=40.0, seq_ms=15.0, token_ms=2.0, context_us=30.0, host_share=1.0),
    CostModel(step_ms=5.0, seq_ms=0.0, token_ms=0.5, context_us=0.0, host_share=0.0),
    CostModel(step_ms=60.0, seq_ms=1.0, token_ms=1.5, context_us=100.0, host_share=0.25),
]


def timed(cost: CostModel) -> list[StepSample]:
    """Decode steps at batch 1 to 8 over growing contexts, and prefills of 1 to 4 prompts, each on
    the CPU for the cost model's host share of its time."""
    shapes = [(seqs, seqs, seqs * context) for seqs in (1, 2, 4, 8) for context in range(32, 400, 16)]
    shapes += [(seqs, seqs * length, seqs * length) for seqs in (1, 2, 4) for length in (48, 112, 176)]
    seconds = [cost.step_seconds(t, s, c) for s, t, c in shapes]
    return [
        StepSample(*shape, wall, wall * cost.host_share) for shape, wall in zip(shapes, seconds, strict=True)
    ]


@pytest.mark.parametrize("cost", KNOWN, ids=["cpu-like", "no-sequence-or-context-term", "context-heavy"])
def test_the_fit_gives_back_the_cost_model_that_timed_the_steps(cost: CostModel) -> None:
    fitted = fit_cost_model(timed(cost))
    assert fitted.model_dump() == pytest.approx(cost.model_dump(), abs=1e-3)


def test_a_term_that_would_be_negative_is_dropped() -> None:
    # Steps that get cheaper with more context: no cost model says so; the context term goes.
    samples = [StepSample(1, 1, context, (60.0 - context / 100) / 1000) for context in range(100, 1000, 50)]
    samples.append(StepSample(1, 101, 200, 0.260))
    fitted = fit_cost_model(samples)
    assert fitted.context_us == 0.0 and fitted.step_ms > 0.0


def test_the_host_share_is_at_most_one() -> None:
    # CPU time beyond the wall time is other threads' (torch's pool): the engine's own share is all.
    samples = [StepSample(1, 1, 40, 0.06, 0.09), StepSample(1, 41, 41, 0.1, 0.2)]
    assert fit_cost_model(samples).host_share == 1.0


def test_the_fit_needs_both_kinds_of_step() -> None:
    with pytest.raises(ValueError, match="decode steps and prefill steps"):
        fit_cost_model([StepSample(1, 1, 40, 0.06)])


@pytest.mark.parametrize(
    ("args", "expected_ms"),
    [
        ((1, 1, 0), 61.5),
        ((8, 8, 0), 60 + 8 * 1.5),
        ((8, 8, 4000), 60 + 8 * 1.5 + 0.0),
        ((100, 1, 100), 210.0),
    ],
    ids=["one-decode", "batch-of-8", "context-without-a-context-term", "a-prefill"],
)
def test_a_step_costs_its_terms(args: tuple[int, int, int], expected_ms: float) -> None:
    assert CostModel().step_seconds(*args) * 1000 == pytest.approx(expected_ms)


def test_every_term_counts() -> None:
    cost = CostModel(step_ms=10.0, seq_ms=2.0, token_ms=1.0, context_us=500.0)
    assert cost.step_seconds(num_tokens=4, num_seqs=4, num_context_tokens=2000) * 1000 == pytest.approx(
        10 + 8 + 4 + 1000
    )
