"""Adaptive speculation: how many tokens to propose in the next step, from 0 to ``numTokens``.

Verifying ``k`` proposed tokens makes each decoding sequence's query ``k + 1`` tokens long. A step
costs about ``fixed + per_token * tokens + per_pass * extra draft passes``: at a small batch the
fixed part (reading the weights) dominates and the extra tokens are nearly free, at a large one
every token costs its share, so a rejected proposal is paid for. With acceptance ``a_i`` at
proposal position ``i`` (given all before it were accepted) and a share ``h`` of sequences that get
a proposal at all, a step of ``B`` decodes yields ``B * (1 + h * sum_j prod_{i<j} a_i)`` tokens;
``choose_num_tokens`` picks the ``k`` with the most tokens per second, and 0 unless speculation
beats plain decoding by ``MARGIN``.

The inputs are measured, never configured: ``AcceptanceEstimate`` keeps decayed counts of the
positions tested and accepted, ``StepCostEstimate`` a decayed least-squares fit of the times of
decode steps (the engine leaves out steps with a prefill chunk, whose tokens cost far more each)
against tokens and draft passes (with a weak prior scaled by the first step, so that a run of
identical steps leaves the fit defined). ``SpeculationPolicy`` joins them; when it has chosen fewer
than ``numTokens`` for ``PROBE_INTERVAL`` steps it proposes ``numTokens`` for one sequence, so that
acceptance keeps being measured at every position and speculation comes back when it pays again. Everything here is arithmetic on
numbers the engine pushes in: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AcceptanceEstimate",
    "SpeculationPolicy",
    "StepCost",
    "StepCostEstimate",
    "choose_num_tokens",
    "expected_tokens",
]

MARGIN = 0.05
"""Speculate only when the model says it yields at least 5 % more tokens per second."""
PROBE_INTERVAL = 16
DECAY = 0.98
"""Each observation's weight shrinks by this factor per later observation (a memory of ~50)."""
PRIOR_WEIGHT = 0.1
"""Weight of each of the step cost's three prior points, against ~50 for the measured steps: enough to
hold the split between fixed and per-token cost where the steps seen differ little in size (a steady
batch), little enough that steps of many sizes decide it."""


@dataclass(frozen=True)
class StepCost:
    """A step's seconds: ``fixed + per_token * tokens + per_pass * extra draft passes``."""

    fixed: float
    per_token: float
    per_pass: float = 0.0


@dataclass(frozen=True)
class Choice:
    """Propose ``num_tokens`` for at most ``num_seqs`` sequences (``None``: all)."""

    num_tokens: int
    num_seqs: int | None = None


def expected_tokens(acceptance: Sequence[float], num_tokens: int, proposal_share: float = 1.0) -> float:
    """Tokens a decoding sequence yields per step with ``num_tokens`` proposed."""
    reach, total = 1.0, 0.0
    for rate in acceptance[:num_tokens]:
        reach *= rate
        total += reach
    return 1.0 + proposal_share * total


def choose_num_tokens(
    batch_size: int,
    acceptance: Sequence[float],
    cost: StepCost,
    *,
    max_tokens: int,
    proposal_share: float = 1.0,
) -> int:
    """The ``k`` in ``0..max_tokens`` that maximizes tokens per second for ``batch_size`` decodes;
    0 unless the best beats plain decoding by ``MARGIN``."""
    if batch_size < 1:
        return 0

    def rate(k: int) -> float:
        tokens = batch_size * (1 + proposal_share * k)
        seconds = cost.fixed + cost.per_token * tokens + cost.per_pass * max(0, k - 1)
        return batch_size * expected_tokens(acceptance, k, proposal_share) / max(seconds, 1e-12)

    plain = rate(0)
    best = max(range(1, max_tokens + 1), key=rate, default=0)
    return best if best and rate(best) > plain * (1 + MARGIN) else 0


class AcceptanceEstimate:
    """Decayed per-position acceptance, with a prior of one half-accepted test per position."""

    def __init__(self, num_positions: int) -> None:
        self.tested = [1.0] * num_positions
        self.accepted = [0.5] * num_positions
        self.offered = 1.0
        self.proposed = 1.0

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """One sequence's verification: positions ``0..num_accepted`` were tested (the first
        rejected one included), ``0..num_accepted - 1`` accepted; ``num_proposed == 0``: the
        proposer had nothing for a sequence that had slots."""
        self.offered = self.offered * DECAY + 1
        self.proposed = self.proposed * DECAY + (num_proposed > 0)
        for position in range(min(num_proposed, num_accepted + 1, len(self.tested))):
            self.tested[position] = self.tested[position] * DECAY + 1
            self.accepted[position] = self.accepted[position] * DECAY + (position < num_accepted)

    @property
    def rates(self) -> list[float]:
        return [accepted / tested for accepted, tested in zip(self.accepted, self.tested, strict=True)]

    @property
    def proposal_share(self) -> float:
        """The share of sequences offered slots that got a proposal."""
        return self.proposed / self.offered


class StepCostEstimate:
    """Decayed least squares of step seconds on ``[1, tokens, draft passes]``."""

    def __init__(self) -> None:
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._prior: list[tuple[list[float], float]] = []

    def observe(self, num_tokens: int, num_passes: int, seconds: float) -> None:
        if not self._prior:
            # A weak prior from the first step: a token costs 1/64 and a pass 1/2 of a step, so
            # the fit stays defined while steps look alike; real steps outweigh it within a few.
            fixed = seconds / (1 + num_tokens / 64)
            self._prior = [
                ([1.0, 0.0, 0.0], fixed),
                ([1.0, 64.0, 0.0], 2 * fixed),
                ([1.0, 0.0, 1.0], 1.5 * fixed),
            ]
        self._add([1.0, float(num_tokens), float(num_passes)], seconds, decay=DECAY)

    def _add(self, x: list[float], y: float, *, decay: float) -> None:
        for i in range(3):
            self._xty[i] = self._xty[i] * decay + x[i] * y
            for j in range(3):
                self._xtx[i][j] = self._xtx[i][j] * decay + x[i] * x[j]

    @property
    def cost(self) -> StepCost | None:
        """The fitted cost (each part at least 0), or ``None`` before the first step."""
        if not self._prior:
            return None
        xtx = [row[:] for row in self._xtx]
        xty = self._xty[:]
        for x, y in self._prior:
            for i in range(3):
                xty[i] += PRIOR_WEIGHT * x[i] * y
                for j in range(3):
                    xtx[i][j] += PRIOR_WEIGHT * x[i] * x[j]
        fixed, per_token, per_pass = (max(0.0, value) for value in _solve(xtx, xty))
        return StepCost(fixed, per_token, per_pass)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (3 x 3, well posed by the prior)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


class SpeculationPolicy:
    """The engine's per-step choice; fixed at ``max_tokens`` unless ``adaptive``. ``draft_passes``:
    the proposer runs a model once per proposed token after the first (a draft model; n-gram
    lookup runs none, so the fit's pass cost is not counted for it)."""

    def __init__(self, max_tokens: int, *, adaptive: bool, draft_passes: bool = False) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.draft_passes = draft_passes
        self.acceptance = AcceptanceEstimate(max_tokens)
        self.step_cost = StepCostEstimate()
        self._steps_below_max = 0

    def choose(self, num_decoding: int) -> Choice:
        if not self.adaptive:
            return Choice(self.max_tokens)
        cost = self.step_cost.cost
        if cost is None:
            return Choice(self.max_tokens)
        if not self.draft_passes:
            cost = StepCost(cost.fixed, cost.per_token)
        k = choose_num_tokens(
            num_decoding,
            self.acceptance.rates,
            cost,
            max_tokens=self.max_tokens,
            proposal_share=self.acceptance.proposal_share,
        )
        if k == self.max_tokens:
            self._steps_below_max = 0
            return Choice(k)
        self._steps_below_max += 1
        if self._steps_below_max >= PROBE_INTERVAL:
            self._steps_below_max = 0
            return Choice(self.max_tokens, num_seqs=1)
        return Choice(k)
