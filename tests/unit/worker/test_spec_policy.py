"""The adaptive speculation policy: its choice, table-driven, and the estimates it decides on."""

from __future__ import annotations

import pytest

from herd.worker.speculative.policy import (
    PROBE_INTERVAL,
    AcceptanceEstimate,
    Choice,
    SpeculationPolicy,
    StepCost,
    StepCostEstimate,
    choose_num_tokens,
    expected_tokens,
)

# A CPU-like step: 30 ms fixed, 1 ms a token; a GPU-like one: the same fixed part, tokens nearly free.
CPU = StepCost(fixed=0.030, per_token=0.001)
GPU = StepCost(fixed=0.030, per_token=0.00001)
HIGH = [0.9, 0.85, 0.8, 0.8]
LOW = [0.1, 0.1, 0.1, 0.1]


HALF = [0.5, 0.5, 0.5, 0.5]


@pytest.mark.parametrize(
    ("batch", "acceptance", "cost", "share", "expected"),
    [
        pytest.param(1, HIGH, CPU, 1.0, 4, id="c1-high-acceptance-all-four"),
        pytest.param(1, LOW, CPU, 1.0, 1, id="c1-tokens-nearly-free-even-low-acceptance-pays-once"),
        pytest.param(16, HIGH, CPU, 1.0, 3, id="c16-cpu-high-three"),
        pytest.param(16, HALF, CPU, 1.0, 1, id="c16-cpu-half-one"),
        pytest.param(64, HIGH, CPU, 1.0, 1, id="c64-cpu-high-one"),
        pytest.param(64, HALF, CPU, 1.0, 0, id="c64-cpu-half-none"),
        pytest.param(64, LOW, CPU, 1.0, 0, id="c64-cpu-low-none"),
        pytest.param(64, HIGH, GPU, 1.0, 4, id="c64-tokens-free-all-four"),
        pytest.param(8, [0.9, 0.2, 0.1, 0.1], CPU, 1.0, 1, id="only-the-first-position-pays"),
        pytest.param(64, HALF, CPU, 0.1, 0, id="rare-proposals-do-not-rescue-half"),
        pytest.param(0, HIGH, CPU, 1.0, 0, id="no-decodes"),
        pytest.param(1, HIGH, StepCost(0.030, 0.001, per_pass=0.05), 1.0, 1, id="costly-draft-passes-one"),
    ],
)
def test_choose_num_tokens(
    batch: int, acceptance: list[float], cost: StepCost, share: float, expected: int
) -> None:
    assert choose_num_tokens(batch, acceptance, cost, max_tokens=4, proposal_share=share) == expected


@pytest.mark.parametrize(
    ("acceptance", "k", "share", "expected"),
    [
        ([0.5, 0.5], 0, 1.0, 1.0),
        ([0.5, 0.5], 2, 1.0, 1.75),
        ([1.0, 1.0, 1.0], 3, 1.0, 4.0),
        ([1.0, 1.0, 1.0], 3, 0.5, 2.5),
    ],
)
def test_expected_tokens(acceptance: list[float], k: int, share: float, expected: float) -> None:
    assert expected_tokens(acceptance, k, share) == pytest.approx(expected)


def test_acceptance_counts_tested_positions_only() -> None:
    estimate = AcceptanceEstimate(3)
    for _ in range(200):
        estimate.observe(num_proposed=3, num_accepted=1)  # position 0 accepted, 1 rejected, 2 untested
    rates = estimate.rates
    assert rates[0] == pytest.approx(1.0, abs=0.02)
    assert rates[1] == pytest.approx(0.0, abs=0.02)
    assert rates[2] == pytest.approx(0.5)  # the prior: never tested
    estimate.observe(num_proposed=0, num_accepted=0)
    assert estimate.proposal_share < 1.0


def test_step_cost_fit_recovers_a_linear_cost() -> None:
    estimate = StepCostEstimate()
    assert estimate.cost is None
    for step in range(300):
        tokens, passes = 1 + step % 40, step % 3
        estimate.observe(tokens, passes, 0.02 + 0.002 * tokens + 0.01 * passes)
    cost = estimate.cost
    assert cost is not None
    assert cost.fixed == pytest.approx(0.02, rel=0.05)
    assert cost.per_token == pytest.approx(0.002, rel=0.05)
    assert cost.per_pass == pytest.approx(0.01, rel=0.1)


def test_step_cost_stays_defined_when_every_step_looks_alike() -> None:
    estimate = StepCostEstimate()
    for _ in range(300):
        estimate.observe(16, 0, 0.05)
    cost = estimate.cost
    assert cost is not None
    assert cost.fixed + 16 * cost.per_token == pytest.approx(0.05, rel=0.05)
    assert cost.per_token > 0


def test_fixed_policy_always_proposes_the_maximum() -> None:
    policy = SpeculationPolicy(3, adaptive=False)
    assert policy.choose(100) == Choice(3)


def test_adaptive_policy_turns_off_at_large_batches_and_probes() -> None:
    policy = SpeculationPolicy(4, adaptive=True)
    assert policy.choose(64) == Choice(4)  # nothing measured yet: try
    for step in range(200):  # tokens cost 1 ms each over a 30 ms step; half the first proposals fail
        tokens = 64 + step % 50
        policy.step_cost.observe(tokens, 0, 0.030 + 0.001 * tokens)
        policy.acceptance.observe(4, 2 * (step % 2))
    choices = [policy.choose(64) for _ in range(PROBE_INTERVAL)]
    assert choices[:-1] == [Choice(0)] * (PROBE_INTERVAL - 1)
    assert choices[-1] == Choice(4, num_seqs=1)
    assert policy.choose(1).num_tokens > 0
