"""What a runner measures of its own steps (``Measured.add_step``): a prefill rate from large steps,
a decode step's seconds from the others."""

import pytest

from herd.worker.runner import PREFILL_MIN_TOKENS, Measured


@pytest.mark.parametrize(
    ("steps", "prefill_per_s", "decode_step_s"),
    [
        ([], None, None),
        ([(PREFILL_MIN_TOKENS * 4, 0.5)], PREFILL_MIN_TOKENS * 8, None),
        ([(8, 0.04)], None, 0.04),
        ([(8, 0.04), (8, 0.09)], None, 0.04 + 0.2 * (0.09 - 0.04)),  # averaged as a Rate is
        ([(PREFILL_MIN_TOKENS - 1, 0.04)], None, 0.04),  # too few tokens to time a prefill by
        ([(0, 0.04), (8, 0.0)], None, None),  # an empty or instant step says nothing
        ([(512, 1.0), (4, 0.05)], 512.0, 0.05),
        ([(512, 1e-320), (512, 1.0)], 512.0, None),  # a rate past a float's range is not a measurement
    ],
    ids=[
        "nothing",
        "a-prefill",
        "a-decode",
        "two-decodes",
        "a-small-step",
        "nothing-to-time",
        "both",
        "overflow",
    ],
)
def test_a_step_times_a_prefill_or_a_decode(
    steps: list[tuple[int, float]], prefill_per_s: float | None, decode_step_s: float | None
) -> None:
    measured = Measured()
    for num_tokens, seconds in steps:
        measured.add_step(num_tokens, seconds)
    assert measured.prefill.per_second == prefill_per_s
    assert measured.decode_step_s == pytest.approx(decode_step_s)
