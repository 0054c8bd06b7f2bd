"""The circuit breaker as a table: a script of sends and outcomes at given times, then its state."""

from __future__ import annotations

import pytest

from herd.orchestrator.breaker import BreakerSettings, BreakerState, CircuitBreaker, Outcome, answer_outcome

SETTINGS = BreakerSettings(failures_to_open=3, cooldown_seconds=1.0, max_cooldown_seconds=4.0)

# Each step: (time, action) with action "send", "success", "failure" or "none".
Script = list[tuple[float, str]]


def run(script: Script) -> CircuitBreaker:
    breaker = CircuitBreaker(SETTINGS)
    for now, action in script:
        if action == "send":
            assert breaker.can_send(now), f"a send at {now} was refused"
            breaker.on_send(now)
        else:
            breaker.record(action, now)  # type: ignore[arg-type]
    return breaker


THREE_FAILURES: Script = [(0.0, "failure"), (0.1, "failure"), (0.2, "failure")]


@pytest.mark.parametrize(
    ("script", "now", "state", "can_send"),
    [
        ([], 0.0, "closed", True),
        (THREE_FAILURES[:2], 0.3, "closed", True),
        ([*THREE_FAILURES[:2], (0.25, "success"), (0.3, "failure")], 0.4, "closed", True),
        ([*THREE_FAILURES[:2], (0.25, "none"), (0.3, "failure")], 0.4, "open", False),
        (THREE_FAILURES, 0.3, "open", False),
        ([*THREE_FAILURES, (0.5, "success")], 0.6, "open", False),
        (THREE_FAILURES, 1.2, "half_open", True),
        ([*THREE_FAILURES, (1.2, "send")], 1.3, "half_open", False),
        ([*THREE_FAILURES, (1.2, "send"), (1.4, "success")], 1.5, "closed", True),
        ([*THREE_FAILURES, (1.2, "send"), (1.4, "failure")], 3.3, "open", False),
        ([*THREE_FAILURES, (1.2, "send"), (1.4, "failure")], 3.4, "half_open", True),
        ([*THREE_FAILURES, (1.2, "send"), (1.4, "none")], 1.5, "half_open", True),
        (
            [*THREE_FAILURES, (1.2, "send"), (1.4, "failure"), (3.4, "send"), (3.5, "failure")],
            7.4,
            "open",
            False,
        ),
        (
            [*THREE_FAILURES, (1.2, "send"), (1.4, "failure"), (3.4, "send"), (3.5, "failure")],
            7.5,
            "half_open",
            True,
        ),
    ],
    ids=[
        "fresh",
        "two-failures-stay-closed",
        "a-success-resets-the-count",
        "no-verdict-keeps-the-count",
        "three-in-a-row-open",
        "late-success-while-open-ignored",
        "half-open-after-cooldown",
        "one-probe-at-a-time",
        "probe-success-closes",
        "probe-failure-reopens-for-twice-the-cooldown",
        "second-probe-after-the-doubled-cooldown",
        "probe-without-verdict-frees-the-next-probe",
        "cooldown-doubles-again",
        "third-probe-after-four-seconds",
    ],
)
def test_states(script: Script, now: float, state: BreakerState, can_send: bool) -> None:
    breaker = run(script)
    assert (breaker.state(now), breaker.can_send(now)) == (state, can_send)


def test_cooldown_is_capped_and_reset_by_a_successful_probe() -> None:
    breaker = run(THREE_FAILURES)
    now = 0.2
    for _ in range(5):  # failed probes: 2, 4, 4, 4, 4 seconds
        now += breaker.cooldown_seconds
        breaker.on_send(now)
        breaker.record("failure", now)
    assert breaker.cooldown_seconds == SETTINGS.max_cooldown_seconds
    now += breaker.cooldown_seconds
    breaker.on_send(now)
    breaker.record("success", now)
    assert (breaker.state(now), breaker.cooldown_seconds) == ("closed", SETTINGS.cooldown_seconds)


def test_reset_closes_an_open_breaker() -> None:
    breaker = run(THREE_FAILURES)
    breaker.reset()
    assert (breaker.state(0.3), breaker.num_failures) == ("closed", 0)


@pytest.mark.parametrize(
    ("status", "has_retry_after", "outcome"),
    [
        (200, False, "success"),
        (400, False, "success"),
        (404, False, "success"),
        (429, True, "none"),
        (429, False, "none"),
        (500, False, "failure"),
        (502, False, "failure"),
        (503, True, "none"),
        (503, False, "failure"),
        (504, False, "failure"),
    ],
    ids=[
        "ok",
        "bad-request",
        "not-found",
        "full",
        "full-no-retry-after",
        "internal-error",
        "bad-gateway",
        "draining",
        "unavailable",
        "timeout",
    ],
)
def test_answer_outcome(status: int, has_retry_after: bool, outcome: Outcome) -> None:
    assert answer_outcome(status, has_retry_after=has_retry_after) == outcome
