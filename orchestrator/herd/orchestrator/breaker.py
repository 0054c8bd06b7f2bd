"""A circuit breaker per worker: stop sending to a worker whose requests keep failing, probe it back.

- closed: every request may go; ``failures_to_open`` failures in a row open it (a success resets
  the count);
- open: no request goes until ``cooldown`` has passed since it opened; outcomes that arrive meanwhile
  belong to requests sent before, and change nothing;
- half-open: one request, the probe, may go; the first verdict decides: a success closes the breaker
  (and resets the cooldown), a failure opens it again with the cooldown doubled, up to
  ``max_cooldown_seconds``. A probe with no verdict (the worker was full, the client left) lets the
  next request probe.

Pure: the caller passes the time, so the states are tested without sleeping. The registry owns one
per worker, beside its ``/ready`` polling (which ejects a worker that stops answering at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BreakerSettings", "BreakerState", "CircuitBreaker", "Outcome", "answer_outcome"]

BreakerState = Literal["closed", "open", "half_open"]
Outcome = Literal["success", "failure", "none"]
"""What one request says about its worker: it served (``success``, a client error included), it
failed (a 5xx it produced, a transport error, a stream broken mid-way), or nothing (``none``: full,
draining, the client left)."""


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failures_to_open: int = 5
    """Consecutive failed requests that open the breaker."""
    cooldown_seconds: float = 1.0
    """Time from opening to the first probe; doubles after each failed probe."""
    max_cooldown_seconds: float = 30.0


class CircuitBreaker:
    """One worker's breaker; see the module docstring for the states."""

    def __init__(self, settings: BreakerSettings | None = None) -> None:
        self.settings = settings or BreakerSettings()
        self.num_failures = 0
        """Consecutive failures while closed."""
        self.cooldown_seconds = self.settings.cooldown_seconds
        self._opened_at: float | None = None
        self._is_probing = False

    @property
    def is_closed(self) -> bool:
        """Closed: every request may go, whatever the time (no cooldown is running)."""
        return self._opened_at is None

    def state(self, now: float) -> BreakerState:
        if self._opened_at is None:
            return "closed"
        return "open" if now - self._opened_at < self.cooldown_seconds else "half_open"

    def can_send(self, now: float) -> bool:
        """Closed, or half-open with no probe out. The registry asks for every worker on every
        decision, so the closed state is tested first, without working out the state."""
        if self._opened_at is None:
            return True
        return now - self._opened_at >= self.cooldown_seconds and not self._is_probing

    def on_send(self, now: float) -> None:
        """A request was sent to the worker: in half-open, it is the probe."""
        if self.state(now) == "half_open":
            self._is_probing = True

    def record(self, outcome: Outcome, now: float) -> None:
        match (outcome, self.state(now)):
            case (_, "open"):
                pass  # a request sent before the breaker opened
            case ("success", _):
                self.reset()
            case ("failure", "closed"):
                self.num_failures += 1
                if self.num_failures >= self.settings.failures_to_open:
                    self._open(now)
            case ("failure", "half_open"):
                self.cooldown_seconds = min(self.cooldown_seconds * 2, self.settings.max_cooldown_seconds)
                self._open(now)
            case ("none", _):
                self._is_probing = False

    def reset(self) -> None:
        """Closed, with no failure counted (a success, or a restarted worker: a new process)."""
        self.num_failures = 0
        self.cooldown_seconds = self.settings.cooldown_seconds
        self._opened_at = None
        self._is_probing = False

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._is_probing = False


def answer_outcome(status: int, *, has_retry_after: bool) -> Outcome:
    """What a worker's HTTP answer says about the worker.

    A client error (4xx) is the request's fault, so the worker served it; 429, or 503 with
    ``Retry-After``, is a full or draining worker that is healthy; any other 5xx is a failure.
    """
    if status == 429 or (status == 503 and has_retry_after):
        return "none"
    return "failure" if status >= 500 else "success"
